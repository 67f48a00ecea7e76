"""Prometheus metrics of a running watcher (``gpuwatch watch --metrics ADDR``).

Everything is fed from the watcher's event stream, on the event loop: GPU counts are
recomputed from the ``detect-vfio`` answer a ``probe-changed`` event carries, so a scrape
(on prometheus_client's HTTP thread) never walks the model while the loop changes it.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import math
import socket
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any, get_args
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily, Metric
from pydantic import BaseModel

from gpuwatch.core.events import EVENT_TYPES, Resync
from gpuwatch.core.modes import group_mode
from gpuwatch.core.results import HEALTH_STATES
from gpuwatch.settings import InvalidListenAddress, parse_listen_address

if TYPE_CHECKING:
    from gpuwatch.watch.watcher import Watcher

_log = logging.getLogger("gpuwatch.service")

#: Buckets for a switch: unbind/bind takes tens of ms, a module reload seconds, the timeout 90 s.
SWITCH_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 90.0, 120.0)
#: ``gpuwatch_switches_total``'s outcomes (``switch-failed`` with ``wedged`` is ``wedged``).
SWITCH_OUTCOMES = ("completed", "refused", "failed", "wedged")


#: The endpoint is open to the network (``:9464`` in a pod), so every client is bounded:
#: connections served at once, ...
HTTP_MAX_CONNECTIONS = 16
#: ... of them from one address, ...
HTTP_MAX_PER_ADDRESS = 4
#: ... seconds for a request's line and headers to arrive, and for a reply to be taken ...
HTTP_TIMEOUT = 10.0
#: ... and bytes of request line and headers (a scrape sends a few hundred).
HTTP_MAX_HEAD_BYTES = 16384
#: A connection that comes when its address or the server is full takes the place of one
#: that only holds a slot: the oldest still waiting for its request's head (a scraper that
#: sends at once waits there microseconds), else a reply whose client has taken none of it
#: for `HTTP_STALL` seconds, or takes it slower than `HTTP_MIN_REPLY_RATE` bytes a second
#: (after a first `HTTP_STALL`). Only when every slot is a request being rendered or a reply
#: its client takes is the newcomer told ``503``: idle connections, from however many
#: addresses, never leave a scrape without a slot.
HTTP_STALL = 1.0
HTTP_MIN_REPLY_RATE = 256 << 10
#: Renders kept (one per request shape: format, encoding, ``name[]`` filter).
RENDERS_KEPT = 4


class _TooSlow(Exception):
    pass


class _TooLarge(Exception):
    pass


class _HeadReader(io.RawIOBase):
    """The connection's reads for one request, against a deadline for the whole head (a
    client sending a byte every few seconds gains nothing) and a byte budget."""

    def __init__(self, sock: socket.socket, timeout: float, budget: int) -> None:
        super().__init__()
        self._sock, self._budget = sock, budget
        self._deadline = time.monotonic() + timeout
        self._timeout = timeout

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._budget <= 0:
            raise _TooLarge
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise _TooSlow
        self._sock.settimeout(left)
        try:
            n = self._sock.recv_into(memoryview(buffer)[: self._budget])
        except TimeoutError:
            raise _TooSlow from None
        finally:
            self._sock.settimeout(self._timeout)  # what writing the reply may take
        self._budget -= n
        return n


def _one_line(status: str) -> bytes:
    body = f"{status}\n".encode()
    return (f"HTTP/1.0 {status}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def _answer(sock: socket.socket, status: str) -> None:
    """A one-line plain-text answer, best effort: never waits for a client."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        sock.send(_one_line(status))


_HEAD, _WORKING, _WRITING, _EVICTED, _DONE = "head", "working", "writing", "evicted", "done"


@dataclass(eq=False)
class _Conn:
    """One admitted connection: what it is doing decides whether a newcomer may take its
    slot. Its `state` changes only under the server's lock; `progress` (the last time its
    client took reply bytes) is written by its own thread alone."""

    sock: socket.socket
    peer: str
    since: float
    state: str = _HEAD
    progress: float = 0.0
    #: When its reply is late at `HTTP_MIN_REPLY_RATE`.
    due: float = math.inf

    def stalled(self, now: float) -> bool:
        return self.state == _WRITING and (now - self.progress >= HTTP_STALL or now >= self.due)


class _ReplyWriter(io.BufferedIOBase):
    """The handler's ``wfile``: a reply written within `HTTP_TIMEOUT` in all, each byte the
    client takes noted (a reply it stops taking may be evicted; one it takes, never)."""

    def __init__(self, server: _Server, conn: _Conn) -> None:
        super().__init__()
        self._server, self._conn = server, conn
        self._deadline = math.inf

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        now = time.monotonic()
        if self._deadline == math.inf:
            self._deadline = now + HTTP_TIMEOUT
        if not self._server.writing(self._conn, len(view), now):
            raise ConnectionAbortedError(errno.ECONNABORTED, "evicted")
        sock = self._conn.sock
        sent = 0
        while sent < len(view):
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("reply not taken in time")
            sock.settimeout(left)
            sent += sock.send(view[sent:])
            self._conn.progress = time.monotonic()
        return sent


class _Handler(WSGIRequestHandler):
    """prometheus_client's WSGI app behind bounded reads, one-line errors, and no
    tracebacks on stderr for clients that go away or stall."""

    timeout = HTTP_TIMEOUT
    #: What an error reply to a request line that names no usable version speaks: the
    #: stdlib's HTTP/0.9 would send the body alone, no status line a client can read.
    default_request_version = "HTTP/1.0"
    error_message_format = "%(code)d %(message)s\n"
    error_content_type = "text/plain; charset=utf-8"
    server: _Server

    def setup(self) -> None:
        super().setup()
        self._conn = self.server.conn_of(self.connection)
        self.rfile = io.BufferedReader(_HeadReader(self.connection, HTTP_TIMEOUT,
                                                   HTTP_MAX_HEAD_BYTES))
        self.wfile = _ReplyWriter(self.server, self._conn)

    def parse_request(self) -> bool:
        """The head is in: from now on the connection does real work, unless a newcomer
        took its slot while its last bytes came (then it ends here, unanswered)."""
        return bool(super().parse_request()) and self.server.working(self._conn)

    def handle(self) -> None:
        try:
            super().handle()
        except _TooSlow:
            _answer(self.connection, "408 Request Timeout")
        except _TooLarge:
            _answer(self.connection, "431 Request Header Fields Too Large")
        except OSError as exc:  # reset, evicted, or a reply the client did not take in time
            _log.debug("metrics client %s: %s", self.client_address, exc)

    def get_stderr(self) -> Any:
        return io.StringIO()  # wsgiref's tracebacks of a dropped client: not the journal's

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged: one line per scrape would flood the journal."""


def _victim(candidates: list[_Conn], peer: str, per_peer: Tally[str],
            now: float) -> _Conn | None:
    """Whose slot a newcomer from `peer` takes: one waiting for its head (of the newcomer's
    own address first, then of the address holding most, the oldest), else the reply most
    overdue; None when every candidate does real work."""
    waiting = [c for c in candidates if c.state == _HEAD]
    if waiting:
        return min(waiting, key=lambda c: (c.peer != peer, -per_peer[c.peer], c.since))
    stalled = [c for c in candidates if c.stalled(now)]
    if stalled:
        return min(stalled, key=lambda c: min(c.progress + HTTP_STALL, c.due))
    return None


class _Server(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most `HTTP_MAX_CONNECTIONS` admitted at once, plus as
    many at most that were evicted and are ending."""

    daemon_threads = True
    request_queue_size = 64  # a burst of scrapes waits in the kernel, not in SYN retries

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily) -> None:
        self.address_family = family
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, _Conn] = {}  # admitted, by their socket
        self._per_peer: Tally[str] = Tally()
        self._ending: set[socket.socket] = set()  # evicted, their threads not yet ended
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:  # "::" takes IPv4 too (dual stack)
            with contextlib.suppress(OSError):
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

    def process_request(self, request: Any, client_address: Any) -> None:
        """On the accepting thread: admit the connection, evicting one that only holds a
        slot where its address or the server is full, or answer 503."""
        peer = str(client_address[0])
        now = time.monotonic()
        with self._lock:
            refused = self._make_room(peer, now)
            if refused is None:
                self._conns[request] = _Conn(request, peer, now, progress=now)
                self._per_peer[peer] += 1
        if refused is not None:
            _answer(request, f"503 Service Unavailable: {refused}")
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)  # a thread that failed to start
        # raised here; serve_forever's handle_error and shutdown_request release the slot

    def _make_room(self, peer: str, now: float) -> str | None:
        """Under the lock: evict what the newcomer needs gone; else why it is refused."""
        if self._per_peer[peer] >= HTTP_MAX_PER_ADDRESS:
            mine = [c for c in self._conns.values() if c.peer == peer]
            victim = _victim(mine, peer, self._per_peer, now)
            if victim is None or len(self._ending) >= HTTP_MAX_CONNECTIONS:
                return "too many connections from this address"
            self._evict(victim)
        if len(self._conns) >= HTTP_MAX_CONNECTIONS:
            victim = _victim(list(self._conns.values()), peer, self._per_peer, now)
            if victim is None or len(self._ending) >= HTTP_MAX_CONNECTIONS:
                return "too many connections"
            self._evict(victim)
        return None

    def _evict(self, conn: _Conn) -> None:
        """Under the lock, so its thread has not closed the socket (it closes only after
        taking it out, under the lock): wake the thread from its read or write, to end."""
        del self._conns[conn.sock]
        self._release(conn.peer)
        waiting = conn.state == _HEAD
        conn.state = _EVICTED
        self._ending.add(conn.sock)
        with contextlib.suppress(OSError):
            if waiting:  # its thread writes nothing now: the one line is ours to send
                conn.sock.send(_one_line("408 Request Timeout"), socket.MSG_DONTWAIT)
            conn.sock.shutdown(socket.SHUT_RDWR)

    def _release(self, peer: str) -> None:
        self._per_peer[peer] -= 1
        if self._per_peer[peer] <= 0:
            del self._per_peer[peer]

    def conn_of(self, request: socket.socket) -> _Conn:
        with self._lock:
            conn = self._conns.get(request)
        if conn is None:  # evicted before its thread began: it ends at its first read
            conn = _Conn(request, "", 0.0, state=_EVICTED)
        return conn

    def working(self, conn: _Conn) -> bool:
        """Its head is in; False when it was evicted (it must end)."""
        with self._lock:
            if conn.state != _HEAD:
                return False
            conn.state = _WORKING
            return True

    def writing(self, conn: _Conn, size: int, now: float) -> bool:
        """`size` more bytes of its reply to write; False when it was evicted."""
        with self._lock:
            if conn.state in (_EVICTED, _DONE):
                return False
            if conn.state != _WRITING:
                conn.state, conn.due = _WRITING, now + HTTP_STALL
            conn.progress = now
            conn.due += size / HTTP_MIN_REPLY_RATE
            return True

    def shutdown_request(self, request: Any) -> None:
        """Take the connection out under the lock before its socket closes, so an eviction
        never shuts down a descriptor number the kernel has given to another file."""
        with self._lock:
            conn = self._conns.pop(request, None)
            if conn is not None:
                self._release(conn.peer)
                conn.state = _DONE
            else:
                self._ending.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        _log.debug("metrics client %s failed", client_address, exc_info=True)


_Render = tuple[float, str, list[tuple[str, str]], bytes]


class _SharedRenders:
    """prometheus_client's WSGI app, one render at a time, and a render shared by every
    request that arrived before it began (they waited for the one before to end). On a host
    of thousands of functions a render takes a tenth of a second of the interpreter the
    event loop needs: sixteen scrapers at once were sixteen renders, and the loop (probes,
    the socket) got a seventeenth of it. Now it shares it with one render at most, and no
    answer is older than its request."""

    def __init__(self, app: Callable[..., Any], clock: Callable[[], float] = time.monotonic,
                 ) -> None:
        self._app = app
        self._clock = clock
        self._lock = threading.Lock()
        self._renders: dict[tuple[str, ...], _Render] = {}
        #: Renders made (for tests and diagnostics).
        self.rendered = 0

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        arrived = self._clock()
        key = tuple(str(environ.get(name, "")) for name in (
            "REQUEST_METHOD", "PATH_INFO", "QUERY_STRING", "HTTP_ACCEPT",
            "HTTP_ACCEPT_ENCODING"))
        with self._lock:
            render = self._renders.get(key)
            if render is None or render[0] < arrived:  # begun before this request came
                render = self._render(environ)
                self._renders.pop(key, None)
                if len(self._renders) >= RENDERS_KEPT:
                    del self._renders[next(iter(self._renders))]  # the oldest
                self._renders[key] = render
        _, status, headers, body = render
        start_response(status, list(headers))  # each its own: wsgiref adds to the list
        return [body]

    def _render(self, environ: dict[str, Any]) -> _Render:
        began = self._clock()
        taken: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]],
                           exc_info: Any = None) -> Callable[[bytes], None]:
            taken[:] = [status, headers]
            return lambda data: None

        body = b"".join(self._app(environ, start_response))
        self.rendered += 1
        return began, taken[0], list(taken[1]), body


def _bind(host: str, port: int) -> _Server:
    """``""`` is every address: IPv6 and IPv4 on one dual-stack socket where the host has
    IPv6 (an IPv6-only pod is scraped on its IPv6 address), else IPv4's ``0.0.0.0``."""
    if host == "":
        try:
            return _Server(("::", port), socket.AF_INET6)
        except OSError as exc:
            if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
                raise
        return _Server(("0.0.0.0", port), socket.AF_INET)
    family, _, _, _, sockaddr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    return _Server((str(sockaddr[0]), port), family)


class _Exposed:
    """A registry as scrapes see it: without the ``_created`` samples prometheus_client adds
    to each counter and histogram. In the text format (0.0.4, what curl and many scrapers
    get) each became a gauge family of its own (``gpuwatch_events_created``, one series per
    label set, holding a start-up timestamp): metrics the docs do not name, doubling every
    counter's series. Dropped alike in OpenMetrics, where ``_created`` is optional, so both
    formats expose the same families."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Any]:
        for family in self._registry.collect():
            created = family.name + "_created"
            copy = Metric(family.name, family.documentation, family.type, family.unit)
            copy.samples = [s for s in family.samples if s.name != created]
            yield copy  # a collector's own family is never changed

    def restricted_registry(self, names: Any) -> _Exposed:
        """``?name[]=…`` (prometheus_client's filter), still without ``_created``."""
        return _Exposed(self._registry.restricted_registry(names))


class _ReadCounter:
    """A counter kept by its owner (an int attribute), read at scrape time: the owner
    needs no import of prometheus_client and no lock."""

    def __init__(self, name: str, documentation: str, read: Callable[[], int]) -> None:
        self._name, self._doc, self._read = name, documentation, read

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._doc)
        family.add_metric([], float(self._read()))
        yield family


class Metrics:
    """One registry per watcher (not the global one), so tests and embedders can hold several."""

    def __init__(self, vendor_name: Callable[[str], str] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._watcher: Watcher | None = None
        r = self.registry
        self._vendor_name = vendor_name or (lambda vid: vid or "unknown")
        self.gpus = Gauge("gpuwatch_gpus", "GPUs (display-class functions) by vendor and mode "
                          "of their IOMMU group", ["vendor", "mode"], registry=r)
        self._gpu_series: set[tuple[str, str]] = set()
        self._tally: Tally[tuple[str, str]] = Tally()
        self.functions = Gauge("gpuwatch_pci_functions", "PCI functions in the model", registry=r)
        self.function_health = Gauge(
            "gpuwatch_function_health", "1 for each PCI function's health state (ok, recovering, "
            "failed, wedged: from PCI error recovery and DRM wedge uevents), 0 for the others",
            ["addr", "state"], registry=r)
        self._health: dict[str, str] = {}
        self._variants: frozenset[str] = frozenset()
        self.nvidia_usable = Gauge("gpuwatch_nvidia_gpu_usable", "1 when an NVIDIA GPU is usable "
                                   "now (detect-gpu: nvidia loaded, CDI reachable, a display "
                                   "function bound to nvidia)", registry=r)
        self.events = Counter("gpuwatch_events", "Events published, by type", ["type"], registry=r)
        self.resyncs = Counter("gpuwatch_resyncs", "Full rescans diffed against the model, by "
                               "reason", ["reason"], registry=r)
        self.switches = Counter("gpuwatch_switches", "Driver switches by outcome (completed, "
                                "refused, failed, wedged)", ["outcome"], registry=r)
        # Every value the docs name is a series from the start, at 0: Prometheus'
        # increase() and rate() see a counter's first increment only against an earlier
        # sample, so a series born at 1 (the first wedged switch) would fire no alert.
        for etype in sorted(EVENT_TYPES):
            self.events.labels(type=etype)
        for reason in get_args(Resync.model_fields["reason"].annotation):
            self.resyncs.labels(reason=reason)
        for outcome in SWITCH_OUTCOMES:
            self.switches.labels(outcome=outcome)
        self.switch_duration = Histogram("gpuwatch_switch_duration_seconds", "Duration of "
                                         "completed switches", buckets=SWITCH_BUCKETS, registry=r)
        self.probe_calls = Counter("gpuwatch_probe_calls", "Probe requests answered through the "
                                   "socket, by action", ["action"], registry=r)
        self.requests = Counter("gpuwatch_socket_requests", "Socket requests by method and "
                                "outcome (ok or the error code)", ["method", "outcome"], registry=r)
        self.clients = Gauge("gpuwatch_socket_clients", "Connected socket clients", registry=r)
        self.lag_drops = Counter("gpuwatch_subscriber_lag_drops", "Subscribers disconnected "
                                 "because they stopped reading and their buffer filled",
                                 registry=r)
        self.last_seq = Gauge("gpuwatch_last_event_seq", "seq of the last event", registry=r)
        #: When the last event came, on the monotonic clock: an age from wall-clock stamps
        #: would jump with every step of the clock (NTP's first sync after boot).
        self._last_event = time.monotonic()
        self.last_event_age = Gauge("gpuwatch_last_event_age_seconds", "Seconds since the last "
                                    "event was published", registry=r)
        self.last_event_age.set_function(lambda: time.monotonic() - self._last_event)
        self.log_degraded = Gauge("gpuwatch_log_degraded", "1 while the event log cannot be "
                                  "written (full disk, EIO): events go on, the log has a gap",
                                  registry=r)
        self.log_degraded.set_function(
            lambda: 1.0 if self._watcher is not None and self._watcher.log_degraded else 0.0)
        #: The watcher the read-through counters read: kept after `detach`, so that a scrape
        #: as the daemon stops (or an embedder's collection after it) sees the counts they
        #: reached, never a counter gone back to 0.
        self._counted: Watcher | None = None
        r.register(_ReadCounter(
            "gpuwatch_log_write_failures", "Event log writes that failed (each retry counts)",
            lambda: self._counted.log_write_failures if self._counted is not None else 0))
        r.register(_ReadCounter(
            "gpuwatch_uevent_losses", "Times the uevent source lost events (receive buffer "
            "overflow); losses close together share one rescan",
            lambda: self._counted.uevent_losses if self._counted is not None else 0))
        r.register(_ReadCounter(
            "gpuwatch_uevents_forged", "Messages on the kernel uevent socket that did not come "
            "from the kernel (another process's forgery), dropped unread",
            lambda: int(getattr(self._counted.source, "rejected", 0))
            if self._counted is not None else 0))
        ProcessCollector(registry=r)
        self._server: _Server | None = None

    # ------------------------------------------------------------------ feeding

    def attach(self, watcher: Watcher) -> None:
        """Start from the watcher's current state and follow its events from now on."""
        self._watcher = self._counted = watcher
        self._vendor_name = lambda vid: watcher.tables.gpu_vendors.get(vid, vid or "unknown")
        # open_watcher publishes one `ready` before it hands the watcher out, unless the
        # daemon holds it back until its listeners are bound (then it is counted as it comes).
        if watcher.announced:
            self.events.labels(type="ready").inc()
        self.last_seq.set(watcher.seq)
        self.functions.set(len(watcher.model.state.functions))
        self._variants = watcher.model.state.vfio_variants
        self.sync_health()
        self.set_gpus(watcher.probe("detect-vfio"))
        self.nvidia_usable.set(1 if watcher.probe("detect-gpu") else 0)
        watcher.listeners.append(self.on_event)

    def track_nfd(self, nfd: Any) -> None:
        """Count the NFD writer's failed writes (``gpuwatch_nfd_write_failures_total``)."""
        self.registry.register(_ReadCounter(
            "gpuwatch_nfd_write_failures", "NFD features file writes that failed (retried "
            "with backoff, at most once a minute)", lambda: int(nfd.failures)))

    def detach(self) -> None:
        if self._watcher is not None and self.on_event in self._watcher.listeners:
            self._watcher.listeners.remove(self.on_event)
        self._watcher = None

    def set_health(self, addr: str, health: str | None) -> None:
        """One function's health series: 1 for its state, 0 for the others; gone with it."""
        if health is None:
            if self._health.pop(addr, None) is not None:
                for state in HEALTH_STATES:
                    self.function_health.remove(addr, state)
            return
        if self._health.get(addr) == health:
            return
        self._health[addr] = health
        for state in HEALTH_STATES:
            self.function_health.labels(addr=addr, state=state).set(1 if state == health else 0)

    def sync_health(self) -> None:
        """Every function's health from the model (start, resync)."""
        if self._watcher is None:
            return
        functions = self._watcher.model.state.functions
        for addr in sorted(set(self._health) - set(functions)):
            self.set_health(addr, None)
        for addr, fn in sorted(functions.items()):
            self.set_health(addr, fn.health)

    def set_gpus(self, detect_vfio: Any) -> None:
        """GPU gauges from a whole ``detect-vfio`` answer (model or its JSON form)."""
        gpus = detect_vfio["gpus"] if isinstance(detect_vfio, dict) else detect_vfio.gpus
        self._tally = Tally(self._gpu_key(gpu) for gpu in gpus)
        self._publish_gpus(set(self._tally) | self._gpu_series)

    def update_gpus(self, old: Any, new: Any) -> None:
        """GPU gauges patched by a ``detect-vfio`` probe-changed, which carries only the GPU
        entries that changed: the work follows the GPUs touched, not the GPUs present."""
        touched: set[tuple[str, str]] = set()
        for side, sign in ((old, -1), (new, 1)):
            for gpu in side.get("gpus", ()) if isinstance(side, dict) else ():
                key = self._gpu_key(gpu)
                self._tally[key] += sign
                touched.add(key)
        self._publish_gpus(touched)

    def _gpu_key(self, gpu: Any) -> tuple[str, str]:
        if isinstance(gpu, dict):
            from gpuwatch.core.results import GpuInfo

            gpu = GpuInfo.model_validate(gpu)
        return (self._vendor_name(gpu.vendor_id), group_mode(gpu.group_members, self._variants))

    def _publish_gpus(self, keys: set[tuple[str, str]]) -> None:
        # Set the new series, then drop the vanished ones: a scrape never sees an empty gap.
        for key in sorted(keys):
            if self._tally.get(key, 0) > 0:
                self.gpus.labels(vendor=key[0], mode=key[1]).set(self._tally[key])
        for key in sorted(keys):
            if self._tally.get(key, 0) <= 0:
                self._tally.pop(key, None)
                if key in self._gpu_series:
                    self.gpus.remove(*key)
        self._gpu_series = {k for k in self._gpu_series | keys if k in self._tally}

    def on_event(self, event: BaseModel) -> None:
        """Watcher listener: constant work per event, except a detect-vfio change (per GPU).
        Never raises: an exception here would stop the watcher's publishing."""
        try:
            self._count(event)
        except Exception:
            _log.exception("metrics of event %s failed", getattr(event, "seq", "?"))

    def _count(self, event: BaseModel) -> None:
        etype = str(getattr(event, "type", "unknown"))
        self.events.labels(type=etype).inc()
        self._last_event = time.monotonic()
        self.last_seq.set(getattr(event, "seq", 0))
        if self._watcher is not None:
            self.functions.set(len(self._watcher.model.state.functions))
        if etype == "probe-changed" and getattr(event, "action", "") == "detect-vfio":
            self.update_gpus(getattr(event, "old"), getattr(event, "new"))  # noqa: B009
        elif etype == "probe-changed" and getattr(event, "action", "") == "detect-gpu":
            self.nvidia_usable.set(1 if getattr(event, "new") else 0)  # noqa: B009
        elif etype in ("device-added", "device-changed"):
            device = getattr(event, "device", None)
            if device is not None:
                self.set_health(device.addr, device.health)
        elif etype == "device-removed":
            self.set_health(str(getattr(event, "addr", "")), None)
        elif etype in ("device-error", "gpu-wedged") and self._watcher is not None:
            fn = self._watcher.model.state.functions.get(str(getattr(event, "addr", "")))
            if fn is not None:
                self.set_health(fn.addr, fn.health)
        elif etype == "resync":
            self.resyncs.labels(reason=str(getattr(event, "reason", ""))).inc()
            self.sync_health()
        elif etype == "switch-completed":
            self.switches.labels(outcome="completed").inc()
            self.switch_duration.observe(float(getattr(event, "duration_ms", 0.0)) / 1000)
        elif etype == "switch-refused":
            self.switches.labels(outcome="refused").inc()
        elif etype == "switch-failed":
            wedged = bool(getattr(event, "wedged", False))
            self.switches.labels(outcome="wedged" if wedged else "failed").inc()

    # ------------------------------------------------------------------ serving

    def serve(self, address: str) -> tuple[str, int]:
        """Serve ``/metrics`` over HTTP on a daemon thread; returns the bound (host, port)."""
        host, port = parse_listen_address(address)
        if address.strip().rpartition(":")[0] == "":  # ":PORT" or "PORT": every address
            host = ""
        server = _bind(host, port)
        server.set_app(_SharedRenders(make_wsgi_app(_Exposed(self.registry))))
        threading.Thread(target=server.serve_forever, name="gpuwatch-metrics",
                         daemon=True).start()
        self._server = server
        bound = server.server_address
        _log.info("metrics on http://%s:%s/metrics", bound[0], bound[1])
        return str(bound[0]), int(bound[1])

    def close(self) -> None:
        if self._server is not None:  # no scrape is served from here on
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self.detach()


__all__ = ["InvalidListenAddress", "Metrics", "parse_listen_address"]
