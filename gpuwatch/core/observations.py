"""What the I/O edge read from the tree, handed to the pure model.

The model never reads sysfs itself (h11 style): the reader turns a uevent into one or more
observations of what is there *now*, and `HostState.apply` turns observations into changes.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import NamedTuple


class SriovSeen(NamedTuple):
    """A physical function's ``sriov_totalvfs``, the VFs its ``virtfnN`` links name that are in
    the tree, and ``numvfs``: how many VFs the kernel has added (its links, each VF counted
    whether or not a copy of the tree kept the VF's folder)."""

    totalvfs: int
    vfs: tuple[str, ...]
    numvfs: int


def vfs_in_tree(sriov: SriovSeen, addrs: Container[str]) -> SriovSeen:
    """``sriov`` with only the VFs that are functions of the tree (``addrs``): a copy that took
    a PF but not its VFs' folders keeps their ``virtfnN`` links, which lead nowhere (or,
    spelled absolute, anywhere). Such a VF is no function to list; ``numvfs`` still counts
    it (the kernel had it enabled: a switch of the PF is refused for it)."""
    kept = tuple(vf for vf in sriov.vfs if vf in addrs)
    return sriov if len(kept) == len(sriov.vfs) else sriov._replace(vfs=kept)


class VgpuSeen(NamedTuple):
    """``nvidia/current_vgpu_type`` and ``nvidia/creatable_vgpu_types`` of a vGPU VF."""

    type: int
    creatable: tuple[int, ...]


class PciSeen(NamedTuple):
    """A PCI function as read from its sysfs directory. Unreadable fields are ``""`` / -1.

    A NamedTuple rather than a frozen dataclass: one is built per uevent, and a frozen
    dataclass pays an ``object.__setattr__`` per field (3x the cost).
    """

    addr: str
    devpath: str
    vendor_id: str
    device_id: str
    klass: str
    driver: str
    iommu_group: int
    #: The ``vfio-dev/vfioN`` entry's name, ``""`` when the function has none.
    vfio_dev: str = ""
    #: ``/dev/vfio/devices/vfioN`` when ``vfio-dev/vfioN/dev`` exists (a kernel with the
    #: VFIO device cdev); the model reports it once that node exists too.
    vfio_cdev: str = ""
    sriov: SriovSeen | None = None
    physfn: str = ""
    vgpu: VgpuSeen | None = None
    #: ``boot_vga`` reads 1: the firmware's console (only display functions have the file).
    boot_vga: bool = False


class DriversSeen(NamedTuple):
    """Functions a bind or unbind left as they were but for the driver link, each with the
    driver it names now, in the order read: no VFIO device and no vGPU was found with it. The
    edge vouches for the rest: the same card (its uevent's ids), its IOMMU's fixed group, no
    SR-IOV. One record for a run of them: a storm is mostly these."""

    entries: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class PciErrorSeen:
    """A PCI error-recovery ``change`` uevent (``ERROR_EVENT=…``, ``DEVICE_ONLINE=0|1``)."""

    addr: str
    error_event: str
    online: bool | None


@dataclass(frozen=True, slots=True)
class DrmWedgeSeen:
    """A DRM ``change`` uevent with ``WEDGED=<method>[,…]`` on ``card``, under function ``addr``."""

    addr: str
    card: str
    recovery: tuple[str, ...]
    pid: int | None
    task: str | None


class PciRebound(NamedTuple):
    """A ``bind`` or ``add`` uevent named the function: a fresh start clears its bad health,
    even when the batch folded the unbind and bind (or remove and add) into one read. A
    NamedTuple, like `PciSeen`: one is built per bind."""

    addr: str


@dataclass(frozen=True, slots=True)
class VgpusSeen:
    """The vGPU files of the functions that have them, re-read without a uevent (they
    change without one): ``(addr, vgpu)`` pairs, ``None`` where the files went away."""

    vgpus: tuple[tuple[str, VgpuSeen | None], ...]


@dataclass(frozen=True, slots=True)
class PciGone:
    """The function's directory is gone (removed, or vanished between event and read)."""

    addr: str


@dataclass(frozen=True, slots=True)
class DrmSeen:
    """A DRM node (``card0``, ``renderD128``) and what its ``device`` link leads to."""

    name: str
    devpath: str
    device_addr: str  # PCI address of the parent device, "" when not a PCI function
    device_vendor: str
    device_driver: str


@dataclass(frozen=True, slots=True)
class DrmGone:
    name: str


@dataclass(frozen=True, slots=True)
class FramebufferSeen:
    """A framebuffer device (``fb0``: ``graphics`` class) and the PCI function it hangs
    beneath (`gpuwatch.hostfs.bootvga.framebuffer_owner`): that function's driver, or the
    firmware, shows the host's console on it. One beneath no function (the firmware's on a
    platform device, a virtual one) is read as `FramebufferGone`: a scan records none."""

    name: str
    addr: str


@dataclass(frozen=True, slots=True)
class FramebufferGone:
    name: str


@dataclass(frozen=True, slots=True)
class ModuleSeen:
    """Whether ``sys/module/<name>`` exists."""

    name: str
    loaded: bool


@dataclass(frozen=True, slots=True)
class KfdSeen:
    """KFD topology nodes as ``(node_id, gfx_target_version)`` in numeric order, 0 for CPU or
    garbage: those up to the first GPU's (`gpuwatch.hostfs.scan.read_kfd`)."""

    nodes: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class NodeStat:
    """Owner, mode and POSIX ACL of a device node: enough to answer access questions from
    memory. ``acl``: the node's ``system.posix_acl_access`` entries as ``(tag, perm, id)``
    (`ACL_USER` and the others below), ``()`` for a node without one (its mode says all);
    udev's ``uaccess`` and ``setfacl`` grant access there with mode bits that say no."""

    mode: int
    uid: int
    gid: int
    acl: tuple[tuple[int, int, int], ...] = ()


#: POSIX ACL entry tags, as ``include/uapi/linux/posix_acl.h`` numbers them.
ACL_USER_OBJ, ACL_USER, ACL_GROUP_OBJ, ACL_GROUP, ACL_MASK, ACL_OTHER = 1, 2, 4, 8, 16, 32


@dataclass(frozen=True, slots=True)
class NodeSeen:
    """A host device path (``/dev/kvm``) and its stat, or ``stat=None`` when it is absent."""

    path: str
    stat: NodeStat | None


@dataclass(frozen=True, slots=True)
class NodesSeen:
    """The complete set of watched device nodes, after a glob of every pattern."""

    nodes: tuple[tuple[str, NodeStat], ...]


@dataclass(frozen=True, slots=True)
class CdiSeen:
    etc_spec: bool
    var_spec: bool
    ctk_on_path: bool


@dataclass(frozen=True, slots=True)
class IommuSeen:
    enabled: bool
    kind: str
    #: The machine's kind (`gpuwatch.core.hostkind.HostKind`): ``x86``, ``arm64`` or ``""``,
    #: and the hypervisor of a guest (``""``: bare metal, or not known). Only the advice on
    #: turning an IOMMU on reads them: it differs for an arm64 host and a VM guest.
    arch: str = ""
    hypervisor: str = ""


Observation = (
    PciSeen
    | DriversSeen
    | PciGone
    | PciErrorSeen
    | DrmWedgeSeen
    | PciRebound
    | VgpusSeen
    | DrmSeen
    | DrmGone
    | FramebufferSeen
    | FramebufferGone
    | ModuleSeen
    | KfdSeen
    | NodeSeen
    | NodesSeen
    | CdiSeen
    | IommuSeen
)

#: The record types of `Observation`, for runtime checks.
OBSERVATION_TYPES = (
    PciSeen,
    DriversSeen,
    PciGone,
    PciErrorSeen,
    DrmWedgeSeen,
    PciRebound,
    VgpusSeen,
    DrmSeen,
    DrmGone,
    FramebufferSeen,
    FramebufferGone,
    ModuleSeen,
    KfdSeen,
    NodeSeen,
    NodesSeen,
    CdiSeen,
    IommuSeen,
)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one full scan saw: the input of the initial model and of every resync."""

    functions: tuple[PciSeen, ...]
    drm: tuple[DrmSeen, ...]
    modules: frozenset[str]
    kfd: KfdSeen
    nodes: NodesSeen
    cdi: CdiSeen
    iommu: IommuSeen
    #: The framebuffer devices beneath display functions (`FramebufferSeen`).
    framebuffers: tuple[FramebufferSeen, ...] = ()
