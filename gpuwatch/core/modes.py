"""Which driver each function of a GPU's IOMMU group wants in each mode.

One rule, shared by the `group-in-mode` probe, `status`, and the switch planner, so that
"in mode" means exactly the same thing everywhere.

A function is *on VFIO* when it has a ``vfio-dev`` entry or its driver is vfio-pci or a
vfio-pci variant (``nvgrace_gpu_vfio_pci``, ``mlx5_vfio_pci``, or one the table key
``vfio_variant_drivers`` names). Driver names compare with ``-`` and ``_`` as equal, as
modprobe compares module names.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Literal, Protocol, TypeVar

from gpuwatch.errors import UsageError


class FunctionLike(Protocol):
    """What these rules read of a function: a `gpuwatch.core.results.PciFunction`, or the
    plain record of a cold direct probe (`gpuwatch.core.probes.FreshFunction`)."""

    @property
    def addr(self) -> str: ...
    @property
    def driver(self) -> str: ...
    @property
    def class_(self) -> str: ...
    @property
    def vfio_dev(self) -> str: ...


Mode = Literal["vfio", "nvidia"]
MODES: tuple[Mode, ...] = ("vfio", "nvidia")


def parse_mode(text: str | None) -> Mode:
    """A requested mode as a `Mode`; anything else is a `UsageError` (the one mode parser of
    the probes, the CLI and the switch)."""
    for mode in MODES:
        if text == mode:
            return mode
    raise UsageError(f"mode must be {' or '.join(MODES)}, not {text!r}")
VFIO_DRIVER = "vfio-pci"
_NO_VARIANTS: frozenset[str] = frozenset()


def driver_key(name: str) -> str:
    """The spelling two driver or module names are compared in: ``vfio-pci`` → ``vfio_pci``."""
    return name.replace("-", "_")


def same_driver(a: str, b: str) -> bool:
    return a == b or driver_key(a) == driver_key(b)


def variant_keys(names: Iterable[str]) -> frozenset[str]:
    """The table's ``vfio_variant_drivers`` in comparison spelling."""
    return frozenset(driver_key(n) for n in names if n)


def is_vfio_driver(name: str, variants: frozenset[str] = _NO_VARIANTS) -> bool:
    """vfio-pci itself, a driver named ``…_vfio_pci``/``…-vfio-pci``, or a listed variant."""
    key = driver_key(name)
    return key == "vfio_pci" or key.endswith("_vfio_pci") or (bool(key) and key in variants)


def on_vfio(function: FunctionLike, variants: frozenset[str] = _NO_VARIANTS) -> bool:
    return bool(function.vfio_dev) or is_vfio_driver(function.driver, variants)


def vfio_variant(members: Iterable[FunctionLike],
                 variants: frozenset[str] = _NO_VARIANTS) -> str:
    """The vfio-pci variant a group's functions are bound to (``""`` when none is)."""
    for fn in members:
        if is_vfio_driver(fn.driver, variants) and driver_key(fn.driver) != "vfio_pci":
            return fn.driver
    return ""


#: A PCI-to-PCI bridge (a root or downstream port): header type 1, which vfio-pci never
#: binds (it refuses any header but a normal one) ...
BRIDGE_CLASS = "0x0604"
#: ... and the other bridges it never binds either: semi-transparent PCI-to-PCI (0x0609,
#: header type 1) and CardBus (0x0607, header type 2).
BRIDGE_CLASSES = frozenset({BRIDGE_CLASS, "0x0607", "0x0609"})
#: The bridge's own driver: it sets ``driver_managed_dma``, so the kernel lets a group holding
#: a bridge on it (or on none) be used through VFIO with the bridge left where it is.
BRIDGE_DRIVER = "pcieport"


def host_bridge(function: FunctionLike) -> bool:
    """A bridge (`BRIDGE_CLASSES`) on ``pcieport`` or on no driver, or whatever else
    pcieport drives (a root complex event collector, class 0x0807): in every mode as it is
    (the kernel's VFIO ignores it when it decides whether the group is usable), so it makes
    no group mixed."""
    driver = function.driver
    return driver == BRIDGE_DRIVER or (not driver and function.class_ in BRIDGE_CLASSES)


def stays_with_host(function: FunctionLike) -> bool:
    """A function the guest never takes when its group is passed through (no ``<hostdev>``
    line in `list`): any bridge (`BRIDGE_CLASSES`: vfio-pci binds no bridge header) and
    whatever `host_bridge` leaves on pcieport in every mode (a root complex event collector,
    0x0807). A block for one would have libvirt detach it (managed='yes') or, after
    `gpuwatch mode vfio` left it on pcieport, keep the VM from starting (managed='no')."""
    return function.class_ in BRIDGE_CLASSES or host_bridge(function)


def slot_of(addr: str) -> str:
    """The slot (``DDDD:BB:DD``) of a function's address: a card's functions share one."""
    return addr.rsplit(".", 1)[0]


def card_slots(members: Iterable[FunctionLike]) -> frozenset[str] | None:
    """The slots of a group's display functions (``0x03…``): a function in one of them is
    part of a card (its HDMI audio, USB-C, UCSI), whatever its class. None for a group with
    no display function: with no card to tell them from, no function is a bystander."""
    slots = frozenset(slot_of(fn.addr) for fn in members if fn.class_.startswith("0x03"))
    return slots or None


def bystander(function: FunctionLike, slots: Collection[str] | None) -> bool:
    """A function of a GPU's IOMMU group that is no part of any card in it: not a bridge
    (they have rules of their own, `host_bridge`) and not in a display function's slot. A
    PCIe switch without ACS (HGX boards turn it off for GPUDirect RDMA) puts the NIC, the
    NVMe drive or the NVSwitch behind it in the GPU's group; they are the host's."""
    return (slots is not None and function.class_ not in BRIDGE_CLASSES
            and not host_bridge(function) and slot_of(function.addr) not in slots)


_F = TypeVar("_F", bound=FunctionLike)


def host_bystanders(members: Iterable[_F], variants: frozenset[str] = _NO_VARIANTS) -> list[_F]:
    """The group's `bystander` functions on a host driver (not VFIO): what passing the group
    to a VM takes from the host, and what a switch either way refuses to move unasked
    (`gpuwatch.core.plan.bystanders_reason`)."""
    fns = list(members)
    slots = card_slots(fns)
    return [fn for fn in fns
            if bystander(fn, slots) and fn.driver and not on_vfio(fn, variants)]


def target_driver(function: FunctionLike, mode: Mode) -> str:
    """``vfio`` wants vfio-pci everywhere; ``nvidia`` wants nvidia for display functions,
    snd_hda_intel for HDMI audio (0x0403) and vfio-pci for anything else (USB-C, UCSI). The
    class rule is the public contract (`group-in-mode`, `mode --json`, `plan`) and holds for
    a `bystander` too: the switch's safety for one is a refusal, not another target
    (`gpuwatch.core.plan.bystanders_reason`). A `host_bridge` stays on pcieport in both
    (vfio-pci never binds a bridge). (The switch may bind a vfio-pci variant instead: see
    `gpuwatch.core.plan`.)"""
    if host_bridge(function):
        return BRIDGE_DRIVER
    if mode == "vfio":
        return VFIO_DRIVER
    if function.class_.startswith("0x03"):
        return "nvidia"
    if function.class_ == "0x0403":
        return "snd_hda_intel"
    return VFIO_DRIVER


def in_mode(function: FunctionLike, mode: Mode, variants: frozenset[str] = _NO_VARIANTS) -> bool:
    """Whether one function is where ``mode`` wants it; any vfio-pci variant counts as vfio,
    and a `host_bridge` is in both modes."""
    if host_bridge(function):
        return True
    target = target_driver(function, mode)
    if target == VFIO_DRIVER:
        return on_vfio(function, variants)
    return same_driver(function.driver, target)


def group_in_mode(members: Iterable[FunctionLike], mode: Mode,
                  variants: frozenset[str] = _NO_VARIANTS) -> bool:
    return all(in_mode(fn, mode, variants) for fn in members)


def current_mode(function: FunctionLike) -> str:
    """The probe contract's two-valued answer: anything but nvidia counts as vfio."""
    return "nvidia" if function.driver == "nvidia" else "vfio"


def group_mode(members: Iterable[FunctionLike], variants: frozenset[str] = _NO_VARIANTS) -> str:
    """The operator's view of a group: ``vfio``, ``nvidia``, ``unbound`` (no function has a
    driver: nothing is mixed, it is simply free), ``host driver`` (every display function on
    a host driver such as amdgpu or i915, and no function on VFIO) or ``mixed`` (functions on
    drivers of different modes). A `host_bridge` in the group is left out: it stays where it
    is in every mode."""
    every = list(members)
    fns = [fn for fn in every if not host_bridge(fn)] or every
    if fns and not any(fn.driver for fn in fns):
        return "unbound"
    if group_in_mode(fns, "vfio", variants):
        return "vfio"
    if group_in_mode(fns, "nvidia", variants):
        return "nvidia"
    display = [fn for fn in fns if fn.class_.startswith("0x03")]
    # A function on VFIO beside a display on amdgpu (the card's HDMI audio given to vfio-pci,
    # a switch half done) is two modes at once, as it is beside a display on nvidia.
    if (display and all(fn.driver and fn.driver != "nvidia" for fn in display)
            and not any(on_vfio(fn, variants) for fn in fns)):
        return "host driver"
    return "mixed"
