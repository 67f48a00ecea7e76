"""An in-process event source: the caller pushes uevents (tests, the simulated kernel, bridges).

It behaves like the others (batches of whatever was pushed since the last read, an
overflow marker, an end), so code tested against it runs unchanged on netlink.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from gpuwatch.core.uevent import UEvent
from gpuwatch.sources import SourceOverflow

_Item = UEvent | SourceOverflow


class MemorySource:
    """Push-driven source. ``push`` never blocks; ``end`` makes ``batches`` finish."""

    name = "memory"

    def __init__(self) -> None:
        self.warnings: list[str] = []
        self._send: MemoryObjectSendStream[_Item]
        self._recv: MemoryObjectReceiveStream[_Item]
        self._send, self._recv = anyio.create_memory_object_stream[_Item](math.inf)

    def start(self) -> None:
        """Nothing to bind: pushes made before the watcher reads are kept."""

    def push(self, event: UEvent | Mapping[str, str]) -> None:
        ev = event if isinstance(event, UEvent) else UEvent.from_properties(event)
        self._send.send_nowait(ev)

    def overflow(self, error: str = "ENOBUFS: No buffer space available") -> None:
        """Pretend the socket lost events, as ENOBUFS does."""
        self._send.send_nowait(SourceOverflow(error))

    def end(self) -> None:
        """Like EOF of a file: what was pushed is still delivered, then `batches` ends."""
        self._send.close()

    def close(self) -> None:
        self._send.close()
        self._recv.close()

    async def batches(self) -> AsyncIterator[list[UEvent] | SourceOverflow]:
        batch: list[UEvent] = []
        while True:
            try:
                item = await self._recv.receive() if not batch else self._recv.receive_nowait()
            except anyio.WouldBlock:
                yield batch
                batch = []
                continue
            except (anyio.EndOfStream, anyio.ClosedResourceError):
                if batch:
                    yield batch
                return
            if isinstance(item, SourceOverflow):
                if batch:
                    yield batch
                    batch = []
                yield item
            else:
                batch.append(item)
