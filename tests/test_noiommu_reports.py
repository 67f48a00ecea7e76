"""A host in VFIO no-IOMMU mode (``vfio.enable_unsafe_noiommu_mode=1``): VFIO made an IOMMU
group named ``vfio-noiommu`` for the card. detect-vfio's ``iommu_enabled`` keeps its rule
(groups exist), but the operator reports tell the truth: no IOMMU, no passthrough offer, and
the group's node is ``/dev/vfio/noiommu-N``, whose holders block vfio-pci's unbind too."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import gpuwatch
from gpuwatch.errors import SwitchRefused
from gpuwatch.hostfs.noiommu import read_iommu_groups
from gpuwatch.testing import SysRoot
from gpuwatch.testing.machines import vfio_noiommu_host
from gpuwatch.testing.simkernel import SimKernel, simulated_switch
from tests.cli_helpers import run_main

T4 = "0000:00:05.0"


def test_status_says_there_is_no_iommu(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    s = vfio_noiommu_host(tmp_path / "h")
    assert gpuwatch.scan(s.root).probe("detect-vfio").iommu_enabled is True  # its fixed rule
    code, out, _ = run_main(capsys, "status", "--json", "--no-daemon", "--root", str(s.root))
    report = json.loads(out)
    assert code == 0
    assert report["iommu"]["enabled"] is False
    assert report["iommu"]["hint"].startswith("IOMMU group(s) 0: VFIO no-IOMMU mode")
    gpu = next(g for g in report["gpus"] if g["addr"] == T4)
    assert (gpu["vfio_node"], gpu["vfio_accessible"]) == ("/dev/vfio/noiommu-0", False)
    code, out, _ = run_main(capsys, "status", "--no-daemon", "--root", str(s.root))
    assert out.startswith("IOMMU:    disabled\n")
    assert "group 0 (VFIO no-IOMMU)" in out
    assert "/dev/vfio/noiommu-0: VFIO no-IOMMU group" in out


def test_list_offers_no_noiommu_group(tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    s = vfio_noiommu_host(tmp_path / "h")
    code, out, _ = run_main(capsys, "list", "--json", "--no-daemon", "--root", str(s.root))
    assert (code, json.loads(out)) == (0, [])
    code, out, _ = run_main(capsys, "list", "--no-daemon", "--root", str(s.root))
    assert "<hostdev" not in out and "the IOMMU is off" in out


@pytest.mark.parametrize("flags", [("--json",), ()])
def test_list_reads_the_groups_names_once(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch,
                                          flags: tuple[str, ...]) -> None:
    """The list and its header (is there an IOMMU at all?) share one read of every group's
    name: a host with a group per function has a thousand."""
    from gpuwatch import report
    from gpuwatch.cli import fast_report, list_cmd
    from gpuwatch.hostfs.noiommu import IommuGroups

    s = vfio_noiommu_host(tmp_path / "h")
    reads: list[str] = []

    def counted(root: str) -> IommuGroups:
        reads.append(root)
        return read_iommu_groups(root)

    for module in (fast_report, list_cmd, report):  # the stdlib path and the full one
        monkeypatch.setattr(module, "read_iommu_groups", counted)
    code, out, _ = run_main(capsys, "list", *flags, "--no-daemon", "--root", str(s.root))
    assert code == 0 and ("[]" in out or "the IOMMU is off" in out)
    assert reads == [str(s.root)]


def mixed_host(root: Path) -> SysRoot:
    """A real IOMMU (group 7: an A2 on vfio-pci) beside a device it does not cover, bound in
    no-IOMMU mode (group 8, named vfio-noiommu)."""
    s = SysRoot(root)
    s.add_iommu_unit("dmar0")
    s.add_function("0000:17:00.0", device="0x25b6", klass="0x030200", driver="vfio-pci",
                   iommu_group=7)
    s.add_vfio_group(7)
    s.add_function("0000:65:00.0", device="0x1eb8", klass="0x030200", driver="vfio-pci",
                   iommu_group=8)
    (s.root / "sys/kernel/iommu_groups/8/name").write_text("vfio-noiommu\n")
    s.add_dev_node("/dev/vfio/noiommu-8")
    return s


def test_a_real_iommu_beside_a_noiommu_group(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    s = mixed_host(tmp_path / "h")
    code, out, _ = run_main(capsys, "status", "--json", "--no-daemon", "--root", str(s.root))
    iommu = json.loads(out)["iommu"]
    assert code == 0
    assert (iommu["enabled"], iommu["kind"]) == (True, "intel")
    assert iommu["hint"].startswith("IOMMU group(s) 8: VFIO no-IOMMU")
    code, out, _ = run_main(capsys, "list", "--json", "--no-daemon", "--root", str(s.root))
    assert code == 0 and [g["addr"] for g in json.loads(out)] == ["0000:17:00.0"]


@pytest.mark.parametrize("odd", ["fifo", "dangling", "garbage", "directory"])
def test_an_odd_group_name_reads_as_a_real_group(tmp_path: Path, odd: str) -> None:
    """A FIFO (never waited on), a dangling link, garbage bytes or a directory where the name
    should be: not a no-IOMMU group, and the read returns."""
    s = mixed_host(tmp_path / "h")
    name = s.root / "sys/kernel/iommu_groups/8/name"
    name.unlink()
    if odd == "fifo":
        os.mkfifo(name)
    elif odd == "dangling":
        name.symlink_to("nowhere")
    elif odd == "garbage":
        name.write_bytes(b"vfio-noiommu\xff\x00junk")
    else:
        name.mkdir()
    groups = read_iommu_groups(str(s.root))
    assert (groups.noiommu, groups.real, groups.node(8)) == (frozenset(), True, "/dev/vfio/8")


async def test_a_userspace_driver_on_the_noiommu_node_refuses_the_switch(
        tmp_path: Path) -> None:
    """DPDK holding /dev/vfio/noiommu-0: vfio-pci's remove would wait for it forever. The
    plan refuses by name and nothing is written (the node is not /dev/vfio/0)."""
    s = vfio_noiommu_host(tmp_path / "h")
    s.add_module("nvidia")
    sim = SimKernel(s)
    sim.add_holder(5000, "dpdk-testpmd", "/dev/vfio/noiommu-0")
    assert sim._unbind_blocked(T4, "vfio-pci") is True  # the hazard, modelled
    async with simulated_switch(s, sim=sim) as (w, _s, _e, _ev):
        plan = await w.plan(T4, "nvidia")
        assert plan["refused"]["holders"] == [
            {"pid": 5000, "comm": "dpdk-testpmd", "node": "/dev/vfio/noiommu-0"}]
        with pytest.raises(SwitchRefused, match="dpdk-testpmd"):
            await w.switch(T4, "nvidia", timeout=5)
        assert w.probe("display-driver", addr=T4) == "vfio-pci"
    assert sim.record == []


# --------------------------------------------------------------------------- mediated devices

MDEV = "a297db4a-f4c2-11e6-90f6-d3b88d6c9525"
IGPU = "0000:00:02.0"


def gvtg_host(root: Path, *, iommu: bool, member_links: bool = True) -> SysRoot:
    """An Intel GVT-g host with one vGPU (an mdev under the iGPU): VFIO gives the mdev an
    emulated-IOMMU group of its own, named ``vfio-noiommu`` like a no-IOMMU group, but its node
    is ``/dev/vfio/N``. ``iommu``: VT-d on (the iGPU in group 1 and the mdev's group 12), or off
    (the mdev's group 0 is the only one). ``member_links`` False: a copy that lost the group's
    ``devices/`` links."""
    s = SysRoot(root)
    group = 12 if iommu else 0
    if iommu:
        s.add_iommu_unit("dmar0")
    s.add_function(IGPU, vendor="0x8086", device="0x3e92", klass="0x030000", driver="i915",
                   iommu_group=1 if iommu else None, subsystem_vendor="0x8086")
    mdev = s.root / f"sys/devices/pci0000:00/{IGPU}/{MDEV}"
    mdev.mkdir()
    (mdev / "uevent").write_text("MDEV_TYPE=i915-GVTg_V5_4\n")
    gdir = s.root / f"sys/kernel/iommu_groups/{group}"
    (gdir / "devices").mkdir(parents=True)
    (gdir / "name").write_text("vfio-noiommu\n")
    (mdev / "iommu_group").symlink_to(f"../../../kernel/iommu_groups/{group}")
    if member_links:
        (gdir / "devices" / MDEV).symlink_to(f"../../../../devices/pci0000:00/{IGPU}/{MDEV}")
    s.add_dev_node(f"/dev/vfio/{group}")
    return s


@pytest.mark.parametrize("member_links", [True, False])
def test_a_mediated_devices_group_is_no_noiommu_group(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], member_links: bool) -> None:
    """VT-d on and a vGPU created: its group is a VM's to open, and nothing says no-IOMMU
    mode, whether the group lists its member or only its node tells."""
    s = gvtg_host(tmp_path / "h", iommu=True, member_links=member_links)
    assert read_iommu_groups(str(s.root)) == (frozenset(), True, frozenset({12}))
    code, out, _ = run_main(capsys, "status", "--json", "--no-daemon", "--root", str(s.root))
    assert code == 0
    assert json.loads(out)["iommu"] == {"enabled": True, "kind": "intel", "hint": ""}


def test_a_mediated_devices_group_is_no_iommu_either(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """VT-d off: the vGPU's group is the only one. detect-vfio keeps its rule (a group
    exists), status says there is no IOMMU, and names no no-IOMMU mode that is not on."""
    s = gvtg_host(tmp_path / "h", iommu=False)
    assert gpuwatch.scan(s.root).probe("detect-vfio").iommu_enabled is True
    code, out, _ = run_main(capsys, "status", "--json", "--no-daemon", "--root", str(s.root))
    iommu = json.loads(out)["iommu"]
    assert (code, iommu["enabled"]) == (0, False)
    assert "no-IOMMU" not in iommu["hint"] and iommu["hint"].startswith("enable VT-d")


def test_a_group_without_member_links_is_told_by_its_node(tmp_path: Path) -> None:
    """A copy without the group's ``devices/`` links: ``/dev/vfio/noiommu-N`` is no-IOMMU
    VFIO's, ``/dev/vfio/N`` a mediated device's."""
    s = vfio_noiommu_host(tmp_path / "h")
    os.unlink(s.root / "sys/kernel/iommu_groups/0/devices" / T4)
    assert read_iommu_groups(str(s.root)).noiommu == frozenset({0})


def test_a_noiommu_device_cdev_is_seen_and_offered_to_no_vmm(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A kernel with the VFIO device cdev names a no-IOMMU group's device ``noiommu-vfioN``:
    the function has it, and vfio-backend recommends neither it nor the group to a VMM."""
    s = vfio_noiommu_host(tmp_path / "h", cdev=True)
    model = gpuwatch.scan(s.root)
    fn = next(f for f in model.functions() if f.addr == T4)
    assert (fn.vfio_dev, fn.vfio_cdev) == ("noiommu-vfio0", "/dev/vfio/devices/noiommu-vfio0")
    backend = model.probe("vfio-backend", addr=T4)
    assert (backend.cdev_node, backend.iommufd, backend.group_node, backend.recommended) == (
        "/dev/vfio/devices/noiommu-vfio0", True, "", "none")
    code, out, _ = run_main(capsys, "status", "--json", "--no-daemon", "--root", str(s.root))
    gpu = next(g for g in json.loads(out)["gpus"] if g["addr"] == T4)
    assert code == 0 and gpu["vfio_open"] == []
    assert gpu["members"][0]["vfio_cdev"] == "/dev/vfio/devices/noiommu-vfio0"


async def test_a_noiommu_device_cdev_follows_its_uevents(tmp_path: Path) -> None:
    from tests.test_watcher import harness_for, strip

    s = vfio_noiommu_host(tmp_path / "h")
    async with harness_for(s) as h:
        devpath = s.add_vfio_dev(T4, 0, noiommu=True)
        start = len(h.events)
        h.source.push(s.uevent_props("add", devpath))
        got = strip(await h.collect(start, 3))
        assert got[0] == {"type": "node-added", "path": "/dev/vfio/devices/noiommu-vfio0"}
        assert got[1]["type"] == "device-changed"
        assert got[1]["changed"] == ["vfio_dev", "vfio_cdev"]
        assert (got[1]["device"]["vfio_dev"], got[1]["device"]["vfio_cdev"]) == (
            "noiommu-vfio0", "/dev/vfio/devices/noiommu-vfio0")
        assert got[2]["type"] == "probe-changed" and got[2]["action"] == "detect-vfio"
        assert h.watcher.probe("vfio-backend", addr=T4).cdev_node == \
            "/dev/vfio/devices/noiommu-vfio0"


_OPENS_AS_OPEN_DECIDES = """
import json, os, sys
from gpuwatch.hostfs.noiommu import vfio_open
root, cdev = sys.argv[1], sys.argv[2]
os.setresuid(12345, 0, 0)  # real uid another user's, effective uid root: as open() goes by
nodes, ok = vfio_open(root, "/dev/vfio/7", True, [cdev], False)  # no group node: iommufd
opened = []
for node in nodes:
    try:
        os.close(os.open(root + node, os.O_RDWR))
        opened.append(True)
    except OSError:
        opened.append(False)
print(json.dumps([nodes, ok, all(opened)]))
"""


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to set a real uid apart")
def test_the_iommufd_nodes_are_judged_as_open_judges_them(tmp_path: Path) -> None:
    """``vfio_open_accessible`` of an iommufd-only card says what ``open(O_RDWR)`` of
    ``/dev/iommu`` and the cdev decides: by the effective uid (and capabilities), as the
    group node's answer is, not by the real uid ``access()`` takes by default (was: a
    process whose real uid is another user's was told it may not open what it may)."""
    import subprocess
    import sys

    cdev = "/dev/vfio/devices/vfio0"
    for node in ("/dev/iommu", cdev):
        path = tmp_path / node.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")
        path.chmod(0o600)  # root's alone
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _OPENS_AS_OPEN_DECIDES, str(tmp_path), cdev],
                         capture_output=True, text=True, timeout=50, check=True,
                         env={**os.environ, "PYTHONPATH": str(repo)}, cwd=repo)
    nodes, accessible, opened = json.loads(out.stdout)
    assert nodes == ["/dev/iommu", cdev]
    assert opened is True and accessible is opened
