"""The journal lines clients can cause are bounded (`RateLimitedLog`)."""

from __future__ import annotations

import logging

import pytest

from gpuwatch.service.lograte import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_the_rate_and_the_count_of_what_was_held_back(
        caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("gpuwatch.test.lograte")
    clock = Clock()
    limited = RateLimitedLog(log, burst=5, per_second=2.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger=log.name):
        for i in range(1000):
            limited.warning("refusing client %d", i)
        assert [r.getMessage() for r in caplog.records] == [
            f"refusing client {i}" for i in range(5)]
        assert (limited.held_back, limited.held_back_total) == (995, 995)
        caplog.clear()
        clock.now += 0.4  # 0.8 of a token: still nothing
        limited.warning("refusing client late")
        assert caplog.records == []
        clock.now += 0.2  # a whole token now
        limited.warning("refusing client later")
        assert [r.getMessage() for r in caplog.records] == [
            "996 more warning(s) about clients held back (at most 2 a second after a burst "
            "of 5)",
            "refusing client later",
        ]
        assert limited.held_back == 0 and limited.held_back_total == 996


def test_a_quiet_spell_refills_the_burst_but_no_further(
        caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("gpuwatch.test.lograte2")
    clock = Clock()
    limited = RateLimitedLog(log, burst=3, per_second=1.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger=log.name):
        for _ in range(3):
            limited.warning("x")
        clock.now += 3600  # an hour of quiet gives back the burst, not 3,600 lines
        for _ in range(10):
            limited.warning("y")
    assert [r.getMessage() for r in caplog.records] == ["x"] * 3 + ["y"] * 3
    assert limited.held_back == 7
