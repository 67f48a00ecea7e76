"""``gpuwatch list``'s ``<hostdev>`` blocks are what a libvirt domain can take as they are:
only the functions the guest gets (none that stays on pcieport), each group's blocks once
(two GPUs of one group), and comments that stay XML whatever text the host or the tables
gave; scanned directly, the stdlib path without a daemon, and through one."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from cli_helpers import run_cli as run_cli_async
from cli_helpers import run_main as run_cli

from gpuwatch.service.testing import served_watcher, short_socket_dir
from gpuwatch.testing import SysRoot

pytestmark = pytest.mark.timeout(120)

PORT, RCEC = "0000:00:01.0", "0000:00:01.1"
GPU, AUDIO, GPU2 = "0000:01:00.0", "0000:01:00.1", "0000:02:00.0"


def xml_part(text: str) -> ET.Element:
    """Everything but the prose notes must paste into a domain's ``<devices>`` as XML."""
    body = "\n".join(line for line in text.splitlines() if not line.startswith("note: "))
    return ET.fromstring(f"<devices>{body}</devices>")


def block_addrs(devices: ET.Element) -> list[str]:
    """The host address of each ``<hostdev>``, as sysfs writes it."""
    out = []
    for hostdev in devices.iter("hostdev"):
        a = hostdev.find("source/address")
        assert a is not None
        out.append(f"{a.get('domain', '')[2:]}:{a.get('bus', '')[2:]}:"
                   f"{a.get('slot', '')[2:]}.{a.get('function', '')[2:]}")
    return out


def rcec_host(root: Path) -> SysRoot:
    """A root port, a root complex event collector (class 0x0807, on pcieport, as the
    kernel's portdrv binds one) and a GPU with its audio, all in IOMMU group 1, the card on
    vfio-pci: what `gpuwatch mode vfio` leaves (the collector stays on pcieport)."""
    s = SysRoot(root)
    s.add_iommu_unit("dmar0")
    s.add_bridge(PORT, iommu_group=1, driver="pcieport")
    s.add_function(RCEC, klass="0x080700", driver="pcieport", iommu_group=1,
                   vendor="0x8086", device="0x09a6")
    s.add_function(GPU, parent=PORT, klass="0x030000", driver="vfio-pci", iommu_group=1)
    s.add_function(AUDIO, parent=PORT, device="0x22ba", klass="0x040300", driver="vfio-pci",
                   iommu_group=1)
    s.add_vfio_group(1)
    s.add_module("vfio_pci")
    return s


def two_gpu_host(root: Path) -> SysRoot:
    """Two NVIDIA cards behind one root port without ACS: one IOMMU group for both, and
    for the first card's audio."""
    s = SysRoot(root)
    s.add_iommu_unit("dmar0")
    s.add_bridge(PORT, iommu_group=1, driver="pcieport")
    s.add_function(GPU, parent=PORT, klass="0x030000", driver="nvidia", iommu_group=1)
    s.add_function(AUDIO, parent=PORT, device="0x22ba", klass="0x040300",
                   driver="snd_hda_intel", iommu_group=1)
    s.add_function(GPU2, parent=PORT, device="0x2331", klass="0x030200", driver="nvidia",
                   iommu_group=1)
    return s


def hyphen_host(root: Path) -> SysRoot:
    """A captured tree whose GPUs' id files hold ``--`` (a damaged or hostile copy)."""
    s = SysRoot(root)
    s.add_iommu_unit("dmar0")
    s.add_function(GPU, klass="0x030000", driver="nvidia", iommu_group=1, device="0x22--04")
    s.add_function("0000:00:02.0", klass="0x030000", driver="i915", iommu_group=2,
                   vendor="0x80--86", device="0x46a6-")
    return s


#: The ways a `list` is answered without a daemon: the full command, the stdlib path.
DIRECT = (("--no-daemon",), ())


@pytest.mark.parametrize("how", DIRECT)
@pytest.mark.parametrize("managed", ["yes", "no"])
def test_a_function_pcieport_drives_gets_no_block(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], managed: str,
        how: tuple[str, ...]) -> None:
    """The collector stays on pcieport in both modes: a block for it would have libvirt
    take it from pcieport (managed='yes') or keep the VM from starting after `gpuwatch mode
    vfio` (managed='no': it is on no VFIO driver)."""
    s = rcec_host(tmp_path / "h")
    root = ["--root", str(s.root), "--managed", managed, *how]
    code, out, err = run_cli(capsys, "list", *root)
    assert (code, err) == (0, "")
    assert block_addrs(xml_part(out)) == [GPU, AUDIO]
    code, out, err = run_cli(capsys, "list", "--json", *root)
    assert (code, err) == (0, "")
    (gpu,) = json.loads(out)
    assert [f["addr"] for f in gpu["functions"]] == [GPU, AUDIO]
    # `status` still shows the whole group: the collector is in it.
    code, out, err = run_cli(capsys, "status", "--json", "--root", str(s.root), *how)
    assert [m["addr"] for m in json.loads(out)["gpus"][0]["members"]] == [PORT, RCEC, GPU, AUDIO]


@pytest.mark.parametrize("how", DIRECT)
def test_two_gpus_of_one_group_give_its_blocks_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], how: tuple[str, ...]) -> None:
    """Each function of the group once, in address order: pasted whole, the blocks make a
    domain libvirt takes (a function named twice, it refuses); both GPUs named."""
    s = two_gpu_host(tmp_path / "h")
    code, out, err = run_cli(capsys, "list", "--root", str(s.root), *how)
    assert (code, err) == (0, "")
    devices = xml_part(out)
    assert block_addrs(devices) == [GPU, AUDIO, GPU2]
    comments = [line for line in out.splitlines() if line.startswith("<!--")]
    assert len(comments) == 2
    assert f"GPU {GPU} " in comments[0] and f"with GPU {GPU2}" in comments[0]
    assert comments[1].startswith(f"<!-- GPU {GPU2} ") and f"blocks of GPU {GPU} above" \
        in comments[1]
    # JSON keeps one entry per GPU, each with its group's functions.
    code, out, err = run_cli(capsys, "list", "--json", "--root", str(s.root), *how)
    assert [[f["addr"] for f in g["functions"]] for g in json.loads(out)] == \
        [[GPU, AUDIO, GPU2]] * 2


@pytest.mark.parametrize("how", DIRECT)
def test_comments_stay_xml_whatever_the_ids_hold(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], how: tuple[str, ...]) -> None:
    """``--`` may not appear inside an XML comment: an id read from the host that holds it
    must not make the pasted blocks a document libvirt refuses."""
    s = hyphen_host(tmp_path / "h")
    code, out, err = run_cli(capsys, "list", "--root", str(s.root), *how)
    assert (code, err) == (0, "")
    devices = xml_part(out)  # raises ParseError on a "--" in a comment
    assert sorted(block_addrs(devices)) == ["0000:00:02.0", GPU]
    assert "0x22- -04" in out and "0x80- -86 0x46a6-," in out


async def test_through_a_daemon_the_blocks_are_the_same(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A daemon's answer gives the same blocks as a direct scan, for each host above."""
    for build in (rcec_host, two_gpu_host, hyphen_host):
        s = build(tmp_path / build.__name__)
        root = ["--root", str(s.root)]
        direct = run_cli(capsys, "list", "--no-daemon", *root)
        with short_socket_dir() as sockdir:
            async with served_watcher(str(s.root), f"{sockdir}/gw.sock") as served:
                served_out = await run_cli_async(capsys, "list", "--socket", served.path, *root)
        assert served_out == direct, build.__name__
        xml_part(direct[1])
