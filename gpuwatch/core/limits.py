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

#: The largest file size (``off_t``): a rotation size past it is one no log reaches.
MAX_FILE_BYTES: Final = 2**63 - 1
#: The longest socket request line: a real one is under a KiB (the default allows 64), and
#: each connection may hold this much of a line, so the socket's worst case is this times
#: `MAX_SOCKET_CLIENTS` (1 GiB at the default 1024 clients).
MAX_REQUEST_BYTES: Final = 1 << 20
#: Unread output one socket client may leave: four of them still fit the 256 MiB that all
#: connections share (a larger limit raises that shared budget to four limits).
MAX_OUTPUT_BYTES: Final = 64 << 20
#: Socket connections (and those of one uid, and root's reserve): each needs a descriptor,
#: and a history replay ``log_keep`` + 2 more; this many with the default ``log_keep`` need
#: half of the 1048576 descriptors a process may have by default (``fs.nr_open``).
MAX_SOCKET_CLIENTS: Final = 65536

__all__ = [
    "MAX_FILE_BYTES",
    "MAX_LOG_KEEP",
    "MAX_OUTPUT_BYTES",
    "MAX_RECEIVE_BUFFER",
    "MAX_REQUEST_BYTES",
    "MAX_SECONDS",
    "MAX_SOCKET_CLIENTS",
    "MIN_RECEIVE_BUFFER",
]
