"""`gpuwatch.Client`: the daemon's socket from Python, blocking (`Client`) or async (`AsyncClient`).

Both speak the protocol of docs/socket.md and return plain JSON values (dicts, lists,
scalars): exactly what a client in any other language gets. Error replies are raised as
`DaemonError` carrying the code; those that mean "your request is wrong", "no such
device" and each of the switch's codes are also the in-process class (`UsageError`,
`DeviceNotFound`, `SwitchRefused`, `GroupBusy`, ...), so code written against the direct
model handles them unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from types import EllipsisType, TracebackType
from typing import Any, ClassVar, NoReturn, Self

import anyio
import anyio.abc
import anyio.to_thread

from gpuwatch.core.ndjson import TOO_LONG, LineFramer
from gpuwatch.errors import (
    SERVICE,
    Blame,
    DeviceNotFound,
    GroupBusy,
    GroupPoisoned,
    HostError,
    NotPrivileged,
    RebootRequired,
    SubscriberLagged,
    SwitchFailed,
    SwitchRefused,
    SwitchWedged,
    UsageError,
)
from gpuwatch.service import protocol as P

DEFAULT_TIMEOUT = 30.0
#: Replies can be big (a snapshot of a large host); events are small.
_MAX_REPLY = 256 << 20
# How long a client whose request could not be sent looks for the daemon's refusal line
# (already queued when the daemon refused at accept; this only bounds the look).
_REFUSAL_WAIT = 1.0
# How much of what is queued a client reads looking for that refusal: the daemon's refusal is
# its first and only line, so a peer still sending past this is not one to read on from.
_REFUSAL_BYTES = 64 << 10
# How often a client retries a connect that found the daemon's listen backlog full.
_BACKLOG_RETRY = 0.01
# The longest one wait of `AsyncClient.connect`'s worker thread in the kernel's queue for
# room in a full backlog: a caller that gave up (cancelled) leaves the thread at most this
# long, and one still waiting queues again after it (at the end of the queue: a flood's
# queue takes far less than this to move, a few hundred ms for thousands of peers).
_ROOM_SLICE = 0.5


#: The longest wait a socket's timeout holds (``settimeout`` refuses ~292 years and more
#: with OverflowError): a wait at least this long, an infinity among them, is no bound.
_FOREVER = 1e9


def _bounded(timeout: float | None) -> float | None:
    """``timeout`` as `Client` waits it: None (no bound) for one a socket cannot hold (an
    infinity, centuries), which failed every call with "timestamp out of range"."""
    return None if timeout is None or timeout >= _FOREVER else timeout


def _wait_for_room(sock: socket.socket, path: str, deadline: float) -> bool:
    """Connect ``sock`` to ``path`` blocking until ``deadline`` (SO_SNDTIMEO bounds it): a
    connect that waits for room in the listen backlog queues in the kernel, in turn, where
    one retried now and then loses every free place to peers already waiting (a flood of
    them kept root's client out for a second). True when connected; False when it could not
    wait that way, or a signal cut the wait short (the caller then retries). Leaves ``sock``
    blocking."""
    left = max(deadline - time.monotonic(), 0.001)
    sec, usec = int(left), int((left % 1) * 1_000_000)
    try:
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("@ll", sec, usec))
    except OSError:
        return False
    try:
        sock.connect(path)
        # A signal that interrupts the wait (EINTR, which SO_SNDTIMEO makes it) leaves the
        # socket unconnected, but Python then waits for it to turn writable, as a TCP
        # connect under way would, and an unconnected unix socket is: connect "succeeds".
        sock.getpeername()
    except BlockingIOError:
        return False  # still full at the deadline
    except OSError as exc:
        if exc.errno != errno.ENOTCONN:
            raise
        return False  # interrupted: the caller waits again
    finally:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("@ll", 0, 0))
    return True


def _not_accepting(path: str, exc: OSError) -> DaemonUnavailable:
    return DaemonUnavailable(f"the gpuwatch daemon at {path} is not accepting connections: "
                             f"{exc.strerror or exc}")


def _no_daemon(path: str, exc: OSError) -> DaemonUnavailable:
    return DaemonUnavailable(f"no gpuwatch daemon at {path}: {exc.strerror or exc}")


class _Turn:
    """`AsyncClient.connect`'s wait for room in a full backlog, run in a worker thread, and
    who owns its socket meanwhile. A connect blocked in one thread cannot be woken from
    another, and closing its fd there would let the number go to a new file while the
    connect still holds it; so the thread owns the socket while it waits, in slices of at
    most `_ROOM_SLICE`, and the last of the thread and a caller who gave up closes it."""

    def __init__(self, sock: socket.socket, path: str, deadline: float | None) -> None:
        self.sock = sock
        self.path = path
        self.deadline = deadline
        self._lock = threading.Lock()
        self._abandoned = False
        self._started = False
        self._done = False

    def wait(self) -> None:
        """In the worker thread: connect, waiting until the deadline; `BlockingIOError`
        when the backlog stayed full that long, another `OSError` when nothing listens."""
        with self._lock:
            if self._abandoned:
                return  # given up before this thread began: the socket is closed already
            self._started = True
        try:
            while not self._abandoned:
                now = time.monotonic()
                end = now + _ROOM_SLICE
                if self.deadline is not None:
                    if now >= self.deadline:
                        raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
                    end = min(end, self.deadline)
                if _wait_for_room(self.sock, self.path, end):
                    return
                if time.monotonic() < end:  # could not wait in the kernel: retry soon
                    time.sleep(_BACKLOG_RETRY)
        finally:
            with self._lock:
                self._done = True
                if self._abandoned:
                    self.sock.close()

    async def take(self) -> None:
        """Wait for room in the worker thread; `DaemonUnavailable` past the deadline or with
        nothing listening. On any failure (a cancellation too) the socket is left to be
        closed, at once or by the thread when its slice ends."""
        try:
            await anyio.to_thread.run_sync(self.wait, abandon_on_cancel=True)
        except BlockingIOError as exc:
            self.abandon()
            raise _not_accepting(self.path, exc) from None
        except OSError as exc:
            self.abandon()
            raise _no_daemon(self.path, exc) from None
        except BaseException:
            self.abandon()
            raise

    def abandon(self) -> None:
        """In the caller, which takes the socket no more (cancelled, or the wait failed):
        closed now if the thread is done with it, else by the thread at the end of its
        slice."""
        with self._lock:
            self._abandoned = True
            if self._done or not self._started:  # (a worker may never start, cancelled first)
                self.sock.close()


class DaemonError(HostError):
    """An error reply from the daemon; ``code`` is one of docs/socket.md's codes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"daemon: {message}" if message else f"daemon: {code}")
        self.code = code
        self.message = message


class DaemonUsageError(DaemonError, UsageError):
    """``invalid-params``, ``invalid-request``, ``unknown-method``: the request itself is
    wrong (exit 2 in the CLI)."""

    blame: ClassVar[Blame] = "caller"


class DaemonDeviceNotFound(DaemonError, DeviceNotFound):
    """``not-found``: no such PCI function or card on the daemon's host (exit 1)."""

    blame: ClassVar[Blame] = "caller"


class DaemonSwitchRefused(DaemonError, SwitchRefused):
    """``switch-refused``: unsafe now, nothing written (the holders are named in the
    message; ``holders`` is empty, the reply carries no list)."""


class DaemonGroupPoisoned(DaemonError, GroupPoisoned):
    """``group-poisoned``: an earlier switch of this group wedged in this boot."""


class DaemonRebootRequired(DaemonError, RebootRequired):
    """``reboot-required``: ``recover`` refused, a task is stuck in the nvidia driver."""


class DaemonGroupBusy(DaemonError, GroupBusy):
    """``group-busy``: another switch of this group (or of the nvidia module) is running."""


class DaemonSwitchFailed(DaemonError, SwitchFailed):
    """``switch-failed``: a step failed or the drivers did not bind in time."""


class DaemonSwitchWedged(DaemonError, SwitchWedged):
    """``switch-wedged``: a kernel step never returned; the group is poisoned."""


class DaemonNotPrivileged(DaemonError, NotPrivileged):
    """``not-root``: the daemon itself lacks the privilege to switch."""


#: The daemon's error codes that name an in-process error class: the reply is raised as
#: both, so one ``except gpuwatch.GroupBusy`` (``SwitchRefused``, …) serves a switch done in
#: this process and one the daemon did.
_BY_CODE: dict[str, type[DaemonError]] = {
    P.INVALID_PARAMS: DaemonUsageError,
    P.INVALID_REQUEST: DaemonUsageError,
    P.UNKNOWN_METHOD: DaemonUsageError,
    P.NOT_FOUND: DaemonDeviceNotFound,
    P.SWITCH_REFUSED: DaemonSwitchRefused,
    P.GROUP_POISONED: DaemonGroupPoisoned,
    P.REBOOT_REQUIRED: DaemonRebootRequired,
    P.GROUP_BUSY: DaemonGroupBusy,
    P.SWITCH_FAILED: DaemonSwitchFailed,
    P.SWITCH_WEDGED: DaemonSwitchWedged,
    P.NOT_ROOT: DaemonNotPrivileged,
}


class DaemonUnavailable(HostError, ConnectionError):
    """Nothing answers at the socket, or the connection broke."""

    code = SERVICE


def _closed_error() -> UsageError:
    """A client used after its own ``close``: the caller's doing, said in words (the socket
    underneath would say EBADF, or blame the daemon for a close that was ours)."""
    return UsageError("this client is closed: connect another to go on")


def _take(lines: deque[bytes]) -> bytes:
    """The next reply line; one over `_MAX_REPLY` ends the connection's usefulness."""
    line = lines.popleft()
    if line is TOO_LONG:
        raise DaemonUnavailable(f"reply longer than {_MAX_REPLY} bytes")
    return line


def error_from_reply(error: Any) -> DaemonError:
    if not isinstance(error, dict):
        return DaemonError(P.INTERNAL, f"malformed error reply: {error!r}")
    code = str(error.get("code", P.INTERNAL))
    message = str(error.get("message", ""))
    return _BY_CODE.get(code, DaemonError)(code, message)


def refusal(reply: Any) -> DaemonError | None:
    """The error of a reply line with ``"id": null``, else None.

    The daemon answers ``null`` where it cannot name a request: a peer refused at accept
    (``permission-denied``, ``too-many-clients``), a line too long, stalled or unreadable.
    A client with one request in flight knows it is the answer to that request; skipping
    it would turn the daemon's reason into a bare "connection closed".
    """
    if isinstance(reply, dict) and reply.get("id") is None and "error" in reply:
        return error_from_reply(reply["error"])
    return None


def _params(**kwargs: Any) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if v is not None}


def _list(name: str, values: Iterable[str] | None) -> list[str] | None:
    """A ``types``/``addrs`` filter as a list; one string is refused as the in-process
    subscription refuses it (split into its characters, it drew the daemon's "unknown event
    type '-'")."""
    if isinstance(values, str | bytes):
        raise UsageError(f"{name} is a collection of names, not one string: "
                         f"{name}=[{values!r}]")
    return None if values is None else list(values)


#: Replies echo a request id (itself up to `P.MAX_DEPTH` deep) inside their envelope.
REPLY_MAX_DEPTH = 2 * P.MAX_DEPTH


def _decode(line: bytes, path: str) -> Any:
    """One reply or event line, decoded strictly and without recursion past
    `REPLY_MAX_DEPTH` (what answers at ``path`` may be anything, even hostile)."""
    try:
        return P.loads(line, max_depth=REPLY_MAX_DEPTH)
    except ValueError:
        raise DaemonUnavailable(f"{path} does not speak the gpuwatch protocol") from None


def _event(obj: Any) -> dict[str, Any] | None:
    """An event line's dict; the daemon's ``lagged`` notice (it is about to close a
    subscriber that fell behind) raised as `SubscriberLagged`; None for anything else."""
    if not isinstance(obj, dict) or "type" not in obj:
        return None
    if "seq" in obj:
        return obj
    if obj["type"] == "lagged":
        missed, first = obj.get("missed"), obj.get("first_missed_seq")
        raise SubscriberLagged(missed if isinstance(missed, int) else 0,
                               first if isinstance(first, int) else None)
    return None


def default_socket_path() -> str:
    return os.environ.get("GPUWATCH_SOCKET") or P.DEFAULT_SOCKET_PATH


# --------------------------------------------------------------------------- blocking


def _first_refusal(lines: Iterable[bytes]) -> DaemonError | None:
    """The daemon's refusal (its ``"id": null`` line) among the lines already read, if any."""
    for line in lines:
        with contextlib.suppress(ValueError):
            error = refusal(P.loads(line, max_depth=REPLY_MAX_DEPTH))
            if error is not None:
                return error
    return None


class Client:
    """A blocking connection to the daemon. One request at a time; use as a context manager.

    >>> with gpuwatch.Client() as c:            # /run/gpuwatch/gpuwatch.sock
    ...     c.probe("group-in-mode", addr="0000:01:00.0", mode="vfio")
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *,
                 timeout: float | None = DEFAULT_TIMEOUT) -> None:
        self.path = os.fspath(path) if path is not None else default_socket_path()
        self.timeout = timeout = _bounded(timeout)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.settimeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                self._sock.connect(self.path)
                break
            except BlockingIOError as exc:
                # A unix socket's full listen backlog (a busy daemon) is EAGAIN at once under
                # a timeout, where a blocking connect would wait for room: wait, within it.
                if deadline is not None and time.monotonic() < deadline:
                    try:
                        connected = _wait_for_room(self._sock, self.path, deadline)
                    except OSError as failed:
                        self._sock.close()
                        raise _no_daemon(self.path, failed) from None
                    finally:
                        with contextlib.suppress(OSError):
                            self._sock.settimeout(timeout)
                    if connected:
                        break
                    time.sleep(_BACKLOG_RETRY)
                    continue
                self._sock.close()
                raise _not_accepting(self.path, exc) from None
            except OSError as exc:
                self._sock.close()
                raise _no_daemon(self.path, exc) from None
        self._framer = LineFramer(_MAX_REPLY)
        self._lines: deque[bytes] = deque()
        self._next_id = 0
        self._subscribed = False
        #: Why this connection can carry no more requests (a request cut off part-way).
        self._broken: str | None = None
        self._closed = False

    # -- plumbing

    def _send(self, data: bytes, deadline: float | None) -> None:
        """Send one request line by ``deadline``: a daemon that stopped reading (stopped,
        hung, swamped) makes it `TimeoutError`, never a wait without end. A line cut off
        part-way would fuse with the next request into garbage, so then the connection is
        closed and later calls say why (`DaemonUnavailable`)."""
        view = memoryview(data)
        while view:
            timeout = None if deadline is None else deadline - time.monotonic()
            if timeout is not None and timeout <= 0:
                self._give_up_send(view, len(data))
            self._sock.settimeout(timeout)
            try:
                view = view[self._sock.send(view):]
            except TimeoutError:
                self._give_up_send(view, len(data))

    def _give_up_send(self, unsent: memoryview, size: int) -> NoReturn:
        if len(unsent) < size:
            self._broken = (f"connection to {self.path} closed: a request timed out part-way "
                            "through being sent (the daemon was not reading)")
            self._sock.close()
        raise TimeoutError(f"the daemon at {self.path} took no request in time "
                           "(it is not reading)")

    def _readline(self, timeout: float | None, deadline: float | None = None) -> bytes:
        """The next line, each read waiting at most ``timeout``, and all of them together
        until ``deadline`` (monotonic) at most: what answers at the path may drip bytes or
        stray lines forever, and a timeout per read alone would wait with it."""
        while True:
            if self._lines:
                return _take(self._lines)
            if deadline is not None:
                timeout = deadline - time.monotonic()
                if timeout <= 0:
                    raise TimeoutError(f"no reply from {self.path} in time")
            self._sock.settimeout(timeout)
            try:
                chunk = self._sock.recv(1 << 16)
            except TimeoutError:
                raise
            except OSError as exc:
                if self._closed:  # closed by another thread while this one waited
                    raise _closed_error() from None
                raise DaemonUnavailable(f"connection to {self.path} broke: {exc}") from None
            if not chunk:
                raise DaemonUnavailable(f"the daemon at {self.path} closed the connection")
            self._lines.extend(self._framer.feed(chunk))

    def call(self, method: str, params: Mapping[str, Any] | None = None,
             *, timeout: float | EllipsisType | None = ...) -> Any:
        """Send one request and return its result. An error reply raises `DaemonError`, as
        the in-process class where it has one (`UsageError`, `DeviceNotFound`,
        `SwitchRefused`, `GroupBusy`, …); a request JSON cannot carry (NaN, an infinity, a
        lone surrogate) is a `UsageError` before anything is sent.

        ``timeout`` overrides the client's for this call (a switch may take its own
        90 seconds; ``timeout=None`` waits as long as it takes).
        """
        if self._closed:
            raise _closed_error()
        if self._subscribed:
            raise UsageError("this connection streams events; open another Client to call")
        if self._broken is not None:
            raise DaemonUnavailable(self._broken)
        self._next_id += 1
        rid = self._next_id
        request = P.encode_request(rid, method, params)  # a UsageError before any wait
        wait = self.timeout if timeout is ... else _bounded(timeout)
        deadline = None if wait is None else time.monotonic() + wait
        try:
            self._send(request, deadline)
        except TimeoutError:
            raise
        except OSError as exc:
            if self._closed:
                raise _closed_error() from None
            # Refused at accept and closed before our request went out: the reason waits.
            raise self._refused() or DaemonUnavailable(
                f"connection to {self.path} broke: {exc}") from None
        while True:
            reply = _decode(self._readline(wait, deadline), self.path)
            error = refusal(reply)
            if error is not None:
                raise error
            if not isinstance(reply, dict) or reply.get("id") != rid:
                continue  # stray data
            if "error" in reply:
                raise error_from_reply(reply["error"])
            return reply.get("result")

    def _refused(self) -> DaemonError | None:
        """The refusal the daemon left in our receive queue before it closed, if any."""
        left = _REFUSAL_BYTES
        try:
            self._sock.settimeout(0)
            while left > 0 and (chunk := self._sock.recv(left)):
                left -= len(chunk)
                self._lines.extend(self._framer.feed(chunk))
        except OSError:
            pass  # nothing more (EAGAIN), or the reset that follows the refusal
        return _first_refusal(self._lines)

    def close(self) -> None:
        """Close the connection (again: nothing); a later call is a `UsageError`."""
        self._closed = True
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # -- methods

    def probe(self, action: str, *, group: int | None = None, addr: str | None = None,
              mode: str | None = None, vendor: str | None = None) -> Any:
        return self.call("probe", _params(action=action, group=group, addr=addr, mode=mode,
                                          vendor=vendor))

    def snapshot(self) -> dict[str, Any]:
        result: dict[str, Any] = self.call("snapshot")
        return result

    def config(self) -> dict[str, Any]:
        """The config file the daemon read, its root and tables (docs/socket.md)."""
        result: dict[str, Any] = self.call("config")
        return result

    def subscribe(self, types: Iterable[str] | None = None, addrs: Iterable[str] | None = None,
                  *, since_seq: int | None = None) -> Iterator[dict[str, Any]]:
        """Events as dicts, forever (until the daemon goes away). This connection then only
        streams; ``since_seq`` replays what the log still holds after that seq first."""
        self.subscribe_start(types, addrs, since_seq=since_seq)
        return self.events()

    def subscribe_start(self, types: Iterable[str] | None = None,
                        addrs: Iterable[str] | None = None, *,
                        since_seq: int | None = None) -> dict[str, Any]:
        """Subscribe and return the reply (``{"seq", "complete"}``); then iterate `events`."""
        result: dict[str, Any] = self.call(
            "subscribe", _params(types=_list("types", types), addrs=_list("addrs", addrs),
                                 since_seq=since_seq))
        self._subscribed = True
        return result

    def events(self, timeout: float | None = None) -> Iterator[dict[str, Any]]:
        """The events after `subscribe`; `SubscriberLagged` when the daemon dropped this
        subscriber for reading too slowly (resubscribe with its ``since_seq``).

        ``timeout`` bounds the wait for each event (`TimeoutError`), however the bytes
        before it arrive: dripped, or as lines that are no events."""
        timeout = _bounded(timeout)
        while True:
            if self._closed:
                raise _closed_error()
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                event = _event(_decode(self._readline(timeout, deadline), self.path))
                if event is not None:
                    break
            yield event

    def switch(self, mode: str, *, addr: str | None = None, vendor: str | None = None,
               timeout: float | None = None, tolerant: bool | None = None,
               force: bool | None = None, vfio_driver: str | None = None) -> Any:
        wait = None if timeout is None else timeout + 10
        return self.call("switch", _params(mode=mode, addr=addr, vendor=vendor, timeout=timeout,
                                           tolerant=tolerant, force=force or None,
                                           vfio_driver=vfio_driver), timeout=wait)

    def plan(self, mode: str, *, addr: str | None = None, vendor: str | None = None,
             force: bool | None = None, vfio_driver: str | None = None) -> Any:
        return self.call("plan", _params(mode=mode, addr=addr, vendor=vendor,
                                         force=force or None, vfio_driver=vfio_driver))

    def recover(self, *, addr: str | None = None, vendor: str | None = None) -> Any:
        return self.call("recover", _params(addr=addr, vendor=vendor), timeout=None)

    def holders(self, *, addr: str | None = None, vendor: str | None = None) -> Any:
        return self.call("holders", _params(addr=addr, vendor=vendor))


# --------------------------------------------------------------------------- async


class AsyncClient:
    """The same calls for asyncio/trio programs: ``async with await AsyncClient.connect() as c``."""

    def __init__(self, stream: anyio.abc.ByteStream, path: str,
                 timeout: float | None = DEFAULT_TIMEOUT) -> None:
        self._stream = stream
        self.path = path
        self.timeout = timeout
        self._framer = LineFramer(_MAX_REPLY)
        self._lines: deque[bytes] = deque()
        self._next_id = 0
        self._subscribed = False
        self._lock = anyio.Lock()
        #: Why this connection can carry no more requests (a request cut off part-way).
        self._broken: str | None = None
        self._closed = False

    @classmethod
    async def connect(cls, path: str | os.PathLike[str] | None = None, *,
                      timeout: float | None = DEFAULT_TIMEOUT) -> AsyncClient:
        where = os.fspath(path) if path is not None else default_socket_path()
        # A non-blocking unix connect never waits (no EINPROGRESS): it connects, or finds
        # the daemon's listen backlog full (EAGAIN). Then, as `Client` does, it waits for
        # room in the kernel's queue of connectors, in turn, within the timeout: a worker
        # thread does that wait (`_Turn`), so the event loop runs on and the caller can
        # cancel. (anyio's own connect waits for room with no bound, and leaks its socket
        # when cancelled; one retried now and then loses every free place to peers already
        # waiting.)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.setblocking(False)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            sock.connect(where)
        except BlockingIOError as exc:
            if deadline is not None and time.monotonic() >= deadline:
                sock.close()
                raise _not_accepting(where, exc) from None
            await _Turn(sock, where, deadline).take()  # closes sock unless connected
        except OSError as exc:
            sock.close()
            raise _no_daemon(where, exc) from None
        try:
            sock.setblocking(False)
            stream = await anyio.abc.UNIXSocketStream.from_socket(sock)
        except BaseException:
            sock.close()
            raise
        return cls(stream, where, timeout)

    async def _readline(self) -> bytes:
        while True:
            if self._lines:
                return _take(self._lines)
            try:
                chunk = await self._stream.receive(1 << 16)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError,
                    OSError):
                if self._closed:  # closed by another task while this one waited
                    raise _closed_error() from None
                raise DaemonUnavailable(
                    f"the daemon at {self.path} closed the connection") from None
            self._lines.extend(self._framer.feed(chunk))

    async def _send(self, data: bytes) -> None:
        """Send one request line. Cancelled (the call's timeout, or the caller's own scope)
        before a byte went out, the connection is as it was; cancelled part-way, the cut
        line would fuse with the next request into garbage, so the connection takes no more
        requests and later calls say why (`DaemonUnavailable`)."""
        sock = self._stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
        view = memoryview(data)
        try:
            if sock is None:  # a stream of another kind: it says nothing of a partial send
                await self._stream.send(data)
                view = view[len(view):]
            else:
                while view:
                    try:
                        view = view[sock.send(view):]
                    except BlockingIOError:
                        await anyio.wait_writable(sock)
        finally:
            if view and (sock is None or len(view) < len(data)):
                self._broken = (f"connection to {self.path} closed: a request was cut off "
                                "part-way through being sent (timed out or cancelled while "
                                "the daemon was not reading)")

    async def call(self, method: str, params: Mapping[str, Any] | None = None, *,
                   timeout: float | EllipsisType | None = ...) -> Any:
        """As `Client.call`: ``timeout`` bounds sending the request and waiting for its
        reply together (`TimeoutError`)."""
        if self._closed:
            raise _closed_error()
        if self._subscribed:
            raise UsageError("this connection streams events; open another client to call")
        async with self._lock:
            if self._broken is not None:
                raise DaemonUnavailable(self._broken)
            self._next_id += 1
            rid = self._next_id
            request = P.encode_request(rid, method, params)  # a UsageError before any wait
            wait = self.timeout if timeout is ... else timeout
            with anyio.move_on_after(wait) as scope:
                try:
                    await self._send(request)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                    if self._closed:
                        raise _closed_error() from None
                    # Refused at accept and closed before our request went out: the reason
                    # waits.
                    raise await self._refused() or DaemonUnavailable(
                        f"connection to {self.path} broke: {exc}") from None
                while True:
                    reply = _decode(await self._readline(), self.path)
                    error = refusal(reply)
                    if error is not None:
                        raise error
                    if isinstance(reply, dict) and reply.get("id") == rid:
                        break
            if scope.cancelled_caught:
                raise TimeoutError(f"no reply from {self.path} within {wait} s")
            if "error" in reply:
                raise error_from_reply(reply["error"])
            return reply.get("result")

    async def _refused(self) -> DaemonError | None:
        """As `Client._refused`: what is already queued is read, waiting at most a moment
        (``_REFUSAL_WAIT``) for a refusal still on its way, and never more than
        ``_REFUSAL_BYTES`` of it."""
        left = _REFUSAL_BYTES
        with anyio.move_on_after(_REFUSAL_WAIT):
            with contextlib.suppress(Exception):
                while left > 0:
                    chunk = await self._stream.receive(left)
                    left -= len(chunk)
                    self._lines.extend(self._framer.feed(chunk))
        return _first_refusal(self._lines)

    async def aclose(self) -> None:
        """Close the connection (again: nothing); a later call is a `UsageError`."""
        self._closed = True
        await self._stream.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def probe(self, action: str, *, group: int | None = None, addr: str | None = None,
                    mode: str | None = None, vendor: str | None = None) -> Any:
        return await self.call("probe", _params(action=action, group=group, addr=addr,
                                                mode=mode, vendor=vendor))

    async def snapshot(self) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("snapshot")
        return result

    async def config(self) -> dict[str, Any]:
        """As `Client.config`."""
        result: dict[str, Any] = await self.call("config")
        return result

    async def subscribe(self, types: Iterable[str] | None = None,
                        addrs: Iterable[str] | None = None, *,
                        since_seq: int | None = None) -> dict[str, Any]:
        """Subscribe; returns ``{"seq", "complete"}``. Then ``async for event in c.events()``."""
        result: dict[str, Any] = await self.call(
            "subscribe", _params(types=_list("types", types), addrs=_list("addrs", addrs),
                                 since_seq=since_seq))
        self._subscribed = True
        return result

    def events(self, timeout: float | None = None) -> AsyncIterator[dict[str, Any]]:
        """As `Client.events`: ``timeout`` bounds the wait for each event (`TimeoutError`),
        however the bytes before it arrive. Leaving the loop early (``break``) leaves
        nothing behind to clean up (`_AsyncEvents`)."""
        return _AsyncEvents(self, timeout)

    async def switch(self, mode: str, *, addr: str | None = None, vendor: str | None = None,
                     timeout: float | None = None, tolerant: bool | None = None,
                     force: bool | None = None, vfio_driver: str | None = None) -> Any:
        wait = None if timeout is None else timeout + 10
        return await self.call("switch", _params(mode=mode, addr=addr, vendor=vendor,
                                                 timeout=timeout, tolerant=tolerant,
                                                 force=force or None, vfio_driver=vfio_driver),
                               timeout=wait)

    async def plan(self, mode: str, *, addr: str | None = None,
                   vendor: str | None = None, force: bool | None = None,
                   vfio_driver: str | None = None) -> Any:
        return await self.call("plan", _params(mode=mode, addr=addr, vendor=vendor,
                                               force=force or None, vfio_driver=vfio_driver))

    async def recover(self, *, addr: str | None = None, vendor: str | None = None) -> Any:
        return await self.call("recover", _params(addr=addr, vendor=vendor), timeout=None)

    async def holders(self, *, addr: str | None = None, vendor: str | None = None) -> Any:
        return await self.call("holders", _params(addr=addr, vendor=vendor))


class _AsyncEvents:
    """`AsyncClient.events`: an iterator object, not an async generator. trio warns
    (``ResourceWarning``, an error under a strict warnings filter) of every async generator
    collected before it was exhausted, which a ``break`` out of ``async for event in
    c.events()`` is; this holds no frame to finalise, so leaving it is silent on either
    backend. The connection stays the client's, closed with it."""

    __slots__ = ("_client", "_timeout")

    def __init__(self, client: AsyncClient, timeout: float | None) -> None:
        self._client = client
        self._timeout = timeout

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> dict[str, Any]:
        client = self._client
        if client._closed:
            raise _closed_error()
        if client._broken is not None:
            raise DaemonUnavailable(client._broken)
        event: dict[str, Any] | None = None
        with anyio.move_on_after(self._timeout):
            while event is None:
                event = _event(_decode(await client._readline(), client.path))
        if event is None:
            raise TimeoutError(f"no event from {client.path} within {self._timeout} s")
        return event

    async def aclose(self) -> None:
        """Nothing to release: kept for code that closed the async generator this was."""


# --------------------------------------------------------------------------- CLI helper


def is_host_root(root: str | os.PathLike[str] | None) -> bool:
    """True for the real root (the daemon's view); a fixture root is never the daemon's."""
    if root is None:
        return True
    try:
        return os.path.realpath(os.fspath(root)) == "/"
    except OSError:
        return False


def try_daemon(socket_path: str | None, no_daemon: bool, *,
               root: str | os.PathLike[str] | None = None,
               timeout: float | None = DEFAULT_TIMEOUT) -> Client | None:
    """A connected `Client` when a daemon answers, else None (the caller scans directly).

    An explicit ``socket_path`` is always tried; the default path only for the host root, so
    a fixture ``--root`` is never answered by the host's daemon. ``no_daemon`` forces None.
    """
    if no_daemon:
        return None
    path = socket_path
    if path is None:
        if not is_host_root(root):
            return None
        path = default_socket_path()
    if not os.path.exists(path):
        return None
    with contextlib.suppress(DaemonUnavailable):
        return Client(path, timeout=timeout)
    return None


__all__ = [
    "AsyncClient",
    "Client",
    "DaemonDeviceNotFound",
    "DaemonError",
    "DaemonGroupBusy",
    "DaemonGroupPoisoned",
    "DaemonNotPrivileged",
    "DaemonRebootRequired",
    "DaemonSwitchFailed",
    "DaemonSwitchRefused",
    "DaemonSwitchWedged",
    "DaemonUnavailable",
    "DaemonUsageError",
    "default_socket_path",
    "error_from_reply",
    "is_host_root",
    "refusal",
    "try_daemon",
]
