"""The host model: every state transition of gpuwatch lives in this file.

`HostState` is fed observations (what the I/O edge read after a uevent, or a whole scan)
and returns the change events they caused. It never awaits, never reads the filesystem and
never looks at a clock of its own (the edge hands it one, `HostState.clock`, to stamp PCI
error-recovery uevents with), so every rule here is testable with plain data.

Incrementality is the point: an observation of one function touches that function, its old
and new IOMMU group, and only the cached answers that depend on them. Probe answers are
built once after a change and then handed out as the same frozen object until the next
change that concerns them.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from pydantic import BaseModel

from gpuwatch.core.events import (
    DeviceAdded,
    DeviceChanged,
    DeviceError,
    DeviceRemoved,
    GpuWedged,
    IommuGroupChanged,
    NodeAdded,
    NodeRemoved,
    ProbeChanged,
    VgpuChanged,
    driver_changed,
)
from gpuwatch.core.health import RECOVERY_STALE_AFTER, wedge_needs_recovery
from gpuwatch.core.hostkeep import kept_for_host_reason, own_displays
from gpuwatch.core.kfd import first_gfx_target, first_gfx_version
from gpuwatch.core.modes import variant_keys
from gpuwatch.core.observations import (
    OBSERVATION_TYPES,
    CdiSeen,
    DriversSeen,
    DrmGone,
    DrmSeen,
    DrmWedgeSeen,
    FramebufferGone,
    FramebufferSeen,
    IommuSeen,
    KfdSeen,
    ModuleSeen,
    NodeSeen,
    NodesSeen,
    NodeStat,
    Observation,
    PciErrorSeen,
    PciGone,
    PciRebound,
    PciSeen,
    Snapshot,
    SriovSeen,
    VgpuSeen,
    VgpusSeen,
)
from gpuwatch.core.pci import is_gpu_class
from gpuwatch.core.probes import (
    IOMMU_NODE,
    RENDER_PREFIX,
    VFIO_CDEV_RE,
    VFIO_NODE_RE,
    WATCHED_PROBES,
    choose_render_node,
    compiled_patterns,
    drm_vendor,
    is_amd_card,
    is_watched_node,
    nvidia_usable,
    ordered_devices,
)
from gpuwatch.core.results import (
    DetectVfioResult,
    GpuInfo,
    Health,
    HostDevicesResult,
    PciFunction,
    Sriov,
    Vgpu,
)
from gpuwatch.core.tables import Tables
from gpuwatch.core.trusted import build, evolve, shared_fields_set

_GPU_FIELDS = frozenset(GpuInfo.model_fields)
_new = object.__new__
_set = object.__setattr__
_VFIO_FIELDS = frozenset(DetectVfioResult.model_fields)
_HOST_DEVICES_FIELDS = frozenset(HostDevicesResult.model_fields)
#: The fields a ``device-changed`` names, in the order it names them.
_DEVICE_FIELDS = ("vfio_dev", "vfio_cdev", "sriov", "physfn", "health")
#: ``ERROR_EVENT`` values of a PCI error-recovery uevent and the health each leaves.
ERROR_HEALTH: dict[str, Health] = {
    "BEGIN_RECOVERY": "recovering",
    "SUCCESSFUL_RECOVERY": "ok",
    "FAILED_RECOVERY": "failed",
}


@dataclass(frozen=True, slots=True)
class RecoveryMark:
    """When a function's last ``BEGIN_RECOVERY`` or ``FAILED_RECOVERY`` was applied.

    ``order`` ranks it among all the error-recovery uevents this state applied (which came
    first, whatever any clock says); ``at`` is the edge's monotonic clock then (None with no
    clock), so a recovery's age is immune to wall-clock steps (NTP, an operator's date)."""

    order: int
    at: float | None


#: Drivers that build AMD's KFD topology (``sys/class/kfd/kfd/topology/nodes``) as they bind
#: a GPU and take its node down as they let it go. amdkfd sends no uevent for either (its
#: arrival and removal notice is still a stub), so the topology is read again with the bind or
#: unbind (`HostState.rereads`), or a probe would keep the old gfx version until a rescan.
KFD_DRIVERS = frozenset(("amdgpu",))


class _Unheard(list[BaseModel]):
    """Where the change events of a state's first build go: nobody is told of them (the
    whole host is new), so each is dropped as it is made instead of all being kept until
    the build ends. 4,096 ``device-added`` held at once and then freed left ~2 MiB of
    holes between the records that stay, resident for a watcher's life."""

    __slots__ = ()

    def append(self, event: BaseModel, /) -> None:
        pass

    def extend(self, events: Iterable[BaseModel], /) -> None:
        for _ in events:  # (a generator's work is still done)
            pass


class Rereads(NamedTuple):
    """Parts of the tree a batch changed without a uevent of their own (`HostState.rereads`)."""

    kfd: bool = False
    iommu: bool = False


class HostState:
    """The in-memory model of one host. Build it from a `Snapshot`, then `apply` changes."""

    def __init__(self, tables: Tables, snapshot: Snapshot | None = None) -> None:
        self.tables = tables
        self._gpu_vendor_ids = frozenset(tables.gpu_vendors)
        self._patterns = tables.device_patterns
        self._pattern_res = compiled_patterns(self._patterns)
        #: ``vfio_variant_drivers`` in comparison spelling (see `gpuwatch.core.modes`).
        self.vfio_variants = variant_keys(tables.vfio_variant_drivers)
        self.functions: dict[str, PciFunction] = {}
        #: Each function's cdev path as sysfs names it (reported once the node exists), and
        #: the reverse map, so a node event updates its function without a search.
        self._cdev_of: dict[str, str] = {}
        #: The recovery methods of each wedged function's last DRM wedge uevent.
        self.wedge_recovery: dict[str, tuple[str, ...]] = {}
        #: The edge's monotonic clock (`time.monotonic`, given by `gpuwatch.model.HostModel`):
        #: read once per PCI error-recovery uevent, never on the hot path. None: not stamped.
        self.clock: Callable[[], float] | None = None
        #: Each function's last ``BEGIN_RECOVERY`` or ``FAILED_RECOVERY`` (`RecoveryMark`):
        #: how long a recovery has been going on (the switch waits for a young one, and not
        #: for ever for one whose end was lost), and whether a bridge's failure came after a
        #: function's begin. Meaningful only while the health is ``recovering`` or ``failed``.
        self.recovery_marks: dict[str, RecoveryMark] = {}
        #: Each function's last sign of life (a bind, a ``SUCCESSFUL_RECOVERY``) seen while
        #: some recovery mark is held, ranked with the marks (`RecoveryMark.order`): after a
        #: bridge's ``FAILED_RECOVERY`` it shows the function below it reachable again, so
        #: that failure no longer counts for it. Not kept while no mark is held (no bridge
        #: has failed): a bind then costs nothing more.
        self.alive_marks: dict[str, int] = {}
        #: Each wedged function's last DRM wedge uevent, ranked with the marks: a wedge
        #: uevent carries nothing else to tell a second wedge from the first (a switch under
        #: way stops on a new one).
        self.wedge_marks: dict[str, int] = {}
        self._recovery_order = 0
        self._cdev_owner: dict[str, str] = {}
        self.devpaths: dict[str, str] = {}
        #: Display functions whose ``boot_vga`` reads 1 (the firmware's console).
        self.boot_vga: set[str] = set()
        #: Framebuffer device (``fb0``) → the PCI function it hangs beneath.
        self.framebuffers: dict[str, str] = {}
        self.groups: dict[int, set[str]] = {}
        self._gpu_addrs: list[str] = []  # sorted
        self._gpu_info: dict[str, GpuInfo] = {}  # cache; an absent GPU entry is stale
        # detect-vfio's GPU list, parallel to _gpu_addrs, patched in place: a change to one GPU
        # rebuilds one entry, so the answer costs a C-level tuple copy, not a pass over all GPUs.
        self._gpu_infos: list[GpuInfo | None] = []
        self._gpu_dirty: set[str] = set()  # GPUs whose _gpu_infos entry is stale
        # GPUs rebuilt or gone since detect-vfio was last published, and the entries it was
        # published with: what a probe-changed carries is the difference of the two.
        self._gpu_touched: set[str] = set()
        self._published_gpus: dict[str, GpuInfo] = {}
        self.drm: dict[str, DrmSeen] = {}
        self._drm_by_addr: dict[str, set[str]] = {}
        self._amd_cards: set[str] = set()
        #: Display functions bound to nvidia: detect-gpu needs one (a loaded module and a
        #: CDI spec with every card on vfio-pci is not a usable GPU).
        self._nvidia_gpus: set[str] = set()
        #: SR-IOV physical functions (a record with ``sriov``): where a VF the model never
        #: held is looked for when it goes (`_pci_gone`), without a pass over every function.
        self._sriov_pfs: set[str] = set()
        self.kfd = KfdSeen(nodes=())
        self.modules: set[str] = set()
        self.nodes: dict[str, NodeStat] = {}
        #: Bumped whenever a ``/dev/vfio/N`` node appears, goes or changes owner or mode, so
        #: answers derived from those nodes (per-group access) are rebuilt only then.
        self.vfio_nodes_version = 0
        self.cdi = CdiSeen(etc_spec=False, var_spec=False, ctk_on_path=False)
        self.iommu = IommuSeen(enabled=False, kind="")
        self._stale: set[str] = set(WATCHED_PROBES)
        self._devices: tuple[str, ...] | None = None
        self._render_node: str | None = None
        self._answers: dict[str, Any] = {}
        if snapshot is not None:
            self._apply_snapshot(snapshot, _Unheard())
        self._refresh_answers()

    # ------------------------------------------------------------------ transitions

    def apply(self, observations: Observation | Sequence[Observation]) -> list[BaseModel]:
        """Fold observations into the model; return the change events, probe changes last.

        ``probe-changed`` compares the answers before and after the whole batch, so a burst
        of uevents drained together reports one change per answer, not every midway state.
        """
        # One observation or many (a PciSeen is itself a tuple: test for the record types).
        batch: Iterable[Observation] = (
            (observations,) if isinstance(observations, OBSERVATION_TYPES) else observations
        )
        events: list[BaseModel] = []
        self._apply_batch(batch, events)
        return events

    def _apply_batch(self, batch: Iterable[Observation], events: list[BaseModel]) -> None:
        functions = self.functions
        for obs in batch:
            if type(obs) is PciRebound:  # one per bind: nothing to do unless health is bad
                fn = functions.get(obs.addr)  # (or a bridge failed: see `alive_marks`)
                if fn is None or (fn.health == "ok" and not self.recovery_marks):
                    continue
            self._apply_one(obs, events)
        events.extend(self._refresh_answers())

    def rereads(self, observations: Iterable[Observation]) -> Rereads:
        """What else in the tree ``observations`` change that sends no uevent of its own, for
        the watcher to read along with them (the model reads nothing itself):

        - ``kfd``: a function bound to a driver that builds AMD's KFD topology
          (`KFD_DRIVERS`) or let go of by one, bound to it again (a `PciRebound` of a
          function on it: the node came back last), or one bound to it coming or going;
        - ``iommu``: a function gaining or losing an IOMMU group, or one with a group coming
          or going: ``sys/kernel/iommu_groups`` (detect-vfio's ``iommu_enabled``) can change
          then, as it does when vfio-pci binds a card on a host in no-IOMMU mode; and a VFIO
          group node (``/dev/vfio/N``) appearing while no group is known, or going while no
          function has one: a mediated device's (an mdev vGPU's) emulated-IOMMU group, no
          PCI function's, comes and goes with its node, and on a host without an IOMMU it
          is the only one.

        A re-read of a function that changes neither asks for nothing."""
        functions = self.functions
        kfd = iommu = False
        for obs in observations:
            kind = type(obs)
            if kind is DriversSeen:  # the plain lane: only the driver changed, never a group
                if kfd:
                    continue
                for addr, driver in cast(DriversSeen, obs).entries:
                    fn = functions.get(addr)
                    was = fn.driver if fn is not None else ""
                    if was != driver and (was in KFD_DRIVERS or driver in KFD_DRIVERS):
                        kfd = True
                        break
            elif kind is PciSeen:
                seen = cast(PciSeen, obs)
                fn = functions.get(seen.addr)
                if fn is None:
                    kfd = kfd or seen.driver in KFD_DRIVERS
                    iommu = iommu or seen.iommu_group >= 0
                    continue
                if ((fn.driver in KFD_DRIVERS or seen.driver in KFD_DRIVERS)
                        and (fn.driver != seen.driver or fn.device_id != seen.device_id
                             or fn.vendor_id != seen.vendor_id)):
                    kfd = True  # bound, let go, or another card in the slot
                iommu = iommu or (fn.iommu_group >= 0) != (seen.iommu_group >= 0)
            elif kind is PciGone:
                fn = functions.get(cast(PciGone, obs).addr)
                if fn is not None:
                    kfd = kfd or fn.driver in KFD_DRIVERS
                    iommu = iommu or fn.iommu_group >= 0
            elif kind is NodeSeen and not iommu:
                node = cast(NodeSeen, obs)
                if node.path in self.nodes:
                    iommu = (node.stat is None and self.iommu.enabled and not self.groups
                             and VFIO_NODE_RE.match(node.path) is not None)
                else:
                    iommu = (node.stat is not None and not self.iommu.enabled
                             and VFIO_NODE_RE.match(node.path) is not None)
            elif kind is PciRebound and not kfd:
                # A bind by amdgpu of a card it drove before: an unbind and a bind read in one
                # batch leave the driver as it was, but amdkfd took the card's node out and
                # appended it again, and numbers its nodes by their place in its list.
                fn = functions.get(cast(PciRebound, obs).addr)
                kfd = fn is not None and fn.driver in KFD_DRIVERS
        return Rereads(kfd, iommu)

    def apply_snapshot(self, snapshot: Snapshot) -> list[BaseModel]:
        """Diff a full scan against the model (initial build, overflow resync, reconcile).

        Everything the scan did not see is gone; everything it saw is applied as if a
        uevent had named it. Unchanged parts emit nothing.
        """
        events: list[BaseModel] = []
        self._apply_snapshot(snapshot, events)
        return events

    def _apply_snapshot(self, snapshot: Snapshot, events: list[BaseModel]) -> None:
        # VFIO device cdevs that appeared go first, as a vfio-dev add uevent has them
        # (`gpuwatch.hostfs.scan.observe`): a function that gained its VFIO device then
        # takes ``vfio_dev`` and ``vfio_cdev`` in one device-changed, never a second one
        # for the cdev after a first that showed a state the scanned tree did not have.
        # (One that went is let go of by its function's record first, the same way.)
        nodes = self.nodes
        obs: list[Observation] = [
            NodeSeen(path, stat) for path, stat in snapshot.nodes.nodes
            if path not in nodes and VFIO_CDEV_RE.match(path)]
        obs.extend(snapshot.functions)
        seen = {f.addr for f in snapshot.functions}
        obs.extend(PciGone(addr) for addr in self.functions if addr not in seen)
        seen_drm = {d.name for d in snapshot.drm}
        obs.extend(DrmGone(name) for name in self.drm if name not in seen_drm)
        obs.extend(snapshot.drm)
        seen_fb = {f.name for f in snapshot.framebuffers}
        obs.extend(FramebufferGone(name) for name in self.framebuffers if name not in seen_fb)
        obs.extend(snapshot.framebuffers)
        # Modules as one set difference, not an observation each: a host loads a hundred of
        # them, and that loop alone was a sixth of a fresh scan on a small host.
        loaded = snapshot.modules
        if ("nvidia" in loaded) != ("nvidia" in self.modules):
            self._stale.update(("detect-gpu", "detect-host-devices"))
        self.modules.intersection_update(loaded)
        self.modules.update(loaded)
        obs.extend((snapshot.kfd, snapshot.nodes, snapshot.cdi, snapshot.iommu))
        self._apply_batch(obs, events)

    def _framebuffer_seen(self, obs: FramebufferSeen) -> None:
        """Record a framebuffer as a scan does (`gpuwatch.hostfs.scan.scan_framebuffers`):
        beneath a display function that is no SR-IOV VF, the only ones the host-keep rule
        asks about. A uevent names one beneath any function (a VF's driver's fbdev, a
        non-display function's): kept, it made the model differ from a fresh scan's."""
        fn = self.functions.get(obs.addr)
        if fn is not None and is_gpu_class(fn.class_) and not fn.physfn:
            self.framebuffers[obs.name] = obs.addr
        else:
            self.framebuffers.pop(obs.name, None)

    def _apply_one(self, obs: Observation, events: list[BaseModel]) -> None:
        kind = type(obs)  # the three of every bind first, by identity
        if kind is DriversSeen:
            self._drivers_seen(cast(DriversSeen, obs).entries, events)
        elif kind is PciSeen:
            self._pci_seen(cast(PciSeen, obs), events)
        elif kind is PciRebound:
            addr = cast(PciRebound, obs).addr
            fn = self.functions.get(addr)
            if fn is not None:
                self._alive(addr)
                if self._bind_clears(fn):
                    self._set_health(addr, "ok", events, announce=True)
        elif isinstance(obs, PciGone):
            self._pci_gone(obs.addr, events)
        elif isinstance(obs, PciErrorSeen):
            self._pci_error(obs, events)
        elif isinstance(obs, DrmWedgeSeen):
            self._drm_wedge(obs, events)
        elif isinstance(obs, VgpusSeen):
            for addr, vgpu in obs.vgpus:
                self._vgpu_seen(addr, vgpu, events)
        elif isinstance(obs, DrmSeen):
            self._drm_seen(obs)
        elif isinstance(obs, DrmGone):
            self._drm_gone(obs.name)
        elif isinstance(obs, FramebufferSeen):
            self._framebuffer_seen(obs)
        elif isinstance(obs, FramebufferGone):
            self.framebuffers.pop(obs.name, None)
        elif isinstance(obs, ModuleSeen):
            self._module_seen(obs)
        elif isinstance(obs, KfdSeen):
            if obs != self.kfd:
                self.kfd = obs
                self._stale.update(("amd-gfx-version", "amd-gfx-target", "detect-host-devices"))
        elif isinstance(obs, NodeSeen):
            self._node_seen(obs.path, obs.stat, events)
        elif isinstance(obs, NodesSeen):
            present = dict(obs.nodes)
            for path in sorted(set(self.nodes) - set(present)):
                self._node_seen(path, None, events)
            for path, stat in sorted(present.items()):
                self._node_seen(path, stat, events)
        elif isinstance(obs, CdiSeen):
            if obs != self.cdi:
                self.cdi = obs
                self._stale.update(("detect-gpu", "detect-host-devices"))
        elif isinstance(obs, IommuSeen) and obs != self.iommu:
            self.iommu = obs
            self._stale.add("detect-vfio")

    def _pci_seen(self, seen: PciSeen, events: list[BaseModel]) -> None:
        old = self.functions.get(seen.addr)
        self.devpaths[seen.addr] = seen.devpath
        if seen.boot_vga:
            self.boot_vga.add(seen.addr)
        else:
            self.boot_vga.discard(seen.addr)
        cdev = seen.vfio_cdev if seen.vfio_cdev and seen.vfio_cdev in self.nodes else ""
        if (
            old is not None
            and old.vendor_id == seen.vendor_id
            and old.device_id == seen.device_id
            and old.class_ == seen.klass
        ):
            # The same card. Field by field before building anything: the label follows from
            # the class, so this is `old == new` without constructing `new`.
            if not (
                old.driver == seen.driver
                and old.iommu_group == seen.iommu_group
                and old.vfio_dev == seen.vfio_dev
                and old.vfio_cdev == cdev
                and old.physfn == seen.physfn
                and _same_sriov(old.sriov, seen.sriov)
                and _same_vgpu(old.vgpu, seen.vgpu)
            ):
                self._pci_update(old, seen, cdev, events)
            return
        if old is not None:
            # Another card in the same slot: report it as the swap it is.
            self._pci_gone(seen.addr, events)
            self.devpaths[seen.addr] = seen.devpath
            if seen.boot_vga:
                self.boot_vga.add(seen.addr)
        new = PciFunction(
            addr=seen.addr,
            vendor_id=seen.vendor_id,
            device_id=seen.device_id,
            class_=seen.klass,
            class_label=self.tables.class_label(seen.klass) if seen.klass else "",
            driver=seen.driver,
            iommu_group=seen.iommu_group,
            vfio_dev=seen.vfio_dev,
            vfio_cdev=cdev,
            sriov=_sriov(seen.sriov),
            physfn=seen.physfn,
            vgpu=_vgpu(seen.vgpu),
        )
        # Every record given the same fields shares one set of their names (a fifth of a
        # large host's model was these sets, one per record).
        _set(new, "__pydantic_fields_set__", shared_fields_set(new.__pydantic_fields_set__))
        self._set_cdev(seen.addr, seen.vfio_cdev)
        self._store_function(None, new)
        events.append(DeviceAdded(addr=new.addr, device=new))

    def _drivers_seen(self, entries: Iterable[tuple[str, str]],
                      events: list[BaseModel]) -> None:
        """A run of plain binds and unbinds (see `DriversSeen`): each function is its old record
        with the driver replaced, and one ``driver-changed``. Anything more to it (a VFIO
        device or cdev to let go of, a bad health a bind clears, a vGPU, a wedge) goes through
        `_pci_seen` as the full observation it stands for, so the outcome is the same.

        `_store_same_group` and `evolve` inlined: a storm is this loop."""
        functions, cdev_of, wedged = self.functions, self._cdev_of, self.wedge_recovery
        groups, gpu_info, gpu_dirty = self.groups, self._gpu_info, self._gpu_dirty
        append = events.append
        vfio_stale = False
        for addr, driver in entries:
            old = functions.get(addr)
            if old is None:
                continue  # the edge reads only functions the model holds: nothing to change
            fields = old.__dict__
            if (fields["vfio_dev"] or fields["vfio_cdev"] or fields["vgpu"] is not None
                    or fields["sriov"] is not None or fields["physfn"] or addr in cdev_of
                    or addr in wedged or (driver and fields["health"] != "ok")):
                self._pci_seen(self._seen_with_driver(old, driver), events)
                continue
            was = fields["driver"]
            if was == driver:
                continue
            fields = fields.copy()
            fields["driver"] = driver
            new = _new(PciFunction)
            _set(new, "__dict__", fields)
            fields_set = old.__pydantic_fields_set__
            _set(new, "__pydantic_fields_set__",
                 fields_set if "driver" in fields_set
                 else shared_fields_set(fields_set | {"driver"}))
            _set(new, "__pydantic_extra__", None)
            _set(new, "__pydantic_private__", None)
            functions[addr] = new
            if fields["class_"].startswith("0x03"):  # a GPU (`is_gpu_class`)
                self._track_nvidia(addr, driver == "nvidia")
                gpu_info.pop(addr, None)
                gpu_dirty.add(addr)
                vfio_stale = True
            # The GPU entries of its group list it with its driver (`_invalidate_around`).
            for member in groups.get(fields["iommu_group"], ()):
                if member in gpu_info:
                    del gpu_info[member]
                    gpu_dirty.add(member)
                    vfio_stale = True
                elif not vfio_stale and member in functions:
                    vfio_stale = functions[member].class_.startswith("0x03")
            if addr in self._drm_by_addr:
                for name in self._drm_by_addr[addr]:
                    self._classify_card(name)
            append(driver_changed(addr, was, driver))
        if vfio_stale:
            self._stale.add("detect-vfio")

    def _seen_with_driver(self, old: PciFunction, driver: str) -> PciSeen:
        """What a full read of ``old``'s directory would give with ``driver`` bound and no
        VFIO device or vGPU found (see `DriversSeen`)."""
        sriov = (SriovSeen(old.sriov.totalvfs, tuple(old.sriov.vfs), old.sriov.numvfs)
                 if old.sriov is not None else None)
        return PciSeen(old.addr, self.devpaths.get(old.addr, ""), old.vendor_id, old.device_id,
                       old.class_, driver, old.iommu_group, "", "", sriov, old.physfn, None,
                       old.addr in self.boot_vga)

    def _pci_update(self, old: PciFunction, seen: PciSeen, cdev: str,
                    events: list[BaseModel]) -> None:
        """The same card with something it can change changed (a bind or unbind above all):
        the new record is the old one with just those fields replaced (`evolve`, no
        validation: a storm does this per uevent), and the events name exactly them. The
        same record and events as building it anew would give (a test compares the two)."""
        update: dict[str, Any] = {}
        if old.driver != seen.driver:
            update["driver"] = seen.driver
            if seen.driver and old.health != "ok" and self._bind_clears(old):
                # A bind to another driver is a fresh start: it clears a failed or wedged state.
                update["health"] = "ok"
                self._alive(old.addr)
        if old.iommu_group != seen.iommu_group:
            update["iommu_group"] = seen.iommu_group
        if old.vfio_dev != seen.vfio_dev:
            update["vfio_dev"] = seen.vfio_dev
        if old.vfio_cdev != cdev:
            update["vfio_cdev"] = cdev
        if (old.sriov is not None or seen.sriov is not None) and not _same_sriov(old.sriov,
                                                                                 seen.sriov):
            update["sriov"] = _sriov(seen.sriov)
        if old.physfn != seen.physfn:
            update["physfn"] = seen.physfn
        if (old.vgpu is not None or seen.vgpu is not None) and not _same_vgpu(old.vgpu,
                                                                              seen.vgpu):
            update["vgpu"] = _vgpu(seen.vgpu)
        new = evolve(old, update)
        addr = seen.addr
        if self._cdev_of.get(addr, "") != seen.vfio_cdev:
            self._set_cdev(addr, seen.vfio_cdev)
        if "iommu_group" in update:
            self._store_function(old, new)
        else:
            self._store_same_group(new)
        if "driver" in update:
            events.append(driver_changed(addr, old.driver, seen.driver))
            if len(update) == 1:
                return  # a plain bind or unbind
        if "iommu_group" in update:
            events.append(IommuGroupChanged(addr=addr, old=old.iommu_group,
                                            new=seen.iommu_group))
        changed = [name for name in _DEVICE_FIELDS if name in update]
        if changed:
            events.append(DeviceChanged(addr=addr, changed=changed, device=new))
        if "vgpu" in update:
            events.append(VgpuChanged(addr=addr, vgpu=new.vgpu))

    def _store_same_group(self, new: PciFunction) -> None:
        """`_store_function` for the same card in the same IOMMU group (a bind or unbind):
        no group membership or GPU list to change, only the answers that embed it."""
        addr = new.addr
        functions = self.functions
        functions[addr] = new
        if new.sriov is not None:
            self._sriov_pfs.add(addr)
        else:
            self._sriov_pfs.discard(addr)
        if addr in self.wedge_recovery and new.health != "wedged":
            del self.wedge_recovery[addr]
            self.wedge_marks.pop(addr, None)
        vfio_stale = is_gpu = is_gpu_class(new.class_)
        gpu_info = self._gpu_info
        if is_gpu:
            self._track_nvidia(addr, new.driver == "nvidia")
            gpu_info.pop(addr, None)
            self._gpu_dirty.add(addr)
        self._invalidate_around(addr, (new.iommu_group,) if new.iommu_group >= 0 else (),
                                vfio_stale)

    def _set_cdev(self, addr: str, cdev: str) -> None:
        old = self._cdev_of.get(addr, "")
        if old == cdev:
            return
        if old:
            del self._cdev_of[addr]
            if self._cdev_owner.get(old) == addr:
                del self._cdev_owner[old]
        if cdev:
            self._cdev_of[addr] = cdev
            self._cdev_owner[cdev] = addr

    def _pci_gone(self, addr: str, events: list[BaseModel]) -> None:
        old = self.functions.get(addr)
        if old is None:
            if self._sriov_pfs:
                self._drop_vf(addr, "", events)
            return
        self._store_function(old, None)
        self._set_cdev(addr, "")
        self.devpaths.pop(addr, None)
        self.boot_vga.discard(addr)
        for name in sorted(self._drm_by_addr.get(addr, ())):
            self._drm_gone(name)
        events.append(DeviceRemoved(addr=addr, device=old))
        # The kernel drops the PF's virtfnN link before it removes the VF, and sends no event
        # for the PF: follow the VF's removal here.
        self._drop_vf(addr, old.physfn, events)

    def _drop_vf(self, addr: str, physfn: str, events: list[BaseModel]) -> None:
        """Take ``addr`` out of the VF list of the PF that names it (``physfn``, else any PF
        whose ``virtfnN`` links named it): a PF re-read while an earlier VF's ``add`` was
        read names every VF the kernel had added by then, some of which the model may not
        hold yet when they go again (``sriov_numvfs`` set back to 0 at once), their own
        ``add`` read only after their removal. A fresh scan lists none of them."""
        functions = self.functions
        owners = [physfn] if physfn else [
            a for a in sorted(self._sriov_pfs)
            if (pf := functions.get(a)) is not None and pf.sriov is not None
            and addr in pf.sriov.vfs]
        for owner in owners:
            pf = functions.get(owner)
            if pf is not None and pf.sriov is not None and addr in pf.sriov.vfs:
                vfs = tuple(a for a in pf.sriov.vfs if a != addr)
                # its virtfnN link went with it; one of a VF not in the tree stays counted
                numvfs = max(len(vfs), pf.sriov.numvfs - 1)
                sriov = Sriov(totalvfs=pf.sriov.totalvfs, numvfs=numvfs, vfs=vfs)
                self._replace(pf, {"sriov": sriov}, events)

    def _replace(self, old: PciFunction, update: dict[str, Any], events: list[BaseModel],
                 *, announce: bool = True) -> PciFunction:
        """Change fields of a known function in place; ``device-changed`` names them."""
        new = evolve(old, update)  # `model_copy` that shares the fields-set
        self._store_function(old, new)
        if announce:
            events.append(DeviceChanged(addr=new.addr, changed=list(update), device=new))
        return new

    def _pci_error(self, seen: PciErrorSeen, events: list[BaseModel]) -> None:
        health = ERROR_HEALTH.get(seen.error_event)
        fn = self.functions.get(seen.addr)
        if health is None or fn is None:
            return
        if fn.health != health:
            self._replace(fn, {"health": health}, events, announce=False)
        event = DeviceError(addr=seen.addr, error_event=seen.error_event, online=seen.online,
                            health=health)
        if health == "ok":
            self._drop_recovery_mark(seen.addr)
            self._alive(seen.addr)
        else:
            self._recovery_order += 1
            clock = self.clock
            self.recovery_marks[seen.addr] = RecoveryMark(
                self._recovery_order, clock() if clock is not None else None)
        events.append(event)

    def _bind_clears(self, fn: PciFunction) -> bool:
        """Whether a bind of ``fn`` ends its bad health: a fresh start for a failed or
        wedged function, but not for one whose PCI error recovery is under way. The kernel
        holds the device lock only through each recovery callback, so a bind can come
        between them, and the recovery still ends later with its own uevent; until then the
        link may be reset under the new driver. Unless that recovery already ended at a
        bridge above it that reported ``FAILED_RECOVERY`` since it began (older kernels
        report a failure on the bridge alone): then the bind is the recovery (`recover`);
        or one begun `RECOVERY_STALE_AFTER` seconds ago, taken as over (its end was lost)."""
        if fn.health != "recovering":
            return True
        began = self.recovery_marks.get(fn.addr)
        clock = self.clock
        if (began is not None and began.at is not None and clock is not None
                and clock() - began.at >= RECOVERY_STALE_AFTER):
            return True
        functions, marks = self.functions, self.recovery_marks
        for part in self.devpaths.get(fn.addr, "").split("/")[:-1]:
            bridge = functions.get(part)
            if bridge is not None and bridge.health == "failed":
                failed = marks.get(part)
                if began is None or (failed is not None and failed.order > began.order):
                    return True
        return False

    def _drop_recovery_mark(self, addr: str) -> None:
        """Forget ``addr``'s recovery mark; with the last one gone, every sign of life too:
        a failure to come is ranked after all of them, so none can outlive it."""
        self.recovery_marks.pop(addr, None)
        if not self.recovery_marks:
            self.alive_marks.clear()

    def _alive(self, addr: str) -> None:
        """``addr`` was just bound or recovered: rank that sign of life (`alive_marks`), but
        only while some recovery mark is held, the only time it can matter."""
        if self.recovery_marks:
            self._recovery_order += 1
            self.alive_marks[addr] = self._recovery_order

    def _drm_wedge(self, seen: DrmWedgeSeen, events: list[BaseModel]) -> None:
        if not seen.addr:  # a devpath that does not name the parent: the card's link does
            node = self.drm.get(seen.card)
            if node is not None and node.device_addr:
                seen = DrmWedgeSeen(node.device_addr, seen.card, seen.recovery, seen.pid,
                                    seen.task)
        fn = self.functions.get(seen.addr) if seen.addr else None
        if fn is not None and not wedge_needs_recovery(seen.recovery):
            fn = None  # ``WEDGED=none``: recovered by its driver; published, health kept
        if fn is not None and fn.health != "wedged":
            self._replace(fn, {"health": "wedged"}, events, announce=False)
        if fn is not None:
            self.wedge_recovery[fn.addr] = seen.recovery
            self._recovery_order += 1
            self.wedge_marks[fn.addr] = self._recovery_order
        events.append(GpuWedged(addr=seen.addr, card=seen.card, recovery=list(seen.recovery),
                                pid=seen.pid, task=seen.task))

    def _set_health(self, addr: str, health: Health, events: list[BaseModel], *,
                    announce: bool) -> None:
        fn = self.functions.get(addr)
        if fn is not None and fn.health != health:
            self._replace(fn, {"health": health}, events, announce=announce)

    def _vgpu_seen(self, addr: str, seen: VgpuSeen | None, events: list[BaseModel]) -> None:
        fn = self.functions.get(addr)
        if fn is None or _same_vgpu(fn.vgpu, seen):
            return
        new = self._replace(fn, {"vgpu": _vgpu(seen)}, events, announce=False)
        events.append(VgpuChanged(addr=addr, vgpu=new.vgpu))

    def vgpu_addrs(self) -> tuple[str, ...]:
        """Functions whose vGPU files the cheap poll re-reads (those that have them)."""
        return tuple(sorted(a for a, fn in self.functions.items() if fn.vgpu is not None))

    def _store_function(self, old: PciFunction | None, new: PciFunction | None) -> None:
        """Swap one function's record and invalidate exactly what depends on it."""
        fn = new or old
        assert fn is not None
        addr = fn.addr
        groups, functions = self.groups, self.functions
        old_group = old.iommu_group if old is not None else -1
        new_group = new.iommu_group if new is not None else -1
        touched_groups: tuple[int, ...]
        if old_group == new_group:  # the common case (a driver change): membership stays
            touched_groups = (old_group,) if old_group >= 0 else ()
        else:
            touched_groups = tuple(g for g in (old_group, new_group) if g >= 0)
            if old_group >= 0:
                members = groups.get(old_group)
                if members is not None:
                    members.discard(addr)
                    if not members:
                        del groups[old_group]
            if new_group >= 0:
                groups.setdefault(new_group, set()).add(addr)
        if new is not None and new.sriov is not None:
            self._sriov_pfs.add(addr)
        else:
            self._sriov_pfs.discard(addr)
        if new is None:
            del functions[addr]
            self._drop_recovery_mark(addr)
            self.alive_marks.pop(addr, None)
            self.wedge_marks.pop(addr, None)
        else:
            functions[addr] = new
        if addr in self.wedge_recovery and (new is None or new.health != "wedged"):
            del self.wedge_recovery[addr]
            self.wedge_marks.pop(addr, None)  # ranks a wedge only while it lasts
        was_gpu = old is not None and is_gpu_class(old.class_)
        is_gpu = new is not None and is_gpu_class(new.class_)
        if was_gpu and not is_gpu:
            index = bisect.bisect_left(self._gpu_addrs, addr)
            del self._gpu_addrs[index]
            del self._gpu_infos[index]
            self._gpu_touched.add(addr)
        elif is_gpu and not was_gpu:
            index = bisect.bisect_left(self._gpu_addrs, addr)
            self._gpu_addrs.insert(index, addr)
            self._gpu_infos.insert(index, None)
        vfio_stale = was_gpu or is_gpu
        self._track_nvidia(addr, is_gpu and new is not None and new.driver == "nvidia")
        self._gpu_info.pop(addr, None)
        if is_gpu:
            self._gpu_dirty.add(addr)
        self._invalidate_around(addr, touched_groups, vfio_stale)

    def _track_nvidia(self, addr: str, on_nvidia: bool) -> None:
        """Keep the set of GPUs bound to nvidia. detect-gpu (and detect-host-devices, which
        embeds it) asks only whether it is empty: stale only when that flips."""
        gpus = self._nvidia_gpus
        if on_nvidia != (addr in gpus):
            was_empty = not gpus
            if on_nvidia:
                gpus.add(addr)
            else:
                gpus.discard(addr)
            if was_empty != (not gpus):
                self._stale.update(("detect-gpu", "detect-host-devices"))

    def _invalidate_around(self, addr: str, touched_groups: Iterable[int],
                           vfio_stale: bool) -> None:
        """After ``addr``'s record changed: the GPU entries of its group(s) (they list their
        members), ``detect-vfio`` when a GPU is among them, and its DRM cards' classes."""
        gpu_info, functions = self._gpu_info, self.functions
        for group in touched_groups:
            for member in self.groups.get(group, ()):
                if member in gpu_info:
                    del gpu_info[member]
                    self._gpu_dirty.add(member)
                    vfio_stale = True
                elif not vfio_stale and member in functions:
                    vfio_stale = is_gpu_class(functions[member].class_)
        if vfio_stale:
            self._stale.add("detect-vfio")
        if addr in self._drm_by_addr:
            for name in self._drm_by_addr[addr]:
                self._classify_card(name)

    def _drm_seen(self, seen: DrmSeen) -> None:
        old = self.drm.get(seen.name)
        if old == seen:
            return
        if old is not None:
            self._drm_gone(seen.name)
        self.drm[seen.name] = seen
        if seen.device_addr:
            self._drm_by_addr.setdefault(seen.device_addr, set()).add(seen.name)
        self._classify_card(seen.name)
        if seen.name.startswith("renderD"):
            self._render_node = None
            self._stale.add("detect-host-devices")

    def _drm_gone(self, name: str) -> None:
        old = self.drm.pop(name, None)
        if old is None:
            return
        if old.device_addr:
            names = self._drm_by_addr.get(old.device_addr)
            if names is not None:
                names.discard(name)
                if not names:
                    del self._drm_by_addr[old.device_addr]
        self._classify_card(name)
        if name.startswith("renderD"):
            self._render_node = None
            self._stale.add("detect-host-devices")

    def _classify_card(self, name: str) -> None:
        """Keep the set of cards driven by amdgpu current, so detect-amd-gpu is O(1)."""
        is_amd = is_amd_card(name, self.drm.get(name), self.functions)
        if is_amd != (name in self._amd_cards):
            if is_amd:
                self._amd_cards.add(name)
            else:
                self._amd_cards.discard(name)
            self._stale.update(("detect-amd-gpu", "detect-host-devices"))

    def _module_seen(self, seen: ModuleSeen) -> None:
        if seen.loaded == (seen.name in self.modules):
            return
        if seen.loaded:
            self.modules.add(seen.name)
        else:
            self.modules.discard(seen.name)
        if seen.name == "nvidia":
            self._stale.update(("detect-gpu", "detect-host-devices"))

    def _node_seen(self, path: str, stat: NodeStat | None, events: list[BaseModel]) -> None:
        if not self.is_watched_node(path):
            return
        old = self.nodes.get(path)
        if old == stat:
            return
        is_vfio = VFIO_NODE_RE.match(path) is not None
        if is_vfio:
            self.vfio_nodes_version += 1
        if stat is None:
            del self.nodes[path]
            events.append(NodeRemoved(path=path))
        else:
            self.nodes[path] = stat
            if old is not None:
                return  # a mode change is not a new node; the access answers are rebuilt
            events.append(NodeAdded(path=path))
        if path == IOMMU_NODE:
            self._stale.add("detect-vfio")
            return
        if VFIO_CDEV_RE.match(path):
            owner = self._cdev_owner.get(path)
            fn = self.functions.get(owner) if owner else None
            if fn is not None:
                self._replace(fn, {"vfio_cdev": path if stat is not None else ""}, events)
            return
        if not is_vfio:
            self._devices = None
            if path.startswith(RENDER_PREFIX):
                self._render_node = None
            self._stale.add("detect-host-devices")

    def vfio_group_nodes(self) -> list[tuple[str, NodeStat]]:
        """The ``/dev/vfio/<N>`` nodes held, with their stats (what the access answers use)."""
        return [(p, st) for p, st in self.nodes.items() if VFIO_NODE_RE.match(p)]

    def is_watched_node(self, path: str) -> bool:
        """A device path gpuwatch reports: one matching ``device_patterns``, a vfio group, a
        VFIO device cdev or ``/dev/iommu``."""
        return is_watched_node(path, self._pattern_res)

    # ------------------------------------------------------------------ answers

    def _refresh_answers(self) -> list[BaseModel]:
        """Rebuild the stale watched answers; report those whose value really changed."""
        changes: list[BaseModel] = []
        if not self._stale:
            return changes
        stale, self._stale = self._stale, set()
        # detect-host-devices embeds the others, so it is rebuilt last.
        for action in WATCHED_PROBES:
            if action not in stale:
                continue
            new = self._compute(action)
            old = self._answers.get(action, _MISSING)
            if old is _MISSING:
                self._answers[action] = new
                if action == "detect-vfio":
                    self._published_gpus = {gpu.addr: gpu for gpu in new.gpus}
                    self._gpu_touched.clear()
                continue
            # A scalar answer's delta is the two values themselves (bool, str), not dicts.
            delta: tuple[Any, Any] | None
            if action == "detect-vfio":
                delta = self._vfio_delta(old, new)
            elif isinstance(new, BaseModel):
                delta = _fields_delta(old, new)
            else:
                delta = None if old == new else (old, new)
            if delta is not None:
                self._answers[action] = new
                changes.append(ProbeChanged(action=action, old=delta[0], new=delta[1]))
        return changes

    def _vfio_delta(
        self, old: DetectVfioResult, new: DetectVfioResult
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """What changed in detect-vfio: the IOMMU fields that differ, and under ``gpus`` only
        the GPU entries that changed (before in ``old``, after in ``new``; an entry on one side
        only was added or removed). The cost follows the GPUs touched, not the GPUs present."""
        before, after = _fields_delta(old, new, skip="gpus") or ({}, {})
        touched, self._gpu_touched = self._gpu_touched, set()
        published, functions = self._published_gpus, self.functions
        old_gpus: list[GpuInfo] = []
        new_gpus: list[GpuInfo] = []
        for addr in sorted(touched):
            was = published.get(addr)
            fn = functions.get(addr)
            now = self._gpu(addr) if fn is not None and is_gpu_class(fn.class_) else None
            # Equal records: the same fields (pydantic's __eq__, minus its Python frames).
            if was is now or (was is not None and now is not None
                              and was.__dict__ == now.__dict__):
                continue
            if was is not None:
                old_gpus.append(was)
            if now is None:
                del published[addr]
            else:
                new_gpus.append(now)
                published[addr] = now
        if old_gpus or new_gpus:
            before["gpus"], after["gpus"] = old_gpus, new_gpus
        return (before, after) if before or after else None

    def _compute(self, action: str) -> Any:
        if action == "detect-gpu":
            return self.nvidia_usable()
        if action == "detect-amd-gpu":
            return bool(self._amd_cards)
        if action == "amd-gfx-version":
            return first_gfx_version(self.kfd.nodes)
        if action == "amd-gfx-target":
            return first_gfx_target(self.kfd.nodes)
        if action == "detect-vfio":
            return build(DetectVfioResult, {
                "iommu_enabled": self.iommu.enabled,
                "iommu_kind": self.iommu.kind,
                "iommufd": IOMMU_NODE in self.nodes,
                "gpus": self._gpu_tuple(),
            }, shared_fields_set(_VFIO_FIELDS))
        if action == "detect-host-devices":
            amd = bool(self._amd_cards)
            return build(HostDevicesResult, {
                "gpu": self._answers["detect-gpu"],
                "amd_gpu": amd,
                "amd_gfx_version": self._answers["amd-gfx-version"] if amd else "",
                "amd_gfx_target": self._answers["amd-gfx-target"] if amd else "",
                "devices": self.devices(),
                "render_node": self.render_node(),
            }, shared_fields_set(_HOST_DEVICES_FIELDS))
        raise KeyError(action)

    def _gpu_tuple(self) -> tuple[GpuInfo, ...]:
        """Every GPU's info in address order; only the entries marked stale are rebuilt."""
        if self._gpu_dirty:
            addrs, infos = self._gpu_addrs, self._gpu_infos
            for addr in self._gpu_dirty:
                index = bisect.bisect_left(addrs, addr)
                if index < len(addrs) and addrs[index] == addr:
                    infos[index] = self._gpu(addr)
            self._gpu_touched |= self._gpu_dirty
            self._gpu_dirty.clear()
        # Every entry is set: a GPU enters _gpu_infos as None and dirty at once.
        return cast("tuple[GpuInfo, ...]", tuple(self._gpu_infos))

    def _gpu(self, addr: str) -> GpuInfo:
        info = self._gpu_info.get(addr)
        if info is None:
            fn = self.functions[addr]
            # The function's checked fields and its group's records, as they are (`build`: what
            # validating them again would give, a third of the cost).
            info = build(GpuInfo, {**fn.__dict__, "group_members": self.group_members(addr)},
                         shared_fields_set(_GPU_FIELDS))
            self._gpu_info[addr] = info
        return info

    def nvidia_usable(self) -> bool:
        """detect-gpu: the nvidia module is loaded, CDI is reachable, and at least one
        display function is bound to nvidia: an NVIDIA GPU containers can use now."""
        return nvidia_usable(self.modules, self.cdi, bool(self._nvidia_gpus))

    def answer(self, action: str) -> Any:
        """The cached answer of a watched probe: the same object until it changes."""
        return self._answers[action]

    def devices(self) -> tuple[str, ...]:
        """Present device paths in pattern order, sorted within a pattern."""
        if self._devices is None:
            self._devices = ordered_devices(self.nodes, self._pattern_res)
        return self._devices

    def render_node(self) -> str:
        """The first render node whose device is a known GPU vendor, else the first one."""
        if self._render_node is None:
            drm, functions = self.drm, self.functions

            def vendor_of(name: str) -> str | None:
                node = drm.get(name)
                return None if node is None else drm_vendor(node, functions)

            self._render_node = choose_render_node(self.devices(), vendor_of,
                                                   self._gpu_vendor_ids)
        return self._render_node

    def group_members(self, addr: str) -> tuple[PciFunction, ...]:
        """Every function of ``addr``'s IOMMU group, sorted by address (itself alone if none)."""
        fn = self.functions[addr]
        if fn.iommu_group < 0:
            return (fn,)
        return tuple(self.functions[a] for a in sorted(self.groups.get(fn.iommu_group, (addr,))))

    def kept_for_host(self, addr: str) -> str:
        """Why the IOMMU group of ``addr`` stays with the host (`kept_for_host_reason`), or
        ``""`` when it may be passed through."""
        framebuffers = set(self.framebuffers.values())
        functions = self.functions
        gpus = ((a, functions[a].physfn, functions[a].class_) for a in self._gpu_addrs)
        return kept_for_host_reason(
            self.group_members(addr),
            console_drivers=self.tables.host_console_drivers,
            console_devices=self.tables.host_console_devices,
            boot_vga=self.boot_vga,
            host_displays=own_displays(gpus, framebuffers),
            framebuffers=framebuffers,
        )

    def gpu_addrs(self) -> Sequence[str]:
        return tuple(self._gpu_addrs)


def _sriov(seen: SriovSeen | None) -> Sriov | None:
    if seen is None:
        return None
    return Sriov(totalvfs=seen.totalvfs, numvfs=seen.numvfs, vfs=seen.vfs)


def _vgpu(seen: VgpuSeen | None) -> Vgpu | None:
    return None if seen is None else Vgpu(type=seen.type, creatable=seen.creatable)


def _same_sriov(model: Sriov | None, seen: SriovSeen | None) -> bool:
    if model is None or seen is None:
        return model is None and seen is None
    return (model.totalvfs == seen.totalvfs and model.vfs == seen.vfs
            and model.numvfs == seen.numvfs)


def _same_vgpu(model: Vgpu | None, seen: VgpuSeen | None) -> bool:
    if model is None or seen is None:
        return model is None and seen is None
    return model.type == seen.type and model.creatable == seen.creatable


def _fields_delta(
    old: BaseModel, new: BaseModel, *, skip: str = ""
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The fields of two answers of one model that differ, as ``(before, after)``."""
    before: dict[str, Any] = {}
    after: dict[str, Any] = {}
    old_fields = old.__dict__
    for name, value in new.__dict__.items():
        if name != skip and old_fields.get(name) != value:
            before[name] = old_fields.get(name)
            after[name] = value
    return (before, after) if after else None


class _Missing:
    pass


_MISSING: Any = _Missing()
