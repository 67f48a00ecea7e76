"""The journal lines clients can cause are bounded (`RateLimitedLog`)."""

from __future__ import annotations

import logging

import pytest

from gpuwatch.lograte import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def limited(burst: int, per_second: float) -> tuple[RateLimitedLog, Clock, str]:
    """A limiter on its own logger, with a clock the test moves."""
    clock = Clock()
    name = f"gpuwatch.test.lograte.{burst}.{per_second}"
    return RateLimitedLog(logging.getLogger(name), burst=burst, per_second=per_second,
                          clock=clock), clock, name


def test_a_burst_then_the_rate_and_the_count_of_what_was_held_back(
        caplog: pytest.LogCaptureFixture) -> None:
    limited_log, clock, name = limited(5, 2.0)
    with caplog.at_level(logging.WARNING, logger=name):
        for i in range(1000):
            limited_log.warning("refusing client %d", i)
        assert [r.getMessage() for r in caplog.records] == [
            f"refusing client {i}" for i in range(5)]
        assert (limited_log.held_back, limited_log.held_back_total) == (995, 995)
        caplog.clear()
        clock.now += 0.4  # 0.8 of a token: still nothing
        limited_log.warning("refusing client late")
        assert caplog.records == []
        clock.now += 0.2  # a whole token now
        limited_log.warning("refusing client later")
        assert [r.getMessage() for r in caplog.records] == [
            "996 more warning(s) about clients held back (at most 2 a second after a burst "
            "of 5)",
            "refusing client later",
        ]
        assert limited_log.held_back == 0 and limited_log.held_back_total == 996


def test_a_quiet_spell_refills_the_burst_but_no_further(
        caplog: pytest.LogCaptureFixture) -> None:
    limited_log, clock, name = limited(3, 1.0)
    with caplog.at_level(logging.WARNING, logger=name):
        for _ in range(3):
            limited_log.warning("x")
        clock.now += 3600  # an hour of quiet gives back the burst, not 3,600 lines
        for _ in range(10):
            limited_log.warning("y")
    assert [r.getMessage() for r in caplog.records] == ["x"] * 3 + ["y"] * 3
    assert limited_log.held_back == 7


def test_errors_share_the_warnings_budget_and_keep_their_traceback(
        caplog: pytest.LogCaptureFixture) -> None:
    limited_log, clock, name = limited(2, 1.0)
    with caplog.at_level(logging.WARNING, logger=name):
        for i in range(5):
            limited_log.error("request %d failed", i, exc_info=ValueError(f"bug {i}"))
        limited_log.warning("refusing a client")
        assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
            (logging.ERROR, "request 0 failed"), (logging.ERROR, "request 1 failed")]
        assert caplog.records[0].exc_info is not None
        assert str(caplog.records[0].exc_info[1]) == "bug 0"
        assert limited_log.held_back == 4
        clock.now += 1.0
        caplog.clear()
        limited_log.warning("refusing a client later")
        assert [r.getMessage() for r in caplog.records] == [
            "4 more warning(s) about clients held back (at most 1 a second after a burst of 2)",
            "refusing a client later"]
