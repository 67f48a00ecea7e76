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
import socket
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    make_wsgi_app,
)
from prometheus_client.core import CounterMetricFamily
from pydantic import BaseModel

from gpuwatch.core.modes import group_mode
from gpuwatch.core.results import HEALTH_STATES
from gpuwatch.settings import InvalidListenAddress, parse_listen_address

if TYPE_CHECKING:
    from gpuwatch.watch.watcher import Watcher

_log = logging.getLogger("gpuwatch.service")

#: Buckets for a switch: unbind/bind takes tens of ms, a module reload seconds, the timeout 90 s.
SWITCH_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 90.0, 120.0)


#: The endpoint is open to the network (``:9464`` in a pod), so every client is bounded:
#: connections served at once (more get a one-line 503 and are closed at once), ...
HTTP_MAX_CONNECTIONS = 16
#: ... of them from one address (a scraper needs one: one client reopening idle connections
#: must not hold every slot and leave each scrape a 503) ...
HTTP_MAX_PER_ADDRESS = 4
#: ... seconds for a request's line and headers to arrive, and for a reply to be taken ...
HTTP_TIMEOUT = 10.0
#: ... and bytes of request line and headers (a scrape sends a few hundred).
HTTP_MAX_HEAD_BYTES = 16384
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


def _answer(sock: socket.socket, status: str) -> None:
    """A one-line plain-text answer, best effort: never waits for a client."""
    body = f"{status}\n".encode()
    head = (f"HTTP/1.0 {status}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        sock.send(head + body)


class _Handler(WSGIRequestHandler):
    """prometheus_client's WSGI app behind bounded reads, one-line errors, and no
    tracebacks on stderr for clients that go away or stall."""

    timeout = HTTP_TIMEOUT
    #: What an error reply to a request line that names no usable version speaks: the
    #: stdlib's HTTP/0.9 would send the body alone, no status line a client can read.
    default_request_version = "HTTP/1.0"
    error_message_format = "%(code)d %(message)s\n"
    error_content_type = "text/plain; charset=utf-8"

    def setup(self) -> None:
        super().setup()
        self.rfile = io.BufferedReader(_HeadReader(self.connection, HTTP_TIMEOUT,
                                                   HTTP_MAX_HEAD_BYTES))

    def handle(self) -> None:
        try:
            super().handle()
        except _TooSlow:
            _answer(self.connection, "408 Request Timeout")
        except _TooLarge:
            _answer(self.connection, "431 Request Header Fields Too Large")
        except OSError as exc:  # reset, or a reply the client did not take in time
            _log.debug("metrics client %s: %s", self.client_address, exc)

    def get_stderr(self) -> Any:
        return io.StringIO()  # wsgiref's tracebacks of a dropped client: not the journal's

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged: one line per scrape would flood the journal."""


class _Server(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most `HTTP_MAX_CONNECTIONS` of them."""

    daemon_threads = True
    request_queue_size = 64  # a burst of scrapes waits in the kernel, not in SYN retries

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily) -> None:
        self.address_family = family
        self._slots = threading.BoundedSemaphore(HTTP_MAX_CONNECTIONS)
        self._per_address: Tally[str] = Tally()
        self._per_address_lock = threading.Lock()
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:  # "::" takes IPv4 too (dual stack)
            with contextlib.suppress(OSError):
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = str(client_address[0])
        with self._per_address_lock:
            crowded = self._per_address[peer] >= HTTP_MAX_PER_ADDRESS
            if not crowded:
                self._per_address[peer] += 1
        if crowded:
            _answer(request, "503 Service Unavailable: too many connections from this address")
            self.shutdown_request(request)
            return
        if not self._slots.acquire(blocking=False):
            self._leave(peer)
            _answer(request, "503 Service Unavailable: too many connections")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            self._leave(peer)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()
            self._leave(str(client_address[0]))

    def _leave(self, peer: str) -> None:
        with self._per_address_lock:
            self._per_address[peer] -= 1
            if self._per_address[peer] <= 0:
                del self._per_address[peer]

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
        self._last_event = time.time()
        self.last_event_age = Gauge("gpuwatch_last_event_age_seconds", "Seconds since the last "
                                    "event was published", registry=r)
        self.last_event_age.set_function(lambda: time.time() - self._last_event)
        self.log_degraded = Gauge("gpuwatch_log_degraded", "1 while the event log cannot be "
                                  "written (full disk, EIO): events go on, the log has a gap",
                                  registry=r)
        self.log_degraded.set_function(
            lambda: 1.0 if self._watcher is not None and self._watcher.log_degraded else 0.0)
        r.register(_ReadCounter(
            "gpuwatch_log_write_failures", "Event log writes that failed (each retry counts)",
            lambda: self._watcher.log_write_failures if self._watcher is not None else 0))
        r.register(_ReadCounter(
            "gpuwatch_uevent_losses", "Times the uevent source lost events (receive buffer "
            "overflow); losses close together share one rescan",
            lambda: self._watcher.uevent_losses if self._watcher is not None else 0))
        r.register(_ReadCounter(
            "gpuwatch_uevents_forged", "Messages on the kernel uevent socket that did not come "
            "from the kernel (another process's forgery), dropped unread",
            lambda: int(getattr(self._watcher.source, "rejected", 0))
            if self._watcher is not None else 0))
        ProcessCollector(registry=r)
        self._server: _Server | None = None

    # ------------------------------------------------------------------ feeding

    def attach(self, watcher: Watcher) -> None:
        """Start from the watcher's current state and follow its events from now on."""
        self._watcher = watcher
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
        self._last_event = time.time()
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
        server.set_app(_SharedRenders(make_wsgi_app(self.registry)))
        threading.Thread(target=server.serve_forever, name="gpuwatch-metrics",
                         daemon=True).start()
        self._server = server
        bound = server.server_address
        _log.info("metrics on http://%s:%s/metrics", bound[0], bound[1])
        return str(bound[0]), int(bound[1])

    def close(self) -> None:
        self.detach()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


__all__ = ["InvalidListenAddress", "Metrics", "parse_listen_address"]
