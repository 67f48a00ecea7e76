"""The live watcher: a source of uevents keeps a `HostModel` current and publishes its changes.

One task pumps the source: each drained batch is read from the tree (only the devices it
names), folded into the pure model, and the resulting events are stamped, logged and fanned
out to subscribers without ever waiting on them. Overflow and the periodic reconcile go
through the same path with a full rescan in a worker thread, under the same lock, so a stale
scan can never overwrite a newer event.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypedDict, TypeVar, overload

import anyio
from anyio.abc import TaskGroup
from pydantic import BaseModel

from gpuwatch.core.events import (
    EVENT_TYPES,
    LogDegraded,
    LogGap,
    Ready,
    Resync,
    Stopped,
    event_json,
    format_event_time,
    stamp,
)
from gpuwatch.core.limits import MAX_LOG_KEEP
from gpuwatch.core.observations import NodeSeen, Observation, Snapshot
from gpuwatch.core.pci import parse_addr
from gpuwatch.core.state import HostState
from gpuwatch.core.tables import Tables
from gpuwatch.core.uevent import UEvent
from gpuwatch.core.uevent_facts import batch_facts
from gpuwatch.errors import CallerError, UsageError
from gpuwatch.hostfs.scan import (
    HostPaths,
    node_stat,
    observe_batch,
    read_cdi,
    read_iommu,
    read_kfd,
    read_vgpus,
    scan,
)
from gpuwatch.model import HostModel
from gpuwatch.settings import (
    ConfigInForce,
    host_namespaces_in_force,
    proc_read_timeout_in_force,
    read_once,
    root_in_force,
    tables_in_force,
)
from gpuwatch.sources import EventSource, SourceOverflow, open_source
from gpuwatch.sources.turns import end_turn
from gpuwatch.watch.eventlog import EventLog, EventLogWriteError, EventRecord, read_records
from gpuwatch.watch.handover import first_is_next, gap_span
from gpuwatch.watch.overflow import OverflowGate
from gpuwatch.watch.subscription import Subscription

if TYPE_CHECKING:
    from gpuwatch.core.probes import BoolAction, TextAction
    from gpuwatch.core.results import (
        DetectVfioResult,
        Holder,
        HostDevicesResult,
        MemlockResult,
        VfioBackend,
    )

_log = logging.getLogger("gpuwatch.watch")

DEFAULT_RECONCILE_INTERVAL = 300.0
DEFAULT_CDI_POLL_INTERVAL = 0.5
DEFAULT_VGPU_POLL_INTERVAL = 1.0
#: How often the VFIO group nodes' owner, mode and ACL are looked at again: a chown, chmod
#: or setfacl sends no uevent (udev's own, after the kernel's ``add``; libvirt's and
#: KubeVirt's for a VM's user), and ``vfio-group-accessible`` is answered from them.
DEFAULT_VFIO_NODE_POLL_INTERVAL = 1.0
DEFAULT_SUBSCRIBER_BUFFER = 4096
#: Events applied between two chances for other tasks to run (requests, subscribers).
PUMP_SLICE = 64
#: Actions after which only a function's driver link can have changed (see `observe`).
_DRIVER_ACTIONS = frozenset(("bind", "unbind"))
#: A failed log write is retried after 1 s, doubling up to a minute, with the next event.
LOG_RETRY_FIRST = 1.0
#: The ``error`` of a ``log-gap`` record naming seqs an earlier run published and could not
#: write before it stopped (`EventLog.unwritten`).
UNWRITTEN_BY_EARLIER_RUN = "not written before the previous run stopped"
LOG_RETRY_MAX = 60.0
#: The reasons a `resync` event may give.
RESYNC_REASONS = ("overflow", "reconcile")

_P = ParamSpec("_P")
_T = TypeVar("_T")


class WatcherClosed(CallerError, anyio.EndOfStream):
    """The watcher closed (its context was left) before the awaited event came.

    Also an ``anyio.EndOfStream``, which is what `Watcher.wait_for` raised before it had
    a name of its own.
    """


class _EnteredOnce(AbstractAsyncContextManager[_T]):
    """An async context manager that says, in words, that it can be entered only once
    (a spent ``asynccontextmanager`` otherwise fails with an unrelated AttributeError)."""

    __slots__ = ("_cm", "_entered", "_what")

    def __init__(self, cm: AbstractAsyncContextManager[_T], what: str) -> None:
        self._cm = cm
        self._what = what
        self._entered = False

    async def __aenter__(self) -> _T:
        if self._entered:
            raise UsageError(f"{self._what}(...) can be entered once: call {self._what}(...) "
                             "again for another")
        self._entered = True
        return await self._cm.__aenter__()

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> bool | None:
        return await self._cm.__aexit__(exc_type, exc, tb)


def entered_once(
    fn: Callable[_P, AbstractAsyncContextManager[_T]],
) -> Callable[_P, AbstractAsyncContextManager[_T]]:
    """Make each context manager ``fn`` returns refuse a second ``async with`` clearly."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> AbstractAsyncContextManager[_T]:
        return _EnteredOnce(fn(*args, **kwargs), fn.__name__)

    return wrapper


def _led_by(first: EventRecord, records: Generator[EventRecord, None, None],
            ) -> Generator[EventRecord, None, None]:
    """``first`` then the rest of ``records``, as a generator whose ``close`` closes
    ``records`` however far it got (a subscriber that leaves mid-replay releases the log's
    files then; `itertools.chain` has no ``close``, so they waited for the collector)."""
    try:
        yield first
        yield from records
    finally:
        records.close()


def event_filters(types: Iterable[str] | None, addrs: Iterable[str] | None,
                  ) -> tuple[frozenset[str] | None, frozenset[str] | None]:
    """The ``types``/``addrs`` of a subscription, checked the way the socket checks them:
    an unknown type is an error (it would match nothing, silently), and an address is
    spelled the way events spell it (``0000:0a:00.0`` for ``00000000:0A:00.0``)."""
    for name, value in (("types", types), ("addrs", addrs)):
        if isinstance(value, str | bytes):
            raise UsageError(f"{name} is a collection of names, not one string: "
                             f"{name}={{{value!r}}}")
    type_set = frozenset(types) if types is not None else None
    if type_set is not None:
        unknown = sorted(map(str, type_set - EVENT_TYPES))
        if unknown:
            raise UsageError(f"unknown event type {unknown[0]!r} "
                             f"(known: {', '.join(sorted(EVENT_TYPES))})")
    addr_set = frozenset(parse_addr(a) for a in addrs) if addrs is not None else None
    return type_set, addr_set


class HostSnapshot(BaseModel):
    """A consistent copy of the model at one ``seq``: what a lagged subscriber restarts from."""

    seq: int
    source: str
    functions: list[Any]
    nodes: list[str]
    probes: dict[str, Any]


class Watcher:
    """A running watcher. Get one from `open_watcher`; every method answers from memory."""

    def __init__(
        self,
        model: HostModel,
        source: EventSource,
        *,
        log: EventLog | None,
        reconcile_interval: float,
        cdi_poll_interval: float,
        subscriber_buffer: int,
        vgpu_poll_interval: float = DEFAULT_VGPU_POLL_INTERVAL,
        vfio_node_poll_interval: float = DEFAULT_VFIO_NODE_POLL_INTERVAL,
    ) -> None:
        self.model = model
        self._vgpu_poll_interval = vgpu_poll_interval
        self._vfio_node_poll_interval = vfio_node_poll_interval
        self.source = source
        self._log = log
        self._reconcile_interval = reconcile_interval
        self._cdi_poll_interval = cdi_poll_interval
        self._subscriber_buffer = subscriber_buffer
        self._subscribers: list[Subscription] = []
        self._seq = (log.last_seq or 0) if log is not None else 0
        self._lock = anyio.Lock()
        self._closed = False
        #: The thread whose event loop runs this watcher: its awaitables belong there.
        self._thread = threading.get_ident()
        self._stopped = False
        self._stop_reason: str | None = None
        #: Set by the composition (`gpuwatch.host`): "is work under way that `stopped` must
        #: follow?" (an interrupted switch putting its group back).
        self.stop_waits_for: Callable[[], bool] | None = None
        #: Called once ``ready`` is published (the switch engine's report of switches whose
        #: process died half-way: their ends follow ``ready`` in the log).
        self.after_ready: Callable[[], None] | None = None
        self.source_ended = anyio.Event()
        self.resyncs = 0
        #: Times the source lost uevents (each one a rescan, or a share of one: see
        #: `OverflowGate`).
        self.uevent_losses = 0
        self._overflows = OverflowGate()
        self._overflow_held = anyio.Event()
        #: Observers called with every stamped event (metrics, NFD).
        self.listeners: list[Callable[[BaseModel], None]] = []
        #: Observers called once per published batch with the stamped events and their JSON
        #: lines, serialised once for the log and every reader (the socket server).
        self.batch_listeners: list[Callable[[Sequence[BaseModel], Sequence[str]], None]] = []
        self._announced = anyio.Event()
        # Event log health: the unwritten seq range and when to try again. A range an
        # earlier run published and never wrote (its disk full when it stopped) is named by
        # this run's first write.
        self._gap: tuple[int, int] | None = log.unwritten if log is not None else None
        self._log_retry_at = 0.0
        self._log_backoff = LOG_RETRY_FIRST
        self.log_write_failures = 0
        self._log_error = ""
        #: This run said the log is failing (log-degraded, one error line): apart from
        #: ``_gap``, which a restart on a still-full disk inherits before any write failed.
        self._degraded_told = False

    @property
    def announced(self) -> bool:
        """Whether ``ready`` has been published."""
        return self._announced.is_set()

    @property
    def log_degraded(self) -> str | None:
        """Why the event log is not being written (None: it is)."""
        return self._log_error if self._gap is not None and self._log_error else None

    @property
    def replay_log_path(self) -> str | None:
        """The log's path when history can be replayed from its files (None: no log, or one
        written to stdout, a FIFO or a device, which cannot be read back)."""
        log = self._log
        return log.path if log is not None and log.replayable else None

    # ------------------------------------------------------------------ reading

    @property
    def paths(self) -> HostPaths:
        return self.model.paths

    @property
    def tables(self) -> Tables:
        return self.model.tables

    @property
    def seq(self) -> int:
        """The seq of the last event published."""
        return self._seq

    @overload
    def probe(self, action: Literal["detect-vfio"], *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> DetectVfioResult: ...
    @overload
    def probe(self, action: BoolAction, *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> bool: ...
    @overload
    def probe(self, action: TextAction, *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> str: ...
    @overload
    def probe(self, action: Literal["detect-host-devices"], *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> HostDevicesResult: ...
    @overload
    def probe(self, action: Literal["memlock"], *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> MemlockResult: ...
    @overload
    def probe(self, action: Literal["nvidia-holders"], *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> tuple[Holder, ...]: ...
    @overload
    def probe(self, action: Literal["vfio-backend"], *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> VfioBackend: ...
    @overload
    def probe(self, action: Literal["plan"], *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> list[dict[str, Any]]: ...
    @overload
    def probe(self, action: str, *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> Any: ...
    def probe(
        self,
        action: str,
        *,
        group: int | None = None,
        addr: str | None = None,
        mode: str | None = None,
        vendor: str | None = None,
    ) -> Any:
        """Answer a probe action from memory, typed per action (`HostModel.probe`)."""
        return self.model.probe(action, group=group, addr=addr, mode=mode, vendor=vendor)

    def snapshot(self) -> HostSnapshot:
        """The model at one ``seq``, from any thread: a batch is applied and numbered as one
        change (`HostModel.consistent`), so a snapshot never mixes two batches."""
        return self.model.consistent(self._snapshot_now)

    def _snapshot_now(self) -> HostSnapshot:
        model = self.model
        state = model.state
        return HostSnapshot(
            seq=self._seq,
            source=self.source.name,
            functions=model._functions_now(),
            nodes=sorted(state.nodes),
            probes={a: state.answer(a) for a in state._answers},
        )

    def check_open(self) -> None:
        """Refuse work that needs the live watcher once it has closed: a switch would write
        to the host with nobody watching for the drivers it waits on."""
        self.check_thread()
        if self._closed:
            raise WatcherClosed("this watcher is closed (its context was left): open another")

    def check_thread(self) -> None:
        """Refuse a call from another thread's event loop: the watcher's locks, streams and
        tasks belong to the loop that opened it (on trio such a call would kill the pump;
        on asyncio it races it)."""
        if threading.get_ident() != self._thread:
            raise UsageError(
                "this watcher belongs to the event loop of the thread that opened it: call "
                "it there (from a worker thread of that loop, through anyio.from_thread.run)")

    # ------------------------------------------------------------------ subscribing

    @entered_once
    @asynccontextmanager
    async def subscribe(
        self,
        types: Iterable[str] | None = None,
        addrs: Iterable[str] | None = None,
        *,
        since_seq: int | None = None,
        buffer: int | None = None,
    ) -> AsyncIterator[Subscription]:
        """Events from now on, filtered; with ``since_seq``, first every logged event after
        it (no gap, no duplicate at the hand-over; ``complete`` says whether the log still
        held them all). A reader that falls ``buffer`` behind gets `SubscriberLagged`
        instead of slowing anyone else down. On a closed watcher: `WatcherClosed` (no
        event could ever come; an empty stream would look like a quiet host)."""
        self.check_open()
        if since_seq is not None and since_seq < 0:
            raise UsageError(f"since_seq must be >= 0, not {since_seq}")
        if buffer is not None and buffer < 1:
            raise UsageError(f"buffer must be >= 1, not {buffer}")
        type_set, addr_set = event_filters(types, addrs)
        sub = Subscription(
            type_set, addr_set, self._subscriber_buffer if buffer is None else buffer
        )
        self._subscribers.append(sub)  # live from here: every seq after `now`
        now = self._seq
        try:
            if since_seq is not None and since_seq < now:
                await self._start_replay(sub, since_seq, now)
            elif since_seq is not None and since_seq > now:
                sub.complete = False  # a seq from another log: what was missed is unknown
            yield sub
        finally:
            sub.dispose()
            if sub in self._subscribers:
                self._subscribers.remove(sub)

    async def _start_replay(self, sub: Subscription, since_seq: int, now: int) -> None:
        path = self.replay_log_path
        if path is None:
            sub.complete = False  # no log to replay from (none, stdout, a FIFO, a device)
            return
        # Every record, not only the wanted types: a seq jump between two of them is a hole
        # in the log (`Subscription.start_replay`), which a filter would hide.
        records = read_records(path, since_seq=since_seq)
        try:
            first = await anyio.to_thread.run_sync(next, records, None)
        except BaseException:
            records.close()  # cancelled or failed: release the files now, not at collection
            raise
        if first is None:
            sub.complete = False
            return
        sub.start_replay(_led_by(first, records), since_seq, now,
                         first_is_next(first.event["seq"], since_seq,
                                       gap=gap_span(first.event) is not None))

    async def wait_for(
        self,
        predicate: Callable[[Any], bool],
        timeout: float | None = None,
        *,
        types: Iterable[str] | None = None,
    ) -> Any:
        """The first future event ``predicate`` accepts; `TimeoutError` after ``timeout``,
        `WatcherClosed` when the watcher closes first."""
        with anyio.fail_after(timeout):
            async with self.subscribe(types=types) as sub:
                async for event in sub:
                    if predicate(event):
                        return event
        raise WatcherClosed("the watcher closed before the event came")

    # ------------------------------------------------------------------ publishing

    def publish(self, events: Sequence[BaseModel]) -> None:
        """Stamp, log and fan out. Never awaits: a slow reader cannot hold up the model."""
        if not events:
            return
        self._number(events)
        self._deliver(events)

    def _number(self, events: Sequence[BaseModel]) -> None:
        """Stamp the events with the next seqs (under the model's lock, with the batch that
        made them, inside `HostModel.begin_change`: `snapshot` pairs a state with its seq)."""
        stamp(events, self._seq + 1, format_event_time())
        self._seq += len(events)

    def _deliver(self, events: Sequence[BaseModel]) -> None:
        """Log and fan out numbered events, outside the model's lock (a log write may be
        slow; a reader in another thread need not wait for it)."""
        lines: Sequence[str] = ()
        if self._log is not None or self.batch_listeners:  # serialised once, for everyone
            lines = [event_json(event) for event in events]
        degraded_now = self._log is not None and self._write_log(events, lines)
        for batch_listener in tuple(self.batch_listeners):
            batch_listener(events, lines)
        for listener in self.listeners:
            for event in events:
                listener(event)
        for sub in tuple(self._subscribers):
            sub.offer_batch(events)
        if degraded_now:
            assert self._log is not None
            self.publish([LogDegraded(path=self._log.path, error=self._log_error)])

    def _write_log(self, events: Sequence[BaseModel], lines: Sequence[str]) -> bool:
        """On disk before anyone hears of it, or, on a full or failing disk, not at all:
        the daemon goes on, the range is remembered, and a write is tried again (with the
        next event, after a backoff) led by a ``log-gap`` record naming what is missing.
        True when this batch is the one that found the log failing."""
        assert self._log is not None
        first = int(getattr(events[0], "seq", 0))
        last = int(getattr(events[-1], "seq", 0))
        if self._gap is not None and time.monotonic() < self._log_retry_at:
            self._gap = (self._gap[0], last)
            self._log.hold_seq(last)  # a restart numbers after it, whatever the disk says
            return False
        told = False  # whether a log-gap record leads the lines
        if self._gap is not None and self._gap[0] < first:
            gap = LogGap(first_seq=self._gap[0], last_seq=first - 1,
                         error=self._log_error or UNWRITTEN_BY_EARLIER_RUN,
                         seq=first - 1, time=getattr(events[0], "time", ""))
            lines = [gap.model_dump_json(), *lines]
            told = True
        try:
            self._log.write_lines(lines)
        except EventLogWriteError as exc:
            self.log_write_failures += 1
            fresh = not self._degraded_told
            # Whole lines may have landed before the disk filled: the gap starts after them
            # (a log-gap record that landed has named the earlier range).
            written = exc.lines_written
            if told and written:
                self._gap, written = None, written - 1
            start = first + written
            self._log_error = exc.strerror or str(exc)
            self._log_retry_at = time.monotonic() + self._log_backoff
            self._log_backoff = min(self._log_backoff * 2, LOG_RETRY_MAX)
            if start <= last:
                self._gap = (start, last) if self._gap is None else (self._gap[0], last)
                self._log.hold_seq(last)
            if fresh:
                self._degraded_told = True
                _log.error("event log %s: %s; events go on, the log resumes when it can",
                           self._log.path, self._log_error)
            return fresh and self._gap is not None
        if self._gap is not None:
            _log.warning("event log %s resumed; seqs %d..%d are not in it", self._log.path,
                         self._gap[0], first - 1)
        self._gap = None
        self._degraded_told = False
        self._log_backoff = LOG_RETRY_FIRST
        return False

    def apply(self, observations: Sequence[Observation]) -> list[BaseModel]:
        """Fold observations into the model and publish what changed, with what they change
        in the tree that sends no uevent (`HostState.rereads`): the KFD topology after a bind
        or unbind by amdgpu, the IOMMU groups after a function gains or loses one (or a
        mediated device's group node comes or goes where it can change them)."""
        state = self.model.state
        rereads = state.rereads(observations)
        if rereads.kfd or rereads.iommu:
            observations = list(observations)
            if rereads.kfd:
                observations.append(read_kfd(self.paths))
            if rereads.iommu:
                observations.append(read_iommu(self.paths))
        model = self.model
        model.begin_change()  # once a batch, not an event: a storm costs what it did
        try:
            events = state.apply(observations)
            if events:
                self._number(events)
        finally:
            model.end_change()
        if events:
            self._deliver(events)
        return events

    async def refresh(self, observations: Sequence[Observation]) -> None:
        """`apply` under the pump's lock: for observations read outside the pump (the switch
        re-reading the tree), so they cannot interleave with a batch or a rescan."""
        self.check_thread()
        async with self._lock:
            self.apply(observations)

    async def resync(self, reason: str) -> int:
        """Rescan everything (in a thread), diff against the model, publish the drift and a
        ``resync`` event. Returns how many change events the diff produced."""
        self.check_open()
        if reason not in RESYNC_REASONS:
            raise UsageError(f"resync reason must be one of {', '.join(RESYNC_REASONS)}, "
                             f"not {reason!r}")
        async with self._lock:
            seen = await _scan_in_thread(self.paths, self.tables)
            model = self.model
            model.begin_change()
            try:
                events = model.state.apply_snapshot(seen)
                if events:
                    self._number(events)
            finally:
                model.end_change()
            del seen  # not held while the events are delivered
            if events:
                self._deliver(events)
            self.resyncs += 1
            self.publish([Resync(reason=reason, changes=len(events))])
        if events and reason != "overflow":  # an overflow's rescan says it in its own line
            _log.warning("resync (%s): %d change(s) found", reason, len(events))
        return len(events)

    # ------------------------------------------------------------------ tasks

    def announce_ready(self) -> None:
        """Publish ``ready`` and start applying uevents (queued in the source meanwhile).
        `open_watcher` does it before its body unless ``announce=False``: a daemon first
        binds its listeners, so ``ready`` is never a promise it cannot keep."""
        if self._announced.is_set() or self._stopped:
            return  # a stop that came first (a signal during start-up) ends the run unannounced
        self.publish([Ready(devices=len(self.model.state.functions), source=self.source.name)])
        self._announced.set()
        if self.after_ready is not None:
            self.after_ready()

    def stop(self, reason: str) -> None:
        """Publish the ``stopped`` record (once): the last line of this run's log.

        While `stop_waits_for` says work is under way (a switch winding down after the same
        signal), the record waits for `finish_stop`, so the switch's own end comes before it.
        """
        if self._stopped:
            return
        self._stopped = True
        if self.stop_waits_for is not None and self.stop_waits_for():
            self._stop_reason = reason
            return
        self._publish_stopped(reason)

    def finish_stop(self) -> None:
        """Publish a ``stopped`` record that `stop` held back (once; nothing if none was)."""
        reason, self._stop_reason = self._stop_reason, None
        if reason is not None and not self._closed:
            self._publish_stopped(reason)

    def _publish_stopped(self, reason: str) -> None:
        """``stopped``, with one last try of a degraded log whatever its backoff says (the
        ``log-gap`` record, then ``stopped``); what still does not reach it is said on
        stderr, and its last seq stays in ``PATH.lock`` for the next run to number after,
        when the lock file can keep it (one made on a full disk, or none, cannot: then the
        line says a restart may reuse those seqs, not a promise the restart breaks)."""
        self._log_retry_at = 0.0
        self.publish([Stopped(reason=reason)])
        if self._gap is not None and self._log is not None:
            first, last = self._gap
            if self._log.hold_seq(last):
                after = f"a restart numbers after {last}"
            else:
                after = f"not kept: a restart may reuse {first}..{last}"
            _log.error("event log %s: %s; seqs %d..%d were published but never written to "
                       "it (%s)", self._log.path, self._log_error or UNWRITTEN_BY_EARLIER_RUN,
                       first, last, after)

    async def _pump(self) -> None:
        await self._announced.wait()
        batches = self.source.batches()
        try:
            async for batch in batches:
                if isinstance(batch, SourceOverflow):
                    if self._closed:  # as in _poll_vgpu: not a WatcherClosed out of the context
                        return
                    self.uevent_losses += 1
                    # The source's next batch, if any, holds the drained uevents whose facts
                    # no rescan sees: applied as usual (read, then their facts) after this
                    # rescan, or now if the rescan waits, in order either way.
                    if self._overflows.admit(anyio.current_time(), batch.error, batch.dropped,
                                             batch.unkept):
                        changes = await self._resync_overflow()
                        _log.warning("events lost (%s; %s): rescanned, %d change(s) found",
                                     batch.error, _dropped_text(batch.dropped, batch.unkept),
                                     changes)
                    else:  # one rescan covers every loss until it starts
                        self._overflow_held.set()
                    continue
                # A source may hand over a whole backlog at once: read each device it names once,
                # then apply in slices, letting socket requests and subscribers run between
                # them, so nobody waits for all of it.
                reads = self._collapse(batch)
                for start in range(0, max(1, len(reads)), PUMP_SLICE):
                    if start:
                        await end_turn()
                    async with self._lock:
                        observations = self._observe(reads[start : start + PUMP_SLICE])
                        if start + PUMP_SLICE >= len(reads):
                            # What only the uevents say (error recovery, wedges, fresh binds):
                            # every one, in the kernel's order, after the reads that brought
                            # their functions into the model.
                            observations.extend(batch_facts(batch))
                        self.apply(observations)
        finally:
            # Closed here, not left to the garbage collector: the pump is cancelled where it
            # waits for the lock or its turn as often as inside the source, and trio warns
            # of (and a strict embedder's warning filter fails on) an abandoned generator.
            try:
                aclose = getattr(batches, "aclose", None)
                if aclose is not None:
                    with anyio.CancelScope(shield=True):
                        await aclose()
            finally:
                self.source_ended.set()

    async def _resync_overflow(self) -> int:
        """The rescan after lost uevents, timed for `OverflowGate`'s schedule; how many
        changes it found."""
        gate = self._overflows
        gate.started()
        began = anyio.current_time()
        try:
            return await self.resync("overflow")
        finally:
            gate.finished(began, anyio.current_time())

    async def _resync_held_overflows(self) -> None:
        """One rescan, once the gap after the last is over, for every loss held meanwhile:
        a storm that overflows the buffer as fast as it is drained costs a rescan a gap."""
        gate = self._overflows
        while True:
            await self._overflow_held.wait()
            self._overflow_held = anyio.Event()
            while gate.held:
                await anyio.sleep_until(gate.due)
                if self._closed:
                    return
                losses, dropped, error, unkept = gate.take_held()
                changes = await self._resync_overflow()
                _log.warning("events lost %d more time(s) since the last rescan (last: %s; "
                             "%s): rescanned, %d change(s) found", losses, error,
                             _dropped_text(dropped, unkept), changes)

    @staticmethod
    def _collapse(batch: Sequence[UEvent]) -> list[UEvent]:
        """One uevent per device the batch names, however often it names it.

        The tree is read after the batch, so the last read is the only one that counts: a
        flapping link or a storm of a hundred events for one function costs one read. A
        bind/unbind-only read (`read_function_known`) is kept only when every event for the
        device was one; anything else makes it the full read.
        """
        last: dict[tuple[str, str, str], UEvent] = {}
        full: set[tuple[str, str, str]] = set()
        pop = last.pop
        for event in batch:
            action, devpath, subsystem, props = event
            key = (subsystem, devpath, props.get("DEVNAME", ""))
            if action not in _DRIVER_ACTIONS:
                full.add(key)
            pop(key, None)  # re-insert: dict order is then the order of last mention
            last[key] = event
        return [
            event._replace(action="change")
            if key in full and event.action in _DRIVER_ACTIONS else event
            for key, event in last.items()
        ]

    def _observe(self, reads: Sequence[UEvent]) -> list[Observation]:
        """Read the tree for each (already collapsed) uevent."""
        return observe_batch(self.paths, self.tables, reads, self.model.state.devpaths)

    async def _poll_cdi(self) -> None:
        # CDI specs are plain files: no uevent announces them, so look twice a second.
        await self._announced.wait()
        while True:
            await anyio.sleep(self._cdi_poll_interval)
            seen = read_cdi(self.paths)
            if seen != self.model.state.cdi:
                async with self._lock:
                    self.apply([seen])

    async def poll_vgpus(self) -> int:
        """Re-read the vGPU files of the functions that have them (no uevent announces a new
        ``current_vgpu_type``) and publish ``vgpu-changed`` for each that differs.

        Read under the pump's lock, as a rescan reads: a batch applied between the read and
        its apply (the VF unbound from nvidia, removed, or re-read with a newer type) would
        otherwise be overwritten with what the files said before it, a vGPU on a function
        that no longer has one, until the next poll."""
        self.check_open()
        async with self._lock:
            addrs = self.model.state.vgpu_addrs()
            if not addrs:
                return 0
            seen = await anyio.to_thread.run_sync(read_vgpus, self.paths, addrs)
            return len(self.apply([seen]))

    async def poll_vfio_nodes(self) -> int:
        """Stat the VFIO group nodes the model holds again and publish what changed in their
        owner, mode or ACL (which no uevent announces). Read under the pump's lock, on the
        loop (a stat and a getxattr each), so a node a uevent just removed is not put back;
        a node gone meanwhile is left to its ``remove`` uevent."""
        self.check_open()
        state = self.model.state
        async with self._lock:
            changed = []
            for path, old in state.vfio_group_nodes():
                new = node_stat(self.paths, path)
                if new is not None and new != old:
                    changed.append(NodeSeen(path, new))
            return len(self.apply(changed)) if changed else 0

    async def _poll_vfio_node(self) -> None:
        await self._announced.wait()
        while True:
            await anyio.sleep(self._vfio_node_poll_interval)
            if self._closed:  # as in _poll_vgpu
                return
            await self.poll_vfio_nodes()

    async def _poll_vgpu(self) -> None:
        while True:
            await anyio.sleep(self._vgpu_poll_interval)
            if self._closed:  # the sleep ended as the context was left: the cancel is next
                return
            await self.poll_vgpus()

    async def _reconcile(self) -> None:
        await self._announced.wait()
        while True:
            await anyio.sleep(self._reconcile_interval)
            if self._closed:  # as in _poll_vgpu: not a WatcherClosed out of the context
                return
            await self.resync("reconcile")

    def _start_tasks(self, tg: TaskGroup) -> None:
        tg.start_soon(self._pump, name="gpuwatch-pump")
        tg.start_soon(self._resync_held_overflows, name="gpuwatch-overflow")
        if self._cdi_poll_interval > 0:
            tg.start_soon(self._poll_cdi, name="gpuwatch-cdi")
        if self._reconcile_interval > 0:
            tg.start_soon(self._reconcile, name="gpuwatch-reconcile")
        if self._vgpu_poll_interval > 0:
            tg.start_soon(self._poll_vgpu, name="gpuwatch-vgpu")
        if self._vfio_node_poll_interval > 0:
            tg.start_soon(self._poll_vfio_node, name="gpuwatch-vfio-nodes")

    def _close(self) -> None:
        self._closed = True
        for sub in self._subscribers:
            sub.close()
        self._subscribers.clear()


class WatcherOptions(TypedDict, total=False):
    """The keywords of `open_watcher` past its root, source, config and log: what
    `gpuwatch.open_host` passes on (typed, so a misspelt one is a type error too)."""

    log_max_bytes: int | None
    log_keep: int
    reconcile_interval: float
    cdi_poll_interval: float
    subscriber_buffer: int
    receive_buffer: int | None
    vgpu_poll_interval: float
    vfio_node_poll_interval: float
    announce: bool
    host_namespaces: bool | None


@entered_once
@asynccontextmanager
async def open_watcher(
    root: str | os.PathLike[str] | None = None,
    source: str | EventSource = "auto",
    *,
    config: str | os.PathLike[str] | Tables | ConfigInForce | None = None,
    log: str | os.PathLike[str] | EventLog | None = None,
    log_max_bytes: int | None = None,
    log_keep: int = 5,
    reconcile_interval: float = DEFAULT_RECONCILE_INTERVAL,
    cdi_poll_interval: float = DEFAULT_CDI_POLL_INTERVAL,
    subscriber_buffer: int = DEFAULT_SUBSCRIBER_BUFFER,
    receive_buffer: int | None = None,
    vgpu_poll_interval: float = DEFAULT_VGPU_POLL_INTERVAL,
    vfio_node_poll_interval: float = DEFAULT_VFIO_NODE_POLL_INTERVAL,
    announce: bool = True,
    host_namespaces: bool | None = None,
) -> AsyncIterator[Watcher]:
    """Start watching ``root``; the body runs once the initial scan is done (``ready`` sent).

    The source is bound *before* the scan, so a change made while the scan runs arrives as
    an event afterwards rather than being lost between the two. With ``announce=False`` the
    body runs before ``ready``: it calls `Watcher.announce_ready` when it is ready to serve.
    ``host_namespaces`` (None: the setting in force, read from the environment and
    ``config``): ``nvidia-ctk`` for the CDI fact is looked for on the host's PATH, where the
    switch runs it.
    """
    # A source object handed in is the watcher's from here: closed on every way out, a
    # refused setting included, as it is when the body ends.
    src: EventSource | None = None if isinstance(source, str) else source
    event_log: EventLog | None = None
    try:
        _check_options(subscriber_buffer=subscriber_buffer, log_max_bytes=log_max_bytes,
                       log_keep=log_keep, reconcile_interval=reconcile_interval,
                       cdi_poll_interval=cdi_poll_interval,
                       vgpu_poll_interval=vgpu_poll_interval,
                       vfio_node_poll_interval=vfio_node_poll_interval)
        config = read_once(config)  # the file read once: its tables, root and timeout
        tables = tables_in_force(config)
        root = root_in_force(root, config)
        if host_namespaces is None:
            host_namespaces = host_namespaces_in_force(config)[0]
        if not os.path.isdir(root):  # a typo would otherwise watch an empty host, silently
            raise UsageError(f"root {root!r} is not a directory")
        if src is None:
            assert isinstance(source, str)
            src = open_source(source, root, receive_buffer=receive_buffer)
        event_log = (
            log
            if isinstance(log, EventLog) or log is None
            else EventLog(log, max_bytes=log_max_bytes, keep=log_keep)
        )
        src.start()
        for warning in src.warnings:
            _log.warning("%s", warning)
        paths = HostPaths(root, host_namespaces=host_namespaces)
        # Abandoned on cancel: SIGTERM during a long first scan stops now, not after it.
        # Not bound to a name: this frame lives as long as the watcher (it is suspended at
        # the `yield` below), and a name would hold the whole first scan for that long.
        model = HostModel(paths, HostState(
            tables, await _scan_in_thread(paths, tables, abandon_on_cancel=True)))
        model.proc_deadline = proc_read_timeout_in_force(config)
        watcher = Watcher(
            model,
            src,
            log=event_log,
            reconcile_interval=reconcile_interval,
            cdi_poll_interval=cdi_poll_interval,
            subscriber_buffer=subscriber_buffer,
            vgpu_poll_interval=vgpu_poll_interval,
            vfio_node_poll_interval=vfio_node_poll_interval,
        )
        if announce:
            watcher.announce_ready()
        try:
            async with anyio.create_task_group() as tg:
                watcher._start_tasks(tg)
                try:
                    yield watcher
                finally:
                    tg.cancel_scope.cancel()
                    watcher.finish_stop()  # held back for a switch that never ended: now
                    watcher._close()
        except BaseExceptionGroup as group:
            # The caller's own exception should reach them as itself, not wrapped by our tasks.
            if len(group.exceptions) == 1:
                reraise_alone(group.exceptions[0])
            raise
    finally:
        if src is not None:
            src.close()
        if event_log is not None and not isinstance(log, EventLog):
            event_log.close()


def _check_options(*, subscriber_buffer: int, log_max_bytes: int | None, log_keep: int,
                   **intervals: float) -> None:
    """Refuse what `open_watcher` cannot honour, whether or not a log is given (a caller that
    logs only in production would meet the error only there). An interval below 0 or NaN
    would be taken for "off" without a word (``0`` is the documented off), as the CLI's
    settings refuse it."""
    if subscriber_buffer < 1:
        raise UsageError(f"subscriber_buffer must be >= 1, not {subscriber_buffer}")
    if log_max_bytes is not None and log_max_bytes < 1:
        raise UsageError(f"log_max_bytes must be >= 1, not {log_max_bytes}")
    if not 0 <= log_keep <= MAX_LOG_KEEP:
        raise UsageError(f"log_keep must be from 0 to {MAX_LOG_KEEP}, not {log_keep}")
    for name, seconds in intervals.items():
        if not seconds >= 0:  # NaN too
            raise UsageError(f"{name} must be a number of seconds >= 0 (0: off), "
                             f"not {seconds}")


def _dropped_text(dropped: int, unkept: int) -> str:
    """What a loss's drain discarded, for the journal: with the uevents carrying facts no
    rescan sees that its bound made it discard too (a health or a wedge that is lost)."""
    text = f"{dropped} queued dropped"
    if unkept:
        text += (f", {unkept} of them with error-recovery, wedge or bind facts past the "
                 "bound on what a drain keeps, which no rescan recovers")
    return text


async def _scan_in_thread(paths: HostPaths, tables: Tables, *,
                         abandon_on_cancel: bool = False) -> Snapshot:
    """`scan` in a worker thread. The snapshot comes back in a box emptied here, not as the
    job's result: an idle anyio worker keeps its last job (the result in its future) until
    it is given another, which a watcher may never do, so a result would hold every record,
    tuple and string of the scan that nothing else keeps, for as long as the worker idles."""
    box: list[Snapshot] = []
    await anyio.to_thread.run_sync(_scan_into, box, paths, tables,
                                   abandon_on_cancel=abandon_on_cancel)
    return box.pop()


def _scan_into(box: list[Snapshot], paths: HostPaths, tables: Tables) -> None:
    box.append(scan(paths, tables))


def reraise_alone(exc: BaseException) -> None:
    """Raise ``exc`` unwrapped from the group being handled, keeping its own ``__cause__``
    and ``__context__`` (``raise exc from None`` would erase a ``raise … from`` of the
    caller's, and a bare ``raise exc`` would chain the group that held it)."""
    cause, context, suppress = exc.__cause__, exc.__context__, exc.__suppress_context__
    try:
        raise exc
    finally:
        exc.__cause__, exc.__context__ = cause, context
        exc.__suppress_context__ = suppress


__all__ = [
    "RESYNC_REASONS",
    "HostSnapshot",
    "Watcher",
    "WatcherClosed",
    "WatcherOptions",
    "entered_once",
    "event_filters",
    "open_watcher",
    "reraise_alone",
]
