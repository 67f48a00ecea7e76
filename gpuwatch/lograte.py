"""Warnings the outside world can cause, bounded like everything else it can cause.

Every refused connection, every client closed for a bad line or for not reading, every
malformed line of a uevent file, is worth a line in the journal, until a hostile peer opens
connections by the thousand or the file is garbage from end to end: then the lines would
flood the journal, and a daemon whose stderr is a full pipe would block writing them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimitedLog:
    """At most ``burst`` warnings at once and ``per_second`` after that (a token bucket);
    what is held back is counted, and the next warning let through says how many of what
    (``subject``: "about clients")."""

    def __init__(self, log: logging.Logger, *, burst: int = 20, per_second: float = 1.0,
                 subject: str = "about clients",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._subject = subject
        self._burst = float(burst)
        self._rate = per_second
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()
        #: Warnings held back since the last one let through.
        self.held_back = 0
        #: Warnings held back in all (for tests and diagnostics).
        self.held_back_total = 0

    def warning(self, msg: str, *args: object) -> None:
        if self._admit():
            self._log.warning(msg, *args)

    def info(self, msg: str, *args: object) -> None:
        """What a client's connection met that is nobody's fault (the daemon stopping)."""
        if self._admit():
            self._log.info(msg, *args)

    def error(self, msg: str, *args: object, exc_info: BaseException | None = None) -> None:
        """An error (with its traceback, ``exc_info``) from the same budget: a request that
        hits a bug of ours, asked again and again, is not a traceback each time."""
        if self._admit():
            self._log.error(msg, *args, exc_info=exc_info)

    def _admit(self) -> bool:
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._last) * self._rate)
        self._last = now
        if self._tokens < 1.0:
            self.held_back += 1
            self.held_back_total += 1
            return False
        self._tokens -= 1.0
        if self.held_back:
            self._log.warning("%d more warning(s) %s held back (at most %g a second after a "
                              "burst of %d)", self.held_back, self._subject, self._rate,
                              int(self._burst))
            self.held_back = 0
        return True
