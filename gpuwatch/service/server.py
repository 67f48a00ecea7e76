"""The socket server: a running `Watcher` served to any language over a Unix stream socket.

Newline-delimited JSON (docs/socket.md). Requests on one connection are answered in order;
those the model answers from memory (probes, snapshot, subscribe) are answered the moment
their line is read. Nothing the server does for a client ever waits on that client: event
fan-out is a synchronous watcher listener that only writes without blocking, and a client
whose unread output passes its limit is cut off (a subscriber with a ``lagged`` line first),
so a slow or hostile client cannot hold up the watcher or anyone else.

On asyncio (the daemon) each connection is an ``asyncio.Protocol``: the loop reads the
socket and the reply is written from the same callback, with no task and no epoll
re-registration per request. On another anyio backend a reader and a writer task serve a
raw non-blocking socket. Either way the output buffer is exactly the bytes the kernel has
not taken yet, which is what makes the output limit exact. Peers are authorised from
SO_PEERCRED at accept, before a byte of theirs is read.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import resource
import select
import socket
import stat
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus
from pydantic import BaseModel

from gpuwatch.core.ndjson import TOO_LONG, LineFramer
from gpuwatch.core.tabledata import tables_json
from gpuwatch.errors import SERVICE, HostError, UsageError
from gpuwatch.lograte import RateLimitedLog
from gpuwatch.model import check_params, may_read_write
from gpuwatch.ownership import not_ours, others_control
from gpuwatch.service import ops as host_ops
from gpuwatch.service import protocol as P
from gpuwatch.service.ops import OpHandler, default_ops
from gpuwatch.service.peers import (
    AccessPolicy,
    PeerCred,
    database_groups,
    group_label,
    kernel_credentials,
    peer_dac_override,
    peer_memlock,
    vouched,
    with_groups,
)
from gpuwatch.service.sharedsend import MIN_BYTES, MIN_SHARERS, SharedBytes
from gpuwatch.sources.turns import end_turn
from gpuwatch.watch.eventlog import RawChunk, read_chunks
from gpuwatch.watch.subscription import Handover, first_is_next
from gpuwatch.watch.watcher import event_filters

if TYPE_CHECKING:
    from gpuwatch.host import Host
    from gpuwatch.service.metrics import Metrics

_log = logging.getLogger("gpuwatch.service")

#: Bytes a client may leave unread before it is disconnected.
DEFAULT_OUTBOX_LIMIT = 4 << 20
#: Bytes all clients together may leave unread (or 4 outbox limits, if that is more): the
#: per-client limit alone let ~960 other users' connections hold 3.8 GiB.
DEFAULT_OUTPUT_BUDGET = 256 << 20
#: Connections served at once, all peers together.
DEFAULT_MAX_CLIENTS = 1024
#: Connections one non-root uid may hold: one user cannot take every slot.
DEFAULT_MAX_PER_UID = 16
#: Slots only root (and the daemon's own user) may take: root is never locked out by others.
DEFAULT_ROOT_RESERVE = 64
#: Seconds a partial request line may wait for its newline before the connection is closed.
DEFAULT_STALL_TIMEOUT = 30.0
# How long a connection being closed for cause gets to take its last (error) line.
_FLUSH_BEFORE_CLOSE = 5.0
# How long, all clients together, a stopping daemon waits for them to take what it sent
# (service.md: a stop is bounded), and how often it looks.
_FLUSH_AT_STOP = 2.0
_FLUSH_POLL = 0.01
_RECV = 64 * 1024
# How often a half-closed subscriber (it sent EOF but still reads) is checked for hang-up.
_HUP_POLL = 1.0
# A client that sent EOF gets this long to read its last replies.
_FLUSH_AFTER_EOF = 60.0
#: Bytes of every subscriber's output limit kept free for its `lagged` line.
_LAG_RESERVE = 512
# A lagged subscriber gets this long to take its `lagged` line before it is closed.
_LAG_GRACE = _FLUSH_BEFORE_CLOSE
#: During a burst, events are held for at most this many seconds, to go to each subscriber
#: in one write when the burst pauses; an event after a quiet spell goes out at once.
FLUSH_WINDOW = 0.01
# Event bytes held for coalescing before a flush is forced, window or not.
_PENDING_CAP = 256 << 10
# Requests of one connection answered in a row before the loop serves everyone else.
_LINES_PER_TURN = 64
# Bytes of a read cut into lines at a time: a read is held as it came and cut as its lines
# are answered, so its lines cost at most this much in line objects, not 16 times the read
# (256 KiB of two-byte lines split at once is 87,000 objects, ~4 MiB per connection).
_CUT = 4096
# A history replay writes its chunks in blocks of this many bytes, or of what this many
# turns read (`_ReplayBlock`).
_REPLAY_BLOCK = 64 * 1024
_REPLAY_BLOCK_TURNS = 16
# Descriptors kept for the daemon's own use (log, sources, sysfs reads, /proc scans)
# beyond one per client and the log files of the replays that run at once.
_FD_HEADROOM = 256
# accept() errors that mean "short of descriptors or memory", not "broken listener".
_ACCEPT_SHORT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# Clients accepted (and authorised or refused) in a row before the loop serves everyone
# else once.
_ACCEPTS_PER_TURN = 16
# Waits between accept tries while the shortage lasts (no spare descriptor to give up).
_ACCEPT_BACKOFF = 0.05
_ACCEPT_BACKOFF_MAX = 1.0
#: Seconds a peer's groups may take to look up where the kernel lacks SO_PEERGROUPS.
GROUPS_TIMEOUT = 5.0
# Group lookups running at once (threads, counting those given up on but not yet ended).
_MAX_GROUP_LOOKUPS = 32
# Probe actions that read /proc live: answered in a worker thread, not from memory.
_LIVE_ACTIONS = frozenset({"nvidia-holders", "wedge-detected", "plan"})
#: Live reads of /proc (`plan`, `holders`, the live probes) run at once for other users
#: than root: each is threads walking every process, and a crowd of them contending for the
#: interpreter starved the loop that answers everyone (200 connections asking `holders`
#: over and over left a probe unanswered for 10 s, with 500 threads).
LIVE_READS = 4
#: Seconds such a request waits for a turn before it is answered `unavailable`.
LIVE_READ_WAIT = 10.0

class SocketSetupError(HostError):
    """The socket cannot be created at that path (missing permission, not a socket, …):
    the configuration must change before a start can succeed."""

    code = SERVICE


class ListenerNotYet(SocketSetupError):
    """A listener cannot bind or listen *yet*: its address is in use (another daemon still
    serves it, or is starting), its directory is missing, the kernel is short of buffers.
    Unlike a bad path, a later start may succeed: ``gpuwatch watch`` exits with a code of
    its own for it (`EXIT_RETRY`), which the unit lets systemd restart."""


class SocketInUse(ListenerNotYet):
    """Another process answers at the socket path (a second daemon), or holds its lock
    (one starting up); we do not steal it."""


#: errno values of bind/listen that a retry may cure: the address is taken, the directory
#: is not there (yet), the kernel is short of memory or descriptors.
NOT_YET_ERRNOS = frozenset({errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.ENOENT, errno.EAGAIN,
                            errno.ENOBUFS, errno.ENOMEM, errno.EMFILE, errno.ENFILE})


# --------------------------------------------------------------------------- binding


def _listener_gone(path: str) -> str | None:
    """None when nothing listens at the socket ``path`` any more (the connect is refused:
    a daemon that died left it); otherwise why it may still be live.

    Only a refusal proves the socket stale. A connect that succeeds is a live daemon; one
    that fails otherwise may be one too: a busy daemon whose listen backlog is full
    (EAGAIN), a stopped one, or one we may not connect to (EACCES). Its socket is never
    taken: the daemon would go on running, unreachable.
    """
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return None
    except OSError as exc:
        return f"cannot tell whether a daemon still serves {path} " \
               f"({exc.strerror or exc}); not replacing it"
    finally:
        probe.close()
    return f"another gpuwatch daemon answers at {path}"


def socket_lock_path(path: str) -> str:
    """The lock file beside a socket: ``PATH.lock``, held by the daemon serving ``PATH``."""
    return path + ".lock"


def _take_socket_lock(path: str) -> int:
    """Hold ``PATH.lock`` (flock) for as long as we serve ``path``; the file names our pid.

    Without it, a second daemon that looks at the path between the first one's bind and
    its listen is refused by the kernel, takes the socket for a dead daemon's and replaces
    it, and the first runs on unreachable. Under the lock only one daemon at a time looks,
    binds and listens, and a socket file is stale only while nobody holds the lock.

    The kernel drops the lock when its holder dies (even by kill -9), so a lock file left
    behind never blocks the next start; a clean stop removes it (`_release_socket_lock`),
    which is why a lock is only ours once the path still names the file we locked.
    """
    name = socket_lock_path(path)
    for _ in range(16):  # each retry means a holder just removed the file: rare, bounded
        flags = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
        try:
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | flags, 0o644)
            except PermissionError as denied:
                # Left by a daemon of another user (root's, killed): flock needs no write
                # access, so it still serves as the lock.
                try:
                    fd = os.open(name, os.O_RDONLY | flags)
                except FileNotFoundError:
                    # None there, and we may not make one (a directory we may not write to):
                    # that, not "no such file" (exit 75), is what a restart cannot change.
                    raise denied from None
        except OSError as exc:
            error = ListenerNotYet if exc.errno in NOT_YET_ERRNOS else SocketSetupError
            raise error(f"not serving {path}: cannot open its lock {name}: "
                        f"{exc.strerror or exc}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SocketSetupError(f"not serving {path}: its lock {name} is not a "
                                       "regular file; not replacing it")
            # Planted in a sticky directory (/tmp): a file of another user's, or a hard link
            # to some file of root's, which writing our pid would truncate.
            whose = not_ours(st)
            if whose is not None:
                raise SocketSetupError(f"not serving {path}: its lock {name} {whose}; not "
                                       "using it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                who = f"pid {holder}" if holder.isdigit() else "another process"
                raise SocketInUse(f"another gpuwatch daemon ({who}) serves {path} or is "
                                  f"starting to (it holds {name})") from None
            except OSError as exc:  # a file system without locks (ENOLCK)
                raise SocketSetupError(f"not serving {path}: cannot lock {name}: "
                                       f"{exc.strerror or exc}") from None
            with contextlib.suppress(FileNotFoundError):
                if _same_file(os.stat(name), os.fstat(fd)):
                    with contextlib.suppress(OSError):  # the pid is a courtesy
                        os.ftruncate(fd, 0)
                        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                    return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # removed (and maybe re-created) by its last holder: lock the new one
    raise ListenerNotYet(f"not serving {path}: its lock {name} keeps being replaced")


def _release_socket_lock(path: str, fd: int) -> None:
    """Remove ``PATH.lock`` while still holding it, then let go: no litter after a clean
    stop, and a daemon that opened the old file sees it was removed and locks afresh."""
    with contextlib.suppress(OSError):
        if _same_file(os.stat(socket_lock_path(path)), os.fstat(fd)):
            os.unlink(socket_lock_path(path))
    os.close(fd)


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


class Listener(socket.socket):
    """The listening socket; it holds ``PATH.lock`` until it is closed (`bind_socket`)."""

    __slots__ = ("_lock_fd", "_lock_path")

    def hold(self, path: str, fd: int) -> None:
        self._lock_path = path
        self._lock_fd = fd

    def close(self) -> None:
        super().close()
        fd = getattr(self, "_lock_fd", -1)
        if fd >= 0:
            self._lock_fd = -1
            _release_socket_lock(self._lock_path, fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def bind_socket(path: str, gid: int | None, *, mode: int = 0o660, backlog: int = 4096,
                ) -> Listener:
    """Create the listening socket: stale file replaced, mode and group set *before* listen.

    Until ``listen`` every connect is refused, so there is no moment at which the socket
    exists with looser permissions than asked for. The socket goes only in a directory no
    other user controls: whoever may rename entries there could swap in a socket of their
    own, and the clients (root's switch among them) would talk to it. From before the look
    at the path until the socket is closed, ``PATH.lock`` is held (`_take_socket_lock`):
    two daemons starting at once never both serve, nor does one take a live one's socket.
    """
    parent = os.path.dirname(path) or "."
    try:
        os.makedirs(parent, mode=0o755, exist_ok=True)
    except OSError as exc:
        error = ListenerNotYet if exc.errno in NOT_YET_ERRNOS else SocketSetupError
        raise error(f"cannot create {parent}: {exc.strerror}") from None
    try:
        shared = others_control(path)
    except OSError as exc:
        error = ListenerNotYet if exc.errno in NOT_YET_ERRNOS else SocketSetupError
        raise error(f"cannot check {parent}: {exc.strerror}") from None
    if shared is not None:
        raise SocketSetupError(f"not serving {path}: {shared}, so another user could put "
                               "a socket of their own in its place")
    if len(os.fsencode(path)) > 107:
        raise SocketSetupError(f"socket path {path} is longer than 107 bytes")
    lock = _take_socket_lock(path)
    try:
        sock = _bind_locked(path, gid, mode, backlog)
    except BaseException:
        _release_socket_lock(path, lock)
        raise
    sock.hold(path, lock)
    return sock


def _bind_locked(path: str, gid: int | None, mode: int, backlog: int) -> Listener:
    """`bind_socket` once ``PATH.lock`` is ours."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise SocketSetupError(f"cannot check {path}: {exc.strerror or exc}") from None
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise SocketSetupError(f"{path} exists and is not a socket; not replacing it")
        live = _listener_gone(path)
        if live is not None:
            raise SocketInUse(live)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # left behind by a daemon that died
    sock = Listener(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    bound = False
    try:
        sock.bind(path)
        bound = True
        if gid is not None:
            os.chown(path, -1, gid)
        os.chmod(path, mode)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        if bound:  # ours to remove; a file bound first by another daemon (EADDRINUSE) is not
            with contextlib.suppress(OSError):
                os.unlink(path)
        if not bound and exc.errno == errno.EADDRINUSE:
            raise SocketInUse(f"cannot serve {path}: another process bound it first "
                              f"({exc.strerror}); not replacing it") from None
        error = ListenerNotYet if exc.errno in NOT_YET_ERRNOS else SocketSetupError
        raise error(f"cannot serve {path}: {exc.strerror or exc}") from None
    sock.setblocking(False)
    return sock


# --------------------------------------------------------------------------- connections


class _Subscription:
    __slots__ = ("addrs", "types")

    def __init__(self, types: frozenset[str] | None, addrs: frozenset[str] | None) -> None:
        self.types = types
        self.addrs = addrs

    def wants(self, etype: Any, addr: Any) -> bool:
        if self.types is not None and etype not in self.types:
            return False
        return self.addrs is None or addr in self.addrs


class _Batch:
    """One published batch as the socket sends it: each line encoded once, when first
    wanted, and the whole batch joined once for every subscriber without a filter. Event
    types and addresses are looked up only if a filtered subscriber asks."""

    __slots__ = ("_addrs", "_encoded", "_events", "_lines", "_types", "_whole", "seqs", "size")

    def __init__(self, events: Sequence[BaseModel], lines: Sequence[str]) -> None:
        self._events = events
        self.seqs = [e.__dict__.get("seq", 0) for e in events]
        self._lines = lines if len(lines) == len(events) else [
            e.model_dump_json() for e in events
        ]
        self.size = sum(map(len, self._lines))
        self._encoded: list[bytes | None] = [None] * len(events)
        self._whole: bytes | None = None
        self._types: list[Any] | None = None
        self._addrs: list[Any] | None = None

    @property
    def types(self) -> list[Any]:
        if self._types is None:
            self._types = [e.__dict__.get("type") for e in self._events]
        return self._types

    @property
    def addrs(self) -> list[Any]:
        if self._addrs is None:
            self._addrs = [e.__dict__.get("addr") for e in self._events]
        return self._addrs

    def line(self, index: int) -> bytes:
        data = self._encoded[index]
        if data is None:
            data = self._encoded[index] = (self._lines[index] + "\n").encode("utf-8")
        return data

    def whole(self) -> bytes:
        if self._whole is None:
            self._whole = "".join(line + "\n" for line in self._lines).encode("utf-8")
        return self._whole


def lagged_line(missed: int, first_missed_seq: int, outbox_limit: int) -> bytes:
    """The notice a subscriber gets instead of events it was too slow to take (docs/socket.md,
    Flow control): how many it lost, where the loss starts and how to resume gaplessly."""
    return json.dumps({
        "type": "lagged", "missed": missed, "first_missed_seq": first_missed_seq,
        "resume_since_seq": max(0, first_missed_seq - 1), "outbox_limit": outbox_limit,
    }, separators=(",", ":")).encode() + b"\n"


def _wanted(batches: Sequence[_Batch], sub: _Subscription,
            count: int) -> tuple[memoryview, int, int] | None:
    """What a subscriber with ``sub``'s filter takes of ``batches`` (``count`` events in
    all): its bytes, the first seq among them and how many; None when it wants none."""
    if sub.types is None and sub.addrs is None:
        data = (batches[0].whole() if len(batches) == 1
                else b"".join(b.whole() for b in batches))
        return memoryview(data), batches[0].seqs[0], count
    parts: list[bytes] = []
    first = 0
    for batch in batches:
        types, addrs = batch.types, batch.addrs
        for i, seq in enumerate(batch.seqs):
            if sub.wants(types[i], addrs[i]):
                if not parts:
                    first = seq
                parts.append(batch.line(i))
    return (memoryview(b"".join(parts)), first, len(parts)) if parts else None


class Connection:
    """One client: its peer, its bounded output and (once subscribed) its event filter.

    The rules live here; a subclass only moves bytes (`buffered`, `_write`, `_shut`).
    Output is never awaited: a reply or an event either fits what the client has left
    unread or the client is cut off.
    """

    def __init__(self, server: SocketServer, peer: PeerCred) -> None:
        self.server = server
        self.peer = peer
        self.closed = False  # no more output is taken: the connection is being closed
        self.sub: _Subscription | None = None
        self.replaying = False
        self.held: list[tuple[int, Any, Any, bytes]] = []
        self.held_bytes = 0
        self.held_seq = 0  # the newest seq seen while holding, wanted or not
        self.last_seq = 0  # the newest seq handled for this subscriber (sent or filtered out)
        #: Whether the peer holds CAP_DAC_OVERRIDE (`peer_dac_override`), read at its first
        #: vfio-group-accessible and kept for the connection (None: not known).
        self.dac_override: bool | None = None
        self.dac_override_read = False

    # -- moving bytes (per transport)

    def buffered(self) -> int:
        """Bytes accepted for this client that the kernel has not taken yet."""
        raise NotImplementedError

    def _write(self, data: bytes | memoryview, shared: SharedBytes | None = None) -> None:
        """Queue ``data`` for the client. With ``shared`` (the same bytes in a file, see
        `SharedBytes`), what the socket takes at once goes by page reference instead of
        a copy: only when nothing is queued before it, so the order holds."""
        raise NotImplementedError

    def _shut(self, grace: float) -> None:
        """Stop reading; close once the output is written, or after ``grace`` seconds
        (at once, dropping what is unsent, when ``grace`` is 0)."""
        raise NotImplementedError

    def fileno(self) -> int:
        """The client's socket (-1 when gone)."""
        raise NotImplementedError

    def hung_up(self) -> bool:
        """Whether the client closed its end, asked of the socket itself: while a replay
        reads a stretch that sends nothing (a crash's NULs) the connection reads nothing
        either, so nothing else would tell. A half-close (the client still reads) is no
        hang-up."""
        return _hung_up(self.fileno())

    async def _drained(self) -> None:
        """Return once at most half the output limit is unread (or the client is gone)."""
        raise NotImplementedError

    # -- output

    def close(self) -> None:
        """Drop the client now (callable from a listener)."""
        self.closed = True
        self.held.clear()
        self._shut(0)

    def reply(self, data: bytes) -> None:
        """Queue a reply. Events published before it go first, so a subscriber never reads
        a reply that is newer than the events it has."""
        if self.closed:
            return
        if self.sub is not None and self.server._pending:
            self.server._catch_up(self)
            if self.closed:
                return
        buffered = self.buffered()
        if (not self.server._room(self, len(data), buffered)
                or (buffered and buffered + len(data) > self._limit())):
            if self.sub is not None:
                self.lag(self.last_seq + 1, 0)
                return
            self.server.client_log.warning(
                "disconnecting %s: %d bytes of replies unread (client stopped reading)",
                self.peer.describe(), buffered)
            self.close()
            return
        self._write(data)

    def deliver(self, data: bytes | memoryview, first_seq: int, count: int,
                shared: SharedBytes | None = None) -> None:
        """Queue ``count`` events starting at ``first_seq``; a subscriber that has left
        too much unread gets the `lagged` notice instead, and is closed."""
        if self.closed:
            return
        buffered = self.buffered()
        if (not self.server._room(self, len(data), buffered)
                or (buffered and buffered + len(data) > self._limit())):
            self.lag(first_seq, count)
            return
        self._write(data, shared)

    def _limit(self) -> int:
        # A subscriber's events leave room for its `lagged` line: the bound holds with it.
        limit = self.server.outbox_limit
        return limit - _LAG_RESERVE if self.sub is not None else limit

    def evict(self) -> None:
        """Cut off to keep the daemon's unread output within its budget (`SocketServer._room`):
        a subscriber is lagged (its line, then the close), another client is closed; one
        already closing (its last line unread) is dropped now, output and all."""
        if self.closed:
            self._shut(0)
        elif self.sub is not None:
            self.lag(self.last_seq + 1, 0)
        else:
            self.server.client_log.warning(
                "disconnecting %s: %d bytes of replies unread, the most of any client, "
                "while all clients together hold the daemon's output budget",
                self.peer.describe(), self.buffered())
            self.close()

    def lag(self, first_missed_seq: int, missed: int, *, hole: str | None = None,
            stopping: bool = False) -> None:
        """The subscriber stopped reading (or reads too slowly): tell it what it missed
        and from where to resume, then close (best effort: it may not read even that).

        With ``hole`` (why), it is the log that lacks those seqs, not the client that was
        slow: the same line, so that resuming from it is answered ``complete: false``.
        With ``stopping``, the daemon stops while the subscriber's replay is under way: the
        same line tells it where to resume once a daemon is back."""
        if self.closed:
            return
        self.closed = True
        self.held.clear()
        self.server._lag_drop(self, counted=hole is None and not stopping)
        if stopping:
            self.server.client_log.info(
                "ending the replay to %s: the daemon is stopping; it resumes from seq %d",
                self.peer.describe(), first_missed_seq)
        elif hole is not None:
            self.server.client_log.warning(
                "ending the replay to %s: %s; %d seq(s) from %d are not in the log",
                self.peer.describe(), hole, missed, first_missed_seq)
        else:
            self.server.client_log.warning(
                "disconnecting %s: %d bytes unread (subscriber stopped reading); %d event(s) "
                "from seq %d dropped", self.peer.describe(), self.buffered() + self.held_bytes,
                missed, first_missed_seq)
        self._write(lagged_line(missed, first_missed_seq, self.server.outbox_limit))
        self._shut(_LAG_GRACE)

    async def paced(self, data: bytes, first_seq: int, last_seq: int) -> None:
        """Queue the events ``first_seq`` … ``last_seq`` (those of them in ``data``),
        waiting first while half the limit is unread (history replay): a long replay is fed
        at the client's pace instead of overflowing it. The wait is bounded: a client that
        leaves half its limit unread for ``stall_timeout`` seconds gets the `lagged` notice
        and is closed, so the log files the replay holds are let go. ``last_seq`` moves past
        them only once they are queued: a `lagged` line during the wait (live events held
        meanwhile that overflow) names ``first_seq``, not a seq after events never sent."""
        if not data:  # none of them wanted: nothing to wait for
            self.last_seq = max(self.last_seq, last_seq)
            return
        half = self.server.outbox_limit // 2
        if not self.closed and self.buffered() > half:
            deadline = anyio.current_time() + self.server.stall_timeout
            while not self.closed and self.buffered() > half:
                left = deadline - anyio.current_time()
                if left <= 0:
                    self.lag(first_seq, data.count(b"\n"))
                    return
                with anyio.move_on_after(left):
                    await self._drained()
        self.deliver(data, first_seq, data.count(b"\n"))
        self.last_seq = max(self.last_seq, last_seq)

    # -- subscription

    def offer_batch(self, batch: _Batch) -> None:
        """A published batch (listener context: never waits): one write for it."""
        if self.closed or self.sub is None:
            return
        seqs = batch.seqs
        if not seqs:
            return
        if self.replaying or seqs[0] <= self.last_seq:
            types, addrs = batch.types, batch.addrs
            for i, seq in enumerate(seqs):  # the rare paths: one event at a time
                self.offer(seq, types[i], addrs[i], functools.partial(batch.line, i))
            return
        self.last_seq = seqs[-1]
        sub = self.sub
        if sub.types is None and sub.addrs is None:
            self.deliver(batch.whole(), seqs[0], len(seqs))
            return
        types, addrs = batch.types, batch.addrs
        wanted = [i for i in range(len(seqs)) if sub.wants(types[i], addrs[i])]
        if wanted:
            self.deliver(b"".join(batch.line(i) for i in wanted), seqs[wanted[0]], len(wanted))

    def offer(self, seq: int, etype: Any, addr: Any, line: Callable[[], bytes]) -> None:
        """A live event (listener context: never waits)."""
        if self.closed or self.sub is None:
            return
        if self.replaying:
            # Held until the log replay is done; only what the filter wants takes memory.
            self.held_seq = max(self.held_seq, seq)
            if self.sub.wants(etype, addr):
                data = line()
                self.held.append((seq, etype, addr, data))
                self.held_bytes += len(data)
                if self.held_bytes > self.server.outbox_limit - _LAG_RESERVE:
                    self.lag(self.last_seq + 1, len(self.held))
            return
        if seq <= self.last_seq:
            return  # already sent from the log
        self.last_seq = seq
        if self.sub.wants(etype, addr):
            self.deliver(line(), seq, 1)


class _ReplayBlock:
    """Replayed chunks held to go out in one write: a replay reads and checks 4 KiB a turn
    (so that it holds up other requests for a short while only), but a write per chunk
    would wake a client that reads as fast as it can sixteen times as often, each wake-up
    taking a CPU from someone else on a small machine. A block goes out once it holds
    `_REPLAY_BLOCK` bytes (less when the output limit is small: a block must fit in what
    `Connection.paced` leaves room for) or `_REPLAY_BLOCK_TURNS` turns went into it (a
    filtered replay that finds little still arrives as it goes), and before anything else
    is said to the client.

    The write of a block is a turn of its own (`end_turn` before it): handing 64 KiB to the
    kernel, which wakes the reader, costs as much as reading a chunk or more, and done in
    the turn that read the chunk it made one step twice as long as any other, which a
    request that came in meanwhile waited for whole."""

    __slots__ = ("cap", "conn", "first", "last", "parts", "size", "turns")

    def __init__(self, conn: Connection, outbox_limit: int) -> None:
        self.conn = conn
        # `paced` queues once at most half the limit is unread, and a subscriber's queue
        # keeps `_LAG_RESERVE` for its `lagged` line.
        self.cap = max(1, min(_REPLAY_BLOCK, outbox_limit // 2 - _LAG_RESERVE))
        self.parts: list[bytes] = []
        self.size = 0
        self.turns = 0
        self.first = 0  # the first seq of the data held
        self.last = 0  # the last seq the chunks held cover (0: none held)

    async def add(self, chunk: RawChunk) -> None:
        """Hold ``chunk``, sending what is held first if it would pass the cap, and after if
        the block is then due."""
        if self.parts and self.size + len(chunk.data) > self.cap:
            await end_turn()  # the write is a turn of its own (see the class)
            await self.send()
        if chunk.data:
            if not self.parts:
                self.first = chunk.first
            self.parts.append(chunk.data)
            self.size += len(chunk.data)
        self.last = chunk.last
        self.turns += 1
        if self.size >= self.cap or self.turns >= _REPLAY_BLOCK_TURNS:
            await end_turn()
            await self.send()

    async def send(self) -> None:
        """Queue what is held, paced by the client (`Connection.paced`)."""
        if not self.last:
            return
        data, first, last = b"".join(self.parts), self.first, self.last
        self.parts.clear()
        self.size = self.turns = self.last = 0
        await self.conn.paced(data, first, last)


class _StreamConnection(Connection):
    """A connection on a raw non-blocking socket, awaited with anyio (any backend).

    The outbox is exactly the bytes the kernel has not taken yet, with no transport buffer
    hidden in between, which is what makes the output limit exact.
    """

    def __init__(self, server: SocketServer, sock: socket.socket, peer: PeerCred) -> None:
        super().__init__(server, peer)
        self.sock = sock
        self.outbox: deque[bytes | memoryview] = deque()
        self.pending = 0  # bytes in the outbox the kernel has not taken yet
        self.gone = False  # output dropped: nothing more is written
        self.scope = anyio.CancelScope()  # the whole connection
        self.reading = anyio.CancelScope()  # the reader (and a replay it runs)
        self.grace = _FLUSH_BEFORE_CLOSE
        self._wake = anyio.Event()
        self._progress = anyio.Event()

    def buffered(self) -> int:
        return self.pending

    def fileno(self) -> int:
        return self.sock.fileno()

    def _write(self, data: bytes | memoryview, shared: SharedBytes | None = None) -> None:
        if self.gone:
            return
        if not self.outbox:
            # Nothing queued: hand it to the kernel now (non-blocking). A reply or a batch
            # that fits the socket buffer then costs no wake-up of the writer task.
            if shared is not None:
                taken = shared.send_to(self.sock.fileno())
                if taken == len(data):
                    self._progress.set()
                    return
                if taken:
                    data = memoryview(data)[taken:]
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:  # EPIPE, ECONNRESET: the client left
                self.close()
                return
            if sent == len(data):
                self._progress.set()
                return
            data = memoryview(data)[sent:]  # the rest, not a copy of it
        self.outbox.append(data)
        self.pending += len(data)
        self._wake.set()

    def _shut(self, grace: float) -> None:
        self.closed = True
        if grace <= 0:
            self.gone = True
            self.outbox.clear()
            self.pending = 0
            self.scope.cancel()
        else:
            self.grace = min(self.grace, grace)
            self.reading.cancel()

    async def _drained(self) -> None:
        self._progress = anyio.Event()
        await self._progress.wait()

    async def writer(self) -> None:
        sock = self.sock
        while True:
            self._wake = anyio.Event()
            while self.outbox:
                data = self.outbox[0]
                try:
                    sent = sock.send(data)
                except BlockingIOError:
                    await anyio.wait_writable(sock)
                    continue
                except OSError:  # EPIPE, ECONNRESET: the client left
                    self.close()
                    return
                self.pending -= sent
                if sent == len(data):
                    self.outbox.popleft()
                else:
                    self.outbox[0] = memoryview(data)[sent:]
                self._progress.set()
            self._progress.set()
            await self._wake.wait()

    async def flushed(self) -> None:
        while self.outbox and not self.gone:
            self._progress = anyio.Event()
            await self._progress.wait()


class _ProtocolConnection(Connection, asyncio.Protocol):
    """A connection served by asyncio's transport (the daemon's backend): the loop reads
    the socket, the lines are cut and answered from the model in the same callback, and
    the reply is written before it returns. No task, no epoll re-registration and no extra
    loop turn per request; only what cannot be answered from memory (a replay, a switch,
    a /proc read) runs as a task, and the connection reads nothing more until it is done.

    The transport's buffer is the outbox: what the kernel has not taken yet, as exact as a
    raw socket's.
    """

    def __init__(self, server: SocketServer, peer: PeerCred,
                 loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(server, peer)
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.sock_fd = -1  # the transport's socket, for `SharedBytes.send_to`
        self.framer = LineFramer(server.max_line)
        self.todo: deque[bytes] = deque()  # complete lines cut and not answered yet
        self.unread = b""  # the bytes read and not cut into lines yet (`_cut`), from ...
        self.unread_at = 0  # ... this offset
        self.finished = False  # the framer's last line (after EOF) is cut
        self.busy = False  # a request runs as a task (or a turn is yielded): later lines wait
        self.eof = False
        self.gone = False
        self.scope: anyio.CancelScope | None = None  # the running task's
        self._stall: asyncio.TimerHandle | None = None
        self._timer: asyncio.TimerHandle | None = None  # the close deadline, the hang-up poll
        self._watching_hangup = False  # a subscriber's EOF came: its socket is polled
        self._drain: asyncio.Future[None] | None = None

    # -- asyncio.Protocol

    def itself(self) -> _ProtocolConnection:
        """The protocol factory for this connection's transport."""
        return self

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        sock = transport.get_extra_info("socket")
        self.sock_fd = sock.fileno() if sock is not None else -1
        # Above half the limit a history replay waits (`paced`) until a quarter is left.
        limit = self.server.outbox_limit
        transport.set_write_buffer_limits(high=limit // 2, low=limit // 4)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        # Held as read, cut into lines as they are answered (`_cut`). Reading pauses while
        # lines wait, so this is at most one read (256 KiB) beside the partial line.
        self.unread = self.unread[self.unread_at:] + data if self.unread else data
        self.unread_at = 0
        if not self.busy:
            self._serve()

    def eof_received(self) -> bool:
        self.eof = True
        self._stop_stall_timer()
        if not self.busy:
            self._serve()
        return True  # keep the write side open for the replies

    def _cut(self) -> bool:
        """Cut the next `_CUT` bytes read into lines (at EOF, a last line without its
        newline); False when nothing is left to cut."""
        unread = self.unread
        if not unread:
            if not self.eof or self.finished:
                return False
            self.finished = True
            self.todo.extend(self.framer.finish())  # a last request without its newline
            return True
        start = self.unread_at
        end = start + _CUT
        if end >= len(unread):
            piece = unread[start:] if start else unread
            self.unread, self.unread_at = b"", 0
        else:
            piece = unread[start:end]
            self.unread_at = end
        lines = self.framer.feed(piece)
        if lines:
            self.todo.extend(lines)
            self._stop_stall_timer()  # the partial line that was timed is complete
        if (not self.unread and not self.eof and self.framer.pending
                and self._stall is None):
            self._stall = self.loop.call_later(self.server.stall_timeout, self._stalled)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = self.gone = True
        self.held.clear()
        self.todo.clear()
        self.unread = b""
        self._stop_stall_timer()
        if self._timer is not None:
            self._timer.cancel()
        if self.scope is not None:
            self.scope.cancel()  # a switch shields itself and runs to its end
        self._wake_drain()
        self.server._forget(self)

    def pause_writing(self) -> None:
        self._drain = self.loop.create_future()

    def resume_writing(self) -> None:
        self._wake_drain()

    # -- moving bytes

    def fileno(self) -> int:
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        return sock.fileno() if sock is not None else -1

    def buffered(self) -> int:
        transport = self.transport
        return 0 if transport is None or self.gone else transport.get_write_buffer_size()

    def _write(self, data: bytes | memoryview, shared: SharedBytes | None = None) -> None:
        transport = self.transport
        if self.gone or transport is None:
            return
        if (shared is not None and not transport.get_write_buffer_size()
                and not transport.is_closing()):
            taken = shared.send_to(self.sock_fd)
            if taken == len(data):
                return
            if taken:
                data = memoryview(data)[taken:]
        transport.write(data)

    def _shut(self, grace: float) -> None:
        self.closed = True
        self.todo.clear()
        self.unread = b""
        self._stop_stall_timer()
        transport = self.transport
        if transport is None or self.gone:
            return
        if grace <= 0:
            self.gone = True
            transport.abort()
            return
        transport.close()  # stops reading; closes once the buffer is written
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(grace, transport.abort)

    async def _drained(self) -> None:
        if self._drain is not None and not self._drain.done():
            await self._drain

    def _wake_drain(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    # -- requests

    def _serve(self) -> None:
        """Answer the complete lines in order; an answer that needs a task pauses the rest
        (and reading) until it is done. A client's burst of lines gets `_LINES_PER_TURN`
        answers, then the loop serves everyone else once."""
        transport = self.transport
        assert transport is not None
        server = self.server
        budget = _LINES_PER_TURN
        todo = self.todo
        if server.stopping:
            self.refuse_queued()
        while not self.closed:
            if not todo and not self._cut():
                break
            if not todo:
                continue  # inside a long line: cut on
            if not budget:
                self._pause()
                self.loop.call_soon(self._resume)
                return
            if self._drain is not None and not self._drain.done():
                # Half the output limit unread (`pause_writing`): the next answer waits
                # until the client has read down to a quarter, so a pipelining client that
                # reads gets every reply, however large, instead of a cut-off.
                self._pause()
                server._spawn(self, self._room_for_replies)
                return
            budget -= 1
            line = todo.popleft()
            if line is TOO_LONG:
                server._too_long(self)
                self._shut(_FLUSH_BEFORE_CLOSE)
                return
            later = server._answer(self, line)
            if later is not None:
                self._pause()
                server._spawn(self, later)
                return
        if self.eof and not self.closed:
            if self.sub is None:
                self._shut(_FLUSH_AFTER_EOF)  # its replies are out (or get a minute)
            elif not self._watching_hangup:
                self._watching_hangup = True
                self._check_hangup()

    async def _room_for_replies(self) -> None:
        """Wait while the client leaves half its output limit unread, for at most
        ``stall_timeout`` seconds: one that reads nothing in that time is closed."""
        with anyio.move_on_after(self.server.stall_timeout):
            await self._drained()
            return
        if self.sub is not None:  # a subscriber: its `lagged` line, which says where to resume
            self.lag(self.last_seq + 1, 0)
            return
        self.server.client_log.warning(
            "disconnecting %s: %d bytes of replies unread for %g s (client stopped reading)",
            self.peer.describe(), self.buffered(), self.server.stall_timeout)
        self.close()

    def refuse_queued(self) -> None:
        """The daemon stops: every line read and not answered gets `unavailable`."""
        while self._cut():  # what was read and not cut yet is answered too
            pass
        lines = list(self.todo)
        self.todo.clear()
        self.server._refuse_queued(self, lines)

    def _pause(self) -> None:
        self.busy = True
        if self.transport is not None and not self.eof:
            self.transport.pause_reading()

    def _resume(self) -> None:
        self.busy = False
        if self.closed or self.transport is None:
            return
        if not self.eof:
            self.transport.resume_reading()
        self._serve()

    async def _run(self, later: Callable[[], Awaitable[None]]) -> None:
        try:
            with anyio.CancelScope() as self.scope:
                if not self.closed:
                    await later()
        except anyio.get_cancelled_exc_class():
            if not self.closed:  # not this connection's end, so the daemon's: it stops
                self.server.stopping = True
            raise
        finally:
            self.scope = None
            self._resume()

    def _stalled(self) -> None:
        self._stall = None
        if self.closed:
            return
        if self.busy:  # our own slow answer kept the line waiting, not the client
            self._stall = self.loop.call_later(self.server.stall_timeout, self._stalled)
            return
        self.server._refuse_line(self, P.REQUEST_TIMEOUT, f"request line incomplete after "
                                                          f"{self.server.stall_timeout:g} seconds")
        self._shut(_FLUSH_BEFORE_CLOSE)

    def _stop_stall_timer(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _check_hangup(self) -> None:
        """A subscriber that sent EOF may still read: stream on until it hangs up."""
        self._timer = None
        if self.closed or not self._watching_hangup:
            return
        if self.hung_up():
            self.close()
            return
        self._timer = self.loop.call_later(_HUP_POLL, self._check_hangup)


# --------------------------------------------------------------------------- server


class SocketServer:
    """Serves the `Host` ``watcher`` at ``path``. Run `serve` as a task
    (``await tg.start(server.serve)``)."""

    def __init__(
        self,
        watcher: Host,
        path: str,
        *,
        read_gid: int | None = None,
        switch_gid: int | None = None,
        log_path: str | None = None,
        metrics: Metrics | None = None,
        outbox_limit: int = DEFAULT_OUTBOX_LIMIT,
        max_clients: int = DEFAULT_MAX_CLIENTS,
        max_per_uid: int = DEFAULT_MAX_PER_UID,
        root_reserve: int = DEFAULT_ROOT_RESERVE,
        max_line: int = P.MAX_LINE,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT,
        ops: dict[str, OpHandler] | None = None,
        flush_window: float = FLUSH_WINDOW,
        log_keep: int = 5,
        groups_timeout: float = GROUPS_TIMEOUT,
        output_budget: int = DEFAULT_OUTPUT_BUDGET,
        config: Mapping[str, Any] | None = None,
        live_read_wait: float = LIVE_READ_WAIT,
    ) -> None:
        self.watcher = watcher
        #: What the ``config`` method answers (`served_config`): without it, no file, a
        #: root the caller named (a client whose root would come from its file asks itself)
        #: and the watcher's tables.
        self.config = dict(config) if config is not None else {
            "path": None, "identity": None, "root": watcher.paths.root, "root_from": "flag",
            "tables": tables_json(watcher.model.tables)}
        self.path = os.fspath(path)
        self.policy = AccessPolicy(read_gid=read_gid, switch_gid=switch_gid,
                                   owner_uid=os.geteuid())
        for gid in (read_gid, switch_gid):
            group_label(gid)  # looked up now, not on the loop at each refusal that names it
        self.log_path = log_path if log_path not in (None, "-") else None
        self.metrics = metrics
        self.outbox_limit = max(outbox_limit, 4 * _LAG_RESERVE)
        #: Unread output of all connections together (`_room`).
        self.output_budget = max(output_budget, 4 * self.outbox_limit)
        # An upper bound of that output since it was last summed: what was written since
        # is added, what clients read is not taken off (the sum is taken when it passes
        # the budget, which on a daemon whose clients read is once per budget written).
        self._out_bound = 0
        self.max_clients = max_clients
        self.max_per_uid = max_per_uid
        self.root_reserve = min(root_reserve, max_clients)
        self.max_line = max_line
        self.stall_timeout = stall_timeout
        self.flush_window = flush_window
        #: Descriptors one history replay may hold: every file of the log, and one more
        #: for a rotation while it opens them.
        self.fds_per_replay = log_keep + 2
        #: Replays that may hold their log files at once (set by `serve` from the
        #: RLIMIT_NOFILE it got); a replay beyond them is refused with `unavailable`.
        self.replay_slots = max_clients
        self._replays: set[Connection] = set()
        self._per_uid: dict[int, int] = {}
        #: What clients cause in the journal (refusals, closes), bounded: `RateLimitedLog`.
        self.client_log = RateLimitedLog(_log)
        self._unprivileged = 0
        self.ops = ops if ops is not None else default_ops()
        self.connections: set[Connection] = set()
        self._subscribers: list[Connection] = []
        self._ident: tuple[int, int] | None = None
        self._to_spawn: deque[tuple[_ProtocolConnection,
                                    Callable[[], Awaitable[None]]]] = deque()
        self._spawn_wake: anyio.Event | None = None  # made in `serve`: it needs the loop
        # Coalescing (`_on_batch`): batches published since the last flush, and when that was.
        self._pending: list[_Batch] = []
        self._pending_bytes = 0
        self._last_flush = 0.0
        self._flush_due = False
        self._held_since = 0.0
        self._published = 0  # batches seen: the flusher's sign that a burst goes on
        self._flush_wake: anyio.Event | None = None
        self.lag_drops = 0
        #: The daemon is stopping: a request not answered yet is answered `unavailable`.
        self.stopping = False
        self.groups_timeout = groups_timeout
        self.live_read_wait = live_read_wait
        # Other users' live /proc reads (`_call`); made in `serve`, where the loop runs.
        self._live_reads: anyio.CapacityLimiter | None = None
        # Group lookups in threads (no SO_PEERGROUPS), ended or not: bounded.
        self._lookups = 0
        self._lookup_lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Bind, report started, accept until cancelled; the socket file is removed at the end."""
        self.replay_slots = self._fd_budget()
        lsock = bind_socket(self.path, self.policy.read_gid if self.policy.read_gid is not None
                            else (0 if os.geteuid() == 0 else None))
        try:
            st = os.stat(self.path)
        except OSError as exc:  # removed under us between bind and now
            lsock.close()
            raise ListenerNotYet(f"cannot serve {self.path}: {exc.strerror}") from None
        self._ident = (st.st_dev, st.st_ino)
        self.watcher.batch_listeners.append(self._on_batch)
        loop = _asyncio_loop()
        self._spawn_wake = anyio.Event()
        self._flush_wake = anyio.Event()
        self._live_reads = anyio.CapacityLimiter(LIVE_READS)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._flusher)
                tg.start_soon(self._spawner, tg)
                task_status.started()
                await self._accept_loop(lsock, tg, loop)
        finally:
            self.stopping = True
            with contextlib.suppress(Exception):
                self._unstarted()  # before the lines queued behind them, in order
            if self._on_batch in self.watcher.batch_listeners:
                self.watcher.batch_listeners.remove(self._on_batch)
            with contextlib.suppress(Exception):
                self._flush()  # the last events (`stopped`) to whoever can take them now
            closing = [conn for conn in self.connections if isinstance(conn, _ProtocolConnection)]
            for conn in closing:
                with contextlib.suppress(Exception):
                    conn.refuse_queued()
                conn._shut(_FLUSH_AT_STOP)  # what each was sent, `stopped` last, then the close
            with contextlib.suppress(RuntimeError):
                anyio.notify_closing(lsock)
            self._unlink()  # while PATH.lock is still ours: no successor has bound yet
            lsock.close()  # lets go of PATH.lock
            if closing:
                await self._flushed_at_stop(closing)

    async def _flushed_at_stop(self, closing: list[_ProtocolConnection]) -> None:
        """Wait (shielded from the stop, at most `_FLUSH_AT_STOP` seconds in all) while the
        clients take what they were sent: a reader that keeps up loses nothing to the stop,
        not the tail of a line nor its `stopped`. One that does not read is cut off then."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(_FLUSH_AT_STOP):
            while any(not conn.gone for conn in closing):
                await anyio.sleep(_FLUSH_POLL)
        for conn in closing:
            conn.close()

    def _fd_budget(self) -> int:
        """Lift RLIMIT_NOFILE to fit every client, each replaying the log at once, and
        return how many replays fit what the hard limit allowed.

        Where the limit cannot fit even one descriptor per client beside the daemon's own,
        fewer clients are served (`_fit_clients`): else a crowd of other users would take
        every descriptor, and root's connection, the log and the watcher's reads would all
        fail with EMFILE.
        """
        if self.log_path is None:
            _raise_fd_limit(self.max_clients + _FD_HEADROOM)
        else:
            _raise_fd_limit(self.max_clients * (1 + self.fds_per_replay) + _FD_HEADROOM)
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_clients
        self._fit_clients(soft)
        if self.log_path is None:
            return self.max_clients
        spare = soft - self.max_clients - _FD_HEADROOM
        slots = max(0, min(self.max_clients, spare // self.fds_per_replay))
        if slots < self.max_clients:
            _log.warning("RLIMIT_NOFILE %d leaves room for %d history replays at once (of "
                         "%d clients); raise LimitNOFILE= for more", soft, slots,
                         self.max_clients)
        return slots

    def _fit_clients(self, soft: int) -> None:
        """Serve at most the clients ``soft`` descriptors leave room for, keeping root's
        reserved share (at most half of them)."""
        room = soft - _FD_HEADROOM if soft >= 2 * _FD_HEADROOM else soft // 2
        if room >= self.max_clients:
            return
        wanted = self.max_clients
        self.max_clients = max(1, room)
        self.root_reserve = min(self.root_reserve, self.max_clients // 2)
        _log.warning("RLIMIT_NOFILE %d leaves room for %d clients (of --socket-max-clients "
                     "%d, %d of them reserved for root); raise LimitNOFILE= for more", soft,
                     self.max_clients, wanted, self.root_reserve)

    def _unlink(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            return
        if (st.st_dev, st.st_ino) == self._ident:  # never remove a successor's socket
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def _spawn(self, conn: _ProtocolConnection, later: Callable[[], Awaitable[None]]) -> None:
        """Run ``later`` for ``conn`` as a task, from a protocol callback (no task context
        there, so no task group call): the spawner task starts it in the server's task
        group. One the daemon stops before it starts is answered by `_unstarted`."""
        self._to_spawn.append((conn, later))
        assert self._spawn_wake is not None
        self._spawn_wake.set()

    def _unstarted(self) -> None:
        """The daemon stops: a request whose task was never started (read in the loop turn
        the stop came in) gets `unavailable` too, not silence."""
        while self._to_spawn:
            conn, later = self._to_spawn.popleft()
            if (isinstance(later, functools.partial) and later.func == self._answer_later
                    and not conn.closed):
                req: P.Request = later.args[1]
                self._stopping_reply(conn, req.id, req.method)

    async def _spawner(self, tg: anyio.abc.TaskGroup) -> None:
        while True:
            assert self._spawn_wake is not None
            await self._spawn_wake.wait()
            self._spawn_wake = anyio.Event()
            while self._to_spawn:
                conn, later = self._to_spawn.popleft()
                tg.start_soon(conn._run, later)

    async def _accept_loop(self, lsock: socket.socket, tg: anyio.abc.TaskGroup,
                           loop: asyncio.AbstractEventLoop | None) -> None:
        # One descriptor kept in reserve: out of them (EMFILE, ENFILE: something other
        # than clients took them, which are fitted to RLIMIT_NOFILE), it is given up to
        # accept the waiting clients one at a time and tell each why (`_turn_away_one`).
        spare = _open_spare()
        backoff = _ACCEPT_BACKOFF
        try:
            while True:
                await anyio.wait_readable(lsock)
                turn = 0
                while True:
                    if turn >= _ACCEPTS_PER_TURN:
                        # Everyone else's I/O before the next ones: a refusal awaits nothing,
                        # so peers that connect as fast as they are refused kept the backlog
                        # from ever running dry and the loop from ever serving anyone else.
                        await anyio.lowlevel.checkpoint()
                        turn = 0
                    turn += 1
                    try:
                        csock, _ = lsock.accept()
                    except BlockingIOError:
                        break
                    except OSError as exc:
                        if exc.errno in (errno.ECONNABORTED, errno.EINTR):
                            continue
                        if exc.errno not in _ACCEPT_SHORT:
                            raise
                        if exc.errno in (errno.EMFILE, errno.ENFILE) and spare is not None:
                            spare = self._turn_away_one(lsock, spare, exc)
                            await anyio.lowlevel.checkpoint()  # others first, then the next
                            continue
                        # No spare to give up (another thread took it), or the kernel is
                        # short of memory: wait, longer while it lasts, then look again.
                        self.client_log.warning("cannot accept a client: %s", exc.strerror)
                        await anyio.sleep(backoff)
                        backoff = min(2 * backoff, _ACCEPT_BACKOFF_MAX)
                        if spare is None:
                            spare = _open_spare()
                        break
                    backoff = _ACCEPT_BACKOFF
                    await self._take(csock, tg, loop)
        finally:
            if spare is not None:
                os.close(spare)

    def _turn_away_one(self, lsock: socket.socket, spare: int, exc: OSError) -> int | None:
        """Out of descriptors with clients waiting: give up the spare, accept the first
        client with it, tell it why in one line, close it and take the spare back. Without
        this, clients wait in the backlog unanswered until a descriptor frees, and the
        listening socket stays readable, waking the loop for nothing. Returns the spare
        taken back (None when another thread got the freed descriptor first)."""
        os.close(spare)
        try:
            csock, _ = lsock.accept()
        except OSError:
            pass  # it left, or the freed descriptor was taken meanwhile
        else:
            name = errno.errorcode.get(exc.errno or 0, "EMFILE")
            self._turn_away(csock, None, P.TOO_MANY_CLIENTS,
                            f"the daemon has no file descriptor free for another client "
                            f"({name}: {exc.strerror}); retry")
        return _open_spare()

    async def _take(self, csock: socket.socket, tg: anyio.abc.TaskGroup,
                    loop: asyncio.AbstractEventLoop | None) -> None:
        """Authorise a just-accepted client and serve it."""
        csock.setblocking(False)
        try:
            # The start time (a read of /proc, a pidfd) only for a peer that is served: a
            # refusal is the cheapest thing the loop does for a flood of them.
            peer, complete = kernel_credentials(csock, vouch=False)
        except OSError:
            csock.close()
            return
        if not complete and not self.policy.privileged(peer):
            peer = vouched(csock, peer)  # at accept, not after the lookup
            # No SO_PEERGROUPS (Linux < 4.13): the groups come from the group database,
            # which may block on the network (LDAP, sssd). Looked up off the loop, bounded,
            # while everyone else is served.
            with self._lookup_lock:
                busy = self._lookups >= _MAX_GROUP_LOOKUPS
                if not busy:
                    self._lookups += 1
            if busy:
                self._turn_away(csock, peer, P.TOO_MANY_CLIENTS,
                                f"{_MAX_GROUP_LOOKUPS} lookups of peers' groups are pending "
                                "(the group database is slow); retry")
                return
            tg.start_soon(self._take_after_lookup, csock, peer, tg, loop)
            return
        if not self._authorise(csock, peer):
            return
        if (not self.policy.privileged(peer) and not self.policy.allows("switch", peer)
                and _hung_up(csock.fileno())):
            # A reader that hung up while it waited in the backlog: whatever it asked is a
            # read, whose answer could go nowhere. Closed here, at the cost of a refusal:
            # readers that ask and hang up by the thousand kept the backlog full of
            # connections each served in full, and root's connection waited behind them.
            csock.close()
            return
        await self._serve_peer(csock, vouched(csock, peer), tg, loop)

    async def _take_after_lookup(self, csock: socket.socket, peer: PeerCred,
                                 tg: anyio.abc.TaskGroup,
                                 loop: asyncio.AbstractEventLoop | None) -> None:
        """`_take` for a peer whose groups the kernel did not give: they are looked up in a
        thread (counted in ``_lookups`` until it ends, even one given up on), and a peer
        whose lookup takes longer than ``groups_timeout`` is refused, not waited for."""
        from gpuwatch.hostfs.facts import call_bounded

        def lookup() -> list[int]:
            try:
                return database_groups(peer.uid, peer.gid)
            finally:
                with self._lookup_lock:
                    self._lookups -= 1

        try:
            try:
                groups = await call_bounded(lookup, self.groups_timeout,
                                            f"groups of uid {peer.uid}")
            except Exception as exc:
                why = ("did not finish within "
                       f"{self.groups_timeout:g} s" if isinstance(exc, TimeoutError) else
                       f"failed ({type(exc).__name__})")
                self._turn_away(csock, peer, P.UNAVAILABLE,
                                f"the lookup of uid {peer.uid}'s groups in the group database "
                                f"{why}; retry")
                return
        except BaseException:
            csock.close()  # the daemon is stopping
            raise
        peer = with_groups(peer, groups)
        if self._authorise(csock, peer):
            await self._serve_peer(csock, peer, tg, loop)

    async def _serve_peer(self, csock: socket.socket, peer: PeerCred, tg: anyio.abc.TaskGroup,
                          loop: asyncio.AbstractEventLoop | None) -> None:
        """Serve an authorised client."""
        if loop is None:
            tg.start_soon(self._handle, csock, peer)
            return
        conn = _ProtocolConnection(self, peer, loop)
        self._register(conn)
        try:
            await loop.connect_accepted_socket(conn.itself, csock)
        except (OSError, RuntimeError) as exc:  # it left before we got to it
            _log.debug("client %s left at accept: %s", peer.describe(), exc)
            csock.close()
            self._forget(conn)

    # ------------------------------------------------------------------ one client

    def _admit(self, peer: PeerCred) -> tuple[str, str] | None:
        """Why ``peer`` may not have a connection now ((code, message)), or None.

        Decided from SO_PEERCRED alone, before a byte of the peer is read: a peer that may
        not use the socket, or that holds its uid's share already, costs one error line.
        """
        if not self.policy.may_connect(peer):
            return P.PERMISSION_DENIED, self.policy.refusal("probe", peer)
        if self.policy.privileged(peer):
            if len(self.connections) >= self.max_clients:
                return P.TOO_MANY_CLIENTS, (f"the daemon serves at most {self.max_clients} "
                                            "clients")
            return None
        if self._per_uid.get(peer.uid, 0) >= self.max_per_uid:
            return P.TOO_MANY_CLIENTS, (f"uid {peer.uid} holds {self.max_per_uid} connections "
                                        "already (--socket-max-per-uid)")
        if (self._unprivileged >= self.max_clients - self.root_reserve
                or len(self.connections) >= self.max_clients):
            return P.TOO_MANY_CLIENTS, (f"the daemon serves at most "
                                        f"{self.max_clients - self.root_reserve} non-root "
                                        "clients")
        return None

    def _authorise(self, sock: socket.socket, peer: PeerCred) -> bool:
        """Whether the peer of a just-accepted socket may have a connection; otherwise it
        gets one error line and is closed, before a byte of it is read."""
        refusal = self._admit(peer)
        if refusal is None:
            return True
        self._turn_away(sock, peer, *refusal)
        return False

    def _turn_away(self, sock: socket.socket, peer: PeerCred | None, code: str,
                   message: str) -> None:
        """One error line (``"id": null``) to a client we will not serve, then close it,
        before a byte of it is read. The line fits an empty socket buffer: never waits."""
        who = peer.describe() if peer is not None else "a client"
        self.client_log.warning("refusing %s: %s", who, message)
        self._count("?", code)
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.send(P.encode_error(None, code, message), socket.MSG_NOSIGNAL)
            sock.shutdown(socket.SHUT_WR)
        sock.close()

    def _track(self, peer: PeerCred, delta: int) -> None:
        if self.policy.privileged(peer):
            return
        count = self._per_uid.get(peer.uid, 0) + delta
        if count > 0:
            self._per_uid[peer.uid] = count
        else:
            self._per_uid.pop(peer.uid, None)
        self._unprivileged += delta

    def _register(self, conn: Connection) -> None:
        self.connections.add(conn)
        self._track(conn.peer, +1)
        if self.metrics is not None:
            self.metrics.clients.set(len(self.connections))

    def _forget(self, conn: Connection) -> None:
        if conn not in self.connections:
            return
        conn.closed = True
        self.connections.discard(conn)
        self._replays.discard(conn)
        self._track(conn.peer, -1)
        if conn in self._subscribers:
            self._subscribers.remove(conn)
        if self.metrics is not None:
            self.metrics.clients.set(len(self.connections))

    async def _handle(self, sock: socket.socket, peer: PeerCred) -> None:
        """A connection on another backend than asyncio: a reader and a writer task."""
        conn = _StreamConnection(self, sock, peer)
        self._register(conn)
        try:
            with conn.scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(conn.writer)
                    ended_by_peer = False
                    with conn.reading:
                        ended_by_peer = await self._reader(conn)
                    with anyio.move_on_after(_FLUSH_AFTER_EOF if ended_by_peer
                                             else conn.grace):
                        await conn.flushed()
                    if ended_by_peer and conn.sub is not None and not conn.closed:
                        await self._await_hangup(conn)
                        with anyio.move_on_after(conn.grace):
                            await conn.flushed()
                    tg.cancel_scope.cancel()
        finally:
            self._forget(conn)
            with contextlib.suppress(RuntimeError):
                anyio.notify_closing(sock)
            sock.close()

    async def _await_hangup(self, conn: _StreamConnection) -> None:
        """A subscriber that sent EOF may still read: stream on until it hangs up."""
        while not conn.closed:
            if conn.hung_up():
                return
            await anyio.sleep(_HUP_POLL)

    async def _reader(self, conn: _StreamConnection) -> bool:
        """Read lines; each complete line is one request, answered in order.

        True when the peer ended (EOF); False when the connection is being closed for
        cause: a line over ``max_line`` bytes, or a partial line that stalled for
        ``stall_timeout`` seconds. At most ``max_line`` bytes of a request are ever held.
        """
        sock = conn.sock
        framer = LineFramer(self.max_line)
        deadline = 0.0  # when the partial line held must be complete
        while not conn.closed:
            if framer.pending:
                with anyio.move_on_after(deadline - anyio.current_time()) as waited:
                    await anyio.wait_readable(sock)
                if waited.cancelled_caught:
                    self._refuse_line(conn, P.REQUEST_TIMEOUT,
                                      f"request line incomplete after {self.stall_timeout:g} "
                                      "seconds")
                    return False
            else:
                await anyio.wait_readable(sock)
            try:
                chunk = sock.recv(_RECV)
            except BlockingIOError:
                continue
            except OSError:
                conn.close()
                return True
            had_partial = framer.pending
            completed = False
            # Cut `_CUT` bytes at a time, as the asyncio connection does: a read of tiny
            # lines costs their objects for one piece, not for the whole read.
            for at in range(0, len(chunk), _CUT) if chunk else (-1,):
                lines = framer.feed(chunk[at:at + _CUT]) if at >= 0 else framer.finish()
                completed = completed or bool(lines)
                for i, line in enumerate(lines):
                    if line is TOO_LONG:
                        self._too_long(conn)
                        return False
                    if i or at > 0:
                        # One busy client must not starve the rest: yield between the lines
                        # of one chunk (the first one already waited for its chunk).
                        await anyio.lowlevel.checkpoint()
                    later = self._answer(conn, line)
                    if later is not None:
                        try:
                            await later()
                        except anyio.get_cancelled_exc_class():
                            if not conn.closed:  # stopping: the rest of the read is told so
                                rest = lines[i + 1:]
                                if at >= 0:
                                    rest += framer.feed(chunk[at + _CUT:])
                                self._refuse_queued(conn, rest)
                            raise
                    if conn.closed:
                        return True
            if not chunk:
                return True
            if framer.pending and (completed or not had_partial):
                deadline = anyio.current_time() + self.stall_timeout
        return True

    def _refuse_line(self, conn: Connection, code: str, message: str) -> None:
        """One error line; the connection is then flushed (briefly) and closed."""
        self.client_log.warning("closing %s: %s", conn.peer.describe(), message)
        conn.reply(P.encode_error(None, code, message))
        self._count("?", code)

    def _too_long(self, conn: Connection) -> None:
        self._refuse_line(conn, P.REQUEST_TOO_LARGE,
                          f"request line longer than {self.max_line} bytes")

    # ------------------------------------------------------------------ requests

    def _answer(self, conn: Connection, line: bytes) -> Callable[[], Awaitable[None]] | None:
        """Answer one request line now, from memory, when it can be; otherwise return what
        to await for the answer (a replay, a switch, a /proc read), in order."""
        if not line or line.isspace():
            return None  # blank lines are spacing (a shell's trailing newline)
        try:
            req = P.parse_request(line)
        except P.RequestError as exc:
            conn.reply(P.encode_error(exc.rid, exc.code, exc.message))
            self._count("?", exc.code)
            return None
        method = req.method
        if not self.policy.allows(method, conn.peer):
            message = self.policy.refusal(method, conn.peer)
            self.client_log.warning("refused %s for %s", method, conn.peer.describe())
            conn.reply(P.encode_error(req.id, P.PERMISSION_DENIED, message))
            self._count(method, P.PERMISSION_DENIED)
            return None
        try:
            if method == "probe":
                action = req.params.get("action")
                if isinstance(action, str) and action in _LIVE_ACTIONS:
                    return functools.partial(self._answer_later, conn, req)
                result = self._probe_now(conn, P.Params(method, req.params))
            elif method == "snapshot":
                P.Params(method, req.params).done()
                result = self.watcher.snapshot()
            elif method == "config":
                P.Params(method, req.params).done()
                result = self.config
            elif method == "subscribe":
                replay = self._subscribe(conn, req)
                if replay is None:  # a replay counts once its reply goes (`_first_chunk`)
                    self._count(method, "ok")
                return replay
            else:
                return functools.partial(self._answer_later, conn, req)
        except P.RpcError as exc:
            conn.reply(P.encode_error(req.id, exc.code, exc.message))
            self._count(method, exc.code)
            return None
        except Exception as exc:
            self._internal(conn, req, exc)
            return None
        self._send_result(conn, req, result)
        return None

    async def _answer_later(self, conn: Connection, req: P.Request) -> None:
        try:
            result = await self._call(conn, req)
        except anyio.get_cancelled_exc_class():
            # The daemon is stopping (a connection that was lost or cut off is closed
            # already, and takes no reply): one line saying so, not a reply that never
            # comes before the connection is reset. The lines queued behind it get the
            # same (`_serve` when it resumes, or `serve` on its way out).
            if not conn.closed:
                self.stopping = True
                self._stopping_reply(conn, req.id, req.method)
            raise
        except P.RpcError as exc:
            conn.reply(P.encode_error(req.id, exc.code, exc.message))
            self._count(req.method, exc.code)
            return
        except Exception as exc:
            self._internal(conn, req, exc)
            return
        self._send_result(conn, req, result)

    def _stopping_reply(self, conn: Connection, rid: Any, method: str) -> None:
        conn.reply(P.encode_error(rid, P.UNAVAILABLE, f"{method}: the daemon is stopping; retry"))
        self._count(method, P.UNAVAILABLE)

    def _refuse_queued(self, conn: Connection, lines: Sequence[bytes]) -> None:
        """Requests read but not answered when the daemon stops: each gets `unavailable`
        (a line that is no request gets its error, as ever), none is left unanswered."""
        for line in lines:
            if conn.closed:
                return
            if line is TOO_LONG:
                self._too_long(conn)
                return
            if not line or line.isspace():
                continue
            try:
                req = P.parse_request(line)
            except P.RequestError as exc:
                conn.reply(P.encode_error(exc.rid, exc.code, exc.message))
                self._count("?", exc.code)
                continue
            self._stopping_reply(conn, req.id, req.method)

    def _send_result(self, conn: Connection, req: P.Request, result: Any) -> None:
        try:
            data = P.encode_result(req.id, result)
        except Exception as exc:  # an op returned something JSON cannot carry
            data = P.encode_error(req.id, P.INTERNAL, f"unserialisable result: {exc}")
        conn.reply(data)
        self._count(req.method, "ok")

    def _internal(self, conn: Connection, req: P.Request, exc: Exception) -> None:
        self.client_log.error("%s failed for %s", req.method, conn.peer.describe(),
                              exc_info=exc)
        conn.reply(P.encode_error(req.id, P.INTERNAL, f"{type(exc).__name__}: {exc}"))
        self._count(req.method, P.INTERNAL)

    def _count(self, method: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(method=method, outcome=outcome).inc()

    # ------------------------------------------------------------------ methods

    async def _call(self, conn: Connection, req: P.Request) -> Any:
        """A request that is not answered from memory. Other users' live reads of /proc
        take turns (`LIVE_READS` at once, a turn waited for `live_read_wait` seconds at
        most); a switch, a recover and root's requests never wait behind them. A read for
        a client that has hung up (closed its end; one that only shut its sending side
        still gets its reply) is not done: a flood of clients that ask and close at once
        would otherwise keep the turns busy with walks whose replies go nowhere. (One that
        hangs up during its read keeps its turn until the read ends.)"""
        if req.method in P.SWITCH_METHODS:
            return await self._call_now(conn, req)
        self._unless_hung_up(conn, req)
        limiter = self._live_reads
        if limiter is None or self.policy.privileged(conn.peer):
            return await self._call_now(conn, req)
        turn = False
        with anyio.move_on_after(self.live_read_wait):
            await limiter.acquire()
            turn = True
        if not turn:
            raise P.RpcError(P.UNAVAILABLE, f"{req.method}: {LIVE_READS} reads of /proc for "
                                            "other clients are running; retry")
        try:
            self._unless_hung_up(conn, req)  # it may have left while it waited
            return await self._call_now(conn, req)
        finally:
            limiter.release()

    def _unless_hung_up(self, conn: Connection, req: P.Request) -> None:
        """Close ``conn`` and raise when its client hung up: its read would go nowhere. (A
        method a program added (``ops``) that is no read is done all the same.)"""
        if req.method in P.READ_METHODS and (conn.closed or conn.hung_up()):
            conn.close()
            raise P.RpcError(P.UNAVAILABLE, f"{req.method}: the client hung up")

    async def _call_now(self, conn: Connection, req: P.Request) -> Any:
        params = P.Params(req.method, req.params)
        if req.method == "probe":
            action, group, addr, mode, vendor = self._probe_params(params)
            if action in ("nvidia-holders", "wedge-detected"):
                model = self.watcher.model
                return await host_ops.bounded(lambda: model.probe(action), action)
            if action == "plan":
                try:
                    return await host_ops.plan_probe(self.watcher, mode, addr, vendor)
                except P.RpcError:
                    raise
                except Exception as exc:
                    raise host_ops.error_for(exc) from None
            return self._probe_answer(conn, action, group, addr, mode, vendor)
        handler = self.ops.get(req.method)
        if handler is None:
            raise P.RpcError(P.UNAVAILABLE, f"{req.method} is not available in this daemon")
        if req.method in P.SWITCH_METHODS:
            # A switch half done is worse than one the client stopped waiting for: finish it.
            # `recover` too: it is a switch to vfio-pci, and one cut off by a stopping daemon
            # would roll back, binding nvidia again to the card that wedged it.
            with anyio.CancelScope(shield=True):
                return await handler(self.watcher, params, conn.peer)
        return await handler(self.watcher, params, conn.peer)

    def _probe_params(self, params: P.Params) -> tuple[str, int | None, str | None,
                                                       str | None, str | None]:
        action = params.req_str("action")
        group = params.opt_int("group")
        addr = params.opt_str("addr")
        mode = params.opt_str("mode")
        vendor = params.opt_str("vendor")
        params.done()
        try:
            check_params(action, group, addr, mode, vendor)
        except Exception as exc:
            raise host_ops.error_for(exc) from None
        if self.metrics is not None:  # after the check: labels only for real actions
            self.metrics.probe_calls.labels(action=action).inc()
        return action, group, addr, mode, vendor

    def _probe_now(self, conn: Connection, params: P.Params) -> Any:
        return self._probe_answer(conn, *self._probe_params(params))

    def _probe_answer(self, conn: Connection, action: str, group: int | None,
                      addr: str | None, mode: str | None, vendor: str | None) -> Any:
        """A probe answered from memory (every action but the live ones)."""
        try:
            # The contract answers for the asking process: answer for the peer, not for us.
            if action == "vfio-group-accessible":
                assert group is not None
                node = self.watcher.model.state.nodes.get(f"/dev/vfio/{group}")
                if group < 0 or node is None:
                    return False
                if not conn.dac_override_read:
                    conn.dac_override = peer_dac_override(conn.peer)
                    conn.dac_override_read = True
                return may_read_write(node, conn.peer.uid, conn.peer.groups, conn.dac_override)
            if action == "memlock":
                limit = peer_memlock(conn.peer.pid)
                # Checked after the read: a pid the peer left behind, reused by another
                # process, must not be answered with that process's limit.
                if limit is not None and not conn.peer.still_there():
                    raise P.RpcError(P.UNAVAILABLE, f"the process that connected (pid "
                                                    f"{conn.peer.pid}) has exited; its pid "
                                                    "may name another process now")
                if limit is None:
                    raise P.RpcError(P.UNAVAILABLE, f"cannot read the memlock limit of pid "
                                                    f"{conn.peer.pid}")
                return limit
            if vendor is not None:
                return self.watcher.model.probe(action, group=group, addr=addr, mode=mode,
                                                vendor=vendor)
            return self.watcher.probe(action, group=group, addr=addr, mode=mode)
        except P.RpcError:
            raise
        except Exception as exc:
            raise host_ops.error_for(exc) from None

    def _subscribe(self, conn: Connection,
                   req: P.Request) -> Callable[[], Awaitable[None]] | None:
        """Register the subscription and reply; the log replay (``since_seq``), if any, is
        returned to be awaited: it is paced to the client."""
        params = P.Params(req.method, req.params)
        types = params.opt_str_list("types")
        addrs = params.opt_str_list("addrs")
        since_seq = params.opt_int("since_seq")
        params.done()
        if conn.sub is not None:
            raise P.RpcError(P.ALREADY_SUBSCRIBED, "this connection is already subscribed; "
                                                   "open another one for another filter")
        try:  # checked as an in-process subscription checks them (addrs as events spell them)
            type_set, addr_set = event_filters(types, addrs)
        except UsageError as exc:
            raise P.RpcError(P.INVALID_PARAMS, f"subscribe: {exc}") from None
        if since_seq is not None and since_seq < 0:
            raise P.RpcError(P.INVALID_PARAMS, "subscribe: 'since_seq' must be >= 0")
        sub = _Subscription(type_set, addr_set)
        now = self.watcher.seq
        replay = since_seq is not None and since_seq < now and self.log_path is not None
        if replay and len(self._replays) >= self.replay_slots:
            raise P.RpcError(P.UNAVAILABLE, f"subscribe: {self.replay_slots} history replays "
                                            "run already (the daemon's open-file limit); "
                                            "retry, or subscribe without 'since_seq'")
        conn.sub = sub
        conn.last_seq = now
        complete = True
        if since_seq is not None and since_seq < now:
            # Live events are held from here on; the log covers (since_seq, now] and more.
            # The reply waits for the log's first chunk (`_first_chunk`), the connection's
            # next requests with it.
            conn.replaying = True
            conn.last_seq = since_seq
            if replay:
                self._replays.add(conn)
            self._subscribers.append(conn)
            raw = self._history(since_seq, sub)
            return functools.partial(self._replay, conn, req, since_seq, now, raw)
        if since_seq is not None and since_seq > now:
            complete = False  # a seq from another log: what the client missed is unknown
        self._subscribers.append(conn)
        conn.reply(P.encode_result(req.id, {"seq": now, "complete": complete}))
        return None

    async def _first_chunk(self, conn: Connection, req: P.Request, since_seq: int, now: int,
                           raw: Iterator[RawChunk]) -> Iterator[RawChunk] | None:
        """Reply to the subscribe once the log's first chunk after ``since_seq`` says
        whether it is ``complete``; the chunks to replay, or None when there are none to
        send (the connection closed, or the log could not be read: an error reply, and the
        client is not subscribed).

        Finding ``since_seq`` (a directory scan, a bisection: a few reads, more across a
        crash's NULs) runs in a thread; the reads after it, one per turn of the loop."""
        try:
            first = await anyio.to_thread.run_sync(next, raw, None)
            while first is not None and not first.first and not conn.closed:
                if conn.hung_up():  # no reply yet, nor a line read: only the socket tells
                    conn.close()
                    return None
                await end_turn()  # a read that completed no line: others' turn
                first = next(raw, None)
        except OSError as exc:
            self._replays.discard(conn)
            if conn in self._subscribers:
                self._subscribers.remove(conn)
            conn.replaying = False
            conn.sub = None  # not subscribed: the client may ask again
            conn.held.clear()
            conn.held_bytes = 0
            self.client_log.warning("cannot replay the log to %s: %s",
                                    conn.peer.describe(), exc)
            conn.reply(P.encode_error(req.id, P.UNAVAILABLE, f"subscribe: cannot read the "
                                                             f"event log: {exc.strerror or exc}"))
            self._count(req.method, P.UNAVAILABLE)
            return None
        if conn.closed:
            return None
        complete = first is not None and first_is_next(first.first, since_seq,
                                                       gap=bool(first.gap))
        conn.reply(P.encode_result(req.id, {"seq": now, "complete": complete}))
        self._count(req.method, "ok")
        return _chain(first, raw) if first is not None else raw

    async def _replay(self, conn: Connection, req: P.Request, since_seq: int, now: int,
                      raw: Iterator[RawChunk]) -> None:
        """The same hand-over as in-process subscriptions (gpuwatch.watch.subscription): the
        log's lines after since_seq, then what was held live, each seq once.

        ``complete`` in the reply could only judge the first seq. A hole further on (a
        rotated file missing, unreadable or no file at all, writes that failed, a line
        damaged or lost anywhere in a file) shows as a jump between two chunks (a chunk
        never spans a hole: `read_chunks`), or as a log that ends before ``now``: the
        replay stops there with the `lagged` line, so the client resumes from the hole and
        is told ``complete: false`` instead of taking a stream with seqs silently missing
        for a whole one."""
        handover = Handover(since_seq)
        expected: int | None = None  # the seq the log must hold next (None: not judged yet)
        block = _ReplayBlock(conn, self.outbox_limit)
        replied = False
        try:
            history = await self._first_chunk(conn, req, since_seq, now, raw)
            replied = True
            if history is None:
                return
            # One chunk (one read of at most 4 KiB) per turn, and the requests that came in
            # meanwhile answered before the next (`end_turn`): a replay of a huge log never
            # holds up other clients' requests. The chunks go out as stored, a block of
            # them per write (`_ReplayBlock`).
            for chunk in history:
                if conn.closed:
                    return
                if not chunk.first and conn.hung_up():  # a read that completed no line:
                    conn.close()  # nothing was sent whose failure would have told
                    return
                if handover.fresh(chunk.last):
                    if expected is not None and chunk.gap:
                        # A log-gap record: the seqs it names are a hole, whoever sent it.
                        await block.send()
                        conn.lag(expected, chunk.last + 1 - expected,
                                 hole=f"a log-gap record: seqs {chunk.gap}..{chunk.last} "
                                      "were never written")
                        return
                    if expected is not None and chunk.first > expected:
                        await block.send()
                        conn.lag(expected, chunk.first - expected,
                                 hole=f"the log jumps from seq {expected - 1} to {chunk.first}")
                        return
                    expected = chunk.last + 1
                    await block.add(chunk)
                await end_turn()
            await block.send()
            if conn.closed:
                return
            if expected is not None and expected <= now:
                conn.lag(expected, now + 1 - expected,
                         hole=f"the log ends at seq {expected - 1}, before seq {now}")
                return
            for seq, _etype, _addr, data in conn.held:
                if conn.closed:
                    return
                if handover.fresh(seq):
                    await conn.paced(data, seq, seq)
            conn.last_seq = max(conn.last_seq, conn.held_seq)
        except OSError as exc:  # a log file failed under the replay: resume from here
            self.client_log.warning("replay of the log to %s failed: %s",
                                    conn.peer.describe(), exc)
            conn.lag(conn.last_seq + 1, 0)
        except anyio.get_cancelled_exc_class():
            # The daemon is stopping (a lost connection is closed already): the requests
            # queued behind the subscribe are answered, then the `lagged` line says where
            # to resume, the replay's last line. The live events held meanwhile, `stopped`
            # among them, cannot follow it without the history between.
            if not conn.closed:
                self.stopping = True
                if not replied:  # no reply yet: the subscribe is answered as stopping
                    self._stopping_reply(conn, req.id, req.method)
                if isinstance(conn, _ProtocolConnection):
                    conn.refuse_queued()
                if replied:
                    conn.lag(conn.last_seq + 1, max(0, conn.held_seq - conn.last_seq),
                             stopping=True)
            raise
        finally:
            self._replays.discard(conn)
            close = getattr(raw, "close", None)
            if close is not None:
                close()  # release the log files now, not at garbage collection
            conn.held.clear()
            conn.held_bytes = 0
            conn.replaying = False

    def _history(self, since_seq: int, sub: _Subscription) -> Iterator[RawChunk]:
        if self.log_path is None:
            return iter(())
        wants = None if sub.types is None and sub.addrs is None else sub.wants
        return read_chunks(self.log_path, since_seq=since_seq, wants=wants, progress=True)

    # ------------------------------------------------------------------ fan-out

    def _on_batch(self, events: Sequence[BaseModel], lines: Sequence[str]) -> None:
        """Watcher batch listener: never waits and never raises (an exception here would
        stop the watcher's publishing).

        A batch after a quiet spell (no flush within ``flush_window``) goes out at once.
        Batches that follow it closely are held while the publisher keeps publishing (the
        pump still has slices to apply) and flushed together as soon as it pauses for a
        turn of the loop, or ``flush_window`` after the first one was held, or once
        `_PENDING_CAP` bytes wait: each client takes a burst in a few large writes instead
        of one per 64-event slice.
        """
        if not self._subscribers:
            return
        try:
            batch = _Batch(events, lines)
            self._pending.append(batch)
            self._pending_bytes += batch.size
            self._published += 1
            if self._flush_due and self._pending_bytes < _PENDING_CAP:
                return
            now = time.monotonic()
            if (self._pending_bytes >= _PENDING_CAP or self._flush_wake is None
                    or now - self._last_flush >= self.flush_window):
                self._flush()
            else:
                self._flush_due = True
                self._held_since = now
                self._flush_wake.set()
        except Exception:
            _log.exception("socket fan-out of %d event(s) failed", len(events))
            self._pending = []
            self._pending_bytes = 0

    async def _flusher(self) -> None:
        """Flushes what `_on_batch` held back: once a turn of the loop passes with nothing
        new published, or at the end of the window."""
        while True:
            assert self._flush_wake is not None
            await self._flush_wake.wait()
            self._flush_wake = anyio.Event()
            seen = -1
            while (self._flush_due and seen != self._published
                   and time.monotonic() - self._held_since < self.flush_window):
                seen = self._published
                await anyio.lowlevel.checkpoint()
            self._flush_due = False
            try:
                self._flush()
            except Exception:
                _log.exception("socket fan-out failed")

    def _flush(self) -> None:
        """Every held batch to every subscriber: one write per client. The bytes are cut and
        joined once per distinct filter (every subscriber without one shares the same), not
        once per subscriber, and go out as a view: a send the socket takes only in part
        leaves the rest queued without copying the whole remainder first. A large run of
        bytes that many subscribers share goes to the kernel once (`SharedBytes`)."""
        batches = self._pending
        self._last_flush = time.monotonic()
        if not batches:
            return
        self._pending = []
        self._pending_bytes = 0
        first = batches[0].seqs[0]
        last = batches[-1].seqs[-1]
        count = sum(len(b.seqs) for b in batches)
        alike: dict[tuple[frozenset[str] | None, frozenset[str] | None],
                    tuple[_Subscription, list[Connection]]] = {}
        for conn in tuple(self._subscribers):
            sub = conn.sub
            if sub is None or conn.replaying or conn.last_seq >= first:
                for batch in batches:  # the rare paths: a replay's end, events seen already
                    conn.offer_batch(batch)
                continue
            alike.setdefault((sub.types, sub.addrs), (sub, []))[1].append(conn)
        for sub, conns in alike.values():
            out = _wanted(batches, sub, count)
            if out is None:
                for conn in conns:
                    conn.last_seq = last
                continue
            shared = (SharedBytes(out[0]) if len(out[0]) >= MIN_BYTES
                      and len(conns) >= MIN_SHARERS and SharedBytes.supported else None)
            try:
                for conn in conns:
                    conn.last_seq = last
                    conn.deliver(*out, shared)
            finally:
                if shared is not None:
                    shared.close()

    def _catch_up(self, conn: Connection) -> None:
        """The held batches to one subscriber now (before a reply to it)."""
        for batch in self._pending:
            conn.offer_batch(batch)

    def _room(self, conn: Connection, size: int, buffered: int) -> bool:
        """Whether ``size`` more bytes for ``conn`` (``buffered`` unread already) fit the
        daemon-wide output budget. When they do not, the client with the most unread output
        is cut off (`Connection.evict`) until they fit: False when that client is ``conn``
        itself, which its caller then treats as over its own limit (a client that has read
        everything always gets its write, as under its own limit). A crowd of clients that
        read nothing cannot hold more than the budget, and those that keep up lose nothing
        to them."""
        self._out_bound += size
        if self._out_bound <= self.output_budget or not buffered:
            return True
        total = sum(c.buffered() for c in self.connections)
        spared: set[Connection] = set()  # cut off just now: their bytes go within seconds
        while total + size > self.output_budget:
            victim = max((c for c in self.connections if c not in spared),
                         key=lambda c: c.buffered(), default=None)
            if victim is None or victim is conn:
                self._out_bound = total
                return victim is None
            held = victim.buffered()
            if held == 0:
                break
            victim.evict()
            spared.add(victim)
            total -= held
        self._out_bound = total + size
        return True

    def _lag_drop(self, conn: Connection, *, counted: bool = True) -> None:
        if counted:
            self.lag_drops += 1
            if self.metrics is not None:
                self.metrics.lag_drops.inc()
        if conn in self._subscribers:
            self._subscribers.remove(conn)


def _asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio loop when anyio runs on asyncio (the daemon), else None (another
    backend runs no asyncio loop in this thread). No sniffio: anyio no longer brings it."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _raise_fd_limit(wanted: int) -> None:
    """Lift the soft RLIMIT_NOFILE towards ``wanted`` (within the hard limit), as systemd
    expects of a daemon: the default soft 1024 is less than the clients it may serve."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _open_spare() -> int | None:
    """The accept loop's reserve descriptor (None when there is none to take now)."""
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


def _hung_up(fd: int) -> bool:
    """Whether the peer of socket ``fd`` closed its end (-1: no socket, gone too). A peer
    that only shut its sending side (it still reads its replies) has not."""
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


def _chain(first: RawChunk, rest: Iterator[RawChunk]) -> Iterator[RawChunk]:
    yield first
    yield from rest


__all__ = [
    "DEFAULT_MAX_CLIENTS",
    "DEFAULT_OUTBOX_LIMIT",
    "FLUSH_WINDOW",
    "NOT_YET_ERRNOS",
    "Connection",
    "Listener",
    "ListenerNotYet",
    "SocketInUse",
    "SocketServer",
    "SocketSetupError",
    "bind_socket",
    "lagged_line",
    "socket_lock_path",
]
