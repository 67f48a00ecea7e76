"""How a task that works through a backlog in turns gives way between them.

A history replay, the watcher's slices of a uevent backlog and a source's chunks all do a
bounded piece of work, then let the rest of the program run. One checkpoint is not enough
for that on asyncio: it queues the task's next turn at once, and the loop polls its sockets
only after that, so the callbacks of a request that came in during a turn (a probe on the
daemon's socket) are queued behind the next turn too. Such a request then waits for the rest
of one turn and the whole of another. `end_turn` waits one more trip round the loop, so the
request is answered before the next turn starts.
"""

from __future__ import annotations

from anyio.lowlevel import checkpoint


async def end_turn() -> None:
    """Let every task and I/O callback that became ready during this turn run before the
    next one: the first checkpoint lets the loop poll, the second puts this task behind what
    the poll found. It costs one more trip round the loop (a few µs) per turn."""
    await checkpoint()
    await checkpoint()


__all__ = ["end_turn"]
