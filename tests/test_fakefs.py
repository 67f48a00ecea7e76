"""Hotplug races on a pyfakefs tree: a device that disappears while gpuwatch reads it."""

from __future__ import annotations

import shutil

import pytest
from pyfakefs.fake_filesystem import FakeFilesystem

import gpuwatch
from gpuwatch.core.observations import PciGone, PciSeen
from gpuwatch.core.uevent import UEvent
from gpuwatch.hostfs import scan as scan_mod
from gpuwatch.hostfs.scan import HostPaths, observe, read_function
from gpuwatch.settings import default_tables
from gpuwatch.testing import SysRoot, example_gpu_host

NV, NIC = "0000:01:00.0", "0000:02:00.0"
TABLES = default_tables()  # loaded from the real package before the fake filesystem is on


def vanish_on_first_read(monkeypatch: pytest.MonkeyPatch, host: SysRoot, addr: str) -> None:
    """The device directory disappears right as its first attribute is read (hot unplug)."""
    victim = str(host.device_dir(addr))
    real = scan_mod.read_attr

    def racing_read(path: str) -> str:
        if f"/{addr}/" in path:  # through the devpath or the bus/pci/devices link
            shutil.rmtree(victim, ignore_errors=True)
        return real(path)

    monkeypatch.setattr(scan_mod, "read_attr", racing_read)


def test_same_answers_on_a_fake_filesystem(fs: FakeFilesystem) -> None:
    example_gpu_host("/host")
    model = gpuwatch.scan("/host", TABLES)
    assert [g.addr for g in model.probe("detect-vfio").gpus] == ["0000:00:02.0", NV]
    assert [m.addr for m in model.probe("detect-vfio").gpus[1].group_members] == [
        NV,
        "0000:01:00.1",
    ]
    assert model.probe("detect-host-devices").render_node == "/dev/dri/renderD128"


def test_device_vanishing_mid_read_is_a_removal(
    fs: FakeFilesystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = example_gpu_host("/host")
    paths = HostPaths("/host")
    assert isinstance(read_function(paths, NIC, host.devpath(NIC)), PciSeen)
    vanish_on_first_read(monkeypatch, host, NIC)
    assert read_function(paths, NIC, host.devpath(NIC)) == PciGone(NIC)


def test_watcher_path_turns_a_vanished_device_into_device_removed(
    fs: FakeFilesystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = example_gpu_host("/host")
    model = gpuwatch.scan("/host", TABLES)
    event = UEvent.from_properties(host.uevent_props("change", NIC))
    vanish_on_first_read(monkeypatch, host, NIC)
    events = model.state.apply(observe(model.paths, TABLES, event))
    assert [e.type for e in events] == ["device-removed"]  # type: ignore[attr-defined]
    assert NIC not in model.state.functions
    assert model.probe("display-driver", addr=NV) == "nvidia"  # the rest of the model is intact


def test_scan_skips_a_device_that_vanishes_during_the_scan(
    fs: FakeFilesystem, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = example_gpu_host("/host")
    vanish_on_first_read(monkeypatch, host, NIC)
    model = gpuwatch.scan("/host", TABLES)
    assert NIC not in model.state.functions
    assert NV in model.state.functions
