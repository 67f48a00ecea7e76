"""Planning a driver switch: the exact, ordered host steps for one IOMMU group. Pure.

The planner sees the group's functions (from the model) and `HostFacts` read beforehand by
the I/O edge, and returns a `SwitchPlan`: every sysfs write with its file and value, every
command as an argument list, or a refusal with its reason. ``gpuwatch plan`` prints exactly
these steps and the switch executes exactly these steps, so what an operator reviews is
what runs. Nothing here reads a file, runs a command or looks at a clock.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, assert_never

from gpuwatch.core.health import RECOVERY_STALE_AFTER, UNSWITCHABLE, health_advice
from gpuwatch.core.hostkind import UNKNOWN_HOST, HostKind
from gpuwatch.core.modes import (
    BRIDGE_CLASSES,
    BRIDGE_DRIVER,
    VFIO_DRIVER,
    Mode,
    driver_key,
    group_in_mode,
    group_mode,
    host_bridge,
    host_bystanders,
    is_vfio_driver,
    parse_mode,
    same_driver,
    target_driver,
)
from gpuwatch.core.pci import (
    ADDR_FORMAT,
    DRIVER_NAME_RE,
    PCI_ADDR_RE,
    VENDOR_RE,
    canonical_addr,
    is_gpu_class,
    parse_addr,
    parse_vendor,
)
from gpuwatch.core.reporttext import iommu_needs
from gpuwatch.core.results import Holding, PciFunction
from gpuwatch.core.state import HostState
from gpuwatch.errors import DeviceNotFound, UnsafeName, UsageError

NVIDIA_VENDOR = "0x10de"
#: The documented card `gpuwatch plan` uses on a host without a matching one.
EXAMPLE_DISPLAY = "0000:01:00.0"
EXAMPLE_AUDIO = "0000:01:00.1"
EXAMPLE_GROUP = 1
#: Modules that hold nvidia and go first on a single-GPU host, in this order.
NVIDIA_DEPENDENTS = ("nvidia_drm", "nvidia_modeset", "nvidia_uvm", "nvidia_peermem")
PERSISTENCED_UNIT = "nvidia-persistenced"
CDI_OUTPUT = "etc/cdi/nvidia.yaml"
AUDIO_CLASS = "0x0403"
SND_DRIVER = "snd_hda_intel"
NVIDIA_DRIVER = "nvidia"
#: The value that clears ``driver_override`` (an empty write never reaches the kernel).
CLEAR_OVERRIDE = "\n"

_MODULE_RE = re.compile(r"^[A-Za-z0-9_]+$")

OnError = Literal["fail", "refuse", "warn"]


# --------------------------------------------------------------------------- steps


@dataclass(frozen=True, slots=True)
class WriteStep:
    """Write ``value`` to the sysfs file ``path`` (a host path: ``/sys/…``, under the root)."""

    path: str
    value: str

    def key(self) -> tuple[str, ...]:
        return ("write", self.path, self.value)

    def describe(self) -> str:
        return f"write {self.value!r} to {self.path}"


@dataclass(frozen=True, slots=True)
class CommandStep:
    """Run ``argv`` (never through a shell). ``on_error`` says what a non-zero exit means:
    ``fail`` the switch, ``refuse`` it (a module in use), or only ``warn``."""

    argv: tuple[str, ...]
    on_error: OnError = "fail"

    def key(self) -> tuple[str, ...]:
        return ("command", *self.argv)

    def describe(self) -> str:
        return "run " + shlex.join(self.argv)


@dataclass(frozen=True, slots=True)
class MakeDirStep:
    """Create a folder (host path, under the root) and its parents."""

    path: str

    def key(self) -> tuple[str, ...]:
        return ("mkdir", self.path)

    def describe(self) -> str:
        return f"mkdir -p {self.path}"


#: The closed set of step types. The executor and `step_json` match on the type itself (a
#: new type is a mypy error at every ``assert_never`` until it is handled there), and the
#: ``kind`` string exists only in the plan's JSON.
Step = WriteStep | CommandStep | MakeDirStep


def step_json(step: Step) -> dict[str, Any]:
    """The step as the plan's JSON spells it, ``kind`` first."""
    match step:
        case WriteStep(path=path, value=value):
            return {"kind": "write", "path": path, "value": value}
        case CommandStep(argv=argv, on_error=on_error):
            return {"kind": "command", "argv": list(argv), "on_error": on_error}
        case MakeDirStep(path=path):
            return {"kind": "mkdir", "path": path}
        case _:
            assert_never(step)


def override_path(addr: str) -> str:
    return f"/sys/bus/pci/devices/{addr}/driver_override"


def unbind_path(driver: str) -> str:
    return f"/sys/bus/pci/drivers/{driver}/unbind"


DRIVERS_PROBE = "/sys/bus/pci/drivers_probe"


def module_of(driver: str) -> str:
    """The module (``sys/module`` name) that provides a PCI driver: ``vfio-pci`` → ``vfio_pci``."""
    return driver.replace("-", "_")


# --------------------------------------------------------------------------- facts


@dataclass(frozen=True, slots=True)
class NodeScope:
    """Device nodes whose holders matter: exact paths plus path prefixes (``/dev/nvidia``),
    and, where the root's ``/dev`` has them as character devices, their device numbers.

    A path alone misses a process in a container whose node was renamed
    (``--device /dev/nvidia3:/dev/nvidia0``: its fd reads ``/dev/nvidia0``): the numbers
    find it, and name it by the root's own node."""

    exact: frozenset[str] = frozenset()
    prefixes: tuple[str, ...] = ()
    #: ``(major, minor, node)`` of the scope's nodes as the root's ``/dev`` has them.
    numbers: frozenset[tuple[int, int, str]] = frozenset()
    #: Every minor of these majors is in scope (the char majors of a prefix's nodes: a
    #: renamed ``/dev/nvidia*`` keeps nvidia's major).
    majors: frozenset[int] = frozenset()
    #: ``numbers`` by device, the first node by name where two share one: `device_node`
    #: asks for every ``/dev`` fd a scan finds, so the lookup is made once, here.
    _by_number: dict[tuple[int, int], str] = field(
        init=False, repr=False, compare=False, default_factory=dict)
    #: The nodes whose numbers ``numbers`` holds: for these a stat, not the name, decides.
    _numbered_nodes: frozenset[str] = field(
        init=False, repr=False, compare=False, default=frozenset())

    def __post_init__(self) -> None:
        by_number: dict[tuple[int, int], str] = {}
        for major, minor, node in sorted(self.numbers):
            by_number.setdefault((major, minor), node)
        object.__setattr__(self, "_by_number", by_number)
        object.__setattr__(self, "_numbered_nodes",
                           frozenset(node for _, _, node in self.numbers))

    def matches(self, path: str) -> bool:
        return path in self.exact or any(path.startswith(p) for p in self.prefixes)

    @property
    def numbered(self) -> bool:
        """Are there numbers to look a device up by (else a stat would be wasted)?"""
        return bool(self.numbers or self.majors)

    def device_node(self, major: int, minor: int, seen: str) -> str | None:
        """The node in scope that is the character device ``major:minor``, named as the
        root's ``/dev`` names it (``seen``, the name the holder sees, when only its major is
        known); None when it is not in scope."""
        node = self._by_number.get((major, minor))
        if node is not None:
            return node
        return seen if major in self.majors else None

    def held(self, path: str, dev: tuple[int, int] | None) -> str | None:
        """The node in scope that an open file or mapping named ``path`` holds, ``dev``
        being what a stat of it said (``(major, minor)``; None: no character device).

        The numbers win where they are known: a container's ``/dev/nvidia0`` that is the
        host's GPU 3 (``--device /dev/nvidia3:/dev/nvidia0``) holds ``/dev/nvidia3`` and
        not ``/dev/nvidia0``. A name in scope whose node's numbers the root does not have
        (a captured tree's plain file) still counts by the name alone: a needless refusal
        rather than a missed holder. A stat that failed is the caller's: the name decides."""
        if dev is not None and (node := self.device_node(*dev, path)) is not None:
            return node
        if self.matches(path) and path not in self._numbered_nodes:
            return path
        return None

    def __or__(self, other: NodeScope) -> NodeScope:
        prefixes = self.prefixes + tuple(p for p in other.prefixes if p not in self.prefixes)
        return NodeScope(self.exact | other.exact, prefixes, self.numbers | other.numbers,
                         self.majors | other.majors)

    def __bool__(self) -> bool:
        return bool(self.exact or self.prefixes)


@dataclass(frozen=True, slots=True)
class VfioTarget:
    """The VFIO driver a function goes to: ``driver`` as the kernel spells the driver's name
    (what ``driver_override`` must hold), the ``module`` that provides it, the modules.alias
    pattern that chose it (``""`` for the default or an explicit ``--vfio-driver``), and
    ``exact``: asked for by name, so another VFIO driver does not count as there."""

    driver: str = VFIO_DRIVER
    module: str = "vfio_pci"
    alias: str = ""
    exact: bool = False


DEFAULT_VFIO_TARGET = VfioTarget()


@dataclass(frozen=True)
class HostFacts:
    """What the edge read before planning. Defaults describe an empty host."""

    root: str = "/"
    modules: frozenset[str] = frozenset()
    #: ``sys/module/nvidia/refcnt`` and the modules listed in ``sys/module/nvidia/holders``.
    nvidia_refcnt: int = 0
    nvidia_module_holders: tuple[str, ...] = ()
    #: Functions outside the group bound to nvidia: when any, the module must stay.
    other_nvidia: tuple[str, ...] = ()
    #: The ``/dev/nvidiaN`` minor of each function of the group on nvidia
    #: (``proc/driver/nvidia/gpus/<addr>/information``): a group may hold several GPUs (behind
    #: a PCIe switch without ACS), and each one's clients block its own unbind.
    nvidia_minors: Mapping[str, int] = field(default_factory=dict)
    #: ``/dev/dri/cardN``, ``renderDN`` per function, and ``/dev/snd/*`` per audio function.
    dri_nodes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    snd_nodes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    persistenced: bool = False
    cdi_spec: bool = False
    ctk_on_path: bool = False
    #: Where ``nvidia-ctk`` writes the spec: ``root/etc/cdi/nvidia.yaml`` with the tree's own
    #: links read as in a chroot (`hostfs.facts.cdi_output`): nvidia-ctk runs outside the
    #: root, and an ``etc/cdi`` linked to ``/run/cdi`` would otherwise lead its write into
    #: the ``/run`` of the container running gpuwatch. ``""``: ``root/etc/cdi/nvidia.yaml``.
    cdi_output: str = ""
    #: Holders of the nodes in `holder_scope` (nvidia-persistenced left out: it is stopped).
    holders: tuple[Holding, ...] = ()
    #: False when not root: other users' ``/proc/<pid>/fd`` cannot be read.
    holders_complete: bool = True
    #: The VFIO driver each function would go to (modules.alias, ``--vfio-driver``); a
    #: function not named gets plain vfio-pci.
    vfio_targets: Mapping[str, VfioTarget] = field(default_factory=dict)
    #: The table's ``vfio_variant_drivers`` (comparison spelling).
    vfio_variants: frozenset[str] = frozenset()
    #: The DRM wedge recovery methods the kernel named, per wedged function.
    wedge_recovery: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: Seconds since each ``recovering`` function's ``BEGIN_RECOVERY``, on the monotonic
    #: clock (a wall-clock step must not end or stretch the wait; absent: not known, taken
    #: as just begun).
    recovery_age: Mapping[str, float] = field(default_factory=dict)
    #: A bridge above a ``recovering`` function that reported ``FAILED_RECOVERY`` after the
    #: function's ``BEGIN_RECOVERY``: the kernel reports a failed recovery on the bridge
    #: alone, so the function's own end never comes (an older failure of the bridge is not
    #: this recovery's outcome).
    recovery_failed_above: Mapping[str, str] = field(default_factory=dict)
    #: A ``recovering`` bridge above a function (its age in `recovery_age`): the kernel
    #: resets the link below it, whether or not the function got a uevent of its own.
    recovery_above: Mapping[str, str] = field(default_factory=dict)
    #: A ``failed`` bridge above a function (not ``recovering``: see
    #: `recovery_failed_above`) whose ``FAILED_RECOVERY`` came after the function's last sign
    #: of life (its own recovery uevent, a bind): the kernel reports the failure on the bridge
    #: alone, so the function's health reads ``ok`` while the link to it is down.
    failed_bridge: Mapping[str, str] = field(default_factory=dict)
    #: The host has IOMMU groups: a function without one is the IOMMU's exception (or a
    #: copy's lost link), not a host whose IOMMU is off.
    iommu_groups: bool = False
    #: The IOMMU's kind (``detect-vfio``'s ``iommu_kind``) and the machine's: what a card
    #: refused for having no group is told to do (`iommu_needs`).
    iommu_kind: str = ""
    host_kind: HostKind = UNKNOWN_HOST
    #: Why the group is the host's own console/management group (`kept_for_host_reason`).
    kept_for_host: str = ""
    #: Why the group is poisoned in this boot (an earlier switch wedged), ``""`` when not.
    poisoned: str = ""
    #: Open files of nvidia-persistenced on ``/dev/nvidia*``: each counts in the nvidia
    #: module's refcnt, and the plan stops persistenced before unloading the module.
    persistenced_fds: int = 0
    #: A switch of this boot stopped nvidia-persistenced (to unload nvidia) and none has
    #: started it since: the switch back to nvidia starts it again, if it is not running.
    persistenced_stopped: bool = False
    #: The functions an earlier switch of the group may have left a ``driver_override`` on:
    #: its process ended half-way (SIGKILL, a crash), so nothing cleared them. A switch to
    #: vfio clears each one it does not rebind anyway (vfio mode leaves no override).
    unpin: tuple[str, ...] = ()


#: What a wedge poisons: an IOMMU group by its number, a card without one by its address.
PoisonKey = int | str


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: str
    holders: tuple[Holding, ...] = ()
    #: The group is poisoned (an earlier switch wedged): `GroupPoisoned`, not a plain refusal.
    poisoned: bool = False


@dataclass(frozen=True)
class SwitchPlan:
    """The switch of one group, decided. A refused plan has no steps."""

    addr: str
    group: int
    from_mode: str
    to_mode: Mode
    members: tuple[PciFunction, ...]
    targets: tuple[tuple[str, str], ...]
    steps: tuple[Step, ...] = ()
    refusal: Refusal | None = None
    notes: tuple[str, ...] = ()
    example: bool = False
    #: True when the plan unloads the nvidia module (it needs the host to itself).
    unloads_nvidia: bool = False
    #: The modules.alias pattern that chose each member's VFIO driver (``""``: none did).
    aliases: tuple[tuple[str, str], ...] = ()
    #: Members `gpuwatch recover` rebinds although they are on their target already
    #: (`needs_recovery`): the switch is done only once the model has seen their bind.
    rebinds: tuple[str, ...] = ()

    @property
    def in_mode(self) -> bool:
        return group_in_mode(self.members, self.to_mode)

    @property
    def poison_key(self) -> PoisonKey:
        """What a wedge of this switch poisons (`poison_key`): the group, else the card."""
        return self.group if self.group >= 0 else self.addr

    def to_json(self) -> dict[str, Any]:
        return {
            "addr": self.addr,
            "group": self.group,
            "from_mode": self.from_mode,
            "to_mode": self.to_mode,
            "example": self.example,
            "members": [{"addr": a, "driver": _driver_of(self.members, a), "target": t,
                         "alias": dict(self.aliases).get(a, "")}
                        for a, t in self.targets],
            "steps": [step_json(s) for s in self.steps],
            "refused": None if self.refusal is None else {
                "reason": self.refusal.reason,
                "holders": [h.model_dump() for h in self.refusal.holders],
            },
            "notes": list(self.notes),
        }


def _driver_of(members: Sequence[PciFunction], addr: str) -> str:
    return next((m.driver for m in members if m.addr == addr), "")


# --------------------------------------------------------------------------- requests


def parse_vfio_driver(name: str | None, mode: Mode,
                      variants: frozenset[str] = frozenset()) -> str | None:
    """``--vfio-driver NAME`` (socket ``vfio_driver``): a driver name that is vfio-pci or a
    vfio-pci variant, for a switch to vfio only. `UsageError` otherwise."""
    if name is None:
        return None
    if mode != "vfio":
        raise UsageError(f"--vfio-driver is for the switch to vfio, not to {mode}")
    if not DRIVER_NAME_RE.fullmatch(name) or name in (".", ".."):
        raise UsageError(f"{name!r} is not a driver name ([A-Za-z0-9_.-]+)")
    if not is_vfio_driver(name, variants):
        raise UsageError(f"{name!r} is neither vfio-pci nor a vfio-pci variant (a driver "
                         "named …_vfio_pci, or one listed in vfio_variant_drivers)")
    return name


def parse_target(text: str) -> tuple[str | None, str | None]:
    """A switch target, a PCI address or a vendor id: ``(addr, None)`` or ``(None, vendor)``."""
    addr = canonical_addr(text)
    if addr is not None:
        return addr, None
    if VENDOR_RE.fullmatch(text):
        return None, parse_vendor(text)
    raise UsageError(f"{text!r} is neither a PCI address ({ADDR_FORMAT}) nor a vendor id "
                     "(0x10de)")


def find_card(state: HostState, *, addr: str | None = None,
              vendor: str | None = None) -> tuple[PciFunction, tuple[PciFunction, ...]]:
    """The display function a request names and every function of its IOMMU group.

    An address may name any function of the group (the audio one too). A vendor must match
    exactly one group: on a host with several such cards, guessing would switch the wrong one.
    """
    if addr is not None:
        norm = parse_addr(addr)
        if norm not in state.functions:
            raise DeviceNotFound(f"no PCI function {norm} on this host")
        members = state.group_members(norm)
        display = next((m for m in members if is_gpu_class(m.class_)), None)
        if display is None:
            raise UsageError(f"{norm} is not a GPU and shares no IOMMU group with one")
        return display, members
    if vendor is None:
        raise UsageError("name the card with an address or a vendor id")
    vendor = parse_vendor(vendor)
    cards: dict[int | str, PciFunction] = {}
    for a in state.gpu_addrs():
        fn = state.functions[a]
        if fn.vendor_id == vendor:
            cards.setdefault(fn.iommu_group if fn.iommu_group >= 0 else fn.addr, fn)
    if not cards:
        raise DeviceNotFound(f"no card of vendor {vendor} on this host")
    if len(cards) > 1:
        names = ", ".join(fn.addr for fn in cards.values())
        raise UsageError(f"{len(cards)} cards of vendor {vendor} ({names}): choose one with --addr")
    display = next(iter(cards.values()))
    return display, state.group_members(display.addr)


def example_card(to_mode: Mode) -> tuple[tuple[PciFunction, ...], HostFacts]:
    """The documented example card in the other mode, on an otherwise plain single-GPU host."""
    if to_mode == "vfio":
        drivers = (NVIDIA_DRIVER, SND_DRIVER)
        modules = frozenset({"nvidia", "nvidia_modeset", "nvidia_drm", "nvidia_uvm", SND_DRIVER})
        facts = HostFacts(modules=modules, nvidia_refcnt=2,
                          nvidia_module_holders=("nvidia_modeset", "nvidia_uvm"))
    else:
        drivers = (VFIO_DRIVER, VFIO_DRIVER)
        modules = frozenset({"vfio", "vfio_pci", SND_DRIVER})
        facts = HostFacts(modules=modules, ctk_on_path=True)
    members = (
        PciFunction(addr=EXAMPLE_DISPLAY, vendor_id=NVIDIA_VENDOR, device_id="0x2204",
                    class_="0x0300", class_label="VGA controller", driver=drivers[0],
                    iommu_group=EXAMPLE_GROUP),
        PciFunction(addr=EXAMPLE_AUDIO, vendor_id=NVIDIA_VENDOR, device_id="0x1aef",
                    class_=AUDIO_CLASS, class_label="Audio device", driver=drivers[1],
                    iommu_group=EXAMPLE_GROUP),
    )
    return members, facts


# --------------------------------------------------------------------------- holder scopes


def nvidia_scope(facts: HostFacts, addr: str | None = None) -> NodeScope:
    """Single-GPU host: every ``/dev/nvidia*``. Otherwise only the ``/dev/nvidiaN`` of the
    group's own GPUs (``addr``'s alone when given; the other cards' clients are not ours to
    count); nothing for a GPU whose minor is unknown (the plan refuses to unbind it)."""
    if not facts.other_nvidia:
        return NodeScope(prefixes=("/dev/nvidia",))
    minors = facts.nvidia_minors
    chosen = minors.values() if addr is None else [minors[addr]] if addr in minors else []
    return NodeScope(exact=frozenset(f"/dev/nvidia{m}" for m in chosen))


def unbind_scope(fn: PciFunction, facts: HostFacts) -> NodeScope:
    """The nodes whose open files make unbinding ``fn`` from its driver block in the kernel."""
    scope = NodeScope(exact=frozenset(facts.dri_nodes.get(fn.addr, ())))
    if fn.driver == NVIDIA_DRIVER:
        scope = scope | nvidia_scope(facts, fn.addr)
    if (is_vfio_driver(fn.driver, facts.vfio_variants) or fn.vfio_dev) and fn.iommu_group >= 0:
        # A VM holds the group node, or the function's own cdev (iommufd); a userspace driver
        # (DPDK) on a host without an IOMMU holds the no-IOMMU group's node, and vfio's remove
        # waits for it just the same.
        group = fn.iommu_group
        scope = scope | NodeScope(exact=frozenset({f"/dev/vfio/{group}",
                                                   f"/dev/vfio/noiommu-{group}"}))
    if fn.vfio_cdev:
        scope = scope | NodeScope(exact=frozenset({fn.vfio_cdev}))
    if fn.driver and (fn.driver == SND_DRIVER or fn.class_ == AUDIO_CLASS):
        scope = scope | NodeScope(exact=frozenset(facts.snd_nodes.get(fn.addr, ())))
    return scope


def holder_scope(members: Iterable[PciFunction], mode: Mode, facts: HostFacts) -> NodeScope:
    """Every node whose holders block this switch: those of each function that must leave
    its current driver."""
    scope = NodeScope()
    for fn in members:
        if fn.driver and not satisfied(fn.driver, fn, target_of(fn, mode, facts), facts):
            scope = scope | unbind_scope(fn, facts)
    return scope


def target_of(fn: PciFunction, mode: Mode, facts: HostFacts) -> VfioTarget:
    """Where ``mode`` sends the function: its VFIO target, or the host driver and its module."""
    driver = target_driver(fn, mode)
    if driver == VFIO_DRIVER:
        return facts.vfio_targets.get(fn.addr, DEFAULT_VFIO_TARGET)
    return VfioTarget(driver=driver, module=module_of(driver))


def satisfied(current: str, fn: PciFunction, target: VfioTarget, facts: HostFacts) -> bool:
    """Is a function on ``current`` where it should be? Any VFIO driver counts for a VFIO
    target, unless that driver was asked for by name. A bridge left on pcieport, or on no
    driver (`host_bridge`), is where every mode wants it: nothing is written for it."""
    if target.driver == BRIDGE_DRIVER:  # only a `host_bridge` is given it
        return current in ("", BRIDGE_DRIVER)
    if not current:
        return False
    if same_driver(current, target.driver):
        return True
    vfio_target = is_vfio_driver(target.driver, facts.vfio_variants)
    return vfio_target and not target.exact and (
        is_vfio_driver(current, facts.vfio_variants)
        or (bool(fn.vfio_dev) and current == fn.driver))


def card_scope(members: Iterable[PciFunction], facts: HostFacts) -> NodeScope:
    """Every node of the card, whatever the direction (``gpuwatch holders``)."""
    scope = NodeScope()
    for fn in members:
        if fn.driver:
            scope = scope | unbind_scope(fn, facts)
    return scope


# --------------------------------------------------------------------------- the plan


def check_names(members: Iterable[PciFunction], mode: Mode,
                facts: HostFacts | None = None) -> None:
    """Every address and driver name that becomes part of a write, checked before any is made.

    ``fullmatch``: with ``re.match`` a ``$`` also matches before a trailing newline, and
    ``"nvidia\n"`` must not pass for ``nvidia``.
    """
    for fn in members:
        if not PCI_ADDR_RE.fullmatch(fn.addr):
            raise UnsafeName(f"refusing to switch: {fn.addr!r} is not a canonical PCI address")
        target = target_of(fn, mode, facts or HostFacts()).driver
        for driver in (fn.driver, target):
            if driver and (not DRIVER_NAME_RE.fullmatch(driver) or driver in (".", "..")):
                raise UnsafeName(f"refusing to switch: driver name {driver!r} of {fn.addr} "
                                 "is not [A-Za-z0-9_.-]+")


def cdi_steps(output: str, cdi_spec: bool,
              ctk_on_path: bool) -> tuple[tuple[Step, ...], tuple[str, ...]]:
    """Make the nvidia CDI spec when neither exists and ``nvidia-ctk`` can; else say why not.
    ``output`` is the place the spec is written, already resolved in the root (`HostFacts`'s
    ``cdi_output``)."""
    if cdi_spec:
        return (), ()
    if not ctk_on_path:
        return (), ("no CDI spec and nvidia-ctk is not on PATH: containers cannot name the GPU "
                    "through CDI until one is generated",)
    return (
        MakeDirStep("/" + os.path.dirname(CDI_OUTPUT)),
        CommandStep(("nvidia-ctk", "cdi", "generate", f"--output={output}"), "warn"),
    ), ()


def unhealthy_reason(members: Iterable[PciFunction], facts: HostFacts, *,
                     recover: bool = False) -> str | None:
    """Why a group with a wedged, failed or recovering function must not be switched, and
    what to do. `gpuwatch recover` is named only for an NVIDIA card: it refuses any other.

    ``recover``: for `gpuwatch recover`, whose rebind is the recovery of a wedged or failed
    device; a PCI error recovery still under way refuses it too (the kernel is resetting
    the device: an unbind or a bind now can wedge the host).

    A ``recovering`` function under a bridge that reported ``FAILED_RECOVERY`` since its
    ``BEGIN_RECOVERY`` is failed (the kernel says so on the bridge alone); one whose
    recovery began more than `RECOVERY_STALE_AFTER` seconds ago with no end seen is taken
    as recovered (its last uevent lost), with a note (`recovery_notes`), so a lost uevent
    never refuses for ever."""
    fns = tuple(members)
    nvidia = any(is_gpu_class(f.class_) and f.vendor_id == NVIDIA_VENDOR for f in fns)
    hint = " (`gpuwatch recover` rebinds it to vfio-pci)" if nvidia else ""
    for fn in fns:
        port_failed = failure_reason(fn, facts, advice=False) if host_bridge(fn) else None
        if port_failed is not None:
            # The group's own port: no switch, nor `recover`, rebinds a bridge.
            return (f"{port_failed}: it is the group's own bridge, which gpuwatch never "
                    "rebinds; remove and rescan it (echo 1 > /sys/bus/pci/devices/"
                    f"{fn.addr}/remove; echo 1 > /sys/bus/pci/rescan) or reboot")
        failure = failure_reason(fn, facts)
        if failure is not None and not recover:
            return f"{failure}; a switch would only add to it{hint}"
        failed_at = facts.recovery_failed_above.get(fn.addr, "")
        if fn.health == "recovering" and not failed_at and _young(fn.addr, facts):
            return (f"{fn.addr} is recovering: PCI error recovery began "
                    f"{facts.recovery_age.get(fn.addr, 0.0):.0f} s ago and has not ended; "
                    f"{_WAIT}")
        bridge = facts.recovery_above.get(fn.addr, "")
        if bridge and _young(bridge, facts):
            return (f"{fn.addr} is behind bridge {bridge}, whose PCI error recovery began "
                    f"{facts.recovery_age.get(bridge, 0.0):.0f} s ago and has not ended; "
                    f"{_WAIT}")
    return None


def failure_reason(fn: PciFunction, facts: HostFacts, *, advice: bool = True) -> str | None:
    """Why ``fn`` is unusable until its recovery, and what to do (not without ``advice``);
    None when it is not: healthy by its own account behind a bridge whose recovery failed
    after its last sign of life (the kernel says so on the bridge alone, and the link below
    it may be down: a rebind of the function does not bring it back), wedged or failed
    itself, or ``recovering`` under a bridge that failed since. What a switch refuses, and
    what stops one under way (`gpuwatch.switch.engine`): no bind, unbind or override may go
    to such a device."""
    bridge = facts.failed_bridge.get(fn.addr, "")
    if bridge:
        head = f"{fn.addr} is behind bridge {bridge}, whose PCI error recovery failed"
        return head if not advice else (
            f"{head}: the link to it may be down; remove and rescan the bridge (echo 1 > "
            f"/sys/bus/pci/devices/{bridge}/remove; echo 1 > /sys/bus/pci/rescan) or reboot")
    if fn.health in UNSWITCHABLE:
        head = f"{fn.addr} is {fn.health}"
        return head if not advice else f"{head}: " + health_advice(
            fn.health, fn.addr, fn.driver, facts.wedge_recovery.get(fn.addr, ()))
    failed_at = facts.recovery_failed_above.get(fn.addr, "")
    if fn.health == "recovering" and failed_at:
        head = f"{fn.addr} is failed: PCI error recovery failed at bridge {failed_at} above it"
        return head if not advice else f"{head}: " + health_advice("failed", fn.addr, fn.driver)
    return None


_WAIT = ("an unbind or a bind now could wedge the host: retry once it ends (after "
         f"{RECOVERY_STALE_AFTER:.0f} s with no end seen, it is taken as over)")


def _young(addr: str, facts: HostFacts) -> bool:
    """A recovery still waited for: begun less than `RECOVERY_STALE_AFTER` seconds ago (an
    unknown beginning counts as now)."""
    return facts.recovery_age.get(addr, 0.0) < RECOVERY_STALE_AFTER


def needs_recovery(fn: PciFunction, facts: HostFacts) -> bool:
    """A function `gpuwatch recover` rebinds even on its target driver: wedged, or failed
    (its own ``FAILED_RECOVERY``, or the bridge's above it since its begin or its last
    bind). The rebind is
    its recovery and its bind clears the health; "already in mode" would leave it refused,
    by the very refusal that named `recover`."""
    return (fn.health in UNSWITCHABLE or fn.addr in facts.failed_bridge
            or (fn.health == "recovering" and fn.addr in facts.recovery_failed_above))


def recovery_notes(members: Iterable[PciFunction], facts: HostFacts) -> list[str]:
    """What a switch says of a recovery it no longer waits for (`unhealthy_reason`)."""
    stale: list[str] = []
    for fn in members:
        if (fn.health == "recovering" and fn.addr not in facts.recovery_failed_above
                and not _young(fn.addr, facts)):
            stale.append(fn.addr)
        bridge = facts.recovery_above.get(fn.addr, "")
        if bridge and not _young(bridge, facts):
            stale.append(bridge)
    return [f"{addr}: PCI error recovery began {facts.recovery_age[addr]:.0f} s ago and no "
            "end was seen (its last uevent lost?): taken as over"
            for addr in dict.fromkeys(stale)]


def bystanders_reason(group: int, mode: Mode,
                      taken: Sequence[tuple[PciFunction, VfioTarget]]) -> str:
    """Why a switch, either way, does not take a group's bystanders (`host_bystanders`) off
    their host drivers unasked: each mode has a target for every function of the group
    (the class rule of `target_driver`), and a NIC, NVMe drive or NVSwitch moved to it is
    lost to the host."""
    named = ", ".join(f"{f.addr} (class {f.class_ or 'unknown'}, {f.vendor_id or '?'}:"
                      f"{f.device_id or '?'}, on {f.driver})" for f, _ in taken)
    wanted = ", ".join(dict.fromkeys(t.driver for _, t in taken))
    lost = " and ".join(dict.fromkeys(_host_use(f.class_) for f, _ in taken))
    return (f"IOMMU group {group} also holds {named}, no part of the card (a PCIe switch "
            f"without ACS shares its group): mode {mode} wants them on {wanted}, so the "
            f"switch would unbind them from the host ({lost}); "
            "enable ACS to split the group, or pass --force to move them too")


#: What the host loses with a function of a class (the longest prefix of its class code).
_HOST_USES = (("0x0680", "its NVLink fabric"), ("0x0403", "its audio"), ("0x01", "its storage"),
              ("0x02", "its network"), ("0x0c03", "its USB"), ("0x04", "its multimedia"))


def _host_use(class_: str) -> str:
    return next((use for prefix, use in _HOST_USES if class_.startswith(prefix)),
                "a device it uses")


def virtual_functions_reason(fn: PciFunction) -> str:
    """Why a physical function with SR-IOV virtual functions enabled is not rebound: its
    driver's unbind disables SR-IOV, and the VFs vanish under the VMs or containers that use
    them. Turning them off is the operator's call, not a side effect of a switch."""
    assert fn.sriov is not None
    vfs = fn.sriov.vfs
    named = ", ".join(vfs[:4]) + (f", … ({len(vfs)} in all)" if len(vfs) > 4 else "")
    named = f" ({named})" if vfs else ""
    return (f"{fn.addr} has {fn.sriov.numvfs} SR-IOV virtual function(s) enabled{named}: "
            f"rebinding it would remove them under whatever uses them; disable them first "
            f"(write 0 to /sys/bus/pci/devices/{fn.addr}/sriov_numvfs, or stop what "
            "created them), then switch")


#: Why a bridge on a driver other than pcieport keeps a switch from its group: said alike
#: when the plan finds one and when one joins the group during the switch.
BRIDGE_RULE = (f"a bridge in a group VFIO takes must be on {BRIDGE_DRIVER} or on no driver, "
               "and gpuwatch does not move bridges")


def foreign_bridges(functions: Iterable[PciFunction]) -> list[PciFunction]:
    """The bridges (`BRIDGE_CLASSES`) of ``functions`` on a driver other than pcieport: the
    kernel's VFIO will not take their group, vfio-pci never binds them, and gpuwatch moves
    no bridge. (One on pcieport or on none is a `host_bridge`: left where it is.)"""
    return [f for f in functions if f.class_ in BRIDGE_CLASSES and not host_bridge(f)]


def bridge_names(bridges: Iterable[PciFunction]) -> str:
    """``ADDR (on DRIVER), …``: the bridges a refusal or failure names."""
    return ", ".join(f"{f.addr} (on {f.driver})" for f in bridges)


def plan_switch(members: Sequence[PciFunction], mode: Mode, facts: HostFacts, *,
                example: bool = False, force: bool = False,
                recovering: bool = False, rebind: bool = True) -> SwitchPlan:
    """The ordered steps that bring every function of the group to its target driver.

    Raises `UnsafeName` for a malformed address or driver name; every other reason not to
    switch is a `Refusal` in the plan, with no steps. ``recovering`` (``gpuwatch recover``)
    plans for a wedged or failed group too: a rebind is its recovery, so such a function is
    rebound even on its target (`needs_recovery`), unless not ``rebind`` (a roll-back, which
    only puts the drivers back).
    """
    fns = tuple(sorted(members, key=lambda f: f.addr))
    display = next((f for f in fns if is_gpu_class(f.class_)), fns[0])
    check_names(fns, mode, facts)
    chosen = {fn.addr: target_of(fn, mode, facts) for fn in fns}
    targets = {a: t.driver for a, t in chosen.items()}
    base: dict[str, Any] = {
        "addr": display.addr, "group": display.iommu_group,
        "from_mode": group_mode(fns, facts.vfio_variants), "to_mode": mode, "members": fns,
        "targets": tuple(targets.items()), "example": example,
        "aliases": tuple((a, t.alias) for a, t in chosen.items()),
    }
    if example:
        base["notes"] = (f"no matching card on this host: planned for the documented example "
                         f"card (display {EXAMPLE_DISPLAY} class 0x0300, audio {EXAMPLE_AUDIO} "
                         "class 0x0403)",)
    guard = switch_guard(display, mode, poisoned=facts.poisoned,
                         kept_for_host=facts.kept_for_host, force=force)
    if guard is not None:
        return SwitchPlan(**base, refusal=guard)  # poison wins even over "already in mode"

    def refuse(reason: str, holders: Sequence[Holding] = ()) -> SwitchPlan:
        return SwitchPlan(**base, refusal=Refusal(reason, tuple(holders)))

    unhealthy = unhealthy_reason(fns, facts, recover=recovering)
    if unhealthy is not None:
        return refuse(unhealthy)
    stale = recovery_notes(fns, facts)
    if stale:
        base["notes"] = (*base.get("notes", ()), *stale)
    # A bridge is never rebound: its unbind would tear down the port every function of the
    # group hangs from.
    rebinds = tuple(fn.addr for fn in fns
                    if recovering and rebind and not host_bridge(fn) and needs_recovery(fn, facts))
    base["rebinds"] = rebinds
    # Overrides an abandoned switch may have left: the writes below clear them (vfio mode
    # leaves none); the functions a switch rebinds clear their own anyway. A bridge never
    # had one (the switch writes nothing to it).
    unpin = [fn for fn in fns if mode == "vfio" and fn.addr in facts.unpin
             and not host_bridge(fn) and fn.class_ not in BRIDGE_CLASSES]
    if not rebinds and not unpin and all(satisfied(fn.driver, fn, chosen[fn.addr], facts)
                                         for fn in fns):
        return SwitchPlan(**{**base, "notes": (*base.get("notes", ()),
                                               f"already in mode {mode}: nothing to write")})

    group = display.iommu_group
    # A bridge on pcieport (or none) stays there (`satisfied`): the kernel's VFIO takes the
    # group with it. One on another driver would keep the group from VFIO, and vfio-pci never
    # binds a bridge: say so rather than switch the endpoints into a group no VM can open.
    bridges = foreign_bridges(fns)
    if bridges:
        return refuse(f"IOMMU group {group} also holds PCI bridge {bridge_names(bridges)}: "
                      f"{BRIDGE_RULE}; bind it to {BRIDGE_DRIVER} first")
    # A NIC, NVMe drive or NVSwitch sharing the group (a PCIe switch without ACS) has a
    # target in each mode like every function (vfio-pci for a NIC in both): moving it there
    # takes it from the host (its network, its storage, the NVLink fabric of the other
    # GPUs). Never without being asked. One unbound or on VFIO already loses the host nothing.
    taken = [(f, chosen[f.addr]) for f in host_bystanders(fns, facts.vfio_variants)
             if not satisfied(f.driver, f, chosen[f.addr], facts)]
    if taken and not force:
        return refuse(bystanders_reason(group, mode, taken))
    with_vfs = [f for f in fns if f.sriov is not None and f.sriov.numvfs > 0
                and (f.addr in rebinds or not satisfied(f.driver, f, chosen[f.addr], facts))]
    if with_vfs:
        return refuse(virtual_functions_reason(with_vfs[0]))
    if mode == "vfio" and group < 0:
        if facts.iommu_groups:
            return refuse(f"{display.addr} has no IOMMU group, though this host has IOMMU "
                          "groups: the IOMMU does not cover it, or the tree lacks its "
                          "iommu_group link (a copy that dropped its links)")
        return refuse(f"{display.addr} has no IOMMU group: vfio-pci needs "
                      f"{iommu_needs(facts.iommu_kind, facts.host_kind)}")
    if facts.holders:
        return refuse(holders_reason(facts.holders), facts.holders)

    notes: list[str] = list(base.pop("notes", ()))
    if not facts.holders_complete:
        notes.append("not root: processes of other users cannot be seen, the holder scan "
                     "is incomplete")
    steps: list[Step] = []
    current = {fn.addr: fn.driver for fn in fns}
    unloads = False
    on_nvidia = [fn for fn in fns
                 if fn.driver == NVIDIA_DRIVER and targets[fn.addr] != NVIDIA_DRIVER
                 and not satisfied(fn.driver, fn, chosen[fn.addr], facts)]
    if on_nvidia:
        if facts.persistenced:
            steps.append(CommandStep(("systemctl", "stop", PERSISTENCED_UNIT), "warn"))
        if not facts.other_nvidia:
            dependents = [m for m in NVIDIA_DEPENDENTS if m in facts.modules]
            kept = [h for h in facts.nvidia_module_holders if h not in dependents]
            left = kernel_users(facts, dependents)
            if left > 0:
                users = f" by module {', '.join(kept)}" if kept else " by a kernel user"
                return refuse(f"the nvidia module is in use{users} (sys/module/nvidia/refcnt "
                              f"{facts.nvidia_refcnt}, of which the switch itself releases "
                              f"{facts.nvidia_refcnt - left}): it cannot be unloaded, so the "
                              "card cannot leave nvidia safely")
            if dependents:
                steps.append(CommandStep(("modprobe", "-r", *dependents), "refuse"))
            if "nvidia" in facts.modules:
                steps.append(CommandStep(("modprobe", "-r", "nvidia"), "refuse"))
            unloads = True
        else:
            unknown = next((fn.addr for fn in on_nvidia if fn.addr not in facts.nvidia_minors),
                           None)
            if unknown is not None:
                return refuse(f"other GPUs stay on nvidia ({', '.join(facts.other_nvidia)}) and "
                              f"{unknown}'s /dev/nvidiaN is unknown (no proc/driver/nvidia/"
                              f"gpus/{unknown}/information): its holders cannot be told apart")
            for fn in on_nvidia:
                steps.append(WriteStep(unbind_path(NVIDIA_DRIVER), fn.addr))
            if facts.persistenced:
                steps.append(CommandStep(("systemctl", "start", PERSISTENCED_UNIT), "warn"))
        for fn in on_nvidia:
            current[fn.addr] = ""

    changing = [fn for fn in fns if fn.addr in rebinds
                or not satisfied(current[fn.addr], fn, chosen[fn.addr], facts)]
    loaded = {driver_key(m) for m in facts.modules}
    for module in dict.fromkeys(driver_key(chosen[fn.addr].module) for fn in changing):
        if module not in loaded:
            steps.append(CommandStep(("modprobe", module), "fail"))
    for fn in changing:
        target = targets[fn.addr]
        if current[fn.addr]:
            steps.append(WriteStep(unbind_path(current[fn.addr]), fn.addr))
        steps.append(WriteStep(override_path(fn.addr), target))
        steps.append(WriteStep(DRIVERS_PROBE, fn.addr))
        if mode == "vfio":
            steps.append(WriteStep(override_path(fn.addr), CLEAR_OVERRIDE))
    rebound = {fn.addr for fn in changing}
    left_pinned = [fn.addr for fn in unpin if fn.addr not in rebound]
    for addr in left_pinned:
        steps.append(WriteStep(override_path(addr), CLEAR_OVERRIDE))
    if left_pinned:
        notes.append(f"an earlier switch of group {group} ended half-way (its process was "
                     f"killed): clearing the driver_override it may have left on "
                     f"{', '.join(left_pinned)}")
    if mode == "nvidia":
        steps.append(CommandStep(("nvidia-modprobe", "-c", "0", "-u"), "warn"))
        if facts.persistenced_stopped and not facts.persistenced:
            # The operator ran it; the switch to vfio stopped it only to unload nvidia. Once
            # the device nodes exist again (nvidia-modprobe), it comes back. One the operator
            # stopped is not in the record, and stays stopped.
            steps.append(CommandStep(("systemctl", "start", PERSISTENCED_UNIT), "warn"))
        more, why = cdi_steps(facts.cdi_output or os.path.join(facts.root, CDI_OUTPUT),
                              facts.cdi_spec, facts.ctk_on_path)
        steps.extend(more)
        notes.extend(why)
    for step in steps:
        if isinstance(step, CommandStep) and step.argv[0] == "modprobe":
            for name in step.argv[1:]:
                if name != "-r" and not _MODULE_RE.fullmatch(name):
                    raise UnsafeName(f"refusing to switch: module name {name!r} is malformed")
    return SwitchPlan(**base, steps=tuple(steps), notes=tuple(notes), unloads_nvidia=unloads)


#: The group modes (`gpuwatch.core.modes.group_mode`) that are one whole state without being
#: a mode a switch goes to: the display on a host driver of its own (amdgpu, i915, nouveau),
#: or nothing bound. An interrupted switch from one puts each function back on the driver it
#: had (`return_steps`); only ``mixed`` (in no one mode) is left as it is.
RETURN_MODES = ("host driver", "unbound")


def return_steps(now: Iterable[PciFunction], before: Mapping[str, str]) -> tuple[Step, ...]:
    """The writes that put each function of ``now`` back on the driver ``before`` names for
    it (``""``: none), the way a switch moves one: unbind, ``driver_override``,
    ``drivers_probe``, override cleared (a host driver binds such a function by its own id
    table, so nothing is left pinned). A function not in ``before`` (it joined meanwhile),
    already back, or a bridge (never rebound) gets none."""
    steps: list[Step] = []
    for fn in sorted(now, key=lambda f: f.addr):
        was = before.get(fn.addr)
        if was is None or fn.driver == was or host_bridge(fn) or fn.class_ in BRIDGE_CLASSES:
            continue
        if fn.driver:
            steps.append(WriteStep(unbind_path(fn.driver), fn.addr))
        if was:
            steps += [WriteStep(override_path(fn.addr), was), WriteStep(DRIVERS_PROBE, fn.addr),
                      WriteStep(override_path(fn.addr), CLEAR_OVERRIDE)]
    return tuple(steps)


def kernel_users(facts: HostFacts, dependents: Sequence[str]) -> int:
    """Users of the nvidia module the switch does not account for: ``refcnt`` counts every
    dependent module (``nvidia_drm``, ``nvidia_modeset``, ``nvidia_uvm``, ``nvidia_peermem``)
    and every open file of ``/dev/nvidia*``. Those the switch itself stops or unloads (the
    dependents it removes, the files of nvidia-persistenced it stops) are subtracted; what
    is left is someone else (a kernel user), and unloading would fail."""
    listed = set(facts.nvidia_module_holders)
    # The kernel's holders/ names the modules that hold nvidia; a tree without it (captured,
    # unreadable) still had each loaded dependent count once.
    released = len(listed & set(dependents)) if listed else len(dependents)
    return facts.nvidia_refcnt - released - facts.persistenced_fds


def poison_key(fn: PciFunction) -> PoisonKey:
    """The poison record of ``fn``'s group: the group number, or for a function with no IOMMU
    group (``-1``: the IOMMU is off) its own address. ``-1`` names no group, so keying by it
    would let one card's wedge refuse every other group-less card of the host."""
    return fn.iommu_group if fn.iommu_group >= 0 else fn.addr


def poison_subject(key: PoisonKey) -> str:
    """``IOMMU group 13``, or ``0000:01:00.0 (no IOMMU group)``."""
    return f"IOMMU group {key}" if isinstance(key, int) else f"{key} (no IOMMU group)"


def poisoned_until(key: PoisonKey) -> str:
    """How long a poison lasts and what lifts it. `gpuwatch recover` rebinds to vfio-pci,
    which needs an IOMMU group: for a card without one only a reboot does."""
    if isinstance(key, int):
        return (f"{poison_subject(key)} is poisoned until the next boot (or `gpuwatch "
                "recover` once no task is stuck)")
    return (f"{poison_subject(key)} is poisoned until the next boot (`gpuwatch recover` "
            "rebinds to vfio-pci, which needs an IOMMU group: reboot)")


def switch_guard(display: PciFunction, mode: Mode, *, poisoned: str = "",
                 kept_for_host: str = "", force: bool = False,
                 action: str = "") -> Refusal | None:
    """The refusals that hold whatever the group's drivers, checked before anything else
    (before "already in mode", before any privilege check): a poisoned group, in either
    direction; ``nvidia`` (and ``recover``) for a card that is not NVIDIA's; ``vfio`` for a
    group kept for the host, unless ``force``."""
    what = action or f"mode {mode}"
    if poisoned:
        key = poison_key(display)
        lift = ("reboot, or run `gpuwatch recover` once no task is stuck"
                if isinstance(key, int) else "reboot")
        return Refusal(f"{poison_subject(key)} is poisoned: an earlier switch wedged in this "
                       f"boot ({poisoned}); {lift}", poisoned=True)
    if (mode == "nvidia" or action == "recover") and display.vendor_id != NVIDIA_VENDOR:
        return Refusal(f"{display.addr} is not an NVIDIA card (vendor "
                       f"{display.vendor_id or 'unknown'}): {what} acts on NVIDIA GPUs "
                       f"({NVIDIA_VENDOR}) only; nothing was written")
    if mode == "vfio" and kept_for_host and not force and action != "recover":
        return Refusal(f"{poison_subject(poison_key(display))} is kept for the host: "
                       f"{kept_for_host} (--force passes it through anyway)")
    return None


def already_in_mode(members: Iterable[PciFunction], mode: Mode,
                    variants: frozenset[str] = frozenset(),
                    vfio_driver: str | None = None) -> bool:
    """Nothing to do, so nothing written and no privilege needed: the group is in ``mode``
    and, when ``--vfio-driver`` names one, its display functions are on exactly that driver
    (the one `vfio_targets` would give them)."""
    fns = tuple(members)
    return group_in_mode(fns, mode, variants) and (
        vfio_driver is None or all(same_driver(fn.driver, vfio_driver)
                                   for fn in fns if fn.class_.startswith("0x03")))


def default_mode(members: Sequence[PciFunction]) -> Mode:
    """With no mode asked for, plan the way out of the current one."""
    return "vfio" if group_mode(members) == "nvidia" else "nvidia"


def holders_reason(holders: Sequence[Holding]) -> str:
    named = ", ".join(
        f"{h.comm or '?'} (pid {h.pid}) could not be read in time (stuck in the kernel?) and "
        "may hold it" if h.unreadable else f"{h.comm or '?'} (pid {h.pid}) holds {h.node}"
        for h in holders)
    return f"the card is in use: {named}; close them and retry (gpuwatch never kills them)"


__all__ = [
    "CLEAR_OVERRIDE",
    "DEFAULT_VFIO_TARGET",
    "DRIVERS_PROBE",
    "EXAMPLE_AUDIO",
    "EXAMPLE_DISPLAY",
    "NVIDIA_VENDOR",
    "RETURN_MODES",
    "CommandStep",
    "HostFacts",
    "MakeDirStep",
    "NodeScope",
    "PoisonKey",
    "Refusal",
    "Step",
    "SwitchPlan",
    "VfioTarget",
    "WriteStep",
    "already_in_mode",
    "bystanders_reason",
    "canonical_addr",
    "card_scope",
    "cdi_steps",
    "check_names",
    "default_mode",
    "example_card",
    "failure_reason",
    "find_card",
    "holder_scope",
    "kernel_users",
    "needs_recovery",
    "override_path",
    "parse_mode",
    "parse_target",
    "parse_vendor",
    "parse_vfio_driver",
    "plan_switch",
    "poison_key",
    "poison_subject",
    "poisoned_until",
    "recovery_notes",
    "return_steps",
    "satisfied",
    "step_json",
    "switch_guard",
    "target_of",
    "unbind_path",
    "unbind_scope",
    "unhealthy_reason",
]
