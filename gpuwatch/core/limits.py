"""Bounds shared by every place a user gives a number: the settings and the CLI's flags."""

from __future__ import annotations

from typing import Final

#: The longest wait or interval any setting or flag takes, a week: a longer one is a typo,
#: and past ~1e9 s the clocks and timers under it overflow (a thread's wait, a date).
MAX_SECONDS: Final = 7 * 24 * 3600.0

__all__ = ["MAX_SECONDS"]
