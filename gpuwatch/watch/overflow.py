"""When to rescan after lost uevents: at once for a loss, then at most so often.

A uevent storm against a small receive buffer (an unprivileged daemon gets the kernel's
``net.core.rmem_max``, 208 KiB by default; ``--receive-buffer`` may ask for less) overflows
it again as soon as it is drained. A rescan for each loss would rescan without end, keep a
CPU busy, and write a ``resync`` record and journal lines by the hundred a second. So the
losses that come while a rescan runs, or within the gap after one, wait for the next and
share it, however many they are. The gap grows with the rescan's own length, so rescans take
at most a fixed share of a storm however large the host. Pure: the watcher feeds it the
clock's readings.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Losses within this long after a rescan share the next one (seconds).
MIN_GAP = 1.0
#: Rescans take at most this share of the time while losses keep coming.
MAX_SHARE = 0.2


@dataclass
class OverflowGate:
    """The rescan schedule of one watcher: `admit` each loss; a loss it holds back waits
    for `due`, and `take_held` hands the held ones to the rescan that covers them."""

    min_gap: float = MIN_GAP
    max_share: float = MAX_SHARE
    #: When the next rescan may start (the loop clock): the held losses' rescan is due then.
    due: float = 0.0
    #: Losses waiting for a rescan, the queued uevents their sources dropped, the last error,
    #: and how many of the dropped carried facts a rescan cannot see (`SourceOverflow`).
    held: int = 0
    dropped: int = 0
    error: str = ""
    unkept: int = 0
    running: bool = False

    def admit(self, now: float, error: str, dropped: int = 0, unkept: int = 0) -> bool:
        """True: rescan for this loss now (`started`, then `finished`). False: it is held
        for the rescan due at `due` (one already held, one running, or one just ended)."""
        if not self.running and not self.held and now >= self.due:
            return True
        self.held += 1
        self.dropped += dropped
        self.error = error
        self.unkept += unkept
        return False

    def take_held(self) -> tuple[int, int, str, int]:
        """``(losses, dropped, last error, unkept)`` of the held losses, now covered by a
        rescan."""
        held = (self.held, self.dropped, self.error, self.unkept)
        self.held, self.dropped, self.error, self.unkept = 0, 0, "", 0
        return held

    def started(self) -> None:
        """A rescan began: losses from now on wait for the next one (this one may already
        have read what they changed, or not)."""
        self.running = True

    def finished(self, began: float, now: float) -> None:
        """A rescan that ``began`` ended at ``now``: the next may start after the gap."""
        self.running = False
        took = max(0.0, now - began)
        self.due = now + max(self.min_gap, took * (1.0 - self.max_share) / self.max_share)


__all__ = ["MAX_SHARE", "MIN_GAP", "OverflowGate"]
