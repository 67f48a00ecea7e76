"""Lost uevents share rescans: the schedule alone (`OverflowGate`, fed a clock), and a
watcher whose source keeps losing events, so a storm costs a rescan a gap, not one a loss."""

from __future__ import annotations

import itertools
import logging
from datetime import datetime

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot
from gpuwatch.watch.overflow import OverflowGate
from gpuwatch.watch.watcher import open_watcher

NIC = "0000:02:00.0"


def stamped(text: str) -> float:
    """An event's ``time`` as seconds."""
    return datetime.fromisoformat(text).timestamp()


def test_a_lone_loss_is_rescanned_at_once() -> None:
    gate = OverflowGate(min_gap=1.0, max_share=0.2)
    assert gate.admit(100.0, "ENOBUFS", dropped=3)
    assert (gate.held, gate.dropped) == (0, 0)


def test_losses_during_and_just_after_a_rescan_wait_for_one_more() -> None:
    gate = OverflowGate(min_gap=1.0, max_share=0.2)
    assert gate.admit(10.0, "ENOBUFS")
    gate.started()
    assert not gate.admit(10.05, "ENOBUFS", dropped=2)  # while it runs
    gate.finished(10.0, 10.1)
    assert gate.due == pytest.approx(11.1)  # a second after it ended
    assert not gate.admit(10.5, "ENOBUFS", dropped=5)  # in the gap
    assert not gate.admit(12.0, "EIO")  # past the gap, but one is already held
    assert gate.take_held() == (3, 7, "EIO", 0)
    assert (gate.held, gate.dropped, gate.error) == (0, 0, "")


def test_a_loss_after_the_gap_with_none_held_is_at_once_again() -> None:
    gate = OverflowGate(min_gap=1.0, max_share=0.2)
    gate.started()
    gate.finished(0.0, 0.2)
    assert not gate.admit(1.1, "ENOBUFS")
    gate.take_held()
    assert gate.admit(1.3, "ENOBUFS")


def test_a_slow_rescan_widens_the_gap_to_keep_its_share() -> None:
    """A rescan of 3 s (a huge host) is followed by 12 s without one: a fifth of the time."""
    gate = OverflowGate(min_gap=1.0, max_share=0.2)
    gate.started()
    gate.finished(50.0, 53.0)
    assert gate.due == pytest.approx(65.0)
    assert 3.0 / (gate.due - 50.0) == pytest.approx(0.2)


@settings(max_examples=300, deadline=None)
@given(
    gaps=st.lists(st.floats(min_value=0.0, max_value=3.0), min_size=1, max_size=200),
    scan=st.floats(min_value=0.0, max_value=2.0),
)
def test_every_loss_is_covered_by_a_later_rescan_and_rescans_keep_their_share(
        gaps: list[float], scan: float) -> None:
    """The watcher's use of the gate, simulated: losses at any times, rescans of a fixed
    length. The first of a quiet spell is rescanned inline (the pump reads nothing until it
    ends); held ones by the helper once due, while the pump reads on, so losses also come
    while that rescan runs. Each loss has a rescan that starts at or after it, and no
    rescan starts within the gap after the one before it ended."""
    gate = OverflowGate(min_gap=1.0, max_share=0.2)
    rescans: list[tuple[float, float]] = []  # (start, end)
    covered: list[tuple[float, float]] = []  # (loss, start of the rescan that covers it)
    held: list[float] = []  # losses waiting for the helper's rescan
    helper_ends: float | None = None  # the helper's rescan running until then

    def begin(start: float) -> float:
        gate.started()
        rescans.append((start, start + scan))
        return start + scan

    def helper_until(now: float) -> None:
        """What the helper does up to ``now``: finish its rescan, start the next when due."""
        nonlocal helper_ends
        while True:
            if helper_ends is not None:
                if helper_ends > now:
                    return
                gate.finished(helper_ends - scan, helper_ends)
                helper_ends = None
            if not held or gate.due > now:
                return
            start = gate.due
            assert gate.take_held()[0] == len(held)
            covered.extend((t, start) for t in held)
            held.clear()
            helper_ends = begin(start)

    clock = 0.0
    for gap in gaps:
        clock += gap
        helper_until(clock)
        if gate.admit(clock, "ENOBUFS"):
            covered.append((clock, clock))
            end = begin(clock)
            gate.finished(clock, end)
            clock = end  # inline: the pump reads no loss until the rescan is done
        else:
            held.append(clock)
    helper_until(float("inf"))
    assert not held
    assert len(covered) == len(gaps)
    assert all(start >= loss for loss, start in covered)
    for (_, end), (start, _) in itertools.pairwise(rescans):
        assert start - end >= max(1.0, 4 * scan) - 1e-9


async def test_a_storm_of_losses_costs_two_rescans_not_one_each(
        host: SysRoot, caplog: pytest.LogCaptureFixture) -> None:
    """Fifty losses in a row: the first rescans at once, the other 49 share one rescan a
    second later, which finds what changed meanwhile. One warning each, and the watcher
    counts every loss."""
    source = MemorySource()
    caplog.set_level(logging.WARNING, logger="gpuwatch.watch")
    async with (
        open_watcher(host.root, source, reconcile_interval=0, cdi_poll_interval=0) as w,
        w.subscribe(types={"resync", "driver-changed"}) as sub,
    ):
        source.overflow()
        with anyio.fail_after(5):
            first = await sub.receive()
        assert (first.type, first.reason) == ("resync", "overflow")
        host.unbind(NIC)  # lost along with the uevents of the storm
        for _ in range(49):
            source.overflow()
        with anyio.fail_after(5):
            changed, second = await sub.receive(), await sub.receive()
        assert (changed.type, changed.addr, changed.new) == ("driver-changed", NIC, "")
        assert (second.type, second.reason, second.changes) == ("resync", "overflow", 1)
        # Each `resync` is stamped once its rescan is done; the second rescan began a gap
        # (a second) after the first ended.
        assert stamped(second.time) - stamped(first.time) >= 1.0
        with anyio.move_on_after(1.5):
            extra = await sub.receive()
            pytest.fail(f"a third rescan: {extra}")
        assert w.uevent_losses == 50
        assert w.resyncs == 2
    lost = [r.getMessage() for r in caplog.records if "events lost" in r.getMessage()]
    assert len(lost) == 2
    assert lost[0].endswith("rescanned, 0 change(s) found")
    assert "49 more time(s)" in lost[1] and lost[1].endswith("rescanned, 1 change(s) found")
    # One journal line per rescan, as docs/events.md says: the rescan adds none of its own.
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == lost


async def test_uevents_in_the_gap_are_applied_before_the_shared_rescan(host: SysRoot) -> None:
    """A loss held for the next rescan does not hold up the uevents that follow it."""
    source = MemorySource()
    async with (
        open_watcher(host.root, source, reconcile_interval=0, cdi_poll_interval=0) as w,
        w.subscribe(types={"resync", "driver-changed"}) as sub,
    ):
        source.overflow()
        source.overflow()  # held: the gap after the first rescan
        with anyio.fail_after(5):
            assert (await sub.receive()).type == "resync"
        host.unbind(NIC)
        source.push(host.uevent_props("unbind", NIC))
        with anyio.fail_after(5):
            event = await sub.receive()
        assert (event.type, event.addr, event.new) == ("driver-changed", NIC, "")
        with anyio.fail_after(5):
            last = await sub.receive()
        # The unbind was applied before the rescan, which found nothing left to report.
        assert (last.type, last.reason, last.changes) == ("resync", "overflow", 0)
