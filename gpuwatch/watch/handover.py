"""The one rule for handing a reader from stored events to newer ones: each seq once, in order.

Every reader that meets the same events from two sides uses it: an in-process subscription
replaying the log before live events (`gpuwatch.watch.subscription`), the socket server
doing the same for a client, and the log follower, whose directory scans can meet one file
twice when a rotation races them (``gpuwatch events --follow``).
"""

from __future__ import annotations

import math

__all__ = ["Handover", "first_is_next"]


class Handover:
    """The seam between a log replay and live events: each seq is delivered once, in order.

    ``last_seq`` starts at the subscriber's ``since_seq`` (None: before every seq); `fresh`
    accepts a seq only if it is newer than every one delivered, whichever side (log or live)
    it came from.
    """

    __slots__ = ("last_seq",)

    def __init__(self, since_seq: int | None) -> None:
        self.last_seq: float = -math.inf if since_seq is None else since_seq

    def fresh(self, seq: int) -> bool:
        if seq <= self.last_seq:
            return False
        self.last_seq = seq
        return True


def first_is_next(first_seq: int | None, since_seq: int) -> bool:
    """Whether a replay starting at ``first_seq`` covers everything after ``since_seq``
    (False when the log rotated those events away, or has none)."""
    return first_seq == since_seq + 1
