"""Which driver each function of a GPU's IOMMU group wants in each mode.

One rule, shared by the `group-in-mode` probe, `status`, and the switch planner, so that
"in mode" means exactly the same thing everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from gpuwatch.core.results import PciFunction

Mode = Literal["vfio", "nvidia"]
MODES: tuple[Mode, ...] = ("vfio", "nvidia")
VFIO_DRIVER = "vfio-pci"
HOST_GPU_DRIVERS = frozenset(
    {"amdgpu", "radeon", "i915", "xe", "nouveau", "virtio-pci", "bochs-drm"}
)


def target_driver(function: PciFunction, mode: Mode) -> str:
    """``vfio`` wants vfio-pci everywhere; ``nvidia`` wants nvidia for display functions,
    snd_hda_intel for HDMI audio (0x0403) and vfio-pci for anything else (USB-C, UCSI)."""
    if mode == "vfio":
        return VFIO_DRIVER
    if function.class_.startswith("0x03"):
        return "nvidia"
    if function.class_ == "0x0403":
        return "snd_hda_intel"
    return VFIO_DRIVER


def group_in_mode(members: Iterable[PciFunction], mode: Mode) -> bool:
    return all(fn.driver == target_driver(fn, mode) for fn in members)


def current_mode(function: PciFunction) -> str:
    """The probe contract's two-valued answer: anything but nvidia counts as vfio."""
    return "nvidia" if function.driver == "nvidia" else "vfio"


def group_mode(members: Iterable[PciFunction]) -> str:
    """The operator's view of a group: ``vfio``, ``nvidia``, ``unbound`` (no function has a
    driver: nothing is mixed, it is simply free), ``host driver`` or ``mixed`` (functions on
    drivers of different modes)."""
    fns = list(members)
    if fns and not any(fn.driver for fn in fns):
        return "unbound"
    if group_in_mode(fns, "vfio"):
        return "vfio"
    if group_in_mode(fns, "nvidia"):
        return "nvidia"
    display = [fn for fn in fns if fn.class_.startswith("0x03")]
    if display and all(fn.driver and fn.driver not in (VFIO_DRIVER, "nvidia") for fn in display):
        return "host driver"
    return "mixed"
