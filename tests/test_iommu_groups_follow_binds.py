"""``iommu_enabled`` follows the IOMMU groups as they come and go. On a host in no-IOMMU mode
(``vfio.enable_unsafe_noiommu_mode=1``, no IOMMU) vfio-pci makes a group of its own for each
card it binds and drops it when it lets go: ``sys/kernel/iommu_groups`` fills and empties with
no uevent of its own. The watcher reads it again with the bind or unbind, so the cached
`detect-vfio` says what a fresh scan says, in the batch of the driver change; binds that touch
no group read nothing more."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest
from watch_helpers import count_reads, until_driver, watching

import gpuwatch
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.testing.machines import vfio_noiommu_host

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


async def test_binds_that_touch_no_group_and_not_amdgpu_read_nothing_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = example_gpu_host(tmp_path / "host")
    host.add_kfd_node(0, 0)
    reads = count_reads(monkeypatch, "read_iommu")
    kfd_reads = count_reads(monkeypatch, "read_kfd")
    nv = "0000:01:00.0"
    async with watching(host) as (w, source, got):
        host.unbind(nv)
        source.push(host.uevent_props("unbind", nv))
        await until_driver(got, nv, "")
        host.bind(nv, "vfio-pci")  # the IOMMU's group stays as it was: nothing to read
        source.push(host.uevent_props("bind", nv))
        await until_driver(got, nv, "vfio-pci")
        source.push(host.uevent_props("change", nv))  # a re-read that changes nothing
        await anyio.sleep(0.05)
        assert reads == [] and kfd_reads == []
        host.remove_function("0000:02:00.0")  # a function with a group goes: read again
        source.push(host.uevent_props("remove", "0000:02:00.0"))
        with anyio.fail_after(10):
            while not reads:
                await anyio.sleep(0.005)
        assert enabled(w.probe("detect-vfio"))
