"""Which GPU groups belong to the host itself, and so are never passthrough candidates. Pure.

A VM manager that passes the BMC's VGA or the host's only console to a guest takes the
host's screen (and on iLO/iDRAC boards its management functions) with it; one that passes
a VMD controller takes every device of its domain, the host's NVMe drives among them.
`list` shows such groups apart and `mode vfio` refuses them unless forced; both ask this
one rule.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from gpuwatch.core.pci import is_gpu_class

if TYPE_CHECKING:
    from gpuwatch.core.results import PciFunction  # types only: no pydantic at import

#: Intel's Volume Management Device driver: its controller opens a PCI domain of its own
#: (``10000:``…) whose devices' DMA carries the controller's requester id.
VMD_DRIVER = "vmd"


def kept_for_host_reason(
    members: Sequence[PciFunction],
    *,
    console_drivers: Collection[str],
    boot_vga: Collection[str],
    host_displays: Iterable[str],
    console_devices: Collection[str] = (),
    framebuffers: Collection[str] = (),
) -> str:
    """Why this IOMMU group stays with the host, or ``""`` when it may be passed through.

    Kept when a member is an Intel VMD controller (driver ``vmd``: the GPU sits in the PCI
    domain it opens and shares its group), when a member is bound to a BMC/console driver
    (``host_console_drivers``), or is a BMC/console device by its ids (``host_console_devices``,
    ``0x1a03:0x2000``: the BMC's VGA with its driver blacklisted or not loaded yet is still the
    BMC's), or when a display function of it has ``boot_vga`` 1 and the group holds every
    display function of the host (``host_displays``: every display-class address that can be
    a screen of the host's, see `own_displays`: no SR-IOV virtual function, and no 3D
    controller without a framebuffer, such as an Optimus laptop's dGPU or a compute card
    beside an iGPU console): that one alone, or all of two cards behind a
    port without ACS, which go to a guest together; or when it holds every display function
    and a framebuffer device hangs beneath one of them (``framebuffers``, see
    `gpuwatch.hostfs.bootvga.framebuffer_names`): the host's console on a display with no
    ``boot_vga`` file (only VGA-class functions have one: QEMU's bochs-display and virtio-gpu
    at class 0x0380, a 3D controller that took the console over from the firmware's
    framebuffer)."""
    ordered = sorted(members, key=lambda m: m.addr)
    controllers = [fn.addr for fn in ordered if fn.driver == VMD_DRIVER]
    if controllers:
        what = ("is an Intel VMD controller" if len(controllers) == 1
                else "are Intel VMD controllers")
        return (f"{', '.join(controllers)} (vmd) {what} in this group: the functions behind it "
                "share its IOMMU group, and taking it from the host takes its whole PCI domain "
                "(the NVMe drives there too); turn VMD off in the firmware, or move the card "
                "to a slot outside VMD, to pass it through")
    consoles = [f"{fn.addr} ({fn.driver})" for fn in ordered
                if fn.driver and fn.driver in console_drivers]
    if consoles:
        return (f"{', '.join(consoles)} {'is' if len(consoles) == 1 else 'are'} bound to a "
                "BMC/console driver (host_console_drivers): this group is the host's console "
                "or management function")
    if console_devices:
        devices = [f"{fn.addr} ({fn.vendor_id[2:]}:{fn.device_id[2:]})" for fn in ordered
                   if f"{fn.vendor_id}:{fn.device_id}" in console_devices]
        if devices:
            return (f"{', '.join(devices)} {'is' if len(devices) == 1 else 'are'} a BMC/console "
                    "device (host_console_devices): this group is the host's console or "
                    "management function")
    if not (boot_vga or framebuffers):
        return ""  # (the rest names a function in one or the other)
    displays = set(host_displays)
    # Every display the host has is in this group (one, or cards behind a port without ACS):
    # passing the group through takes them all, whichever of them holds the console.
    group_displays = [fn.addr for fn in ordered if is_gpu_class(fn.class_)]
    if not displays <= set(group_displays):
        return ""
    own = [a for a in group_displays if a in displays]
    alone = ("its only display function" if len(own) <= 1 else
             f"this group holds every display function of the host ({', '.join(own)})")
    for addr in group_displays:
        if addr in boot_vga:
            return (f"{addr} is the host's boot display (boot_vga 1) and {alone}: passing it "
                    "through leaves the host without a console")
    for addr in group_displays:
        if addr in framebuffers:
            return (f"{addr} carries the host's framebuffer console (a graphics fbN device) "
                    f"and {'is ' if len(own) <= 1 else ''}{alone}: passing it through leaves "
                    "the host without a console")
    return ""


#: The PCI class of a 3D controller: a display controller with no VGA compatibility, which
#: drives no screen unless a framebuffer hangs beneath it.
THREE_D_CONTROLLER_CLASS = "0x0302"


def is_3d_controller(klass: str) -> bool:
    """Whether ``klass`` (``0x0302``, ``0x030200``) is a 3D controller's: an Optimus laptop's
    NVIDIA dGPU, an A100/H100/L4. It has no outputs, so it is a screen of the host only
    when a framebuffer (the console) hangs beneath it."""
    return klass.startswith(THREE_D_CONTROLLER_CLASS)


def own_displays(gpus: Iterable[tuple[str, str, str]],
                 framebuffers: Collection[str] = ()) -> Iterator[str]:
    """The addresses of ``gpus`` (``(addr, physfn, class)`` of every display-class function)
    that can be a screen of the host's own, one it could fall back on: not an SR-IOV virtual
    function, and not a 3D controller unless it carries a framebuffer (``framebuffers``:
    the addresses of the display functions with one beneath them). A VF (an iGPU split with
    SR-IOV for VMs, ``0000:00:02.1``…) has no output of its own: the host whose only
    display is that iGPU still boots on it and keeps it, however many VFs it made. A 3D
    controller without a framebuffer (an Optimus laptop's NVIDIA dGPU beside the iGPU that
    drives the panel; an H100 beside a desktop's iGPU console) drives no screen either.
    VGA (0x0300), XGA (0x0301) and other display controllers (0x0380) always count: they
    may drive a screen with no framebuffer on it yet."""
    return (addr for addr, physfn, klass in gpus
            if not physfn and (not is_3d_controller(klass) or addr in framebuffers))


__all__ = ["is_3d_controller", "kept_for_host_reason", "own_displays"]
