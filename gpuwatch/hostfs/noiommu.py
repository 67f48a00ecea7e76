"""VFIO no-IOMMU groups: IOMMU groups that isolate nothing.

On a host without an IOMMU (none in the firmware, or a VM guest without a vIOMMU), loading
vfio with ``enable_unsafe_noiommu_mode=1`` lets vfio-pci bind a device anyway: VFIO makes it
an IOMMU group of its own, named ``vfio-noiommu`` (``sys/kernel/iommu_groups/N/name``), whose
node is ``/dev/vfio/noiommu-N``. Such a group gives no DMA isolation and taints the kernel;
userspace drivers (DPDK) use it, but no VMM does (QEMU, libvirt and cloud-hypervisor refuse
it). So it is an entry of ``sys/kernel/iommu_groups`` (``detect-vfio``'s ``iommu_enabled`` counts
it, by that probe's rule) but no IOMMU to an operator, and no passthrough candidate.

The group's name is in no probe answer, so the reports read it here, as they read
``boot_vga``: one small attribute per group, only for ``status`` and ``list``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import NamedTuple

from gpuwatch.core.reporttext import NOIOMMU_NODE, vfio_open_nodes
from gpuwatch.hostfs.files import in_root, list_dir, present, read_attr, tree_dir

#: The name VFIO gives the group it makes for a device on a host without an IOMMU.
NOIOMMU_GROUP_NAME = "vfio-noiommu"


class IommuGroups(NamedTuple):
    """The host's IOMMU groups, told apart: VFIO no-IOMMU groups, and whether any other
    (a real IOMMU's) exists. (A NamedTuple, not a dataclass: `status` and `list` answered
    by a daemon import this module, and ``dataclasses`` alone costs them ~10 ms.)"""

    noiommu: frozenset[int] = frozenset()
    real: bool = False

    def node(self, group: int) -> str:
        """The VFIO node of ``group`` as the kernel names it (``""`` for no group)."""
        if group < 0:
            return ""
        return f"{NOIOMMU_NODE}{group}" if group in self.noiommu else f"/dev/vfio/{group}"


def read_iommu_groups(root: str) -> IommuGroups:
    """Every entry of ``sys/kernel/iommu_groups`` under ``root``, by its ``name``. Only groups
    that were given one have it (VFIO's no-IOMMU groups): each is asked first, as a failed
    read costs an exception, and a host with a group per function has a thousand."""
    base = in_root(root, os.path.join(tree_dir(root, "sys"), "kernel/iommu_groups"))
    noiommu: set[int] = set()
    real = False
    for entry in list_dir(base):
        if not (entry.isascii() and entry.isdigit()):
            continue
        name = os.path.join(base, entry, "name")
        if present(name) and read_attr(name) == NOIOMMU_GROUP_NAME:
            noiommu.add(int(entry))
        else:
            real = True
    return IommuGroups(frozenset(noiommu), real)


def vfio_open(root: str, vfio_node: str, iommufd: bool, cdevs: Iterable[str],
              group_accessible: bool) -> tuple[list[str], bool]:
    """`status`'s ``vfio_open`` for the tree under ``root`` (`vfio_open_nodes`: the group
    node when it exists, else on an iommufd-only kernel ``/dev/iommu`` and the cdevs), and
    whether this process may open every one of those read/write (``vfio_open_accessible``):
    for the group node the model's answer (``group_accessible``), for the iommufd nodes,
    which no probe answers, the file system's."""

    def under(node: str) -> str:
        return tree_dir(root, node)

    present = bool(vfio_node) and os.path.exists(under(vfio_node))
    nodes = vfio_open_nodes(vfio_node, present, iommufd, cdevs)
    if nodes == [vfio_node]:
        return nodes, group_accessible
    return nodes, bool(nodes) and all(os.access(under(n), os.R_OK | os.W_OK) for n in nodes)


__all__ = ["NOIOMMU_GROUP_NAME", "IommuGroups", "read_iommu_groups", "vfio_open"]
