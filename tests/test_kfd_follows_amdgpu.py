"""The KFD topology follows amdgpu's binds. amdkfd adds a GPU's topology node while amdgpu
binds it and removes it while amdgpu lets go, and sends no uevent for either (only /dev/kfd
itself has one, at module load, before any GPU is probed). The watcher reads the topology
again with the bind or unbind, in the same batch, so `amd-gfx-version` and `amd-gfx-target`
never lag the driver-changed event that caused them; binds of other drivers, and re-reads that
change nothing, do not read it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

import gpuwatch
from gpuwatch.hostfs import scan as scan_mod
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.testing.machines import instinct_host
from gpuwatch.watch import watcher as watcher_mod
from gpuwatch.watch.watcher import Watcher, open_watcher

pytestmark = pytest.mark.timeout(60)

MI210, MI210_2 = "0000:11:00.0", "0000:21:00.0"
MI210_GFX, MI300_GFX = 90010, 90402


@asynccontextmanager
async def watching(host: SysRoot) -> AsyncIterator[tuple[Watcher, MemorySource, list[Any]]]:
    source = MemorySource()
    async with open_watcher(host.root, source, reconcile_interval=0,
                            cdi_poll_interval=0) as w:
        got: list[Any] = []
        async with w.subscribe() as sub:
            async def collect() -> None:
                async for event in sub:
                    got.append(event)

            async with anyio.create_task_group() as tg:
                tg.start_soon(collect)
                yield w, source, got
                tg.cancel_scope.cancel()


async def until(w: Watcher, got: list[Any], addr: str, driver: str) -> list[Any]:
    """The events of the batch that brought ``addr``'s driver-changed to ``driver``."""
    with anyio.fail_after(10):
        while not any(e.type == "driver-changed" and e.addr == addr and e.new == driver
                      for e in got):
            await anyio.sleep(0.005)
    await anyio.sleep(0.05)  # the rest of that batch (its probe-changed comes last)
    return list(got)


def probe_changes(events: list[Any]) -> set[str]:
    return {e.action for e in events if e.type == "probe-changed"}


@pytest.fixture
def host(tmp_path: Path) -> SysRoot:
    # The first card an MI210, the second an MI300X: which one answers shows.
    s = instinct_host(tmp_path / "host", cards=2)
    s.add_kfd_node(2, MI300_GFX)
    return s


async def test_an_unbind_takes_the_cards_node_out_of_the_answers(host: SysRoot) -> None:
    async with watching(host) as (w, source, got):
        assert w.probe("amd-gfx-target") == "gfx90a"
        host.unbind(MI210)  # the kernel: amdkfd drops node 1 as amdgpu lets the card go
        host.remove_kfd_node(1)
        source.push(host.uevent_props("unbind", MI210))
        events = await until(w, got, MI210, "")
        assert w.probe("amd-gfx-target") == "gfx942"
        assert w.probe("amd-gfx-version") == "9.4.0"
        assert {"amd-gfx-target", "amd-gfx-version"} <= probe_changes(events)
        assert w.model.probe("amd-gfx-target") == gpuwatch.scan(host.root).probe("amd-gfx-target")


async def test_a_bind_brings_the_cards_node_in(host: SysRoot) -> None:
    host.unbind(MI210)
    host.unbind(MI210_2)
    host.remove_kfd_node(1)
    host.remove_kfd_node(2)
    async with watching(host) as (w, source, got):
        assert w.probe("amd-gfx-version") == ""
        host.add_kfd_node(1, MI300_GFX)  # amdkfd adds the node while amdgpu probes the card
        host.bind(MI210_2, "amdgpu")
        source.push(host.uevent_props("bind", MI210_2))
        events = await until(w, got, MI210_2, "amdgpu")
        assert w.probe("amd-gfx-version") == "9.4.0"
        assert w.probe("detect-host-devices").amd_gfx_target == "gfx942"  # type: ignore[union-attr]
        assert "amd-gfx-version" in probe_changes(events)


async def test_a_card_that_goes_away_takes_its_node_along(host: SysRoot) -> None:
    async with watching(host) as (w, source, got):
        host.remove_kfd_node(1)
        host.remove_function(MI210)
        source.push(host.uevent_props("remove", MI210))
        with anyio.fail_after(10):
            while w.probe("amd-gfx-target") != "gfx942":
                await anyio.sleep(0.005)
        assert any(e.type == "device-removed" for e in got)


async def test_binds_that_do_not_touch_amdgpu_do_not_read_the_topology(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = example_gpu_host(tmp_path / "host")
    host.add_kfd_node(0, 0)
    reads: list[str] = []
    real = scan_mod.read_kfd

    def counting(paths: Any) -> Any:
        reads.append(paths.root)
        return real(paths)

    monkeypatch.setattr(watcher_mod, "read_kfd", counting)
    nv = "0000:01:00.0"
    async with watching(host) as (w, source, got):
        host.unbind(nv)
        source.push(host.uevent_props("unbind", nv))
        await until(w, got, nv, "")
        source.push(host.uevent_props("change", nv))  # a re-read that changes nothing
        host.bind(nv, "vfio-pci")
        source.push(host.uevent_props("bind", nv))
        await until(w, got, nv, "vfio-pci")
    assert reads == []


async def test_a_change_uevent_of_a_bound_card_reads_nothing_more(
    host: SysRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[str] = []
    real = scan_mod.read_kfd
    monkeypatch.setattr(watcher_mod, "read_kfd", lambda paths: reads.append("x") or real(paths))
    async with watching(host) as (w, source, got):
        host.unbind(MI210)
        source.push(host.uevent_props("unbind", MI210))
        await until(w, got, MI210, "")
        assert reads == ["x"]
        source.push(host.uevent_props("change", MI210_2))
        host.bind(MI210, "amdgpu")
        source.push(host.uevent_props("bind", MI210))
        await until(w, got, MI210, "amdgpu")
        assert reads == ["x", "x"]
