"""Trees that capture tools damage, each answered as far as the tree allows and the same
way by the scan, the direct CLI, the full CLI and the watcher's re-reads: ``rsync -a``
(links and ``config`` kept, every text attribute dropped), attributes left empty, all NUL
or unreadable, a bus entry copied as an empty folder, IOMMU group listings of empty folders,
and a missing or empty ``proc/cmdline``."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from cli_helpers import run_main as cli
from watch_helpers import watching

import gpuwatch
from gpuwatch.core.pci import config_attr
from gpuwatch.hostfs import files
from gpuwatch.hostfs.files import pci_attr
from gpuwatch.jsonout import jsonable
from gpuwatch.testing import SysRoot, example_gpu_host

pytestmark = pytest.mark.timeout(120)

NV = "0000:01:00.0"
AUDIO = "0000:01:00.1"
IDS = ("vendor", "device", "class", "subsystem_vendor", "subsystem_device", "modalias")


def functions(root: Path) -> list[tuple[str, str, str, str, str, int]]:
    """Each function of a scan of ``root``: address, ids, class, driver, group."""
    return [(f.addr, f.vendor_id, f.device_id, f.class_, f.driver, f.iommu_group)
            for f in gpuwatch.scan(root).functions()]


def every_answer(root: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """``detect-vfio`` from the scan, the direct CLI (stdlib, outlines) and the full CLI,
    and ``status``/``list`` as JSON: each must say the same of one tree, and none fail."""
    got: dict[str, Any] = {"scan": jsonable(gpuwatch.scan(root).probe("detect-vfio"))}
    for where, extra in (("direct", ()), ("full", ("--no-daemon", "--fresh"))):
        code, out, err = cli(capsys, "probe", "detect-vfio", "--root", str(root), *extra)
        assert (code, err) == (0, ""), where
        got[where] = json.loads(out)["result"]
    for command in ("status", "list"):
        code, out, err = cli(capsys, command, "--json", "--no-daemon", "--root", str(root))
        assert (code, err) == (0, ""), command
        got[command] = json.loads(out)
    assert got["direct"] == got["scan"] == got["full"]
    return got


def rsync_like(s: SysRoot) -> SysRoot:
    s.add_config()
    s.drop_like_rsync()
    return s


# ------------------------------------------------------------------ config space


@pytest.mark.parametrize("size", [64, 256, 4096])
def test_config_says_what_sysfs_shows(tmp_path: Path, size: int) -> None:
    """Every id the kernel makes of config space, as sysfs spells it, from the first
    ``size`` bytes (a non-root read gets 64): a bridge's subsystem ids sit in a capability
    past those 64 bytes, so from 64 they are unknown rather than guessed."""
    s = example_gpu_host(tmp_path / "h")
    s.add_config(size=size)
    for addr in s.functions:
        folder = s.device_dir(addr)
        config = (folder / "config").read_bytes()
        assert len(config) == size
        bridge = (folder / "class").read_text().startswith("0x0604")
        for name in IDS:
            want = (folder / name).read_text().strip()
            if bridge and size == 64 and name not in ("vendor", "device", "class"):
                want = ""
            assert config_attr(config, name) == want, (addr, name)
        assert config_attr(config, "revision") == "0x00"


def test_config_of_no_device_says_nothing() -> None:
    """All ones (a device gone, or asleep in D3cold), zeros, or too short: no ids."""
    for config in (b"\xff" * 256, b"\0" * 256, b"\xde\x10\x04\x22"):
        assert {config_attr(config, name) for name in IDS} == {""}


@pytest.mark.parametrize("size", [16, 0x30, 0x34, 0x35])
def test_a_bridge_config_cut_short(size: int) -> None:
    """A bridge's config cut short before its capability pointer (a truncated capture): its
    ids still, and its subsystem ids unknown, not an IndexError."""
    config = bytearray(0x100)
    config[0:4] = b"\x86\x80\x10\x34"  # an Intel root port
    config[6] = 0x10  # a capability list
    config[9:12] = b"\x00\x04\x06"
    config[0x0E] = 1
    config[0x34] = 0x40
    config[0x40:0x48] = bytes([0x0D, 0, 0, 0, 0xDE, 0x10, 0x34, 0x12])
    cut = bytes(config[:size])
    assert (config_attr(cut, "vendor"), config_attr(cut, "class")) == ("0x8086", "0x060400")
    assert config_attr(cut, "subsystem_vendor") == config_attr(cut, "modalias") == ""
    assert config_attr(bytes(config), "subsystem_vendor") == "0x10de"


def test_present_attributes_win_over_config(tmp_path: Path) -> None:
    """``config`` stands in only for what has no text: an attribute present, garbage
    included, is read as written; an empty or all-NUL one is not there."""
    s = example_gpu_host(tmp_path / "h")
    s.add_config()
    folder = str(s.device_dir(NV))
    s.set_attr(NV, "vendor", "0x10dg\n")
    assert pci_attr(folder, "vendor") == "0x10dg"
    for blank in (b"", b"\0" * 4096, b"\n"):
        s.set_attr(NV, "vendor", blank)
        assert pci_attr(folder, "vendor") == "0x10de"
    s.set_attr(NV, "numa_node", b"")
    assert pci_attr(folder, "numa_node") == ""  # not made of config space


def test_a_normal_tree_never_reads_config(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback costs nothing where the attributes are there."""
    s = example_gpu_host(tmp_path / "h")
    s.add_config()
    opened: list[str] = []
    real = files.open_regular

    def counting(path: str) -> int:
        opened.append(path)
        return real(path)

    monkeypatch.setattr(files, "open_regular", counting)
    gpuwatch.scan(s.root)
    assert opened and not [p for p in opened if p.endswith("/config")]


# ------------------------------------------------------------------ rsync -a


def test_rsync_capture_answers_like_the_host_everywhere(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A GPU host copied with ``rsync -a`` shows its GPUs, with the host's ids, on every
    path (before: no vendor, device or class, so no GPU at all)."""
    live = example_gpu_host(tmp_path / "live")
    live.add_config()
    captured = rsync_like(example_gpu_host(tmp_path / "captured"))
    assert not (captured.device_dir(NV) / "class").exists()
    got = every_answer(captured.root, capsys)
    assert [g["addr"] for g in got["scan"]["gpus"]] == ["0000:00:02.0", NV]
    assert got == every_answer(live.root, capsys)
    assert functions(captured.root) == functions(live.root)


def test_rsync_capture_modalias_from_config(tmp_path: Path) -> None:
    """The ``modalias`` a switch matches against ``vfio_pci:`` aliases, from ``config``."""
    live = example_gpu_host(tmp_path / "live")
    live.add_config()
    captured = rsync_like(example_gpu_host(tmp_path / "captured"))
    for addr in live.functions:
        want = (live.device_dir(addr) / "modalias").read_text().strip()
        assert pci_attr(str(captured.device_dir(addr)), "modalias") == want


def test_rsync_capture_without_the_bus_listing_is_walked(tmp_path: Path) -> None:
    """A function folder holding only ``config`` is still a function to the walk."""
    live = example_gpu_host(tmp_path / "live")
    captured = rsync_like(example_gpu_host(tmp_path / "captured"))
    shutil.rmtree(captured.root / "sys/bus/pci/devices")
    assert [f[:4] for f in functions(captured.root)] == [f[:4] for f in functions(live.root)]


async def test_the_watcher_reads_a_new_function_from_config(tmp_path: Path) -> None:
    """A function added after the scan, in an rsync-like tree, is read as the scan reads
    it: the watcher's re-read falls back to ``config`` too."""
    s = rsync_like(example_gpu_host(tmp_path / "h"))
    async with watching(s) as (w, source, _got):
        s.remove_function(NV)
        source.push(s.uevent_props("remove", NV))
        s.add_function(NV, parent="0000:00:01.0", vendor="0x10de", device="0x2204",
                       klass="0x030000", driver="nvidia", iommu_group=13)
        rsync_like(s)
        source.push(s.uevent_props("add", NV))
        with anyio.fail_after(10):
            while NV not in [g.addr for g in w.probe("detect-vfio").gpus]:
                await anyio.sleep(0.01)
        fn = w.model.function(NV)
        assert (fn.vendor_id, fn.device_id, fn.class_) == ("0x10de", "0x2204", "0x0300")
        assert w.probe("detect-vfio") == gpuwatch.scan(s.root).probe("detect-vfio")


# ------------------------------------------------------------------ other damage


def _attributes(s: SysRoot) -> Iterator[Path]:
    """Every regular file under ``sys`` but ``config``."""
    for dirpath, _dirs, names in os.walk(s.root / "sys"):
        for name in names:
            path = Path(dirpath) / name
            if name != "config" and stat.S_ISREG(path.lstat().st_mode):
                yield path


def _emptied(s: SysRoot) -> None:
    for path in _attributes(s):
        path.write_bytes(b"")


def _nul_only(s: SysRoot) -> None:
    for path in _attributes(s):
        path.write_bytes(b"\0" * 4096)


@pytest.mark.parametrize("damage", [_emptied, _nul_only], ids=["empty", "nul"])
def test_blank_attributes_of_a_captured_tree(tmp_path: Path, damage: Callable[[SysRoot], None],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Links copied into folders and every attribute kept without its text (tar of files
    whose size read 0, or padded from nothing): ids from ``config``, and each driver from
    the driver folder that lists the function (an empty ``uevent`` names none, not "no
    driver")."""
    live = example_gpu_host(tmp_path / "live")
    live.add_config()
    captured = example_gpu_host(tmp_path / "captured")
    captured.add_config()
    captured.capture()
    damage(captured)
    assert functions(captured.root) == functions(live.root)
    got = every_answer(captured.root, capsys)
    assert [g["addr"] for g in got["scan"]["gpus"]] == ["0000:00:02.0", NV]


@pytest.fixture
def unreadable_mode_0(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Reads as a user who may not read a mode-0000 file under ``tmp_path``: root reads
    it anyway, so the refusal a non-root reader gets (EACCES) is made here."""
    real = os.open
    top = str(tmp_path)

    def guarded(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if (isinstance(path, str) and path.startswith(top) and "dir_fd" not in kwargs
                and flags & os.O_ACCMODE == os.O_RDONLY):
            with_mode = os.stat(path) if os.path.lexists(path) else None
            if (with_mode is not None and stat.S_ISREG(with_mode.st_mode)
                    and not with_mode.st_mode & 0o444):
                raise PermissionError(errno.EACCES, "Permission denied", path)
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", guarded)


@pytest.mark.usefixtures("unreadable_mode_0")
def test_unreadable_attributes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A capture made as root read as a user: the GPU's ids from a ``config`` that can be
    read; with that unreadable too, no GPU there, said the same way everywhere."""
    s = example_gpu_host(tmp_path / "h")
    s.add_config()
    for name in ("vendor", "device", "class"):
        os.chmod(s.device_dir(NV) / name, 0)
    assert "0000:01:00.0" in [g["addr"] for g in every_answer(s.root, capsys)["scan"]["gpus"]]
    os.chmod(s.device_dir(NV) / "config", 0)
    got = every_answer(s.root, capsys)
    assert [g["addr"] for g in got["scan"]["gpus"]] == ["0000:00:02.0"]


@pytest.mark.parametrize("layout", ["symlink", "captured"])
def test_a_bus_entry_that_is_an_empty_folder(tmp_path: Path, layout: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A copy that stopped early: the bus entry an empty folder, the function's own folder
    in ``sys/devices`` whole. It is read there, on every path."""
    live = example_gpu_host(tmp_path / "live")
    s = example_gpu_host(tmp_path / "h")
    if layout == "captured":
        s.capture()
    entry = s.root / "sys/bus/pci/devices" / NV
    if entry.is_symlink():
        entry.unlink()
    else:
        shutil.rmtree(entry)
    entry.mkdir()
    assert functions(s.root) == functions(live.root)
    assert every_answer(s.root, capsys)["scan"] == every_answer(live.root, capsys)["scan"]


def test_group_listings_of_empty_folders(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``iommu_groups/N/devices/<addr>`` copied as empty folders (and the functions'
    ``iommu_group`` links copied as folders): every group still as the host's."""
    live = example_gpu_host(tmp_path / "live")
    s = example_gpu_host(tmp_path / "h")
    s.capture()
    for group in (s.root / "sys/kernel/iommu_groups").iterdir():
        for entry in (group / "devices").iterdir():
            entry.unlink()
            entry.mkdir()
    assert functions(s.root) == functions(live.root)
    assert every_answer(s.root, capsys)["scan"] == every_answer(live.root, capsys)["scan"]


@pytest.mark.parametrize("cmdline", [None, "", "\0" * 4096])
def test_a_missing_or_empty_cmdline(tmp_path: Path, cmdline: str | None,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """No kernel command line to read: the IOMMU as its units say (here Intel's DMAR)."""
    s = example_gpu_host(tmp_path / "h")
    path = s.root / "proc/cmdline"
    if cmdline is None:
        path.unlink()
    else:
        path.write_text(cmdline)
    got = every_answer(s.root, capsys)
    assert (got["scan"]["iommu_enabled"], got["scan"]["iommu_kind"]) == (True, "intel")
