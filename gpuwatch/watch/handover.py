"""The one rule for handing a reader from stored events to newer ones: each seq once, in order.

Every reader that meets the same events from two sides uses it: an in-process subscription
replaying the log before live events (`gpuwatch.watch.subscription`), the socket server
doing the same for a client, and the log follower, whose directory scans can meet one file
twice when a rotation races them (``gpuwatch events --follow``).
"""

from __future__ import annotations

import math

__all__ = ["LOG_GAP", "Handover", "first_is_next", "gap_span"]


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


#: The record a log resumes with after failed writes: it stands for the seqs
#: ``first_seq`` … ``last_seq`` (its own seq) that the log lacks, not for an event.
LOG_GAP = "log-gap"


def first_is_next(first_seq: int | None, since_seq: int, *, gap: bool = False) -> bool:
    """Whether a replay starting at ``first_seq`` covers everything after ``since_seq``
    (False when the log rotated those events away, or has none, or when that first record
    is a ``log-gap`` (``gap``): the seq after ``since_seq`` is one the log lacks)."""
    return not gap and first_seq == since_seq + 1


def gap_span(event: dict[str, object]) -> int | None:
    """For a ``log-gap`` record, the first seq of the hole it stands for (up to its own
    seq); None for any other record. A malformed ``first_seq`` counts as its own seq."""
    if event.get("type") != LOG_GAP:
        return None
    seq = event["seq"]
    first = event.get("first_seq")
    assert isinstance(seq, int)
    if isinstance(first, int) and not isinstance(first, bool) and 1 <= first <= seq:
        return first
    return seq
