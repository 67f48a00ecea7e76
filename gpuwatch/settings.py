"""Names of the non-table keys a config file may hold (the watch options).

Kept apart from `config` so that the daemon's settings can grow without touching the
table loader; the loader only needs the names to tell a typo from a real key.
"""

from __future__ import annotations

SETTING_KEYS: tuple[str, ...] = (
    "root",
    "source",
    "log",
    "log_max_bytes",
    "log_keep",
    "reconcile_interval",
)
