"""Prometheus metrics of a running watcher, scraped over HTTP on 127.0.0.1."""

from __future__ import annotations

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


async def test_metrics_follow_the_watcher(host: SysRoot, sockdir: str) -> None:
    metrics = Metrics()
    async with served_watcher(host.root, f"{sockdir}/gw.sock") as served:
        w, source = served.watcher, served.source
        assert isinstance(source, MemorySource)
        metrics.attach(w)
        served.server.metrics = metrics
        bound = metrics.serve("127.0.0.1:0")
        try:
            assert bound[0] == "127.0.0.1"  # loopback only, as asked
            s = await scrape(*bound)
            assert value(s, "gpuwatch_gpus", vendor="NVIDIA", mode="nvidia") == 1
            assert value(s, "gpuwatch_gpus", vendor="Intel", mode="host driver") == 1
            assert value(s, "gpuwatch_pci_functions") == 7
            assert value(s, "gpuwatch_nvidia_gpu_usable") == 1
            assert value(s, "gpuwatch_events_total", type="ready") == 1
            assert value(s, "gpuwatch_last_event_seq") == 1

            # The NVIDIA card's group goes to vfio-pci: the gauge moves from nvidia to vfio.
            await rebind(source, host, NV_AUDIO, "vfio-pci", w)
            await rebind(source, host, NV, "vfio-pci", w)
            await w.resync("reconcile")
            published = time.time()  # the last event's time is at or after this
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
            assert age is not None and 0 <= age <= time.time() - published
            assert value(s, "gpuwatch_socket_clients") == 0
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
