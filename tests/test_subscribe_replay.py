"""``host.subscribe(since_seq=N)``: the log's events after N, then live ones, no gap, no dup."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from gpuwatch.errors import SubscriberLagged, UsageError
from gpuwatch.host import Host, open_host
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot

NV = "0000:01:00.0"


@asynccontextmanager
async def logged_host(host: SysRoot, log: Path, **kw: Any) -> AsyncIterator[tuple[Host,
                                                                                    MemorySource]]:
    source = MemorySource()
    async with open_host(host.root, source=source, log=str(log), reconcile_interval=0,
                         cdi_poll_interval=0, **kw) as gpu_host:
        yield gpu_host, source


async def flip(gpu_host: Host, host: SysRoot, source: MemorySource, times: int) -> None:
    """Unbind and rebind the dGPU ``times`` times, waiting until the model has each change."""
    for _ in range(times):
        for action in ("unbind", "bind"):
            before = gpu_host.seq
            if action == "unbind":
                host.unbind(NV)
            else:
                host.bind(NV, "nvidia")
            source.push(host.uevent_props(action, NV))
            with anyio.fail_after(5):
                while gpu_host.seq == before:
                    await anyio.sleep(0.005)


async def take(sub: Any, count: int) -> list[Any]:
    got = []
    with anyio.fail_after(5):
        while len(got) < count:
            got.append(await sub.receive())
    return got


async def test_replay_hands_over_to_live_without_gap_or_duplicate(host: SysRoot,
                                                                  tmp_path: Path) -> None:
    async with logged_host(host, tmp_path / "events.jsonl") as (gpu_host, source):
        await flip(gpu_host, host, source, 3)
        now = gpu_host.seq
        since = 2
        async with gpu_host.subscribe(since_seq=since) as sub:
            assert sub.complete
            await flip(gpu_host, host, source, 1)  # live events while the replay is pending
            after = gpu_host.seq
            got = await take(sub, after - since)
        assert [e.seq for e in got] == list(range(since + 1, after + 1))
        assert after > now
        # The replayed events are typed, frozen records like the live ones.
        assert {type(e).__name__ for e in got} >= {"DriverChanged"}


async def test_replay_filters_by_type_and_address(host: SysRoot, tmp_path: Path) -> None:
    async with logged_host(host, tmp_path / "events.jsonl") as (gpu_host, source):
        await flip(gpu_host, host, source, 2)
        async with gpu_host.subscribe(types={"driver-changed"}, addrs=[NV.upper()],
                                      since_seq=0) as sub:
            await flip(gpu_host, host, source, 1)
            got = await take(sub, 6)
        assert [(e.type, e.addr) for e in got] == [("driver-changed", NV)] * 6
        assert [e.new for e in got] == ["", "nvidia"] * 3
        assert sorted(e.seq for e in got) == [e.seq for e in got]


async def test_a_seq_the_log_cannot_vouch_for_is_incomplete(host: SysRoot,
                                                           tmp_path: Path) -> None:
    async with logged_host(host, tmp_path / "events.jsonl") as (gpu_host, _source):
        async with gpu_host.subscribe(since_seq=gpu_host.seq + 100) as sub:
            assert not sub.complete
        with pytest.raises(UsageError):
            async with gpu_host.subscribe(since_seq=-1):
                pass
    async with open_host(host.root, source=MemorySource(), reconcile_interval=0,
                         cdi_poll_interval=0) as no_log, no_log.subscribe(since_seq=0) as sub:
        assert not sub.complete  # nothing to replay from


async def test_rotated_away_events_make_the_replay_incomplete(host: SysRoot,
                                                              tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    async with logged_host(host, log, log_max_bytes=300, log_keep=1) as (gpu_host, source):
        await flip(gpu_host, host, source, 4)
        async with gpu_host.subscribe(since_seq=0) as sub:
            assert not sub.complete
            first = await take(sub, 1)
        assert first[0].seq > 1


def test_the_handover_delivers_each_seq_once_in_order() -> None:
    from gpuwatch.watch.subscription import Handover, first_is_next

    seam = Handover(5)
    assert [seam.fresh(s) for s in (4, 5, 6, 6, 8, 7, 9)] == [
        False, False, True, False, True, False, True]
    assert seam.last_seq == 9
    assert first_is_next(4, 3) and not first_is_next(6, 3) and not first_is_next(None, 3)


@pytest.mark.parametrize("hole", ["directory", "missing"])
async def test_a_hole_in_the_rotated_log_ends_the_replay_with_lagged(
        host: SysRoot, tmp_path: Path, hole: str) -> None:
    """A rotated file the readers skip (a directory at its name) or lost from the middle of
    the log: the replay gives every event before it, then `SubscriberLagged` naming the
    first missing seq, not a stream with seqs silently missing under ``complete``; resuming
    from there is answered ``complete: False``."""
    log = tmp_path / "events.jsonl"
    async with logged_host(host, log, log_max_bytes=600, log_keep=50) as (gpu_host, source):
        await flip(gpu_host, host, source, 6)
        rotated = sorted(tmp_path.glob("events.jsonl.*[0-9]"), key=lambda p: int(p.suffix[1:]))
        assert len(rotated) >= 3, rotated
        middle = rotated[len(rotated) // 2]
        lost = [int(line.split(b'"seq":', 1)[1].split(b",", 1)[0])
                for line in middle.read_bytes().splitlines()]
        middle.unlink()
        if hole == "directory":
            middle.mkdir()
        async with gpu_host.subscribe(since_seq=0) as sub:
            assert sub.complete
            got: list[int] = []
            with anyio.fail_after(10), pytest.raises(SubscriberLagged) as caught:
                while True:
                    got.append((await sub.receive()).seq)
        assert caught.value.first_missed_seq == lost[0]
        assert caught.value.missed == len(lost)
        assert got == list(range(1, lost[0]))  # everything before the hole, in order
        async with gpu_host.subscribe(since_seq=lost[0] - 1) as again:
            assert not again.complete
            first = await take(again, 1)
        assert first[0].seq == lost[-1] + 1


async def test_a_log_that_ends_before_the_watchers_seq_ends_the_replay_with_lagged(
        host: SysRoot, tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    async with logged_host(host, log) as (gpu_host, source):
        await flip(gpu_host, host, source, 2)
        lines = log.read_bytes().splitlines(keepends=True)
        log.write_bytes(b"".join(lines[:-2]))  # its newest two lines lost
        now = gpu_host.seq
        async with gpu_host.subscribe(since_seq=0) as sub:
            with anyio.fail_after(10), pytest.raises(SubscriberLagged) as caught:
                while True:
                    await sub.receive()
        assert (caught.value.first_missed_seq, caught.value.missed) == (now - 1, 2)


async def test_a_filtered_replay_still_sees_the_hole(host: SysRoot, tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    async with logged_host(host, log, log_max_bytes=600, log_keep=50) as (gpu_host, source):
        await flip(gpu_host, host, source, 6)
        rotated = sorted(tmp_path.glob("events.jsonl.*[0-9]"), key=lambda p: int(p.suffix[1:]))
        rotated[len(rotated) // 2].unlink()
        async with gpu_host.subscribe(types={"driver-changed"}, since_seq=0) as sub:
            with anyio.fail_after(10), pytest.raises(SubscriberLagged):
                while True:
                    assert (await sub.receive()).type == "driver-changed"
