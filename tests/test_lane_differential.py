"""The bind/unbind lane (`observe_batch`, `batch_facts`, `DriversSeen`) against the way it
replaces (`observe` and `uevent_facts` per collapsed uevent), over generated histories.

Two models watch one tree: each batch of uevents goes through the watcher's collapse, then one
model takes what the lane reads and the other what `observe` reads, event by event, as the
watcher did before the lane. Both must end with the same records, groups and answers, and
have published the same events in the same order.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gpuwatch.core.events import event_json, stamp
from gpuwatch.core.observations import Observation
from gpuwatch.core.pci import is_gpu_class
from gpuwatch.core.probes import WATCHED_PROBES, is_amd_card, nvidia_usable
from gpuwatch.core.results import GpuInfo
from gpuwatch.core.state import HostState
from gpuwatch.core.uevent import UEvent
from gpuwatch.core.uevent_facts import batch_facts, uevent_facts
from gpuwatch.hostfs import scan as scan_mod
from gpuwatch.hostfs.scan import HostPaths
from gpuwatch.settings import default_tables
from gpuwatch.testing import SysRoot
from gpuwatch.watch.watcher import Watcher

#: A vfio-pci variant the tables list by a name that says nothing of VFIO.
VARIANT = "acme_passthru"
TABLES = default_tables().model_copy(update={"vfio_variant_drivers": (VARIANT,)})

GPU, AUDIO, NIC, LONE, IGPU = ("0000:01:00.0", "0000:01:00.1", "0000:02:00.0",
                               "0000:03:00.0", "0000:00:02.0")
PF, VF1, VF2, AMD = "0000:04:00.0", "0000:04:00.1", "0000:04:00.2", "0000:05:00.0"
GPU2 = "0000:06:00.0"
ADDRS = (GPU, AUDIO, NIC, LONE, IGPU, PF, AMD, VF1, VF2, GPU2)
DRIVERS = ("igb", "ixgbe", "nvidia", "snd_hda_intel", "vfio-pci", "mlx5_vfio_pci", VARIANT,
           "amdgpu", "i915")
IDS: dict[str, tuple[str, str, str]] = {
    GPU: ("0x10de", "0x2204", "0x030000"),
    AUDIO: ("0x10de", "0x1aef", "0x040300"),
    NIC: ("0x8086", "0x1533", "0x020000"),
    LONE: ("0x8086", "0x10fb", "0x020000"),
    IGPU: ("0x8086", "0x9a49", "0x030000"),
    PF: ("0x15b3", "0x1017", "0x020000"),
    AMD: ("0x1002", "0x744c", "0x030000"),
    GPU2: ("0x10de", "0x2204", "0x030000"),
}
GROUPS = {GPU: 13, AUDIO: 13, NIC: 14, LONE: None, IGPU: 0, PF: 20, AMD: 15, GPU2: 16}
FIRST_DRIVER = {GPU: "nvidia", AUDIO: "snd_hda_intel", NIC: "igb", LONE: None, IGPU: "i915",
                PF: "mlx5_core", AMD: "amdgpu", GPU2: "nvidia"}


def _vfio_family(driver: str) -> bool:
    return "vfio" in driver or driver == VARIANT


@dataclass
class Host:
    """The tree and what its kernel would say; ``noiommu`` groups come with VFIO drivers."""

    sys: SysRoot
    noiommu: set[str] = field(default_factory=set)
    captured: bool = False  # a capture's copies: the builder cannot remove what it copied
    next_group: int = 40
    next_vfio: int = 1

    def props(self, action: str, addr: str, **extra: str) -> dict[str, str]:
        return self.sys.uevent_props(action, addr, **extra)


def _build(root: Path, where: str) -> Host:
    sysroot = SysRoot(root, layout="flat" if where == "flat" else "symlink")
    for addr in IDS:
        vendor, device, klass = IDS[addr]
        sysroot.add_function(addr, vendor=vendor, device=device, klass=klass,
                             driver=FIRST_DRIVER[addr], iommu_group=GROUPS[addr])
    sysroot.set_attr(IGPU, "boot_vga", "1")
    sysroot.enable_sriov(PF, 4)
    sysroot.add_drm("card0", IGPU)
    sysroot.add_drm("card1", GPU)
    sysroot.add_drm("card2", AMD)
    sysroot.add_drm("renderD129", AMD)
    sysroot.add_module("nvidia")
    sysroot.add_cdi_spec()
    if where == "captured":
        sysroot.capture()
    host = Host(sysroot, captured=where == "captured")
    host.noiommu.add(LONE)
    return host


# --------------------------------------------------------------------------- steps

Uevents = list[dict[str, str]]
Step = Callable[[Host], Uevents]


def unbind(addr: str) -> Step:
    def step(h: Host) -> Uevents:
        fn = h.sys._fns.get(addr)
        if fn is None or fn.driver is None:
            return []
        out: Uevents = []
        if fn.vfio_dev is not None:
            devpath = h.sys.remove_vfio_dev(addr)
            out.append(h.props("remove", devpath))
        h.sys.unbind(addr)
        if addr in h.noiommu and fn.group is not None and fn.group >= 40:
            h.sys.set_iommu_group(addr, None)  # no-IOMMU VFIO's group goes with its driver
        out.append(h.props("unbind", addr))
        return out
    return step


def bind(addr: str, driver: str, vfio_dev: bool) -> Step:
    def step(h: Host) -> Uevents:
        fn = h.sys._fns.get(addr)
        if fn is None:
            return []
        out = unbind(addr)(h) if fn.driver is not None else []
        if _vfio_family(driver) and addr in h.noiommu and fn.group is None:
            h.sys.set_iommu_group(addr, h.next_group)
            h.next_group += 1
        h.sys.bind(addr, driver)
        out.append(h.props("bind", addr))
        if vfio_dev and (_vfio_family(driver) or driver == "nvidia"):
            devpath = h.sys.add_vfio_dev(addr, h.next_vfio)
            h.next_vfio += 1
            out.append(h.props("add", devpath))
        return out
    return step


def vgpu(addr: str, current: int) -> Step:
    def step(h: Host) -> Uevents:
        if addr in h.sys._fns:
            h.sys.set_vgpu(addr, current, [(1, "A"), (2, "B")])
        return []  # no uevent says so: the next read of the function finds it
    return step


def replace(addr: str, same_ids: bool, regroup: bool) -> Step:
    """The function removed and a card added at its address (remove, add uevents)."""
    def step(h: Host) -> Uevents:
        fn = h.sys._fns.get(addr)
        if fn is None or addr == PF or fn.physfn or h.captured:
            return []
        group = fn.group
        out: Uevents = []
        for name in list(fn.drm):
            devpath = h.sys._drm[name]
            h.sys.remove_drm(name)
            out.append(h.props("remove", devpath))
        h.sys.remove_function(addr)
        out.append(h.props("remove", addr))
        vendor, device, klass = IDS[addr] if same_ids else ("0x1af4", "0x1041", "0x020000")
        if regroup and group is not None:
            group = h.next_group
            h.next_group += 1
        h.sys.add_function(addr, vendor=vendor, device=device, klass=klass, driver=None,
                           iommu_group=group)
        h.noiommu.discard(addr)
        out.append(h.props("add", addr))
        return out
    return step


def error(addr: str, event: str) -> Step:
    def step(h: Host) -> Uevents:
        if addr not in h.sys._fns:
            return []
        return [h.props("change", addr, ERROR_EVENT=event, DEVICE_ONLINE="1")]
    return step


def wedge(card: str) -> Step:
    def step(h: Host) -> Uevents:
        if card not in h.sys._drm:
            return []
        return [h.props("change", h.sys._drm[card], WEDGED="rebind", PID="7", TASK="x")]
    return step


def vfs(count: int) -> Step:
    def step(h: Host) -> Uevents:
        out: Uevents = []
        if h.captured:
            return out
        for vf in h.sys.remove_vfs(PF):
            out.append(h.props("remove", vf))
        for vf in h.sys.add_vfs(PF, count, driver="nvidia", first_group=60):
            out.append(h.props("add", vf))
            out.append(h.props("bind", vf))
        return out
    return step


def odd(addr: str, kind: str) -> Step:
    """A hand-written line for the function: its ids left out, a DEVNAME it should not have,
    its bus entry as DEVPATH, or ids of another card."""
    def step(h: Host) -> Uevents:
        if addr not in h.sys._fns:
            return []
        action = "bind" if h.sys._fns[addr].driver else "unbind"
        props = h.props(action, addr)
        if kind == "no-ids":
            del props["PCI_ID"], props["PCI_CLASS"]
        elif kind == "devname":
            if not (h.sys.root / "dev/dri/renderD130").exists():
                h.sys.add_dev_node("/dev/dri/renderD130")  # no uevent of its own
            props["DEVNAME"] = "dri/renderD130"
        elif kind == "bus":
            props["DEVPATH"] = "/bus/pci/devices/" + addr
        elif kind == "other-ids":
            props["PCI_ID"] = "1AF4:1041"
        return [props]
    return step


def module(loaded: bool) -> Step:
    def step(h: Host) -> Uevents:
        if loaded:
            h.sys.add_module("nvidia")
        else:
            h.sys.remove_module("nvidia")
        return [{"ACTION": "add" if loaded else "remove", "SUBSYSTEM": "module",
                 "DEVPATH": "/module/nvidia"}]
    return step


def drm(addr: str, name: str) -> Step:
    """A DRM minor comes (or goes) under the function, with its uevent."""
    def step(h: Host) -> Uevents:
        if h.captured:
            return []
        if name in h.sys._drm:
            devpath = h.sys._drm[name]
            h.sys.remove_drm(name)
            return [h.props("remove", devpath)]
        if addr not in h.sys._fns:
            return []
        return [h.props("add", h.sys.add_drm(name, addr))]
    return step


addr_st = st.sampled_from(ADDRS)
STEPS: dict[str, Callable[..., Step]] = {
    "unbind": unbind, "bind": bind, "vgpu": vgpu, "replace": replace, "error": error,
    "wedge": wedge, "vfs": vfs, "odd": odd, "drm": drm, "module": module,
}
#: A step as its name and arguments (what a failing example prints).
step_st: st.SearchStrategy[tuple[Any, ...]] = st.one_of(
    st.tuples(st.just("unbind"), addr_st),
    st.tuples(st.just("bind"), addr_st, st.sampled_from(DRIVERS), st.booleans()),
    st.tuples(st.just("vgpu"), st.just(GPU), st.integers(0, 2)),
    st.tuples(st.just("replace"), st.sampled_from((GPU, NIC, LONE, AUDIO, AMD, GPU2)),
              st.booleans(), st.booleans()),
    st.tuples(st.just("error"), addr_st, st.sampled_from(["BEGIN_RECOVERY", "FAILED_RECOVERY",
                                                          "SUCCESSFUL_RECOVERY"])),
    st.tuples(st.just("wedge"), st.sampled_from(["card0", "card1"])),
    st.tuples(st.just("vfs"), st.integers(0, 2)),
    st.tuples(st.just("module"), st.booleans()),
    st.tuples(st.just("odd"), addr_st, st.sampled_from(["no-ids", "devname", "bus",
                                                         "other-ids"])),
    st.tuples(st.just("drm"), st.sampled_from((GPU, AMD, NIC)),
              st.sampled_from(["card3", "renderD131"])),
)
#: After a step: "pump" its uevents (with those held back), "hold" them for the next batch,
#: or "lose" them (a source that drops lines: the reconcile would find what they said).
fate_st = st.sampled_from(["pump", "pump", "pump", "hold", "lose"])


# --------------------------------------------------------------------------- the two ways


def _lane(paths: HostPaths, state: HostState, batch: list[UEvent]) -> list[Any]:
    reads = Watcher._collapse(batch)
    observations = scan_mod.observe_batch(paths, TABLES, reads, state.devpaths)
    observations.extend(batch_facts(batch))
    return state.apply(observations)


def _general(paths: HostPaths, state: HostState, batch: list[UEvent]) -> list[Any]:
    reads = Watcher._collapse(batch)
    observations: list[Observation] = []
    for event in reads:
        observations.extend(scan_mod.observe(paths, TABLES, event))
    for event in batch:
        observations.extend(uevent_facts(event))
    return state.apply(observations)


def _dumped(events: list[Any]) -> list[dict[str, Any]]:
    return [e.model_dump(exclude={"seq", "time"}) for e in events]


def _same(lane: HostState, general: HostState) -> None:
    assert lane.functions == general.functions
    assert lane.groups == general.groups
    assert lane.devpaths == general.devpaths
    assert lane.boot_vga == general.boot_vga
    assert lane.wedge_recovery == general.wedge_recovery
    for action in WATCHED_PROBES:
        assert lane.answer(action) == general.answer(action), action
    # And no answer is left stale: each is what the records say now.
    gpus = [a for a, fn in sorted(lane.functions.items()) if is_gpu_class(fn.class_)]
    assert lane.answer("detect-vfio").gpus == tuple(
        GpuInfo(**lane.functions[a].__dict__, group_members=lane.group_members(a)) for a in gpus)
    on_nvidia = any(lane.functions[a].driver == "nvidia" for a in gpus)
    assert lane.answer("detect-gpu") == nvidia_usable(lane.modules, lane.cdi, on_nvidia)
    assert lane.answer("detect-host-devices").gpu == lane.answer("detect-gpu")
    assert lane.answer("detect-amd-gpu") == any(
        is_amd_card(name, node, lane.functions) for name, node in lane.drm.items())


@pytest.fixture(scope="module")
def shm() -> Iterator[Path]:
    """tmpfs (inode numbers name one directory for good: the identity shortcut applies)."""
    if not (os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)):
        pytest.skip("no writable /dev/shm")
    path = Path(tempfile.mkdtemp(prefix="gpuwatch-lane-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_history(root: Path, steps: list[tuple[tuple[Any, ...], str]], where: str,
                lose_swaps: bool = False) -> None:
    """Play ``steps`` on a fresh host at ``root``, each batch through both ways, comparing
    the events of every batch and the models after it. A swapped card's lost uevents are
    delivered unless ``lose_swaps``."""
    host = _build(root, where)
    lane_paths, general_paths = HostPaths(host.sys.root), HostPaths(host.sys.root)
    lane = HostState(TABLES, scan_mod.scan(lane_paths, TABLES))
    general = HostState(TABLES, scan_mod.scan(general_paths, TABLES))
    held: Uevents = []
    seq = 1
    for (name, *args), fate in steps:
        uevents = STEPS[name](*args)(host)
        if fate == "lose" and name == "replace" and not lose_swaps:
            fate = "pump"  # see test_a_card_swapped_behind_lost_uevents_is_not_noticed
        if fate == "lose":
            continue
        held.extend(uevents)
        if fate == "hold":
            continue
        batch = [UEvent.from_properties(p) for p in held]
        held = []
        got = _lane(lane_paths, lane, batch)
        expected = _general(general_paths, general, batch)
        assert _dumped(got) == _dumped(expected)
        _same(lane, general)
        # The lines the log and sockets get: the cached ones are pydantic's bytes.
        stamp(got, seq, "2026-12-03T07:00:00.123456Z")
        seq += len(got)
        for event in got:
            assert event_json(event) == event.model_dump_json()


@settings(max_examples=int(os.environ.get("GPUWATCH_LANE_EXAMPLES", "100")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(step_st, fate_st), min_size=1, max_size=14),
       st.sampled_from(["tmpfs", "disk", "flat", "captured"]))
def test_the_lane_gives_what_the_general_path_gives(
    shm: Path, tmp_path_factory: pytest.TempPathFactory,
    steps: list[tuple[tuple[Any, ...], str]],
    where: str,
) -> None:
    """Binds, unbinds, VFIO devices, no-IOMMU groups, vGPU files, swapped cards, SR-IOV VFs,
    errors, wedges, DRM minors, module loads and odd hand-written lines, batched in any way
    and some lost, on tmpfs (the identity shortcut), a disk (none), a flat bus and a captured
    tree: the lane's models and events are the general path's."""
    # A known gap, pinned by its own strict xfail below (test_a_bus_spelling_on_a_captured_
    # tree_keeps_two_paths): left out here so that a random draw cannot turn CI red on it.
    assume(not (where == "captured" and any(name == "odd" and args[-1] == "bus"
                                            for (name, *args), _ in steps)))
    parent = tmp_path_factory.mktemp("lane") if where == "disk" else shm
    root = Path(tempfile.mkdtemp(dir=parent))
    try:
        run_history(root / "host", steps, where)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------- found by the above


@pytest.mark.parametrize("where", ["tmpfs", "disk"])
def test_a_listed_variants_no_iommu_group_goes_with_it_through_the_lane(
    shm: Path, tmp_path: Path, where: str
) -> None:
    """No-IOMMU VFIO makes a group for the function it binds and drops it at the unbind. A
    vfio-pci variant the tables list by a name without "vfio" does the same; the function read
    under it must not count as plain (its group is not the IOMMU's), or the unbind keeps a
    group the tree no longer has."""
    root = Path(tempfile.mkdtemp(dir=shm if where == "tmpfs" else tmp_path))
    try:
        run_history(root / "host", [
            (("bind", LONE, VARIANT, False), "pump"),
            # A change reads it in full (on disk the bind did already).
            (("error", LONE, "SUCCESSFUL_RECOVERY"), "pump"),
            (("unbind", LONE), "pump"),
        ], where)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_pci_line_with_a_devname_still_looks_at_its_node(shm: Path) -> None:
    """`observe` looks at the node a uevent's DEVNAME names, whatever its subsystem; a
    hand-written unbind line of a plain function that carries one must not lose that."""
    root = Path(tempfile.mkdtemp(dir=shm))
    try:
        run_history(root / "host", [(("unbind", NIC), "pump"),
                                    (("odd", NIC, "devname"), "pump")], "tmpfs")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_line_spelling_the_bus_entry_leaves_the_devices_own_path(shm: Path) -> None:
    """A hand-written line naming the function by its bus entry (``/bus/pci/devices/…``), then
    the kernel's unbind and that line again in one batch: the lane vouched for the second
    line by the path the first had left in the model, the general path read it, and the two
    models kept different paths. Every spelling now leaves the path a scan records."""
    root = Path(tempfile.mkdtemp(dir=shm))
    try:
        run_history(root / "host", [(("odd", AUDIO, "bus"), "pump"),
                                    (("unbind", AUDIO), "hold"),
                                    (("odd", AUDIO, "bus"), "pump")], "tmpfs")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.xfail(strict=True, reason="on a captured tree (bus entries are folders, not links) "
                   "a hand-written line naming a function by its bus entry, after a held "
                   "bind, leaves the lane with the device's own path and the general path "
                   "with the bus spelling; the kernel never sends such a DEVPATH")
def test_a_bus_spelling_on_a_captured_tree_keeps_two_paths(shm: Path) -> None:
    root = Path(tempfile.mkdtemp(dir=shm))
    try:
        run_history(root / "host", [(("bind", AUDIO, "igb", False), "hold"),
                                    (("odd", AUDIO, "bus"), "pump")], "captured")
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.xfail(strict=True, reason="the lane trusts the uevent's ids: a card of the same "
                   "ids re-added behind lost remove/add uevents keeps its old IOMMU group "
                   "(the general path's identity stat, or full read, noticed)")
def test_a_card_swapped_behind_lost_uevents_is_not_noticed(shm: Path) -> None:
    """What the lane gave up for its speed, kept visible: the function removed and added
    again with the same ids in another IOMMU group, its remove and add lost, then a bind."""
    root = Path(tempfile.mkdtemp(dir=shm))
    try:
        run_history(root / "host", [(("replace", NIC, True, True), "lose"),
                                    (("bind", NIC, "igb", False), "pump")], "tmpfs",
                    lose_swaps=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

