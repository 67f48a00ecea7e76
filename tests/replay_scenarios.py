"""Recorded uevent files (tests/fixtures/uevents/*.jsonl) and the trees they were recorded on.

Each scenario builds its fixture host, then in phases changes the tree as the kernel did and
hands the next recorded lines to a ``--source file:PATH`` FIFO, waiting for the watcher to
apply them before the tree moves on (sysfs is read when an event is applied). ``check``
asserts the events the whole replay produced. The same scenarios run through the CLI
(``gpuwatch watch``), the library (``open_watcher``) and the socket (a subscriber).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.testing.modern import (
    GH_ADDR,
    SRIOV_PF,
    VGPU_TYPES,
    add_vfs,
    grace_hopper_host,
    sriov_gpu_host,
)

FIXTURES = Path(__file__).parent / "fixtures" / "uevents"
NV = "0000:01:00.0"
VGPU_VF = "0000:41:00.5"

Events = list[dict[str, Any]]


@dataclass
class Phase:
    change: Callable[[SysRoot], object]  # what the kernel did to the tree
    lines: slice  # the recorded uevents it sent
    done: Callable[[Events], bool]  # the watcher has applied them


@dataclass
class Scenario:
    name: str
    build: Callable[[Path], SysRoot]
    phases: list[Phase]
    check: Callable[[Events], None]

    def recorded(self) -> list[str]:
        return (FIXTURES / f"{self.name}.jsonl").read_text().splitlines()


def of(events: Events, etype: str) -> Events:
    return [e for e in events if e["type"] == etype]


def nothing(_: SysRoot) -> None:
    return None


# --------------------------------------------------------------------------- VFIO cdev


def _to_variant(cdev: bool) -> Callable[[SysRoot], None]:
    def change(s: SysRoot) -> None:
        s.unbind(GH_ADDR)
        s.bind(GH_ADDR, "nvgrace_gpu_vfio_pci")
        s.add_vfio_dev(GH_ADDR, 0, cdev=cdev)
    return change


def _back_to_nvidia(s: SysRoot) -> None:
    s.remove_vfio_dev(GH_ADDR)
    s.unbind(GH_ADDR)
    s.bind(GH_ADDR, "nvidia")


def _check_cdev(events: Events) -> None:
    changed = [e for e in of(events, "device-changed") if e["addr"] == GH_ADDR]
    assert any(e["device"]["vfio_cdev"] == "/dev/vfio/devices/vfio0" for e in changed), changed
    assert {"path": "/dev/vfio/devices/vfio0"} in [
        {"path": e["path"]} for e in of(events, "node-added")]
    assert changed[-1]["device"]["vfio_dev"] == "" and changed[-1]["device"]["vfio_cdev"] == ""
    drivers = [(e["old"], e["new"]) for e in of(events, "driver-changed")]
    assert ("nvidia", "nvgrace_gpu_vfio_pci") in drivers or ("", "nvgrace_gpu_vfio_pci") in drivers
    assert drivers[-1][1] == "nvidia"


def _check_no_cdev(events: Events) -> None:
    changed = [e for e in of(events, "device-changed") if e["addr"] == GH_ADDR]
    assert changed[0]["device"]["vfio_dev"] == "vfio0"
    assert all(e["device"]["vfio_cdev"] == "" for e in changed)
    assert not [e for e in of(events, "node-added") if "/devices/" in e["path"]]


def _vfio_phases(cdev: bool) -> list[Phase]:
    return [
        Phase(_to_variant(cdev), slice(0, 3), lambda ev: any(
            e["type"] == "device-changed" and e["device"]["vfio_dev"] == "vfio0"
            and (e["device"]["vfio_cdev"] != "" or not cdev) for e in ev)),
        Phase(_back_to_nvidia, slice(3, 6), lambda ev: any(
            e["type"] == "driver-changed" and e["new"] == "nvidia" for e in ev)),
    ]


# --------------------------------------------------------------------------- SR-IOV, vGPU


def _check_sriov(events: Events) -> None:
    assert [e["addr"] for e in of(events, "device-added")] == ["0000:41:00.4", "0000:41:00.5"]
    assert all(e["device"]["physfn"] == SRIOV_PF for e in of(events, "device-added"))
    assert [e["addr"] for e in of(events, "device-removed")] == ["0000:41:00.5", "0000:41:00.4"]
    pf = [e["device"]["sriov"] for e in of(events, "device-changed") if e["addr"] == SRIOV_PF]
    assert pf[0] == {"totalvfs": 16, "numvfs": 2, "vfs": ["0000:41:00.4", "0000:41:00.5"]}
    assert pf[-1] == {"totalvfs": 16, "numvfs": 0, "vfs": []}


def _choose_vgpu_type(s: SysRoot) -> None:
    s.set_vgpu(VGPU_VF, 1156, VGPU_TYPES[1:])
    s.add_vfio_dev(VGPU_VF, 7)


def _check_vgpu(events: Events) -> None:
    # The uevent's read or the poll, whichever sees it first: exactly one either way.
    assert [(e["addr"], e["vgpu"]) for e in of(events, "vgpu-changed")] == [
        (VGPU_VF, {"type": 1156, "creatable": [1156, 1157, 1158]})]
    assert any(e["addr"] == VGPU_VF and e["device"]["vfio_dev"] == "vfio7"
               for e in of(events, "device-changed"))


# --------------------------------------------------------------------------- health


def _check_aer(events: Events) -> None:
    errors = [(e["addr"], e["error_event"], e["online"], e["health"])
              for e in of(events, "device-error")]
    assert errors == [
        (NV, "BEGIN_RECOVERY", False, "recovering"),
        (NV, "FAILED_RECOVERY", False, "failed"),
        (NV, "BEGIN_RECOVERY", False, "recovering"),
        (NV, "SUCCESSFUL_RECOVERY", True, "ok"),
    ]


def _check_wedge(events: Events) -> None:
    wedged = of(events, "gpu-wedged")
    assert [{k: e[k] for k in ("addr", "card", "recovery", "pid", "task")} for e in wedged] == [
        {"addr": NV, "card": "card1", "recovery": ["rebind", "bus-reset"], "pid": 2817,
         "task": "gnome-shell"}]
    cleared = [e for e in of(events, "device-changed") if e["addr"] == NV]
    assert cleared and cleared[-1]["changed"] == ["health"]
    assert cleared[-1]["device"]["health"] == "ok"
    vfio = [e for e in of(events, "probe-changed") if e["action"] == "detect-vfio"]
    healths = [g["health"] for e in vfio for g in e["new"].get("gpus", []) if g["addr"] == NV]
    assert healths == ["wedged", "ok"]


SCENARIOS = [
    Scenario("grace_hopper_vfio_cdev", lambda p: grace_hopper_host(p, bound=False),
             _vfio_phases(True), _check_cdev),
    Scenario("vfio_without_cdev", lambda p: grace_hopper_host(p, bound=False),
             _vfio_phases(False), _check_no_cdev),
    Scenario("sriov_vfs_come_and_go", sriov_gpu_host, [
        Phase(lambda s: add_vfs(s, 2), slice(0, 2),
              lambda ev: len(of(ev, "device-added")) == 2),
        Phase(lambda s: s.remove_vfs(SRIOV_PF), slice(2, 4),
              lambda ev: len(of(ev, "device-removed")) == 2),
    ], _check_sriov),
    Scenario("vgpu_type_chosen", lambda p: sriov_gpu_host(p, vfs=2, vgpu=True), [
        Phase(_choose_vgpu_type, slice(0, 1), lambda ev: bool(of(ev, "vgpu-changed")) and any(
            e["type"] == "device-changed" for e in ev)),
    ], _check_vgpu),
    Scenario("aer_recovery", example_gpu_host, [
        Phase(nothing, slice(0, 4), lambda ev: len(of(ev, "device-error")) == 4),
    ], _check_aer),
    Scenario("drm_wedge", example_gpu_host, [
        Phase(nothing, slice(0, 1), lambda ev: bool(of(ev, "gpu-wedged"))),
        Phase(nothing, slice(1, 3), lambda ev: any(
            e["type"] == "device-changed" and e["device"]["health"] == "ok" for e in ev)),
    ], _check_wedge),
]


def parse_lines(text: str) -> Events:
    return [json.loads(line) for line in text.splitlines() if line.strip()]
