"""A tree without the bus listing (``sys/bus/pci/devices`` missing or empty, as a capture
that took no link leaves it): the PCI functions are found by walking ``sys/devices``, on
every platform's layout, without following a link, opening a special file, or taking a
copy a capture made of a link for the function itself; and within its bounds."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from cli_helpers import run_main as cli

import gpuwatch
from gpuwatch.core.observations import PciSeen
from gpuwatch.core.uevent import UEvent
from gpuwatch.hostfs import scan as scan_mod
from gpuwatch.hostfs.scan import (
    HostPaths,
    function_entries,
    observe,
    read_console,
    scan,
    walk_functions,
)
from gpuwatch.settings import default_tables
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.testing.machines import single_gpu_desktop, vmd_host

pytestmark = pytest.mark.timeout(60)

NV = "0000:01:00.0"


def _no_bus(s: SysRoot) -> None:
    shutil.rmtree(s.root / "sys/bus/pci/devices")


def _entries(s: SysRoot) -> dict[str, str]:
    return dict(function_entries(HostPaths(s.root)))


def test_the_walk_finds_each_function_at_its_devpath(tmp_path: Path) -> None:
    s = example_gpu_host(tmp_path / "h")
    want = {addr: s.devpath(addr) for addr in s.functions}
    _no_bus(s)
    assert _entries(s) == want
    (s.root / "sys/bus/pci/devices").mkdir()  # there, but empty
    assert _entries(s) == want
    assert gpuwatch.scan(s.root).function(NV).driver == "nvidia"


def test_a_bus_listing_is_read_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a listing, ``sys/devices`` is never walked (a live host pays nothing)."""
    s = example_gpu_host(tmp_path / "h")

    def no_walk(sysdir: str) -> list[tuple[str, str]]:
        raise AssertionError("walked")

    monkeypatch.setattr(scan_mod, "walk_functions", no_walk)
    paths = HostPaths(s.root)
    assert [a for a, _ in function_entries(paths)] == sorted(s.functions)
    assert paths.walked == {}


def test_vmd_domains_behind_their_controller(tmp_path: Path) -> None:
    s = vmd_host(tmp_path / "h")
    want = {addr: s.devpath(addr) for addr in s.functions}
    _no_bus(s)
    assert _entries(s) == want
    model = gpuwatch.scan(s.root)
    assert model.function("10000:01:00.0").iommu_group == 6


def test_a_root_bus_under_a_platform_device(tmp_path: Path) -> None:
    """ARM hosts put the root bus under the host bridge's platform device."""
    s = example_gpu_host(tmp_path / "h")
    _no_bus(s)
    platform = s.root / "sys/devices/platform/soc/40000000.pcie"
    platform.mkdir(parents=True)
    (s.root / "sys/devices/pci0000:00").rename(platform / "pci0000:00")
    got = _entries(s)
    assert got[NV] == "/devices/platform/soc/40000000.pcie" + s.devpath(NV)[len("/devices"):]
    assert sorted(got) == sorted(s.functions)


def test_links_are_never_followed_and_copies_of_links_are_not_the_function(
        tmp_path: Path) -> None:
    """A link that loops, a link named as an address, and what a copier made of links
    (``physical_node``, ``iommu_group``, ``physfn`` folders holding copies of functions)
    stay out: each function once, at its own devpath."""
    s = example_gpu_host(tmp_path / "h")
    want = {addr: s.devpath(addr) for addr in s.functions}
    _no_bus(s)
    fn = s.root / ("sys" + s.devpath(NV))
    (fn / "loop").symlink_to("..")
    (fn / "0000:09:00.0").symlink_to("..")  # a link named as an address
    (s.root / "sys/devices/pci0000:00/up").symlink_to("../..")
    acpi = s.root / "sys/devices/LNXSYSTM:00/LNXSYBUS:00/PNP0A08:00"
    acpi.mkdir(parents=True)
    shutil.copytree(s.root / "sys/devices/pci0000:00", acpi / "physical_node", symlinks=True)
    shutil.copytree(s.root / "sys/devices/pci0000:00", acpi / "physical_node/pci0000:07",
                    symlinks=True)  # a copied root bus inside a copied link: still no
    shutil.copytree(fn, fn / "physfn" / "0000:0a:00.0", symlinks=True)
    assert _entries(s) == want


def test_special_files_are_not_opened_and_odd_names_are_skipped(tmp_path: Path) -> None:
    s = example_gpu_host(tmp_path / "h")
    _no_bus(s)
    fn = s.root / ("sys" + s.devpath(NV))
    (fn / "class").unlink()
    os.mkfifo(fn / "class")  # a FIFO where an attribute is: never waited on
    os.mkfifo(s.root / "sys/devices/pci0000:00/0000:00:1f.7")  # a FIFO named as a function
    (s.root / "sys/devices/pci0000:00" / "0000:00:1f.\udcff").mkdir()  # odd bytes
    got = _entries(s)
    assert NV in got and "0000:00:1f.7" not in got
    model = gpuwatch.scan(s.root)
    assert (model.function(NV).class_, model.function(NV).vendor_id) == ("", "0x10de")


def test_the_walk_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = example_gpu_host(tmp_path / "h")
    _no_bus(s)
    sysdir = str(s.root / "sys")
    monkeypatch.setattr(scan_mod, "WALK_MAX_FUNCTIONS", 2)
    assert len(walk_functions(sysdir)) == 2
    monkeypatch.setattr(scan_mod, "WALK_MAX_FUNCTIONS", 10**6)
    monkeypatch.setattr(scan_mod, "WALK_MAX_DIRS", 1)  # sys/devices itself: no root bus yet
    assert walk_functions(sysdir) == []
    monkeypatch.setattr(scan_mod, "WALK_MAX_DIRS", 10**6)
    monkeypatch.setattr(scan_mod, "WALK_MAX_DEPTH", 2)  # the root bus (1), its functions (2)
    assert {a for a, _ in walk_functions(sysdir)} == {
        a for a in s.functions if s.devpath(a).count("/") == 3}
    deep = s.root / "sys/devices/LNXSYSTM:00/a"
    for _ in range(200):  # no bound but the depth would end this
        deep = deep / "a"
    deep.mkdir(parents=True)
    monkeypatch.setattr(scan_mod, "WALK_MAX_DEPTH", 32)
    assert len(walk_functions(sysdir)) == len(s.functions)


def test_a_devices_folder_that_is_a_link_is_not_walked(tmp_path: Path) -> None:
    """``sys/devices`` a link (to the host's ``/sys/devices``, or anywhere): never followed."""
    s = example_gpu_host(tmp_path / "h")
    _no_bus(s)
    (s.root / "sys/devices").rename(s.root / "elsewhere")
    (s.root / "sys/devices").symlink_to(s.root / "elsewhere")
    assert walk_functions(str(s.root / "sys")) == []


def test_a_missing_tree_has_no_functions(tmp_path: Path) -> None:
    assert walk_functions(str(tmp_path / "sys")) == []
    (tmp_path / "sys").mkdir()
    (tmp_path / "sys/devices").write_text("not a folder")
    assert walk_functions(str(tmp_path / "sys")) == []


@pytest.mark.parametrize("devpath", ["/bus/pci/devices/" + NV, "/devices/../bus/x/" + NV])
def test_a_uevent_in_another_spelling_reads_the_walked_function(tmp_path: Path,
                                                                devpath: str) -> None:
    """A line replayed over such a tree (a JSONL source) that spells the function another
    way than the kernel is read where the walk found it, under the devpath the scan keeps:
    the model sees no other device."""
    s = example_gpu_host(tmp_path / "h")
    _no_bus(s)
    paths = HostPaths(s.root)
    tables = default_tables()
    before = {f.addr: f for f in scan(paths, tables).functions}
    s.unbind(NV)
    for action in ("change", "unbind"):
        event = UEvent(action, devpath, "pci", {"PCI_SLOT_NAME": NV})
        seen = observe(paths, tables, event)[0]
        assert isinstance(seen, PciSeen)
        assert seen == before[NV]._replace(driver="", vgpu=None)
        assert seen.devpath == s.devpath(NV)


@pytest.mark.parametrize("command", ["status", "list"])
def test_the_boot_display_is_read_where_the_walk_found_it(
        tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``boot_vga`` is in no probe answer: a report that reads it beside the answers (no
    daemon, the stdlib path; or a daemon's) reads it in the walked folder, so the only
    display is kept for the host as the full command keeps it."""
    monkeypatch.delenv("GPUWATCH_CONFIG", raising=False)
    monkeypatch.delenv("GPUWATCH_PROC_READ_TIMEOUT", raising=False)
    s = single_gpu_desktop(tmp_path / "h")
    _no_bus(s)
    root = ["--root", str(s.root)]
    full = cli(capsys, command, "--json", "--no-daemon", *root)
    fast = cli(capsys, command, "--json", *root)  # no daemon there: one stdlib scan
    assert fast == full
    got = json.loads(fast[1])
    gpus = got["gpus"] if command == "status" else got
    assert [g["kept_for_host"] for g in gpus] == [True]
    assert read_console(str(s.root), [("0000:01:00.0", "", "0x0300"),
                                    ("0000:01:00.1", "", "0x0403")]).boot_vga == {
        "0000:01:00.0"}
