"""One subscriber's bounded queue. Fan-out never waits: a full queue means the reader lagged.

A lagged reader is not silently skipped: it drains what it already has, then gets
`SubscriberLagged` with the number of events it missed, and can resubscribe and read
``snapshot()`` to catch up.
"""

from __future__ import annotations

from typing import Any

import anyio
from pydantic import BaseModel

from gpuwatch.errors import SubscriberLagged


class Subscription:
    """Async iterator of events matching ``types``/``addrs`` (None means all)."""

    def __init__(
        self, types: frozenset[str] | None, addrs: frozenset[str] | None, buffer: int
    ) -> None:
        self.types = types
        self.addrs = addrs
        self._send, self._recv = anyio.create_memory_object_stream[BaseModel](buffer)
        self.lagged = False
        self.missed = 0

    def offer(self, event: BaseModel) -> None:
        """Queue without waiting; on a full queue mark the subscriber lagged and count."""
        if self.lagged:
            self.missed += 1
            return
        try:
            self._send.send_nowait(event)
        except anyio.WouldBlock:
            self.lagged = True
            self.missed = 1
            self._send.close()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass

    def close(self) -> None:
        """End the stream: a reader waiting in ``receive`` sees the end, not a hang."""
        self._send.close()

    def dispose(self) -> None:
        """Release both ends once the subscriber has left (anyio warns about unclosed streams)."""
        self._send.close()
        self._recv.close()

    async def receive(self) -> Any:
        try:
            return await self._recv.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            if self.lagged:
                raise SubscriberLagged(self.missed) from None
            raise StopAsyncIteration from None

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
