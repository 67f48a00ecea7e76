"""The KFD topology follows amdgpu's binds. amdkfd adds a GPU's topology node while amdgpu
binds it and removes it while amdgpu lets go, and sends no uevent for either (only /dev/kfd
itself has one, at module load, before any GPU is probed). The watcher reads the topology
again with the bind or unbind, in the same batch, so `amd-gfx-version` and `amd-gfx-target`
never lag the driver-changed event that caused them; binds of other drivers, and re-reads that
change nothing, do not read it (`test_iommu_groups_follow_binds` shows other drivers' binds
read neither this nor the groups)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from watch_helpers import count_reads, until_driver, watching

import gpuwatch
from gpuwatch.testing import SysRoot
from gpuwatch.testing.machines import instinct_host

pytestmark = pytest.mark.timeout(60)

CARD1, CARD2 = "0000:11:00.0", "0000:21:00.0"  # KFD nodes 1 and 2
MI300_GFX = 90402


def probe_changes(events: list[Any]) -> set[str]:
    return {e.action for e in events if e.type == "probe-changed"}


@pytest.fixture
def host(tmp_path: Path) -> SysRoot:
    # The first card an CARD1, the second an MI300X: which one answers shows.
    s = instinct_host(tmp_path / "host", cards=2)
    s.add_kfd_node(2, MI300_GFX)
    return s


async def test_an_unbind_takes_the_cards_node_out_of_the_answers(host: SysRoot) -> None:
    async with watching(host) as (w, source, got):
        assert w.probe("amd-gfx-target") == "gfx90a"
        host.unbind(CARD1)  # the kernel: amdkfd drops node 1 as amdgpu lets the card go
        host.remove_kfd_node(1)
        source.push(host.uevent_props("unbind", CARD1))
        events = await until_driver(got, CARD1, "")
        assert w.probe("amd-gfx-target") == "gfx942"
        assert w.probe("amd-gfx-version") == "9.4.0"
        assert {"amd-gfx-target", "amd-gfx-version"} <= probe_changes(events)
        assert w.model.probe("amd-gfx-target") == gpuwatch.scan(host.root).probe("amd-gfx-target")


async def test_a_bind_brings_the_cards_node_in(host: SysRoot) -> None:
    host.unbind(CARD1)
    host.unbind(CARD2)
    host.remove_kfd_node(1)
    host.remove_kfd_node(2)
    async with watching(host) as (w, source, got):
        assert w.probe("amd-gfx-version") == ""
        host.add_kfd_node(1, MI300_GFX)  # amdkfd adds the node while amdgpu probes the card
        host.bind(CARD2, "amdgpu")
        source.push(host.uevent_props("bind", CARD2))
        events = await until_driver(got, CARD2, "amdgpu")
        assert w.probe("amd-gfx-version") == "9.4.0"
        assert w.probe("detect-host-devices").amd_gfx_target == "gfx942"  # type: ignore[union-attr]
        assert "amd-gfx-version" in probe_changes(events)


async def test_a_card_that_goes_away_takes_its_node_along(host: SysRoot) -> None:
    async with watching(host) as (w, source, got):
        host.remove_kfd_node(1)
        host.remove_function(CARD1)
        source.push(host.uevent_props("remove", CARD1))
        with anyio.fail_after(10):
            while w.probe("amd-gfx-target") != "gfx942":
                await anyio.sleep(0.005)
        assert any(e.type == "device-removed" for e in got)


async def test_a_change_uevent_of_a_bound_card_reads_nothing_more(
    host: SysRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = count_reads(monkeypatch, "read_kfd")
    async with watching(host) as (_, source, got):
        host.unbind(CARD1)
        source.push(host.uevent_props("unbind", CARD1))
        await until_driver(got, CARD1, "")
        assert len(reads) == 1
        source.push(host.uevent_props("change", CARD2))
        host.bind(CARD1, "amdgpu")
        source.push(host.uevent_props("bind", CARD1))
        await until_driver(got, CARD1, "amdgpu")
        assert len(reads) == 2


async def test_a_rebind_in_one_batch_reads_the_renumbered_topology(host: SysRoot) -> None:
    """amdkfd numbers its nodes by their place in its list: a card amdgpu lets go of leaves
    the list, and binding it again appends it, so node 1 is now the other card's. An unbind
    and a bind read together leave the card on amdgpu as before (one read of the device per
    batch), and the topology must still be read again."""
    async with watching(host) as (w, source, got):
        assert w.probe("amd-gfx-target") == "gfx90a"
        unbind = host.uevent_props("unbind", CARD1)
        host.unbind(CARD1)
        host.bind(CARD1, "amdgpu")
        host.add_kfd_node(1, MI300_GFX)  # the second card moved up to node 1 ...
        host.add_kfd_node(2, 90010)  # ... and the rebound card came in last
        source.push(unbind)  # pushed together: the watcher drains them as one batch
        source.push(host.uevent_props("bind", CARD1))
        with anyio.fail_after(10):
            while w.probe("amd-gfx-target") != "gfx942":
                await anyio.sleep(0.005)
        assert w.probe("amd-gfx-version") == "9.4.0"
        assert w.model.probe("amd-gfx-target") == gpuwatch.scan(host.root).probe("amd-gfx-target")
        assert "amd-gfx-target" in probe_changes(got)
