"""Groups shaped like real ones, switched on the simulated kernel and checked against its
tree (the ``driver`` links), not only against the model: a Turing card's four functions
behind a consumer board's root port, and two GPUs sharing one group beside a third card."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuwatch.errors import SwitchRefused
from gpuwatch.testing import SysRoot
from gpuwatch.testing.machines import turing_desktop_host
from gpuwatch.testing.simkernel import SimKernel, simulated_switch
from tests.test_switch_engine import NV, add_second_card

PORT = "0000:00:01.0"
TURING = ("0000:01:00.0", "0000:01:00.1", "0000:01:00.2", "0000:01:00.3")


def tree_driver(host: SysRoot, addr: str) -> str:
    """The driver the simulated kernel has the function on (its ``driver`` link)."""
    link = host.root / "sys/bus/pci/devices" / addr / "driver"
    return os.path.basename(os.readlink(link)) if link.is_symlink() else ""


async def test_a_turing_card_behind_its_port_switches_whole_both_ways(tmp_path: Path) -> None:
    """VGA, HDMI audio, USB-C (xhci_hcd) and UCSI (nvidia-gpu) with the CPU's root port in
    one group: to vfio every endpoint goes to vfio-pci; to nvidia the display to nvidia, the
    audio to snd_hda_intel, USB-C and UCSI stay on vfio-pci (the contract); the port is
    never written to, and each `switch-completed` names what the tree shows."""
    host = turing_desktop_host(tmp_path / "h")
    async with simulated_switch(host) as (w, sim, _e, events):
        want = {"vfio": ("vfio-pci",) * 4,
                "nvidia": ("nvidia", "snd_hda_intel", "vfio-pci", "vfio-pci")}
        for mode in ("vfio", "nvidia"):
            result = await w.switch(TURING[0], mode, timeout=10)
            assert tuple(tree_driver(host, a) for a in TURING) == want[mode]
            assert tree_driver(host, PORT) == "pcieport"
            assert {m.addr: m.driver for m in result.members} == {
                PORT: "pcieport", **{a: tree_driver(host, a) for a in TURING}}
        assert not [r for r in sim.record if PORT in " ".join(r)]
        ends = [e.type for e in events if getattr(e, "type", "").startswith("switch-")]
        assert ends == ["switch-started", "switch-completed"] * 2


async def test_two_gpus_in_one_group_each_guard_their_own_node(host: SysRoot) -> None:
    """Two GPUs behind one switch without ACS share group 13, a third card (group 15) keeps
    nvidia loaded: a client of the second GPU's /dev/nvidia2 refuses the switch, nothing
    written; once gone, both GPUs leave nvidia and come back to it."""
    add_second_card(host)
    second = "0000:01:00.2"
    host.add_function(second, device="0x2684", driver="nvidia", iommu_group=13, parent=PORT)
    info = host.root / "proc/driver/nvidia/gpus" / second
    info.mkdir(parents=True)
    (info / "information").write_text("Model: \t\t NVIDIA\nDevice Minor: \t 2\nBus Type: \t PCIe\n")
    host.add_dev_node("/dev/nvidia2")
    sim = SimKernel(host)
    async with simulated_switch(host, sim=sim) as (w, _s, _e, _events):
        sim.add_holder(4242, "python3", "/dev/nvidia2")
        with pytest.raises(SwitchRefused, match=r"pid 4242\) holds /dev/nvidia2"):
            await w.switch(NV, "vfio", timeout=5)
        assert sim.record == []
        host.remove_process(4242)
        await w.switch(NV, "vfio", timeout=5)
        assert [tree_driver(host, a) for a in (NV, second)] == ["vfio-pci", "vfio-pci"]
        assert ("write", "/sys/bus/pci/drivers/nvidia/unbind", second) in sim.record
        await w.switch(second, "nvidia", timeout=5)
        assert [tree_driver(host, a) for a in (NV, second)] == ["nvidia", "nvidia"]
