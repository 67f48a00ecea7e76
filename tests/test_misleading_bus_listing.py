"""A bus listing that misleads: ``sys/bus/pci/devices/ADDR`` dangling, a file, a FIFO, a loop,
a link out of the tree or to another function's folder, while the function's own folder is
still in ``sys/devices``. No kernel leaves its listing so (it adds the entry after the folder
and removes it before); a damaged copy of a tree may. The scan, the direct probe and the
watcher's rescans must then agree with what the watcher reads through its uevents' DEVPATH:
the function is there, in its own folder. A function whose folder is gone too is gone."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import anyio
import pytest
from watch_helpers import count_calls

import gpuwatch
from gpuwatch.cli.direct import run_direct
from gpuwatch.core.observations import PciGone
from gpuwatch.hostfs import scan as scan_mod
from gpuwatch.model import WATCHED_PROBES, HostModel
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.watch.watcher import open_watcher

pytestmark = pytest.mark.timeout(120)

NV, NV_AUDIO = "0000:01:00.0", "0000:01:00.1"
DAMAGES = ["dangling", "file", "fifo", "loop", "out-of-tree", "another-function", "empty-folder",
           "climbs-out-to-a-function", "absolute-out-to-a-function"]


def function_outside(host: SysRoot) -> Path:
    """A folder of the address outside the tree, holding another function's files (the
    HD-audio function's ids): what a link leading out of the tree would read on this host."""
    outside = host.root.parent / "outside" / NV
    if not outside.exists():
        shutil.copytree(host.device_dir(NV_AUDIO), outside, symlinks=True)
    return outside


def damage(host: SysRoot, addr: str, how: str) -> None:
    entry = host.root / "sys/bus/pci/devices" / addr
    os.unlink(entry)
    if how == "dangling":
        os.symlink("../../../devices/pci0000:00/nowhere", entry)
    elif how == "file":
        entry.write_text("0x10de\n")
    elif how == "fifo":
        os.mkfifo(entry)
    elif how == "loop":
        os.symlink(addr, entry)
    elif how == "out-of-tree":
        os.symlink("/", entry)
    elif how == "another-function":
        os.symlink(os.path.relpath(host.device_dir(NV_AUDIO), entry.parent), entry)
    elif how == "climbs-out-to-a-function":  # ../../../../../outside/ADDR: past the root
        os.symlink(os.path.relpath(function_outside(host), entry.parent), entry)
    elif how == "absolute-out-to-a-function":  # /tmp/…/outside/ADDR: the host's path
        os.symlink(function_outside(host), entry)
    else:
        entry.mkdir()


def same_host(a: HostModel, b: HostModel) -> bool:
    return (a.functions() == b.functions()
            and all(a.probe(action) == b.probe(action) for action in WATCHED_PROBES))


@pytest.fixture
def host(tmp_path: Path) -> SysRoot:
    return example_gpu_host(tmp_path / "host")


@pytest.mark.parametrize("how", DAMAGES)
def test_the_scan_reads_the_function_in_its_own_folder(host: SysRoot, how: str) -> None:
    intact = gpuwatch.scan(host.root)
    damage(host, NV, how)
    damaged = gpuwatch.scan(host.root)
    assert same_host(damaged, intact)
    assert damaged.function(NV).driver == os.path.basename(
        os.readlink(host.device_dir(NV) / "driver"))
    assert damaged.state.devpaths[NV] == intact.state.devpaths[NV]


@pytest.mark.parametrize("spelling",
                         ["{}/", "{}/.", "{}/../{leaf}", "/sys/{rest}", "{dots}/{rest}"])
def test_a_bus_link_spelled_otherwise_leads_where_the_kernels_does(host: SysRoot,
                                                                   spelling: str) -> None:
    """The kernel's own spelling (``../../../devices/…``) is taken as it stands; any other
    that names the same folder (a trailing slash, ``.``, ``x/..``, absolute, a ``..`` too
    many stopping at the root) is resolved, to the same devpath."""
    intact = gpuwatch.scan(host.root)
    entry = host.root / "sys/bus/pci/devices" / NV
    kernels = os.readlink(entry)
    assert kernels.startswith("../../../devices/")
    rest = kernels.removeprefix("../../../")
    entry.unlink()
    os.symlink(spelling.format(kernels, leaf=NV, rest=rest, dots="../" * 8), entry)
    damaged = gpuwatch.scan(host.root)
    assert damaged.state.devpaths[NV] == intact.state.devpaths[NV] == "/" + rest
    assert same_host(damaged, intact)


@pytest.mark.parametrize("how", ["dangling", "fifo", "another-function"])
def test_the_direct_probe_says_what_the_scan_says(
    host: SysRoot, how: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["probe", "detect-vfio", "--root", str(host.root), "--no-daemon"]
    assert run_direct(argv) == 0
    intact = capsys.readouterr().out
    damage(host, NV, how)
    assert run_direct(argv) == 0
    assert capsys.readouterr().out == intact
    assert NV in intact


def test_a_function_whose_folder_is_gone_too_is_gone(host: SysRoot) -> None:
    damage(host, NV_AUDIO, "dangling")
    shutil.rmtree(host.device_dir(NV_AUDIO))
    model = gpuwatch.scan(host.root)
    assert NV_AUDIO not in {f.addr for f in model.functions()}
    assert NV in {f.addr for f in model.functions()}


@pytest.mark.parametrize("how", ["climbs-out-to-a-function", "absolute-out-to-a-function"])
def test_nothing_is_read_outside_the_tree(host: SysRoot, how: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A bus entry leading out of the tree is read as in a chroot at the root: what it names
    outside is never read, whether the function's own folder is there or gone."""
    damage(host, NV, how)
    shutil.rmtree(host.device_dir(NV))
    model = gpuwatch.scan(host.root)
    assert NV not in {f.addr for f in model.functions()}
    assert NV_AUDIO in {f.addr for f in model.functions()}
    assert run_direct(["probe", "detect-vfio", "--root", str(host.root), "--no-daemon"]) == 0
    assert NV not in capsys.readouterr().out
    paths = scan_mod.HostPaths(host.root)
    assert isinstance(scan_mod.read_function(paths, NV), PciGone)


def test_sys_devices_is_walked_once_and_only_for_a_listing_that_misleads(
    host: SysRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    walks = count_calls(monkeypatch, scan_mod, "walk_functions")
    gpuwatch.scan(host.root)
    assert walks == []
    damage(host, NV, "dangling")
    damage(host, NV_AUDIO, "file")
    model = gpuwatch.scan(host.root)
    assert len(walks) == 1
    assert {NV, NV_AUDIO} <= {f.addr for f in model.functions()}


@pytest.mark.parametrize("how", ["dangling", "loop", "another-function"])
async def test_a_rescan_of_a_damaged_listing_removes_nothing_the_uevents_keep(
    host: SysRoot, how: str
) -> None:
    source = MemorySource()
    async with open_watcher(host.root, source, reconcile_interval=0,
                            cdi_poll_interval=0) as w:
        damage(host, NV, how)
        assert await w.resync("reconcile") == 0
        host.unbind(NV)  # then the kernel's word on it, through its DEVPATH
        source.push(host.uevent_props("unbind", NV))
        with anyio.fail_after(10):
            while w.model.function(NV).driver:
                await anyio.sleep(0.005)
        assert same_host(w.model, gpuwatch.scan(host.root))
        assert await w.resync("reconcile") == 0
