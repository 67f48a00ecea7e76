"""One subscriber's bounded queue. Fan-out never waits: a full queue means the reader lagged.

A lagged reader is not silently skipped: it drains what it already has, then gets
`SubscriberLagged` with the number of events it missed, and can resubscribe and read
``snapshot()`` to catch up.

A subscription may start in the past (``since_seq``): it is registered for live events
first, then reads the event log from ``since_seq`` up to the seq the watcher had reached at
that moment, so the hand-over from log to live has no gap and no duplicate (`Handover`).
The socket server relays the log's bytes with the same hand-over (`gpuwatch.watch.handover`,
re-exported here).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import anyio
from pydantic import BaseModel

from gpuwatch.core.events import parse_event
from gpuwatch.errors import SubscriberLagged, UsageError
from gpuwatch.watch.eventlog import EventRecord
from gpuwatch.watch.handover import Handover, first_is_next, gap_span

__all__ = ["Handover", "Subscription", "first_is_next", "matches"]

#: Log records read per trip to a worker thread while replaying.
REPLAY_CHUNK = 256


class Subscription:
    """Async iterator of events matching ``types``/``addrs`` (None means all).

    Events travel as the batches the watcher published them in: one queue operation (and
    one wake-up of the reader) per batch, not per event, so a reader that keeps up on
    average takes a whole burst a batch at a time. ``buffer`` still bounds what waits in
    the queue, counted in events.
    """

    def __init__(
        self, types: frozenset[str] | None, addrs: frozenset[str] | None, buffer: int
    ) -> None:
        self.types = types
        self.addrs = addrs
        self.buffer = buffer
        self._send, self._recv = anyio.create_memory_object_stream[Sequence[BaseModel]](
            math.inf
        )
        self._queued = 0  # events waiting in the stream, not yet taken by the reader
        self._taken: deque[BaseModel] = deque()  # the batch the reader is working through
        self.lagged = False
        self.missed = 0
        #: The seq of the first event dropped for this subscriber (None while none was): where
        #: a resubscription with ``since_seq`` resumes, as a socket's ``lagged`` line says.
        self.first_missed_seq: int | None = None
        # Replay from the log, when the subscriber asked for the past (`start_replay`).
        self._replay: Iterator[EventRecord] | None = None
        self._replay_until = 0
        self._handover: Handover | None = None
        self._expected: int | None = None  # the seq the log must hold next while replaying
        #: Where the replayed log has a hole: (first missing seq, how many); the subscriber
        #: gets `SubscriberLagged` there, as a socket subscriber gets its `lagged` line.
        self.hole: tuple[int, int] | None = None
        #: False when the log no longer holds every event after ``since_seq``.
        self.complete = True
        #: The thread whose event loop feeds this queue: a reader elsewhere would race it.
        self._thread = threading.get_ident()

    def start_replay(self, records: Iterator[EventRecord], since_seq: int, until_seq: int,
                     complete: bool) -> None:
        """Deliver the log's events in (``since_seq``, ``until_seq``] before the live ones
        (which, registered at ``until_seq``, all come after).

        ``records`` are every record of the log (unfiltered): ``complete`` judges only the
        first, so a hole further on (a rotated file missing or unreadable, writes that
        failed) shows as a seq jump, or as a log that ends before ``until_seq``. The replay
        stops there, and the reader gets what came before, then `SubscriberLagged` naming
        the first missing seq, instead of events with seqs silently missing."""
        self._replay = records
        self._replay_until = until_seq
        self._handover = Handover(since_seq)
        self.complete = complete

    def _read_replay(self) -> list[BaseModel]:
        """The next chunk of replayed events (a worker thread runs this: it reads files)."""
        records = self._replay
        out: list[BaseModel] = []
        if records is None or self._handover is None:
            return out
        types = self.types
        for record in records:
            seq = record.event["seq"]
            if seq > self._replay_until:
                break  # from here on the live stream has it
            if not self._handover.fresh(seq):
                continue
            gap = self._expected is not None and gap_span(record.event) is not None
            if self._expected is not None and (seq > self._expected or gap):
                # A jump, or a log-gap record (its seqs, its own among them, were never
                # written): the reader is owed everything from the expected seq on.
                self.hole = (self._expected, seq + gap - self._expected)
                self._end_replay()
                return out
            self._expected = seq + 1
            if types is not None and record.event.get("type") not in types:
                continue
            try:
                event = parse_event(record.line)
            except ValueError:
                # Strict JSON with a whole seq and a type, which the models still refuse (a
                # type from a newer gpuwatch): the log holds it, so it is no hole (resuming
                # before it would meet it again); this subscriber cannot have it. A damaged
                # line is no record at all: its seq shows as a hole above.
                continue
            if self.addrs is None or matches(self, event):
                out.append(event)
            if len(out) >= REPLAY_CHUNK:
                return out
        expected = self._expected
        if expected is not None and expected <= self._replay_until:
            self.hole = (expected, self._replay_until + 1 - expected)  # the log ends early
        self._end_replay()
        return out

    def _end_replay(self) -> None:
        records, self._replay = self._replay, None
        close = getattr(records, "close", None)
        if close is not None:
            close()  # release the log files now, not at garbage collection

    def offer(self, event: BaseModel) -> None:
        """Queue one event without waiting (see `offer_batch`)."""
        self.offer_batch((event,))

    def offer_batch(self, events: Sequence[BaseModel]) -> None:
        """Queue the events this subscriber wants, as one batch, without waiting.

        If they do not fit in what is left of the buffer, the subscriber is lagged: it
        keeps what is queued, and every later event counts as missed.
        """
        if self.types is not None or self.addrs is not None:
            events = [e for e in events if matches(self, e)]
        if not events:
            return
        if self.lagged:
            self.missed += len(events)
            return
        if self._queued + len(events) > self.buffer:
            self.lagged = True
            self.missed = len(events)
            seq = getattr(events[0], "seq", None)
            self.first_missed_seq = seq if type(seq) is int and seq > 0 else None
            self._send.close()
            return
        try:
            self._send.send_nowait(events)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return
        self._queued += len(events)

    def close(self) -> None:
        """End the stream: a reader waiting in ``receive`` sees the end, not a hang."""
        self._send.close()

    def dispose(self) -> None:
        """Release both ends once the subscriber has left (anyio warns about unclosed streams)."""
        self._end_replay()
        self._send.close()
        self._recv.close()

    async def receive(self) -> Any:
        taken = self._taken
        if not taken and threading.get_ident() != self._thread:
            raise UsageError("this subscription belongs to the event loop of the thread that "
                             "opened its watcher: read it there")
        if self._replay is not None and not taken:
            while self._replay is not None and not taken:
                taken.extend(await anyio.to_thread.run_sync(self._read_replay))
            if taken:
                return taken.popleft()
        if not taken and self.hole is not None:
            # Nothing after a hole: the live events queued meanwhile would skip it too.
            self._send.close()
            self._recv.close()
            raise SubscriberLagged(self.hole[1], self.hole[0])
        if not taken:
            try:
                batch = await self._recv.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                if self.lagged:
                    raise SubscriberLagged(self.missed, self.first_missed_seq) from None
                raise StopAsyncIteration from None
            self._queued -= len(batch)
            taken.extend(batch)
        return taken.popleft()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Any:
        return await self.receive()


def matches(sub: Subscription, event: BaseModel) -> bool:
    if sub.types is not None and getattr(event, "type", None) not in sub.types:
        return False
    if sub.addrs is not None:
        return getattr(event, "addr", None) in sub.addrs
    return True
