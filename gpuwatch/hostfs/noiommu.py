"""VFIO no-IOMMU groups: IOMMU groups that isolate nothing.

On a host without an IOMMU (none in the firmware, or a VM guest without a vIOMMU), loading
vfio with ``enable_unsafe_noiommu_mode=1`` lets vfio-pci bind a device anyway: VFIO makes it
an IOMMU group of its own, named ``vfio-noiommu`` (``sys/kernel/iommu_groups/N/name``), whose
node is ``/dev/vfio/noiommu-N``. Such a group gives no DMA isolation and taints the kernel;
userspace drivers (DPDK) use it, but no VMM does (QEMU, libvirt and cloud-hypervisor refuse
it). So it is an entry of ``sys/kernel/iommu_groups`` (``detect-vfio``'s ``iommu_enabled`` counts
it, by that probe's rule) but no IOMMU to an operator, and no passthrough candidate.

VFIO gives the same name to the groups it makes for mediated devices (mdev: an Intel GVT-g
or NVIDIA vGPU instance, vfio-ap, vfio-ccw), whose "emulated IOMMU" is the parent driver's own
translation: those are told apart by their members (an mdev is named by its UUID) or, failing
that, by their node (``/dev/vfio/N``). They are usable by a VM, but they are no IOMMU either.

The group's name is in no probe answer, so the reports read it here, as they read
``boot_vga``: one small attribute per group, only for ``status`` and ``list``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from gpuwatch.core.reporttext import NOIOMMU_NODE, iommu_off_param, vfio_open_nodes
from gpuwatch.hostfs.files import in_root, list_dir, read_attr, tree_dir

#: The name VFIO gives the group it makes for a device on a host without an IOMMU (and for
#: a mediated device's emulated-IOMMU group).
NOIOMMU_GROUP_NAME = "vfio-noiommu"
#: A mediated device's name: the UUID it was created with.
_MDEV_NAME_RE = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                           r"[0-9a-fA-F]{12}$")


class IommuGroups(NamedTuple):
    """The host's IOMMU groups, told apart: VFIO no-IOMMU groups, and whether any other
    (a real IOMMU's) exists. (A NamedTuple, not a dataclass: `status` and `list` answered
    by a daemon import this module, and ``dataclasses`` alone costs them ~10 ms.)"""

    noiommu: frozenset[int] = frozenset()
    real: bool = False
    #: Mediated devices' groups (VFIO's emulated IOMMU): a VM's to open, but no IOMMU.
    emulated: frozenset[int] = frozenset()

    def node(self, group: int) -> str:
        """The VFIO node of ``group`` as the kernel names it (``""`` for no group)."""
        if group < 0:
            return ""
        return f"{NOIOMMU_NODE}{group}" if group in self.noiommu else f"/dev/vfio/{group}"


def read_iommu_groups(root: str) -> IommuGroups:
    """Every entry of ``sys/kernel/iommu_groups`` under ``root``, by its ``name``. Only groups
    that were given one have it (VFIO's): each is asked first, as a failed read costs an
    exception, and a host with a group per function has a thousand: asked relative to the
    folder, listed and held open once, so each costs one short lookup (`status` cold on a
    host of 900 groups spent a tenth of its own time here)."""
    base = in_root(root, os.path.join(tree_dir(root, "sys"), "kernel/iommu_groups"))
    noiommu: set[int] = set()
    emulated: set[int] = set()
    real = False
    for entry in _named_groups(base):
        if entry is None:
            real = True
            continue
        name = os.path.join(base, entry, "name")
        if read_attr(name) != NOIOMMU_GROUP_NAME:
            real = True
        elif _emulated(root, os.path.join(base, entry), entry):
            emulated.add(int(entry))
        else:
            noiommu.add(int(entry))
    return IommuGroups(frozenset(noiommu), real, frozenset(emulated))


def _named_groups(base: str) -> Iterator[str | None]:
    """Each group folder in ``base`` that holds a ``name`` (VFIO's), and None for each that
    does not (a real IOMMU's): what `read_iommu_groups` asks of every entry, through one
    descriptor of the folder. Nothing for a folder that cannot be listed."""
    try:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (OSError, ValueError):
        return
    try:
        try:
            entries = os.listdir(fd)
        except OSError:
            return
        access, exists = os.access, os.F_OK
        for entry in entries:
            if entry.isascii() and entry.isdigit():
                yield entry if access(f"{entry}/name", exists, dir_fd=fd) else None
    finally:
        os.close(fd)


def _emulated(root: str, group_dir: str, group: str) -> bool:
    """A ``vfio-noiommu`` group of mediated devices: its members are named by UUID; with no
    member listed (a copy without the links), its node is ``/dev/vfio/N``, where a no-IOMMU
    group's is ``/dev/vfio/noiommu-N``."""
    members = list_dir(os.path.join(group_dir, "devices"))
    if members:
        return all(_MDEV_NAME_RE.match(m) for m in members)
    dev = tree_dir(root, "dev")
    return (os.path.exists(os.path.join(dev, "vfio", group))
            and not os.path.exists(os.path.join(dev, "vfio", f"noiommu-{group}")))


def read_iommu_off(root: str) -> str:
    """`iommu_off_param` of the tree's ``proc/cmdline``: what `status` names as the cause
    when no IOMMU is on (the model keeps only the kind the command line asks for)."""
    return iommu_off_param(read_attr(os.path.join(tree_dir(root, "proc"), "cmdline")))


def vfio_open(root: str, vfio_node: str, iommufd: bool, cdevs: Iterable[str],
              group_accessible: bool, places: Callable[[str], str] | None = None
              ) -> tuple[list[str], bool]:
    """`status`'s ``vfio_open`` for the tree under ``root`` (`vfio_open_nodes`: the group
    node when it exists, else on an iommufd-only kernel ``/dev/iommu`` and the cdevs), and
    whether this process may open every one of those read/write (``vfio_open_accessible``):
    for the group node the model's answer (``group_accessible``), for the iommufd nodes,
    which no probe answers, the file system's. ``places``: where each node is in the tree
    (a `TreePlaces` of ``root`` shared by a report's GPUs), else `tree_dir` of each."""

    def under(node: str) -> str:
        return tree_dir(root, node) if places is None else places(node)

    present = bool(vfio_node) and os.path.exists(under(vfio_node))
    nodes = vfio_open_nodes(vfio_node, present, iommufd, cdevs)
    if nodes == [vfio_node]:
        return nodes, group_accessible
    # By the effective uid, groups and capabilities, as open() decides (and as the group
    # node's answer is), not by the real ones access() takes by default.
    return nodes, bool(nodes) and all(
        os.access(under(n), os.R_OK | os.W_OK, effective_ids=os.access in os.supports_effective_ids)
        for n in nodes)


__all__ = ["NOIOMMU_GROUP_NAME", "IommuGroups", "read_iommu_groups", "read_iommu_off",
           "vfio_open"]
