"""The root's own links (``sys``, ``proc``, ``dev``, ``var``), read as in a chroot at the root.

A fixture or captured tree whose ``sys`` is a link to ``/sys`` was read as this host's sysfs,
and passed for a live host: a switch under it would have run ``modprobe`` here. Every read and
every write under ``--root`` now reads the root's own links as ``chroot`` would, as it already
read the links inside sysfs.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import gpuwatch
from gpuwatch.hostfs.bootstate import DEFAULT_STOPPED_FILE, set_service_stopped, stopped_services
from gpuwatch.hostfs.files import NOWHERE, place_in_root, tree_dir
from gpuwatch.switch.hostops import is_real_sysfs
from gpuwatch.switch.poison import PoisonStore
from gpuwatch.testing import SysRoot, example_gpu_host

pytestmark = pytest.mark.timeout(120)

NV = "0000:01:00.0"


def linked_root(tmp_path: Path, target_of: dict[str, str]) -> Path:
    root = tmp_path / "linked"
    root.mkdir()
    for name, target in target_of.items():
        os.symlink(target, root / name)
    return root


def test_top_links_spelled_absolute_lead_into_the_tree_not_to_the_host(
        host: SysRoot, tmp_path: Path) -> None:
    """``sys -> <a real tree>/sys`` spelled absolute names ``<root>/<that path>``, as in a
    chroot: here nothing, so the model is empty (it read the other tree before)."""
    assert gpuwatch.scan(str(host.root)).functions()  # the tree the links name has a host
    root = linked_root(tmp_path, {name: f"{host.root}/{name}" for name in ("sys", "proc", "dev")})
    model = gpuwatch.scan(str(root))
    assert model.functions() == []
    assert model.probe("detect-host-devices").devices == ()


def test_top_links_to_this_hosts_folders_lead_back_into_the_tree(tmp_path: Path) -> None:
    """``sys -> /sys`` names the tree's own ``sys`` in a chroot: a loop, so nothing. Neither
    the host's sysfs nor its /dev is read, and the tree is no live host to run commands on."""
    root = linked_root(tmp_path, {"sys": "/sys", "proc": "/proc", "dev": "/dev"})
    assert tree_dir(str(root), "sys") == NOWHERE
    assert is_real_sysfs(str(root)) is False
    model = gpuwatch.scan(str(root))
    assert model.functions() == []
    assert model.probe("detect-host-devices").devices == ()


def test_a_relative_top_link_inside_the_tree_is_followed(host: SysRoot, tmp_path: Path) -> None:
    """Not a refusal of links: one that stays in the tree is read as the kernel would."""
    os.rename(host.root / "sys", host.root / "captured-sys")
    os.symlink("captured-sys", host.root / "sys")
    assert gpuwatch.scan(str(host.root)).probe("current-mode", addr=NV) == "nvidia"


def test_switch_records_are_written_in_the_tree_whatever_its_links_spell(
        tmp_path: Path) -> None:
    """``var -> /elsewhere/var`` spelled absolute: the switch's records (a stopped service, a
    poisoned group) land in ``<root>/elsewhere/var``, never in that folder of this host."""
    outside = tmp_path / "outside"
    outside.mkdir()
    root = example_gpu_host(tmp_path / "host").root
    shutil.rmtree(root / "var", ignore_errors=True)
    os.symlink(f"{outside}/var", root / "var")
    set_service_stopped(str(root), "nvidia-persistenced.service", True)
    assert list(outside.iterdir()) == []
    written = Path(place_in_root(str(root), DEFAULT_STOPPED_FILE))
    assert written == root / str(outside).lstrip("/") / "var/lib/gpuwatch/stopped.json"
    assert written.is_file()
    assert stopped_services(str(root)) == frozenset({"nvidia-persistenced.service"})
    store = PoisonStore(str(root))
    assert Path(store.path).is_relative_to(root)


def test_a_write_whose_links_loop_fails_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """``var`` naming itself: the write fails (ENOTDIR), and makes no folder anywhere that a
    later read of another looping path could find (a node would then seem present)."""
    root = linked_root(tmp_path, {"var": "/var", "dev": "/dev"})  # each names itself
    place = place_in_root(str(root), "var/lib/gpuwatch/stopped.json")
    assert place.startswith(NOWHERE + "/")
    with pytest.raises(NotADirectoryError):
        set_service_stopped(str(root), "nvidia-persistenced.service", True)
    assert sorted(p.name for p in root.iterdir()) == ["dev", "var"]
    assert stopped_services(str(root)) == frozenset()
    assert gpuwatch.scan(str(root)).probe("detect-host-devices").devices == ()


def test_a_root_given_relative_is_the_folder_it_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "host/sys").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert tree_dir("./host", "sys") == str(tmp_path / "host/sys")
    assert place_in_root("host", "var/lib/x.json") == str(tmp_path / "host/var/lib/x.json")
