"""The socket server: a running `Watcher` served to any language over a Unix stream socket.

Newline-delimited JSON (docs/socket.md). Each connection has a reader (requests, answered in
order) and a writer draining a bounded outbox. Nothing the server does for a client ever
waits on that client: event fan-out is a synchronous watcher listener that only appends to
outboxes, and a client whose outbox overflows (it stopped reading) is disconnected, so a slow
or hostile client cannot hold up the watcher or anyone else.

Sockets are raw non-blocking ones awaited with ``wait_readable``/``wait_writable``: the
outbox is then exactly the bytes the kernel has not taken yet, with no transport buffer
hidden in between, which is what makes the overflow rule exact.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import resource
import select
import socket
import stat
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus
from pydantic import BaseModel

from gpuwatch.core.events import EVENT_TYPES
from gpuwatch.errors import SERVICE, HostError
from gpuwatch.model import check_params, may_read_write
from gpuwatch.service import ops as host_ops
from gpuwatch.service import protocol as P
from gpuwatch.service.ops import OpHandler, default_ops
from gpuwatch.service.peers import AccessPolicy, PeerCred, peer_credentials, peer_memlock
from gpuwatch.watch.eventlog import RawChunk, read_chunks
from gpuwatch.watch.subscription import Handover, first_is_next

if TYPE_CHECKING:
    from gpuwatch.host import Host
    from gpuwatch.service.metrics import Metrics

_log = logging.getLogger("gpuwatch.service")

#: Bytes a client may leave unread before it is disconnected.
DEFAULT_OUTBOX_LIMIT = 4 << 20
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
_RECV = 64 * 1024
# How often a half-closed subscriber (it sent EOF but still reads) is checked for hang-up.
_HUP_POLL = 1.0
# A client that sent EOF gets this long to read its last replies.
_FLUSH_AFTER_EOF = 60.0

class SocketInUse(HostError):
    """Another process answers at the socket path (a second daemon); we do not steal it."""

    code = SERVICE


class SocketSetupError(HostError):
    """The socket cannot be created at that path (missing permission, not a socket, …)."""

    code = SERVICE


# --------------------------------------------------------------------------- binding


def _answers(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


def bind_socket(path: str, gid: int | None, *, mode: int = 0o660, backlog: int = 4096,
                ) -> socket.socket:
    """Create the listening socket: stale file replaced, mode and group set *before* listen.

    Until ``listen`` every connect is refused, so there is no moment at which the socket
    exists with looser permissions than asked for.
    """
    parent = os.path.dirname(path) or "."
    try:
        os.makedirs(parent, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise SocketSetupError(f"cannot create {parent}: {exc.strerror}") from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise SocketSetupError(f"{path} exists and is not a socket; not replacing it")
        if _answers(path):
            raise SocketInUse(f"another gpuwatch daemon answers at {path}")
        os.unlink(path)  # left behind by a daemon that died
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(path)
        if gid is not None:
            os.chown(path, -1, gid)
        os.chmod(path, mode)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
        if len(path.encode()) > 107:
            raise SocketSetupError(f"socket path {path} is longer than 107 bytes") from None
        raise SocketSetupError(f"cannot serve {path}: {exc.strerror or exc}") from None
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
    wanted, and the whole batch joined once for every subscriber without a filter."""

    __slots__ = ("_encoded", "_lines", "_whole", "addrs", "seqs", "types")

    def __init__(self, events: Sequence[BaseModel], lines: Sequence[str]) -> None:
        self.seqs = [int(getattr(e, "seq", 0)) for e in events]
        self.types = [getattr(e, "type", None) for e in events]
        self.addrs = [getattr(e, "addr", None) for e in events]
        self._lines = lines if len(lines) == len(events) else [
            e.model_dump_json() for e in events
        ]
        self._encoded: list[bytes | None] = [None] * len(events)
        self._whole: bytes | None = None

    def line(self, index: int) -> bytes:
        data = self._encoded[index]
        if data is None:
            data = self._encoded[index] = (self._lines[index] + "\n").encode("utf-8")
        return data

    def whole(self) -> bytes:
        if self._whole is None:
            self._whole = "".join(line + "\n" for line in self._lines).encode("utf-8")
        return self._whole


class Connection:
    """One client: its peer, its bounded outbox and (once subscribed) its event filter."""

    def __init__(self, server: SocketServer, sock: socket.socket, peer: PeerCred) -> None:
        self.server = server
        self.sock = sock
        self.peer = peer
        self.outbox: deque[bytes] = deque()
        self.pending = 0  # bytes in the outbox the kernel has not taken yet
        self.closed = False
        self.overflowed = False
        self.scope = anyio.CancelScope()
        self._wake = anyio.Event()
        self._progress = anyio.Event()
        self.sub: _Subscription | None = None
        self.replaying = False
        self.held: list[tuple[int, Any, Any, bytes]] = []
        self.held_bytes = 0
        self.held_seq = 0  # the newest seq seen while holding, wanted or not
        self.last_seq = 0

    # -- output

    def enqueue(self, data: bytes) -> bool:
        """Queue without waiting. Over the limit: the client stopped reading, drop it."""
        if self.closed:
            return False
        if self.pending and self.pending + len(data) > self.server.outbox_limit:
            self.overflow()
            return False
        if not self.outbox:
            # Nothing queued: hand it to the kernel now (non-blocking). A reply or a batch
            # that fits the socket buffer then costs no wake-up of the writer task.
            try:
                sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:  # EPIPE, ECONNRESET: the client left
                self.close()
                return False
            if sent == len(data):
                self._progress.set()
                return True
            data = data[sent:]
        self.outbox.append(data)
        self.pending += len(data)
        self._wake.set()
        return True

    def overflow(self) -> None:
        if self.closed:
            return
        self.overflowed = True
        if self.sub is not None:
            self.server._lag_drop(self)
        _log.warning("disconnecting %s: %d bytes unread (client stopped reading)",
                     self.peer.describe(), self.pending + self.held_bytes)
        self.close()

    def close(self) -> None:
        """Stop at once (callable from a listener): both tasks are cancelled, the socket
        closed by the handler."""
        self.closed = True
        self.outbox.clear()
        self.pending = 0
        self.held.clear()
        self.scope.cancel()

    async def paced(self, data: bytes) -> None:
        """Queue, waiting first while half the limit is unread (history replay): a long
        replay is fed at the client's pace instead of overflowing it."""
        while not self.closed and self.pending > self.server.outbox_limit // 2:
            self._progress = anyio.Event()
            await self._progress.wait()
        self.enqueue(data)

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
                    self.outbox[0] = data[sent:]
                self._progress.set()
            self._progress.set()
            await self._wake.wait()

    async def flushed(self) -> None:
        while self.outbox and not self.closed:
            self._progress = anyio.Event()
            await self._progress.wait()

    # -- subscription

    def offer_batch(self, batch: _Batch) -> None:
        """A published batch (listener context: never waits): one outbox entry for it."""
        if self.closed or self.sub is None:
            return
        seqs = batch.seqs
        if not seqs:
            return
        if self.replaying or seqs[0] <= self.last_seq:
            for i, seq in enumerate(seqs):  # the rare paths: one event at a time
                self.offer(seq, batch.types[i], batch.addrs[i], functools.partial(batch.line, i))
            return
        self.last_seq = seqs[-1]
        sub = self.sub
        if sub.types is None and sub.addrs is None:
            self.enqueue(batch.whole())
            return
        wanted = [i for i in range(len(seqs)) if sub.wants(batch.types[i], batch.addrs[i])]
        if wanted:
            self.enqueue(b"".join(batch.line(i) for i in wanted))

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
                if self.held_bytes > self.server.outbox_limit:
                    self.overflow()
            return
        if seq <= self.last_seq:
            return  # already sent from the log
        self.last_seq = seq
        if self.sub.wants(etype, addr):
            self.enqueue(line())


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
    ) -> None:
        self.watcher = watcher
        self.path = os.fspath(path)
        self.policy = AccessPolicy(read_gid=read_gid, switch_gid=switch_gid,
                                   owner_uid=os.geteuid())
        self.log_path = log_path if log_path not in (None, "-") else None
        self.metrics = metrics
        self.outbox_limit = outbox_limit
        self.max_clients = max_clients
        self.max_per_uid = max_per_uid
        self.root_reserve = min(root_reserve, max_clients)
        self.max_line = max_line
        self.stall_timeout = stall_timeout
        self._per_uid: dict[int, int] = {}
        self._unprivileged = 0
        self.ops = ops if ops is not None else default_ops()
        self.connections: set[Connection] = set()
        self._subscribers: list[Connection] = []
        self._ident: tuple[int, int] | None = None
        self.lag_drops = 0

    # ------------------------------------------------------------------ lifecycle

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Bind, report started, accept until cancelled; the socket file is removed at the end."""
        _raise_fd_limit(self.max_clients + 256)
        lsock = bind_socket(self.path, self.policy.read_gid if self.policy.read_gid is not None
                            else (0 if os.geteuid() == 0 else None))
        st = os.stat(self.path)
        self._ident = (st.st_dev, st.st_ino)
        self.watcher.batch_listeners.append(self._on_batch)
        try:
            async with anyio.create_task_group() as tg:
                task_status.started()
                await self._accept_loop(lsock, tg)
        finally:
            if self._on_batch in self.watcher.batch_listeners:
                self.watcher.batch_listeners.remove(self._on_batch)
            with contextlib.suppress(RuntimeError):
                anyio.notify_closing(lsock)
            lsock.close()
            self._unlink()

    def _unlink(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError:
            return
        if (st.st_dev, st.st_ino) == self._ident:  # never remove a successor's socket
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    async def _accept_loop(self, lsock: socket.socket, tg: anyio.abc.TaskGroup) -> None:
        while True:
            await anyio.wait_readable(lsock)
            while True:
                try:
                    csock, _ = lsock.accept()
                except BlockingIOError:
                    break
                except OSError as exc:
                    if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                        _log.warning("cannot accept a client: %s", exc.strerror)
                        await anyio.sleep(0.1)
                        break
                    if exc.errno in (errno.ECONNABORTED, errno.EINTR):
                        continue
                    raise
                csock.setblocking(False)
                tg.start_soon(self._handle, csock)

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

    def _track(self, peer: PeerCred, delta: int) -> None:
        if self.policy.privileged(peer):
            return
        count = self._per_uid.get(peer.uid, 0) + delta
        if count > 0:
            self._per_uid[peer.uid] = count
        else:
            self._per_uid.pop(peer.uid, None)
        self._unprivileged += delta

    async def _handle(self, sock: socket.socket) -> None:
        try:
            peer = peer_credentials(sock)
        except OSError:
            sock.close()
            return
        refusal = self._admit(peer)
        if refusal is not None:
            code, message = refusal
            _log.warning("refusing %s: %s", peer.describe(), message)
            self._count("?", code)
            with contextlib.suppress(OSError):
                sock.send(P.encode_error(None, code, message))
                sock.shutdown(socket.SHUT_WR)
            sock.close()
            return
        conn = Connection(self, sock, peer)
        self.connections.add(conn)
        self._track(peer, +1)
        if self.metrics is not None:
            self.metrics.clients.set(len(self.connections))
        try:
            with conn.scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(conn.writer)
                    ended_by_peer = await self._reader(conn)
                    with anyio.move_on_after(_FLUSH_AFTER_EOF if ended_by_peer
                                             else _FLUSH_BEFORE_CLOSE):
                        await conn.flushed()
                    if ended_by_peer and conn.sub is not None:
                        await self._await_hangup(conn)
                    tg.cancel_scope.cancel()
        finally:
            conn.closed = True
            self.connections.discard(conn)
            self._track(peer, -1)
            if conn in self._subscribers:
                self._subscribers.remove(conn)
            if self.metrics is not None:
                self.metrics.clients.set(len(self.connections))
            with contextlib.suppress(RuntimeError):
                anyio.notify_closing(sock)
            sock.close()

    async def _await_hangup(self, conn: Connection) -> None:
        """A subscriber that sent EOF may still read: stream on until it hangs up."""
        poller = select.poll()
        poller.register(conn.sock, select.POLLHUP | select.POLLERR)
        while not conn.closed:
            if poller.poll(0):
                return
            await anyio.sleep(_HUP_POLL)

    async def _reader(self, conn: Connection) -> bool:
        """Read lines; each complete line is one request, answered in order.

        True when the peer ended (EOF); False when the connection is being closed for
        cause: a line over ``max_line`` bytes, or a partial line that stalled for
        ``stall_timeout`` seconds. At most ``max_line`` bytes of a request are ever held.
        """
        sock = conn.sock
        buf = bytearray()
        deadline = 0.0  # when the partial line in buf must be complete
        while not conn.closed:
            if buf:
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
            if not chunk:
                if buf:
                    await self._line(conn, bytes(buf))  # a last request without newline
                return True
            start = 0
            while True:
                cut = chunk.find(b"\n", start)
                if cut < 0:
                    break
                if len(buf) + cut - start > self.max_line:
                    self._too_long(conn)
                    return False
                line = bytes(buf) + chunk[start:cut] if buf else chunk[start:cut]
                if start:
                    # One busy client must not starve the rest: yield between the lines of
                    # one chunk (the first one already waited for its chunk to arrive).
                    await anyio.lowlevel.checkpoint()
                start = cut + 1
                buf.clear()
                await self._line(conn, line)
                if conn.closed:
                    return True
            if len(buf) + len(chunk) - start > self.max_line:
                self._too_long(conn)
                return False
            if start < len(chunk):
                if not buf:
                    deadline = anyio.current_time() + self.stall_timeout
                buf += chunk[start:]
        return True

    def _refuse_line(self, conn: Connection, code: str, message: str) -> None:
        """One error line; the connection is then flushed (briefly) and closed."""
        _log.warning("closing %s: %s", conn.peer.describe(), message)
        conn.enqueue(P.encode_error(None, code, message))
        self._count("?", code)

    def _too_long(self, conn: Connection) -> None:
        self._refuse_line(conn, P.REQUEST_TOO_LARGE,
                          f"request line longer than {self.max_line} bytes")

    async def _line(self, conn: Connection, line: bytes) -> None:
        if not line.strip():
            return  # blank lines are spacing (a shell's trailing newline)
        try:
            req = P.parse_request(line)
        except P.RequestError as exc:
            conn.enqueue(P.encode_error(exc.rid, exc.code, exc.message))
            self._count("?", exc.code)
            return
        if not self.policy.allows(req.method, conn.peer):
            message = self.policy.refusal(req.method, conn.peer)
            _log.warning("refused %s for %s", req.method, conn.peer.describe())
            conn.enqueue(P.encode_error(req.id, P.PERMISSION_DENIED, message))
            self._count(req.method, P.PERMISSION_DENIED)
            return
        try:
            if req.method == "subscribe":
                await self._subscribe(conn, req)
                self._count(req.method, "ok")
                return
            result = await self._call(conn, req)
        except P.RpcError as exc:
            conn.enqueue(P.encode_error(req.id, exc.code, exc.message))
            self._count(req.method, exc.code)
            return
        except Exception as exc:
            _log.exception("%s failed for %s", req.method, conn.peer.describe())
            conn.enqueue(P.encode_error(req.id, P.INTERNAL, f"{type(exc).__name__}: {exc}"))
            self._count(req.method, P.INTERNAL)
            return
        try:
            data = P.encode_result(req.id, result)
        except Exception as exc:  # an op returned something JSON cannot carry
            data = P.encode_error(req.id, P.INTERNAL, f"unserialisable result: {exc}")
        conn.enqueue(data)
        self._count(req.method, "ok")

    def _count(self, method: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels(method=method, outcome=outcome).inc()

    # ------------------------------------------------------------------ methods

    async def _call(self, conn: Connection, req: P.Request) -> Any:
        params = P.Params(req.method, req.params)
        if req.method == "probe":
            return await self._probe(conn, params)
        if req.method == "snapshot":
            params.done()
            return self.watcher.snapshot()
        handler = self.ops.get(req.method)
        if handler is None:
            raise P.RpcError(P.UNAVAILABLE, f"{req.method} is not available in this daemon")
        if req.method == "switch":
            # A switch half done is worse than one the client stopped waiting for: finish it.
            with anyio.CancelScope(shield=True):
                return await handler(self.watcher, params, conn.peer)
        return await handler(self.watcher, params, conn.peer)

    async def _probe(self, conn: Connection, params: P.Params) -> Any:
        action = params.req_str("action")
        group = params.opt_int("group")
        addr = params.opt_str("addr")
        mode = params.opt_str("mode")
        vendor = params.opt_str("vendor")
        params.done()
        try:
            check_params(action, group, addr, mode, vendor)
            if self.metrics is not None:  # after the check: labels only for real actions
                self.metrics.probe_calls.labels(action=action).inc()
            # The contract answers for the asking process: answer for the peer, not for us.
            if action == "vfio-group-accessible":
                assert group is not None
                node = self.watcher.model.state.nodes.get(f"/dev/vfio/{group}")
                return group >= 0 and node is not None and may_read_write(
                    node, conn.peer.uid, conn.peer.groups)
            if action == "memlock":
                limit = peer_memlock(conn.peer.pid)
                if limit is None:
                    raise P.RpcError(P.UNAVAILABLE, f"cannot read the memlock limit of pid "
                                                    f"{conn.peer.pid}")
                return limit
            # Live answers read /proc: off the event loop, bounded.
            if action in ("nvidia-holders", "wedge-detected"):
                model = self.watcher.model
                return await host_ops.bounded(lambda: model.probe(action), action)
            if action == "plan":
                return await host_ops.plan_probe(self.watcher, mode, addr, vendor)
            if vendor is not None:
                return self.watcher.model.probe(action, group=group, addr=addr, mode=mode,
                                                vendor=vendor)
            return self.watcher.probe(action, group=group, addr=addr, mode=mode)
        except P.RpcError:
            raise
        except Exception as exc:
            raise host_ops.error_for(exc) from None

    async def _subscribe(self, conn: Connection, req: P.Request) -> None:
        params = P.Params(req.method, req.params)
        types = params.opt_str_list("types")
        addrs = params.opt_str_list("addrs")
        since_seq = params.opt_int("since_seq")
        params.done()
        if conn.sub is not None:
            raise P.RpcError(P.ALREADY_SUBSCRIBED, "this connection is already subscribed; "
                                                   "open another one for another filter")
        if types is not None:
            unknown = sorted(set(types) - EVENT_TYPES)
            if unknown:
                raise P.RpcError(P.INVALID_PARAMS, f"subscribe: unknown event type "
                                                   f"{unknown[0]!r} (known: "
                                                   f"{', '.join(sorted(EVENT_TYPES))})")
        if since_seq is not None and since_seq < 0:
            raise P.RpcError(P.INVALID_PARAMS, "subscribe: 'since_seq' must be >= 0")
        sub = _Subscription(frozenset(types) if types is not None else None,
                            frozenset(a.lower() for a in addrs) if addrs is not None else None)
        now = self.watcher.seq
        conn.sub = sub
        conn.last_seq = now
        complete = True
        history: Iterator[RawChunk] | None = None
        raw: Iterator[RawChunk] | None = None
        if since_seq is not None and since_seq < now:
            # Live events are held from here on; the log covers (since_seq, now] and more.
            conn.replaying = True
            conn.last_seq = since_seq
            raw = self._history(since_seq, sub)
            first = next(raw, None)
            complete = first_is_next(None if first is None else first.first, since_seq)
            history = _chain(first, raw) if first is not None else raw
        elif since_seq is not None and since_seq > now:
            complete = False  # a seq from another log: what the client missed is unknown
        self._subscribers.append(conn)
        conn.enqueue(P.encode_result(req.id, {"seq": now, "complete": complete}))
        if history is None:
            return
        # The same hand-over as in-process subscriptions (gpuwatch.watch.subscription): the
        # log's lines after since_seq, then what was held live, each seq once.
        handover = Handover(since_seq if since_seq is not None else now)
        try:
            # One chunk (one read of at most 16 KiB, sent as stored) per trip round the loop:
            # a replay of a huge log never holds up other clients' requests.
            for chunk in history:
                if conn.closed:
                    return
                if handover.fresh(chunk.last):
                    conn.last_seq = chunk.last
                    if chunk.data:
                        await conn.paced(chunk.data)
                await anyio.lowlevel.checkpoint()
            for seq, _etype, _addr, data in conn.held:
                if handover.fresh(seq):
                    conn.last_seq = seq
                    await conn.paced(data)
            conn.last_seq = max(conn.last_seq, conn.held_seq)
        finally:
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
        return read_chunks(self.log_path, since_seq=since_seq, wants=wants)

    # ------------------------------------------------------------------ fan-out

    def _on_batch(self, events: Sequence[BaseModel], lines: Sequence[str]) -> None:
        """Watcher batch listener: the lines the watcher serialised, one outbox append (one
        ``send``) per subscriber per batch, never waiting. Never raises either: an exception
        here would stop the watcher's publishing."""
        if not self._subscribers:
            return
        try:
            self._fan_out(events, lines)
        except Exception:
            _log.exception("socket fan-out of %d event(s) failed", len(events))

    def _fan_out(self, events: Sequence[BaseModel], lines: Sequence[str]) -> None:
        batch = _Batch(events, lines)
        for conn in tuple(self._subscribers):
            conn.offer_batch(batch)

    def _lag_drop(self, conn: Connection) -> None:
        self.lag_drops += 1
        if self.metrics is not None:
            self.metrics.lag_drops.inc()
        if conn in self._subscribers:
            self._subscribers.remove(conn)


def _raise_fd_limit(wanted: int) -> None:
    """Lift the soft RLIMIT_NOFILE towards ``wanted`` (within the hard limit), as systemd
    expects of a daemon: the default soft 1024 is less than the clients it may serve."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _chain(first: RawChunk, rest: Iterator[RawChunk]) -> Iterator[RawChunk]:
    yield first
    yield from rest


__all__ = [
    "DEFAULT_MAX_CLIENTS",
    "DEFAULT_OUTBOX_LIMIT",
    "Connection",
    "SocketInUse",
    "SocketServer",
    "SocketSetupError",
    "bind_socket",
]
