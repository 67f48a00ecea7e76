"""One subscriber's bounded queue. Fan-out never waits: a full queue means the reader lagged.

A lagged reader is not silently skipped: it drains what it already has, then gets
`SubscriberLagged` with the number of events it missed, and can resubscribe and read
``snapshot()`` to catch up.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import anyio
from pydantic import BaseModel

from gpuwatch.errors import SubscriberLagged


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
        self._send.close()
        self._recv.close()

    async def receive(self) -> Any:
        taken = self._taken
        if not taken:
            try:
                batch = await self._recv.receive()
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                if self.lagged:
                    raise SubscriberLagged(self.missed) from None
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
