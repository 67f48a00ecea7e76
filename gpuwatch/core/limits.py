"""Bounds shared by every place a user gives a number: the settings and the CLI's flags."""

from __future__ import annotations

from typing import Final

#: The longest wait or interval any setting or flag takes, a week: a longer one is a typo,
#: and past ~1e9 s the clocks and timers under it overflow (a thread's wait, a date).
MAX_SECONDS: Final = 7 * 24 * 3600.0
#: A netlink receive buffer's bounds: less than a page loses uevents at once, and the
#: kernel's socket option is a C int (past it, Python would hand the kernel bytes).
MIN_RECEIVE_BUFFER: Final = 4096
MAX_RECEIVE_BUFFER: Final = 2**31 - 1
#: Rotated event log files kept at most: each rotation looks at every slot, and a typo of a
#: billion would stall the watcher in its first rotation.
MAX_LOG_KEEP: Final = 1000

__all__ = ["MAX_LOG_KEEP", "MAX_RECEIVE_BUFFER", "MAX_SECONDS", "MIN_RECEIVE_BUFFER"]
