"""``iommu_enabled`` follows the IOMMU groups as they come and go. On a host in no-IOMMU mode
(``vfio.enable_unsafe_noiommu_mode=1``, no IOMMU) vfio-pci makes a group of its own for each
card it binds and drops it when it lets go: ``sys/kernel/iommu_groups`` fills and empties with
no uevent of its own. The watcher reads it again with the bind or unbind, so the cached
`detect-vfio` says what a fresh scan says, in the batch of the driver change; binds that touch
no group read nothing more."""

from __future__ import annotations

import os
import shutil
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
from gpuwatch.testing.machines import vfio_noiommu_host
from gpuwatch.watch import watcher as watcher_mod
from gpuwatch.watch.watcher import Watcher, open_watcher

pytestmark = pytest.mark.timeout(60)

T4 = "0000:00:05.0"


def let_go(host: SysRoot) -> None:
    """What vfio-pci leaves on unbind in no-IOMMU mode: no driver, no group, no node."""
    host.unbind(T4)
    host.set_iommu_group(T4, None)
    shutil.rmtree(host.root / "sys/kernel/iommu_groups/0", ignore_errors=True)
    os.unlink(host.root / "dev/vfio/noiommu-0")


def take(host: SysRoot) -> None:
    """What vfio-pci makes on bind in no-IOMMU mode: group 0, named so, and its node."""
    host.bind(T4, "vfio-pci")
    host.set_iommu_group(T4, 0)
    (host.root / "sys/kernel/iommu_groups/0/name").write_text("vfio-noiommu\n")
    host.add_dev_node("/dev/vfio/noiommu-0")


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


async def until_driver(got: list[Any], addr: str, driver: str) -> list[Any]:
    with anyio.fail_after(10):
        while not any(e.type == "driver-changed" and e.addr == addr and e.new == driver
                      for e in got):
            await anyio.sleep(0.005)
    await anyio.sleep(0.05)  # the rest of that batch (its probe-changed comes last)
    return list(got)


def enabled(answer: Any) -> bool:
    return bool(answer.iommu_enabled)


@pytest.fixture
def host(tmp_path: Path) -> SysRoot:
    s = vfio_noiommu_host(tmp_path / "host")
    let_go(s)
    return s


async def test_a_noiommu_bind_makes_the_group_and_the_answer_says_so(host: SysRoot) -> None:
    assert not enabled(gpuwatch.scan(host.root).probe("detect-vfio"))
    async with watching(host) as (w, source, got):
        assert not enabled(w.probe("detect-vfio"))
        take(host)
        source.push(host.uevent_props("bind", T4))
        events = await until_driver(got, T4, "vfio-pci")
        assert enabled(w.probe("detect-vfio"))
        assert enabled(gpuwatch.scan(host.root).probe("detect-vfio"))
        assert any(e.type == "probe-changed" and e.action == "detect-vfio" for e in events)
        assert w.model.function(T4).iommu_group == 0


async def test_the_unbind_drops_it_again(host: SysRoot) -> None:
    take(host)
    async with watching(host) as (w, source, got):
        assert enabled(w.probe("detect-vfio"))
        let_go(host)
        source.push(host.uevent_props("unbind", T4))
        await until_driver(got, T4, "")
        assert not enabled(w.probe("detect-vfio"))
        assert w.model.probe("detect-vfio") == gpuwatch.scan(host.root).probe("detect-vfio")


async def test_binds_that_touch_no_group_read_nothing_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = example_gpu_host(tmp_path / "host")
    reads: list[str] = []
    real = scan_mod.read_iommu

    def counting(paths: Any) -> Any:
        reads.append(paths.root)
        return real(paths)

    monkeypatch.setattr(watcher_mod, "read_iommu", counting)
    nv = "0000:01:00.0"
    async with watching(host) as (w, source, got):
        host.unbind(nv)
        source.push(host.uevent_props("unbind", nv))
        await until_driver(got, nv, "")
        host.bind(nv, "vfio-pci")  # the IOMMU's group stays as it was: nothing to read
        source.push(host.uevent_props("bind", nv))
        await until_driver(got, nv, "vfio-pci")
        source.push(host.uevent_props("change", nv))
        await anyio.sleep(0.05)
        assert reads == []
        host.remove_function("0000:02:00.0")  # a function with a group goes: read again
        source.push(host.uevent_props("remove", "0000:02:00.0"))
        with anyio.fail_after(10):
            while not reads:
                await anyio.sleep(0.005)
        assert enabled(w.probe("detect-vfio"))
