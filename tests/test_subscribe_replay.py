"""``host.subscribe(since_seq=N)``: the log's events after N, then live ones, no gap, no dup."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from gpuwatch.errors import UsageError
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
