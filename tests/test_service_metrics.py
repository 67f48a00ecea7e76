"""Prometheus metrics of a running watcher, scraped over HTTP on 127.0.0.1."""

from __future__ import annotations

import select
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuwatch.core.events import SwitchCompleted, SwitchFailed, SwitchMember, SwitchRefused
from gpuwatch.service import protocol as P
from gpuwatch.service.metrics import Metrics
from gpuwatch.service.testing import served_watcher, short_socket_dir
from gpuwatch.settings import InvalidListenAddress, parse_listen_address
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot

NV, NV_AUDIO, NIC = "0000:01:00.0", "0000:01:00.1", "0000:02:00.0"


@pytest.fixture
def sockdir() -> Iterator[str]:
    with short_socket_dir() as path:
        yield path


async def scrape(host: str, port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    def get() -> str:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
            text: str = r.read().decode()
            return text

    text = await anyio.to_thread.run_sync(get)
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float | None:
    return samples.get((name, frozenset(labels.items())))


async def rebind(source: MemorySource, host: SysRoot, addr: str, driver: str, w: Any) -> None:
    before = w.seq
    host.bind(addr, driver)
    source.push(host.uevent_props("bind", addr))
    with anyio.fail_after(5):
        while w.seq < before + 2:  # driver-changed, then probe-changed of detect-vfio
            await anyio.sleep(0.005)


def serve_metrics(served: Any) -> tuple[Metrics, MemorySource, tuple[str, int]]:
    """Metrics of a served watcher, on the daemon's socket server and on a loopback port
    of their own; its memory source to push uevents through; the address bound."""
    source = served.source
    assert isinstance(source, MemorySource)
    metrics = Metrics()
    metrics.attach(served.watcher)
    served.server.metrics = metrics
    return metrics, source, metrics.serve("127.0.0.1:0")


async def test_metrics_follow_the_watcher(host: SysRoot, sockdir: str) -> None:
    async with served_watcher(host.root, f"{sockdir}/gw.sock") as served:
        w = served.watcher
        metrics, source, bound = serve_metrics(served)
        try:
            assert bound[0] == "127.0.0.1"  # loopback only, as asked
            s = await scrape(*bound)
            assert value(s, "gpuwatch_gpus", vendor="NVIDIA", mode="nvidia") == 1
            assert value(s, "gpuwatch_gpus", vendor="Intel", mode="host driver") == 1
            assert value(s, "gpuwatch_pci_functions") == 7
            assert value(s, "gpuwatch_nvidia_gpu_usable") == 1
            assert value(s, "gpuwatch_events_total", type="ready") == 1
            assert value(s, "gpuwatch_last_event_seq") == 1
            assert value(s, "gpuwatch_uevent_losses_total") == 0
            assert value(s, "gpuwatch_uevents_forged_total") == 0
            source.rejected = 3  # type: ignore[attr-defined]  # as the kernel source counts
            assert value(await scrape(*bound), "gpuwatch_uevents_forged_total") == 3

            # The NVIDIA card's group goes to vfio-pci: the gauge moves from nvidia to vfio.
            await rebind(source, host, NV_AUDIO, "vfio-pci", w)
            await rebind(source, host, NV, "vfio-pci", w)
            await w.resync("reconcile")
            published = time.monotonic()  # the last event came at or after this
            w.publish(
                [
                    SwitchCompleted(
                        addr=NV,
                        group=13,
                        from_mode="nvidia",
                        to_mode="vfio",  # type: ignore[call-arg]
                        members=[SwitchMember(addr=NV, driver="vfio-pci")],
                        duration_ms=1500,
                    ),
                    SwitchRefused(addr=NV, group=13, to_mode="nvidia", reason="held", holders=[]),  # type: ignore[call-arg]
                    SwitchFailed(addr=NV, group=13, to_mode="nvidia", error="hung", wedged=True),  # type: ignore[call-arg]
                ]
            )
            async with await anyio.connect_unix(served.path) as c:
                for _ in range(3):
                    await c.send(P.encode_request(1, "probe", {"action": "detect-gpu"}))
                    await c.receive()
                await c.send(b"garbage\n")
                await c.receive()
                s = await scrape(*bound)
                assert value(s, "gpuwatch_socket_clients") == 1
            # The daemon notices the hang-up on its own schedule: wait for it (bounded), so
            # the scrape below never races the server's EOF handling.
            with anyio.fail_after(10):
                while served.server.connections:
                    await anyio.sleep(0.01)
            s = await scrape(*bound)
            assert value(s, "gpuwatch_gpus", vendor="NVIDIA", mode="vfio") == 1
            assert value(s, "gpuwatch_gpus", vendor="NVIDIA", mode="nvidia") is None  # gone, not 0
            assert value(s, "gpuwatch_events_total", type="driver-changed") == 2
            # detect-vfio twice, and the card leaving nvidia: detect-gpu, detect-host-devices
            assert value(s, "gpuwatch_events_total", type="probe-changed") == 4
            assert value(s, "gpuwatch_nvidia_gpu_usable") == 0
            assert value(s, "gpuwatch_resyncs_total", reason="reconcile") == 1
            assert value(s, "gpuwatch_switches_total", outcome="completed") == 1
            assert value(s, "gpuwatch_switches_total", outcome="refused") == 1
            assert value(s, "gpuwatch_switches_total", outcome="wedged") == 1
            assert value(s, "gpuwatch_switch_duration_seconds_count") == 1
            assert value(s, "gpuwatch_switch_duration_seconds_sum") == 1.5
            assert value(s, "gpuwatch_switch_duration_seconds_bucket", le="2.5") == 1
            assert value(s, "gpuwatch_switch_duration_seconds_bucket", le="1.0") == 0
            assert value(s, "gpuwatch_probe_calls_total", action="detect-gpu") == 3
            assert value(s, "gpuwatch_socket_requests_total", method="probe", outcome="ok") == 3
            assert (
                value(s, "gpuwatch_socket_requests_total", method="?", outcome=P.PARSE_ERROR) == 1
            )
            assert value(s, "gpuwatch_last_event_seq") == w.seq
            age = value(s, "gpuwatch_last_event_age_seconds")
            # Bounded by what the test itself lived through, not by a guess at the machine's
            # speed: no event came after the switch events published above.
            assert age is not None and 0 <= age <= time.monotonic() - published
            assert value(s, "gpuwatch_socket_clients") == 0

            # Two losses: the first rescanned at once, the second held for a rescan a gap
            # later. Both count as losses from the start; the rescans as they come.
            source.overflow()
            source.overflow()
            with anyio.fail_after(5):
                while w.uevent_losses < 2 or w.resyncs < 2:
                    await anyio.sleep(0.005)
            s = await scrape(*bound)
            assert value(s, "gpuwatch_uevent_losses_total") == 2
            assert value(s, "gpuwatch_resyncs_total", reason="overflow") in (1, 2)
            with anyio.fail_after(5):
                while w.resyncs < 3:
                    await anyio.sleep(0.01)
            s = await scrape(*bound)
            assert value(s, "gpuwatch_uevent_losses_total") == 2
            assert value(s, "gpuwatch_resyncs_total", reason="overflow") == 2
        finally:
            metrics.close()


async def test_subscriber_lag_drops_are_counted(host: SysRoot, sockdir: str) -> None:
    from gpuwatch.core.events import ProbeChanged

    metrics = Metrics()
    async with served_watcher(
        host.root, f"{sockdir}/gw.sock", metrics=metrics, outbox_limit=64 << 10
    ) as served:
        metrics.attach(served.watcher)
        bound = metrics.serve("127.0.0.1:0")
        try:
            async with await anyio.connect_unix(served.path) as c:
                await c.send(P.encode_request(1, "subscribe"))
                pad = "z" * 8000
                with anyio.fail_after(10):
                    while served.server.lag_drops == 0:
                        served.watcher.publish(
                            [ProbeChanged(action="detect-gpu", old=pad, new=pad)]
                        )
                        await anyio.sleep(0)
            s = await scrape(*bound)
            assert value(s, "gpuwatch_subscriber_lag_drops_total") == 1
        finally:
            metrics.close()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:9464", ("127.0.0.1", 9464)),
        (":9464", ("0.0.0.0", 9464)),
        ("9464", ("0.0.0.0", 9464)),
        ("[::1]:9464", ("::1", 9464)),
        ("localhost:0", ("localhost", 0)),
    ],
)
def test_listen_addresses(text: str, expected: tuple[str, int]) -> None:
    assert parse_listen_address(text) == expected


@pytest.mark.parametrize("text", ["", "127.0.0.1:", "host:99999", "a b:1", "127.0.0.1:x"])
def test_bad_listen_addresses(text: str) -> None:
    with pytest.raises(InvalidListenAddress):
        parse_listen_address(text)


# --------------------------------------------------------------------------- the HTTP edge
# The endpoint listens on every address of a pod: each client is bounded, and every answer
# that is not the metrics is one plain-text line.


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, int]]:
    import gpuwatch.service.metrics as metrics_module

    monkeypatch.setattr(metrics_module, "HTTP_TIMEOUT", 60.0)
    metrics = Metrics()
    bound = metrics.serve("127.0.0.1:0")
    try:
        yield bound
    finally:
        metrics.close()


def exchange(bound: tuple[str, int], request: bytes) -> tuple[str, bytes]:
    """(status line, body) of one raw request."""
    with socket.create_connection(bound, timeout=30) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode(), body


def test_a_client_that_never_finishes_its_request_is_cut_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A head sent a byte at a time gains nothing: the deadline is for the whole head."""
    import gpuwatch.service.metrics as metrics_module

    monkeypatch.setattr(metrics_module, "HTTP_TIMEOUT", 1.0)
    metrics = Metrics()
    bound = metrics.serve("127.0.0.1:0")
    try:
        with socket.create_connection(bound, timeout=30) as slow:
            slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            while True:  # keep trickling: each byte arrives before a per-read timeout would
                try:
                    slow.sendall(b"X")
                except OSError:
                    break
                ready, _, _ = select.select([slow], [], [], 0.2)
                if ready:
                    break
            answer = slow.recv(4096)
        assert answer.startswith(b"HTTP/1.0 408 Request Timeout\r\n")
        assert answer.endswith(b"\r\n\r\n408 Request Timeout\n")
        with urllib.request.urlopen(f"http://{bound[0]}:{bound[1]}/metrics", timeout=30) as r:
            assert r.status == 200  # the server itself goes on
    finally:
        metrics.close()


def test_connections_at_once_are_bounded(endpoint: tuple[str, int]) -> None:
    """Idle connections hold at most HTTP_MAX_CONNECTIONS threads: each past the bound takes
    the place of the oldest idle one, which is told so in one line (408) and closed."""
    from gpuwatch.service.metrics import HTTP_MAX_CONNECTIONS, HTTP_MAX_PER_ADDRESS

    extra = 6
    # From as many loopback addresses as the per-address bound asks (127.0.0.0/8 is all
    # this host's), so the bound met is the one on all connections.
    idle = []
    for i in range(HTTP_MAX_CONNECTIONS + extra):
        idle.append(socket.create_connection(
            endpoint, timeout=30, source_address=(f"127.0.0.{1 + i // HTTP_MAX_PER_ADDRESS}", 0)))
        time.sleep(0.01)  # each admitted in turn: "oldest" is well defined
    try:
        answers: dict[int, bytes] = {}
        pending = list(idle)
        while len(answers) < extra:  # the held ones answer only after 60 s: these come first
            ready, _, _ = select.select(pending, [], [], 30)
            assert ready, f"only {len(answers)} of {extra} cut: connections are unbounded"
            for s in ready:
                answers[idle.index(s)] = s.recv(4096)
                pending.remove(s)
        # The oldest idle one of the newcomer's own address went, else of the address that
        # held most: 0 for the first, then .5's own, then 4 (127.0.0.1 was down to 3), ...
        assert sorted(answers) == [0, 4, 16, 17, 18, 20]
        for answer in answers.values():
            assert answer == (b"HTTP/1.0 408 Request Timeout\r\nContent-Type: text/plain; "
                              b"charset=utf-8\r\nContent-Length: 20\r\nConnection: close\r\n"
                              b"\r\n408 Request Timeout\n")
        ready, _, _ = select.select(pending, [], [], 0.3)
        assert ready == []  # the newest HTTP_MAX_CONNECTIONS are held
    finally:
        for s in idle:
            s.close()
    status, body = exchange(endpoint, b"GET /metrics HTTP/1.0\r\n\r\n")
    assert status.startswith("HTTP/1.0 200") and b"gpuwatch_pci_functions" in body


def test_one_address_holds_at_most_its_share(endpoint: tuple[str, int]) -> None:
    """A client reopening idle connections holds HTTP_MAX_PER_ADDRESS slots at most: its
    next takes the place of its oldest idle one, and a scraper elsewhere is served."""
    from gpuwatch.service.metrics import HTTP_MAX_PER_ADDRESS

    idle = []
    for _ in range(HTTP_MAX_PER_ADDRESS + 1):
        idle.append(socket.create_connection(endpoint, timeout=30,
                                             source_address=("127.0.0.9", 0)))
        time.sleep(0.01)
    try:
        ready, _, _ = select.select(idle, [], [], 30)
        assert ready == [idle[0]]  # the oldest went; the others answer nothing yet
        assert idle[0].recv(4096).endswith(b"\r\n\r\n408 Request Timeout\n")
        assert select.select(idle[1:], [], [], 0.3)[0] == []
        with socket.create_connection(endpoint, timeout=30,
                                      source_address=("127.0.0.10", 0)) as s:
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        assert data.startswith(b"HTTP/1.0 200") and b"gpuwatch_pci_functions" in data
    finally:
        for s in idle:
            s.close()


# Hogs: clients that hold connections and never finish a request. Every local user shares
# 127.0.0.1, and may bind any of 127.0.0.0/8 to pass for many hosts.


class Hogs:
    """Connections from `sources` kept open: idle, or trickling a head a byte at a time
    (`trickle`), each reopened at once when the server closes it."""

    def __init__(self, bound: tuple[str, int], sources: list[str], trickle: bool) -> None:
        self.bound, self.sources, self.trickle = bound, sources, trickle
        self.socks: list[socket.socket | None] = [None] * len(sources)
        self.reopened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _open(self, i: int) -> None:
        try:
            s = socket.create_connection(self.bound, timeout=5,
                                         source_address=(self.sources[i], 0))
            if self.trickle:
                s.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
        except OSError:
            return  # tried again at the next turn
        self.socks[i] = s

    def _run(self) -> None:
        while not self._stop.is_set():
            for i, s in enumerate(self.socks):
                if s is None:
                    self._open(i)
                    continue
                try:
                    if select.select([s], [], [], 0)[0]:  # an answer or EOF: closed on us
                        raise OSError
                    if self.trickle:
                        s.send(b"a")
                except OSError:
                    s.close()
                    self.socks[i] = None
                    self.reopened += 1
            self._stop.wait(0.05)

    def settle(self, reopened: int = 0) -> None:
        """Until `reopened` hogs came back and every hog is connected again."""
        deadline = time.monotonic() + 10
        while self.reopened < reopened or not all(self.socks):
            assert time.monotonic() < deadline, "hogs did not come back"
            time.sleep(0.01)
        time.sleep(0.1)  # and admitted (or, unbounded, told 503 and back again)

    def __enter__(self) -> Hogs:
        for i in range(len(self.sources)):
            self._open(i)
        assert all(self.socks), "hogs could not connect"
        self._thread.start()
        self.settle()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for s in self.socks:
            if s is not None:
                s.close()


def hog_sources() -> list[str]:
    """Every slot's worth: a full share from the scraper's own 127.0.0.1, the rest one from
    each other loopback address."""
    from gpuwatch.service.metrics import HTTP_MAX_CONNECTIONS, HTTP_MAX_PER_ADDRESS

    others = HTTP_MAX_CONNECTIONS - HTTP_MAX_PER_ADDRESS
    return ["127.0.0.1"] * HTTP_MAX_PER_ADDRESS + [f"127.0.0.{2 + i}" for i in range(others)]


def prompt_scrape(bound: tuple[str, int], source: str = "127.0.0.1",
                  limit: float = 2.0) -> dict[str, str]:
    """A scraper that sends its request at once: 200 within `limit` seconds, a body
    prometheus_client's parser takes; its families' types by name."""
    began = time.monotonic()
    with socket.create_connection(bound, timeout=limit, source_address=(source, 0)) as s:
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: gpuwatch\r\nAccept: */*\r\n\r\n")
        data = b""
        while chunk := s.recv(1 << 20):
            data += chunk
    took = time.monotonic() - began
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200 OK\r\n"), data[:200]
    assert took < limit, took
    return {f.name: f.type for f in text_string_to_metric_families(body.decode())}


@pytest.mark.parametrize("trickle", [False, True], ids=["idle", "trickling"])
def test_hogs_on_every_slot_leave_a_prompt_scraper_served(
    endpoint: tuple[str, int], trickle: bool,
) -> None:
    """Hogs holding every slot, four of them on the scraper's own 127.0.0.1, were every
    scrape's 503: a scraper that sends its request at once takes the oldest hog's place."""
    with Hogs(endpoint, hog_sources(), trickle) as hogs:
        for n in range(1, 6):
            families = prompt_scrape(endpoint)
            assert families["gpuwatch_pci_functions"] == "gauge"
            hogs.settle(reopened=n)  # the evicted hog is back: every slot held again
        for n in range(6, 9):  # from another address: the server full, not the address
            prompt_scrape(endpoint, source="127.0.0.200")
            hogs.settle(reopened=n)


class _Large:
    """A family of `n` samples of 1 KiB each: a reply larger than the socket buffers (as a
    host of thousands of functions makes over a network, whose buffers grow less)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        family = GaugeMetricFamily("test_padding", "large", labels=["pad"])
        for i in range(self.n):
            family.add_metric([f"{i:05d}" + "p" * 1024], 1.0)
        yield family


def test_clients_that_take_no_reply_leave_a_prompt_scraper_served(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hogs that ask and then read nothing of a reply too large for the socket buffers held
    a thread each until the reply timeout: a scraper takes the place of the one stalled
    longest, once it has taken nothing for HTTP_STALL seconds."""
    import gpuwatch.service.metrics as metrics_module
    from gpuwatch.service.metrics import HTTP_MAX_CONNECTIONS, HTTP_MAX_PER_ADDRESS, HTTP_STALL

    monkeypatch.setattr(metrics_module, "HTTP_TIMEOUT", 60.0)
    metrics = Metrics()
    # 6 MiB: more than a loopback connection's send buffer grows to (tcp_wmem's 4 MiB)
    metrics.registry.register(_Large(6000))
    bound = metrics.serve("127.0.0.1:0")
    hogs: list[socket.socket] = []
    try:
        def hog(source: str) -> None:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.bind((source, 0))
            s.connect(bound)
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            hogs.append(s)

        def handlers() -> int:
            return sum(t.name.endswith("(process_request_thread)") and t not in before
                       for t in threading.enumerate())

        before = set(threading.enumerate())
        for i in range(HTTP_MAX_CONNECTIONS):
            hog(f"127.0.0.{2 + i // HTTP_MAX_PER_ADDRESS}")
        for _ in range(3):
            time.sleep(HTTP_STALL + 1.0)  # every hog's reply stalled, each in its thread
            families = prompt_scrape(bound, limit=5.0)
            assert families["test_padding"] == "gauge"
            hog("127.0.0.6")  # the slot the scraper freed, held again
        # The evicted ones' threads ended, their clients' sockets still open: a thread for
        # each slot and no more (once the last hog's has started).
        deadline = time.monotonic() + 10
        while handlers() != HTTP_MAX_CONNECTIONS and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handlers() == HTTP_MAX_CONNECTIONS
        # Three hogs were cut off partway through their replies: a reset or an early EOF
        # (the others, read now, get theirs whole).
        cut = 0
        for s in hogs:
            s.settimeout(5)
            got = 0
            try:
                while chunk := s.recv(1 << 20):
                    got += len(chunk)
            except ConnectionResetError:
                cut += 1
                continue
            except TimeoutError:
                continue
            cut += got < 6000 * 1024
        assert cut == 3
    finally:
        for s in hogs:
            s.close()
        metrics.close()


class _Slow:
    """A collector that takes `delay` seconds: requests stay in the render for a while."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        time.sleep(self.delay)
        yield GaugeMetricFamily("test_slow", "slow", value=1.0)


def test_requests_at_work_are_never_evicted() -> None:
    """Every slot a request being rendered or answered: a newcomer is the one told 503, and
    every request in flight gets its metrics."""
    from gpuwatch.service.metrics import HTTP_MAX_CONNECTIONS, HTTP_MAX_PER_ADDRESS

    metrics = Metrics()
    metrics.registry.register(_Slow(1.5))
    bound = metrics.serve("127.0.0.1:0")
    try:
        busy = [socket.create_connection(
            bound, timeout=30, source_address=(f"127.0.0.{2 + i // HTTP_MAX_PER_ADDRESS}", 0))
            for i in range(HTTP_MAX_CONNECTIONS)]
        for s in busy:
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        deadline = time.monotonic() + 10  # all of them read, in the render or waiting for it
        while not (len(conns := list(metrics._server._conns.values())) == HTTP_MAX_CONNECTIONS
                   and all(c.state == "working" for c in conns)):
            assert time.monotonic() < deadline, [c.state for c in conns]
            time.sleep(0.01)
        status, body = exchange(bound, b"GET /metrics HTTP/1.0\r\n\r\n")
        assert status == "HTTP/1.0 503 Service Unavailable: too many connections", status
        assert body == b"503 Service Unavailable: too many connections\n"
        # From an address at its share, the same answer names the address.
        with socket.create_connection(bound, timeout=30, source_address=("127.0.0.2", 0)) as s:
            assert s.recv(4096).endswith(b"too many connections from this address\n")
        for s in busy:
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            assert data.startswith(b"HTTP/1.0 200 OK\r\n") and b"test_slow 1.0" in data
            s.close()
    finally:
        metrics.close()


def test_bad_requests_get_one_plain_line(endpoint: tuple[str, int]) -> None:
    huge = b"GET /metrics HTTP/1.1\r\n" + b"X-Filler: " + b"a" * 8000 + b"\r\n" * 1 + (
        b"X-More: " + b"b" * 9000 + b"\r\n\r\n")
    status, body = exchange(endpoint, huge)
    assert status == "HTTP/1.0 431 Request Header Fields Too Large"
    assert body == b"431 Request Header Fields Too Large\n"
    status, body = exchange(endpoint, b"DELETE /metrics HTTP/1.0\r\n\r\n")
    assert status.startswith("HTTP/1.0 405") and body.count(b"\n") == 1
    for garbage, code in ((b"\x00\xff\r\n\r\n", 400), (b"GET /metrics HTTP/9.9\r\n\r\n", 505),
                          (b"GET /metrics HTTP/1.x\r\n\r\n", 400),
                          (b"GET /metrics HTTP/1.0 extra words\r\n\r\n", 400)):
        with socket.create_connection(endpoint, timeout=30) as s:
            s.sendall(garbage)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        # A status line a client can read, whatever the request line said (not the stdlib's
        # HTTP/0.9 answer, a body alone), then the one plain line.
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.0 %d " % code), data
        assert body.count(b"\n") == 1 and b"<" not in body, data


def test_every_address_includes_ipv6(monkeypatch: pytest.MonkeyPatch) -> None:
    """`:PORT` is every address of the host or pod: an IPv6-only pod is scraped on ::."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    metrics = Metrics()
    _, port = metrics.serve(":0")
    try:
        for host in ("127.0.0.1", "[::1]"):
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=30) as r:
                assert r.status == 200, host
    finally:
        metrics.close()


async def test_hostile_vendor_names_parse_back_exactly(tmp_path: Any, sockdir: str) -> None:
    vendor = 'x"y\\z{w},a=b'
    tree = SysRoot(tmp_path)
    tree.add_function("0000:01:00.0", vendor=vendor, device="0x1234", klass="0x030000",
                      driver="vfio-pci", iommu_group=1)
    metrics = Metrics()
    async with served_watcher(tree.root, f"{sockdir}/gw.sock") as served:
        metrics.attach(served.watcher)
        bound = metrics.serve("127.0.0.1:0")
        try:
            s = await scrape(*bound)
        finally:
            metrics.close()
    assert value(s, "gpuwatch_gpus", vendor=vendor, mode="vfio") == 1


def test_what_prometheus_asks_for_first_parses_as_openmetrics(endpoint: tuple[str, int]) -> None:
    """Prometheus asks for OpenMetrics before the text format: every family, our own
    collectors' included, must parse with the OpenMetrics parser too."""
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as openmetrics_families,
    )

    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    request = urllib.request.Request(f"http://{endpoint[0]}:{endpoint[1]}/metrics",
                                     headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text")
        text = r.read().decode()
    families = {f.name: f.type for f in openmetrics_families(text)}
    assert families["gpuwatch_log_write_failures"] == "counter"
    assert families["gpuwatch_switch_duration_seconds"] == "histogram"
    assert families["gpuwatch_gpus"] == "gauge"


# --------------------------------------------------------------------------- shared renders


class _CountingApp:
    """A WSGI app that says how often it rendered, slowly (as a 3,000-function host does)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls = 0
        self.delay = delay

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        self.calls += 1
        time.sleep(self.delay)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [f"render {self.calls} for {environ.get('QUERY_STRING', '')}\n".encode()]


def _get(app: Any, query: str = "", accept: str = "") -> tuple[str, bytes]:
    taken: list[str] = []
    body = b"".join(app({"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics",
                         "QUERY_STRING": query, "HTTP_ACCEPT": accept},
                        lambda status, headers: taken.append(status)))
    return taken[0], body


def test_scrapers_that_come_together_share_one_render() -> None:
    """Sixteen scrapers at once were sixteen renders, each holding the interpreter the event
    loop needs (a probe then waited 50-600 ms). Requests that all came before a render began
    share it (here the clock stands still, so all of them came before the first)."""
    from gpuwatch.service.metrics import _SharedRenders

    inner = _CountingApp(delay=0.05)
    app = _SharedRenders(inner, clock=lambda: 100.0)  # no time passes
    import threading

    bodies: list[bytes] = []
    threads = [threading.Thread(target=lambda: bodies.append(_get(app)[1])) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert bodies == [b"render 1 for \n"] * 16
    assert inner.calls == app.rendered == 1


def test_a_render_is_shared_only_with_requests_that_came_before_it_began() -> None:
    """No answer is older than its request: a scrape after a change sees the change."""
    from gpuwatch.service.metrics import RENDERS_KEPT, _SharedRenders

    now = [0.0]
    inner = _CountingApp()
    app = _SharedRenders(inner, clock=lambda: now[0])
    assert _get(app) == ("200 OK", b"render 1 for \n")
    assert _get(app)[1] == b"render 1 for \n"  # the same instant: it began no earlier
    now[0] += 0.001
    assert _get(app)[1] == b"render 2 for \n"
    assert _get(app, query="name[]=gpuwatch_gpus")[1] == b"render 3 for name[]=gpuwatch_gpus\n"
    assert _get(app, accept="application/openmetrics-text")[1] == b"render 4 for \n"
    assert _get(app)[1] == b"render 2 for \n"  # each request shape its own
    for i in range(2 * RENDERS_KEPT):  # request shapes a client makes up are not all kept
        _get(app, query=f"name[]=x{i}")
    assert len(app._renders) == RENDERS_KEPT


def test_each_request_gets_its_own_header_list() -> None:
    """wsgiref adds to the header list it is given (Content-Length): a shared render's list
    handed to every request would be changed by one thread while another reads it."""
    from gpuwatch.service.metrics import _SharedRenders

    app = _SharedRenders(_CountingApp(), clock=lambda: 0.0)
    lists: list[list[tuple[str, str]]] = []
    for _ in range(2):
        b"".join(app({"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics"},
                     lambda status, headers: lists.append(headers)))
    assert lists[0] == lists[1] == [("Content-Type", "text/plain")]
    assert lists[0] is not lists[1]
    lists[0].append(("Content-Length", "9"))
    assert _get(app) == ("200 OK", b"render 1 for \n")
    assert lists[1] == [("Content-Type", "text/plain")]


async def test_a_subscribe_is_counted_by_the_reply_it_gets(host: SysRoot, sockdir: str,
                                                          tmp_path: Any) -> None:
    """A replaying subscribe is answered once the log's first lines are found: it counts
    then, as ``ok``, or as ``unavailable`` when the log cannot be read, never as both."""
    log = tmp_path / "events.jsonl"
    log.write_text('{"seq":1,"time":"2026-01-01T00:00:00.000000Z","type":"stopped",'
                   '"reason":"signal"}\n')
    (tmp_path / "events.jsonl.1").symlink_to("/proc/self/mem")  # a read fails with EIO
    metrics = Metrics()
    async with served_watcher(host.root, f"{sockdir}/gw.sock", log=str(log)) as served:
        metrics.attach(served.watcher)
        served.server.metrics = metrics
        bound = metrics.serve("127.0.0.1:0")
        try:
            async with await anyio.connect_unix(served.path) as c:
                await c.send(P.encode_request(1, "subscribe", {"since_seq": 0}))
                reply = P.loads((await c.receive()).split(b"\n")[0])
                assert reply["error"]["code"] == P.UNAVAILABLE, reply
                (tmp_path / "events.jsonl.1").unlink()
                await c.send(P.encode_request(2, "subscribe", {"since_seq": 1}))
                reply = P.loads((await c.receive()).split(b"\n")[0])
                assert reply["result"]["complete"] is True, reply
            s = await scrape(*bound)
            assert value(s, "gpuwatch_socket_requests_total", method="subscribe",
                         outcome="ok") == 1
            assert value(s, "gpuwatch_socket_requests_total", method="subscribe",
                         outcome=P.UNAVAILABLE) == 1
        finally:
            metrics.close()


def test_a_daemon_s_scraper_is_served_while_hogs_hold_every_slot(
    host: SysRoot, tmp_path: Any, sockdir: str,
) -> None:
    """The same against a real ``gpuwatch watch --metrics 127.0.0.1:PORT``: hogs trickling
    their heads from the scraper's address and fifteen others, and scrapes still answer."""
    from daemon_helpers import Daemon

    with socket.socket() as s:  # a free port, as the other daemon tests find one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    bound = ("127.0.0.1", port)
    with Daemon(host.root, tmp_path, f"{sockdir}/gw.sock", "--metrics", f"127.0.0.1:{port}"), \
            Hogs(bound, hog_sources(), trickle=True) as hogs:
        for n in range(1, 4):
            families = prompt_scrape(bound)
            assert families["gpuwatch_gpus"] == "gauge"
            assert families["process_open_fds"] == "gauge"
            hogs.settle(reopened=n)


# --------------------------------------------------------------------------- alerting semantics


async def test_every_documented_outcome_is_a_series_from_the_start(host: SysRoot,
                                                                   sockdir: str) -> None:
    """Prometheus' ``increase()`` sees a counter's first increment only against an earlier
    sample: a series born at 1 (the first wedged switch, the first overflow rescan, the first
    gpu-wedged event) never makes ``increase(...[10m]) > 0`` fire. Every value the docs name
    for ``outcome``, ``reason`` and ``type`` is exposed at 0 before anything happens."""
    from gpuwatch.core.events import EVENT_TYPES

    metrics = Metrics()
    async with served_watcher(host.root, f"{sockdir}/gw.sock") as served:
        metrics.attach(served.watcher)
        bound = metrics.serve("127.0.0.1:0")
        try:
            s = await scrape(*bound)
            for outcome in ("completed", "refused", "failed", "wedged"):
                assert value(s, "gpuwatch_switches_total", outcome=outcome) == 0, outcome
            for reason in ("overflow", "reconcile"):
                assert value(s, "gpuwatch_resyncs_total", reason=reason) == 0, reason
            for etype in sorted(EVENT_TYPES - {"ready"}):
                assert value(s, "gpuwatch_events_total", type=etype) == 0, etype
            assert value(s, "gpuwatch_events_total", type="ready") == 1
            # ... and the first one then moves its series by exactly one.
            served.watcher.publish([SwitchFailed(addr=NV, group=13, to_mode="nvidia",  # type: ignore[call-arg]
                                                 error="hung", wedged=True)])
            await served.watcher.resync("reconcile")
            s = await scrape(*bound)
            assert value(s, "gpuwatch_switches_total", outcome="wedged") == 1
            assert value(s, "gpuwatch_switches_total", outcome="failed") == 0
            assert value(s, "gpuwatch_events_total", type="switch-failed") == 1
            assert value(s, "gpuwatch_resyncs_total", reason="reconcile") == 1
            assert value(s, "gpuwatch_resyncs_total", reason="overflow") == 0
        finally:
            metrics.close()


def test_the_last_event_s_age_follows_elapsed_time_not_the_wall_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A daemon starts early in boot, often before NTP steps the clock (hours, on a board
    without an RTC years): an age from wall-clock stamps would jump by the step, firing a
    staleness alert at once or going negative. It counts elapsed time."""
    from gpuwatch.core.events import Ready

    metrics = Metrics()
    metrics.on_event(Ready(devices=0, source="memory"))  # type: ignore[call-arg]

    def age() -> float:
        samples = {s.name: s.value for f in metrics.registry.collect() for s in f.samples}
        return samples["gpuwatch_last_event_age_seconds"]

    assert 0 <= age() < 60
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 6 * 3600)  # NTP steps it forward
    assert 0 <= age() < 60
    monkeypatch.setattr(time, "time", lambda: real() - 6 * 3600)  # or back
    assert 0 <= age() < 60


async def test_the_documented_table_is_what_is_exposed(host: SysRoot, sockdir: str) -> None:
    """Each row of docs/service.md's metrics table names a family that exists with exactly
    that name, type and labels (an alert written from the docs matches), and each
    ``gpuwatch_*`` family exposed has its row."""
    import re
    from pathlib import Path

    from prometheus_client.openmetrics.exposition import generate_latest
    from prometheus_client.openmetrics.parser import (
        text_string_to_metric_families as openmetrics_families,
    )

    doc = (Path(__file__).parent.parent / "docs" / "service.md").read_text()
    table = doc.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    rows = {name: (kind, set(re.findall(r"`(\w+)`", labels)))
            for name, kind, labels in re.findall(
                r"^\| `(gpuwatch_\w+)` \| (\w+) \|\s*([^|]*?)\s*\|", table, re.M)}
    assert len(rows) >= 19, rows

    class Nfd:
        failures = 0

    metrics = Metrics()
    async with served_watcher(host.root, f"{sockdir}/gw.sock") as served:
        metrics.attach(served.watcher)
        metrics.track_nfd(Nfd())
        served.server.metrics = metrics
        async with await anyio.connect_unix(served.path) as c:  # a probe and its request
            await c.send(P.encode_request(1, "probe", {"action": "detect-gpu"}))
            await c.receive()
        text = generate_latest(metrics.registry).decode()
        metrics.detach()
    exposed: dict[str, tuple[str, set[str]]] = {}
    for family in openmetrics_families(text):
        suffix = "_total" if family.type == "counter" else ""
        labels = {k for s in family.samples if not s.name.endswith("_created")
                  for k in s.labels if k != "le"}
        exposed[family.name + suffix] = (family.type, labels)
    for name, (kind, labels) in rows.items():
        assert exposed.get(name) == (kind, labels), name
    assert {n for n in exposed if n.startswith("gpuwatch_")} == set(rows)


def _documented_families() -> dict[str, str]:
    """The metrics table of docs/service.md: family name (as the text format names it) and
    type."""
    import re
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "service.md").read_text()
    table = doc.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    return dict(re.findall(r"^\| `(gpuwatch_\w+)` \| (\w+) \|", table, re.M))


async def test_the_text_format_a_scraper_gets_by_default_has_only_documented_families(
        host: SysRoot, sockdir: str) -> None:
    """Scraped as curl or a scraper asking for no format gets it (text 0.0.4), while
    binds, socket clients and a switch come and go: each family is a documented one of its
    documented type with its HELP, or ``process_*``, and no counter goes down. The text
    format held a ``gpuwatch_events_created`` gauge family (and one for every other counter
    and the histogram): undocumented metrics, one series per counter series."""
    documented = _documented_families()
    async with served_watcher(host.root, f"{sockdir}/gw.sock") as served:
        w = served.watcher
        metrics, source, bound = serve_metrics(served)

        def get(accept: str | None) -> tuple[str, str]:
            headers = {"Accept": accept} if accept else {}
            request = urllib.request.Request(f"http://{bound[0]}:{bound[1]}/metrics",
                                             headers=headers)
            with urllib.request.urlopen(request, timeout=30) as r:
                return str(r.headers["Content-Type"]), r.read().decode()

        counters: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
        try:
            for turn in range(3):
                await rebind(source, host, NV_AUDIO, "vfio-pci" if turn % 2 == 0 else
                             "snd_hda_intel", w)
                async with await anyio.connect_unix(served.path) as c:
                    await c.send(P.encode_request(1, "probe", {"action": "detect-vfio"}))
                    await c.receive()
                w.publish([SwitchRefused(addr=NV, group=13, to_mode="vfio",  # type: ignore[call-arg]
                                         reason="held", holders=[])])
                content_type, text = await anyio.to_thread.run_sync(get, None)
                assert content_type.startswith("text/plain; version=0.0.4")
                for family in text_string_to_metric_families(text):
                    if family.name.startswith("process_"):
                        continue
                    name = family.name + ("_total" if family.type == "counter" else "")
                    assert documented.get(name) == family.type, family.name
                    assert family.documentation, family.name
                    if family.type in ("counter", "histogram"):
                        for sample in family.samples:
                            key = (sample.name, frozenset(sample.labels.items()))
                            assert sample.value >= counters.get(key, 0.0), key
                            counters[key] = sample.value
                content_type, text = await anyio.to_thread.run_sync(
                    get, "application/openmetrics-text; version=1.0.0")
                assert content_type.startswith("application/openmetrics-text")
                assert "_created" not in text
        finally:
            metrics.close()
    assert counters[("gpuwatch_switches_total", frozenset({("outcome", "refused")}))] == 3


async def test_read_through_counters_keep_their_counts_once_detached(
        host: SysRoot, sockdir: str) -> None:
    """The daemon stops: `Metrics.close` detaches the watcher. A scrape then (or an
    embedder collecting the registry afterwards) must see the counts reached, not 0: a
    counter that goes down reads to Prometheus as a reset, and rate() over it as new
    forgeries and losses."""
    metrics = Metrics()
    async with served_watcher(host.root, f"{sockdir}/gw.sock") as served:
        w, source = served.watcher, served.source
        metrics.attach(w)
        source.rejected = 3  # type: ignore[attr-defined]  # as the kernel source counts
        w.uevent_losses = 2
        metrics.detach()
        s = {(sample.name, frozenset(sample.labels.items())): sample.value
             for family in metrics.registry.collect() for sample in family.samples}
        metrics.close()
    assert value(s, "gpuwatch_uevents_forged_total") == 3
    assert value(s, "gpuwatch_uevent_losses_total") == 2
