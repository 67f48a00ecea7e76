"""The probe contract without pydantic: its actions, the rules its answers follow, and the
answers of one fresh scan as plain JSON values.

`HostState` keeps the answers current as uevents arrive (frozen pydantic records, rebuilt
piece by piece); `FreshHost` computes them once from a single `Snapshot`, for the cold
``gpuwatch probe`` with no daemon, which must not pay for importing pydantic (about as long
as the interpreter takes to start). Both take their rules from here (which nodes count,
their order, the render node, detect-gpu, a group's access, the VFIO backend, the modes of
`gpuwatch.core.modes`), and the tests compare the two byte for byte over every fixture
machine and every action.
"""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any, Literal, NamedTuple, Protocol

from gpuwatch.core.kfd import first_gfx_target, first_gfx_version
from gpuwatch.core.modes import (
    FunctionLike,
    current_mode,
    group_in_mode,
    on_vfio,
    parse_mode,
    variant_keys,
)
from gpuwatch.core.observations import (
    ACL_GROUP,
    ACL_GROUP_OBJ,
    ACL_USER,
    CdiSeen,
    DrmSeen,
    NodeStat,
    PciSeen,
    Snapshot,
    vfs_in_tree,
)
from gpuwatch.core.pci import is_gpu_class, parse_addr, parse_vendor
from gpuwatch.core.tabledata import TablesView, class_label
from gpuwatch.errors import DeviceNotFound, UsageError

#: Every probe action, with the parameters it requires.
ACTIONS: dict[str, tuple[str, ...]] = {
    "detect-vfio": (),
    "detect-gpu": (),
    "detect-amd-gpu": (),
    "amd-gfx-version": (),
    "amd-gfx-target": (),
    "detect-host-devices": (),
    "memlock": (),
    "vfio-group-accessible": ("group",),
    "nvidia-holders": (),
    "display-driver": ("addr",),
    "current-mode": ("addr",),
    "group-in-mode": ("addr", "mode"),
    "vfio-backend": ("addr",),
    "wedge-detected": (),
    "plan": ("mode",),  # and --addr or --vendor
}

#: The actions answered ``True`` or ``False`` (what a type checker is told of the answer).
BoolAction = Literal["detect-gpu", "detect-amd-gpu", "vfio-group-accessible", "group-in-mode",
                     "wedge-detected"]
#: The actions answered with a string (a version, a target, a driver, a mode).
TextAction = Literal["amd-gfx-version", "amd-gfx-target", "display-driver", "current-mode"]

#: Cached answers whose changes are published as ``probe-changed`` events (in the order
#: they are rebuilt: detect-host-devices embeds the others, so it comes last).
WATCHED_PROBES = (
    "detect-gpu",
    "detect-amd-gpu",
    "amd-gfx-version",
    "amd-gfx-target",
    "detect-vfio",
    "detect-host-devices",
)

VFIO_NODE_RE = re.compile(r"^/dev/vfio/[0-9]+$")
#: A VFIO device cdev (``vfio-dev/vfioN`` of a function) and the iommufd node.
VFIO_CDEV_RE = re.compile(r"^/dev/vfio/devices/(?:noiommu-)?vfio[0-9]+$")
#: A no-IOMMU group's device cdev: it isolates nothing, no VMM opens it.
NOIOMMU_CDEV_PREFIX = "/dev/vfio/devices/noiommu-"
IOMMU_NODE = "/dev/iommu"
RENDER_PREFIX = "/dev/dri/renderD"
_VFIO_PREFIX = "/dev/vfio/"


def check_params(
    action: str, group: int | None, addr: str | None, mode: str | None, vendor: str | None = None
) -> str | None:
    """Validate a probe request; return the normalised address. Raises `UsageError`."""
    needs = ACTIONS.get(action) if type(action) is str else None
    if needs is None:
        raise UsageError(f"unknown action {action!r} (one of: {', '.join(ACTIONS)})")
    # A library caller's types, checked like the socket's JSON: a group "1" or an addr 5
    # would otherwise fail deep inside as a TypeError. (A bool is an int, but no group.)
    if group is not None and type(group) is not int:
        raise UsageError(f"group must be an integer, not {type(group).__name__}")
    for name, text in (("addr", addr), ("mode", mode), ("vendor", vendor)):
        if text is not None and type(text) is not str:
            raise UsageError(f"{name} must be a string, not {type(text).__name__}")
    for name, value in (("group", group), ("addr", addr), ("mode", mode)):
        if name in needs and value is None:
            raise UsageError(f"action {action!r} needs --{name}")
    if mode is not None:
        parse_mode(mode)
    if action == "plan" and addr is None and vendor is None:
        raise UsageError("action 'plan' needs --addr or --vendor")
    if vendor is not None:
        parse_vendor(vendor)
    if addr is None:
        return None
    return parse_addr(addr)


class FunctionView(FunctionLike, Protocol):
    """What the rules read of a PCI function: a `PciFunction` or a `FreshFunction`."""

    @property
    def addr(self) -> str: ...
    @property
    def vendor_id(self) -> str: ...
    @property
    def iommu_group(self) -> int: ...
    @property
    def vfio_cdev(self) -> str: ...


def no_such_function(addr: str | None) -> DeviceNotFound:
    return DeviceNotFound(f"no PCI function {addr} on this host")


# --------------------------------------------------------------------------- rules


#: What makes a pattern component a wildcard to `glob` (`glob.has_magic`).
_GLOB_MAGIC = re.compile(r"[*?[]")


@functools.lru_cache(maxsize=16)
def compiled_patterns(patterns: tuple[str, ...]) -> tuple[re.Pattern[str], ...]:
    """The patterns as the scan's `glob.glob` matches them, translated once per table:
    matching was a tenth of building a small host's model, and translating again per model
    would cost as much. (fnmatch's ``*`` crosses ``/``: a uevent's node in a folder below
    the pattern's, ``/dev/bus/usb/001/005`` for ``/dev/bus/usb/*``, matched, though no scan
    lists it, and the watcher's answer differed from a fresh scan's.)"""
    return tuple(re.compile(glob_regex(p)) for p in patterns)


#: ``fnmatch.translate``'s wrapper: ``(?s:…)\Z`` up to Python 3.13, ``(?s:…)\z`` from 3.14.
_TRANSLATED = re.compile(r"\(\?s:(.*)\)\\[Zz]", re.DOTALL)


def _class_regex(bracket: str) -> str:
    """A ``[…]`` class as fnmatch spells it in a regular expression, unwrapped: the end
    anchor ``fnmatch.translate`` appends is ``\\z`` from Python 3.14 on, and one left inside
    the pattern anchored the class to the end of the path (and ``re`` before 3.14 refuses
    ``\\z``)."""
    translated = fnmatch.translate(bracket)
    match = _TRANSLATED.fullmatch(translated)
    if match is None:  # a spelling no Python has used: take the class as its text
        return re.escape(bracket)
    return match.group(1)


def glob_regex(pattern: str) -> str:
    """A regular expression matching what `glob.glob` finds for ``pattern``: each wildcard
    (``*``, ``?``, ``[…]``) within one path component, never across a ``/``, and a
    component with one matching no name that starts with a dot unless it starts with one
    too (glob's hidden files)."""
    parts = []
    for part in pattern.split("/"):
        if not _GLOB_MAGIC.search(part):
            parts.append(re.escape(part))
            continue
        out = [] if part.startswith(".") else [r"(?!\.)"]
        i, n = 0, len(part)
        while i < n:
            c = part[i]
            i += 1
            if c == "*":
                out.append("[^/]*")
            elif c == "?":
                out.append("[^/]")
            elif c == "[":
                # The class's extent as fnmatch finds it; the class as fnmatch spells it.
                j = i
                if j < n and part[j] == "!":
                    j += 1
                if j < n and part[j] == "]":
                    j += 1
                while j < n and part[j] != "]":
                    j += 1
                if j >= n:
                    out.append(r"\[")
                else:
                    out.append("(?!/)" + _class_regex(part[i - 1 : j + 1]))
                    i = j + 1
            else:
                out.append(re.escape(c))
        parts.append("".join(out))
    return "(?s:" + "/".join(parts) + r")\Z"


def is_watched_node(path: str, pattern_res: Iterable[re.Pattern[str]]) -> bool:
    """A device path gpuwatch reports: one matching ``device_patterns``, a vfio group, a
    VFIO device cdev or ``/dev/iommu``."""
    if VFIO_NODE_RE.match(path) or path == IOMMU_NODE or VFIO_CDEV_RE.match(path):
        return True
    return any(r.match(path) for r in pattern_res)


def ordered_devices(nodes: Iterable[str],
                    pattern_res: Iterable[re.Pattern[str]]) -> tuple[str, ...]:
    """detect-host-devices' ``devices``: present paths (vfio groups aside) in pattern order,
    sorted within a pattern."""
    present = [p for p in nodes if not VFIO_NODE_RE.match(p)]
    ordered: list[str] = []
    taken: set[str] = set()
    for pattern in pattern_res:
        hits = sorted(p for p in present if p not in taken and pattern.match(p))
        ordered.extend(hits)
        taken.update(hits)
    return tuple(ordered)


def drm_vendor(node: DrmSeen, functions: Mapping[str, FunctionView]) -> str:
    """The vendor of a DRM node's device: its function's when the model has it."""
    fn = functions.get(node.device_addr) if node.device_addr else None
    return fn.vendor_id if fn is not None else node.device_vendor


def drm_driver(node: DrmSeen, functions: Mapping[str, FunctionView]) -> str:
    """The driver of a DRM node's device: its function's when the model has it."""
    fn = functions.get(node.device_addr) if node.device_addr else None
    return fn.driver if fn is not None else node.device_driver


def is_amd_card(name: str, node: DrmSeen | None, functions: Mapping[str, FunctionView]) -> bool:
    """A ``cardN`` whose device amdgpu drives: what detect-amd-gpu looks for."""
    return (node is not None and name.startswith("card") and name[4:].isdigit()
            and drm_driver(node, functions) == "amdgpu")


def choose_render_node(devices: Iterable[str], vendor_of: Callable[[str], str | None],
                       gpu_vendors: Collection[str]) -> str:
    """The first render node whose device is a known GPU vendor, else the first one.
    ``vendor_of`` names a DRM node's vendor (None: no such node)."""
    renders = [p for p in devices if p.startswith(RENDER_PREFIX)]
    for path in renders:
        vendor = vendor_of(path.rsplit("/", 1)[1])
        if vendor is not None and vendor in gpu_vendors:
            return path
    return renders[0] if renders else ""


def nvidia_usable(modules: Collection[str], cdi: CdiSeen, nvidia_gpu: bool) -> bool:
    """detect-gpu: the nvidia module is loaded, CDI is reachable, and at least one display
    function is bound to nvidia: an NVIDIA GPU containers can use now."""
    return ("nvidia" in modules and (cdi.etc_spec or cdi.var_spec or cdi.ctk_on_path)
            and nvidia_gpu)


def may_read_write(stat: NodeStat, uid: int, gids: frozenset[int],
                   dac_override: bool | None = None) -> bool:
    """What open(O_RDWR) would decide, from the node's owner, mode and POSIX ACL: the
    kernel's ``posix_acl_permission`` where the node has an ACL, else its mode bits.

    A caller with CAP_DAC_OVERRIDE (``dac_override``) may open any node, whatever its uid;
    one without it is judged by the bits, root too (a container that dropped it is refused
    a node libvirt chowned to qemu, mode 0600). None: its capabilities are not known, and
    root is taken to have it."""
    if dac_override is None:
        dac_override = uid == 0
    if dac_override:
        return True
    if stat.uid == uid:
        return (stat.mode >> 6) & 0o6 == 0o6
    if not stat.acl:
        bits = stat.mode >> 3 if stat.gid in gids else stat.mode
        return bits & 0o6 == 0o6
    # With an ACL the mode's group bits are its mask: a named user, the owning group and
    # the named groups get what their entry and the mask both grant. A caller in some
    # matching group that none grants is refused, not judged by the "other" entry.
    mask = (stat.mode >> 3) & 0o7
    for tag, perm, ident in stat.acl:
        if tag == ACL_USER and ident == uid:
            return perm & mask & 0o6 == 0o6
    found = False
    for tag, perm, ident in stat.acl:
        if (tag == ACL_GROUP_OBJ and stat.gid in gids) or (tag == ACL_GROUP and ident in gids):
            found = True
            if perm & mask & 0o6 == 0o6:
                return True
    return not found and stat.mode & 0o6 == 0o6


def group_access(nodes: Mapping[str, NodeStat], uid: int, gids: frozenset[int],
                 dac_override: bool | None = None) -> dict[int, bool]:
    """vfio-group-accessible for every group with a ``/dev/vfio/N`` node at once
    (``dac_override`` as `may_read_write` takes it)."""
    prefix = _VFIO_PREFIX
    return {
        int(path[len(prefix) :]): may_read_write(stat, uid, gids, dac_override)
        for path, stat in nodes.items()
        if path.startswith(prefix) and path[len(prefix) :].isdigit()
    }


def vfio_backend_fields(fn: FunctionView, nodes: Collection[str],
                        variants: frozenset[str]) -> dict[str, Any]:
    """The ``vfio-backend`` answer's fields: the cdev with iommufd when both exist, else the
    group node, else nothing (a function not on VFIO has neither to offer, nor one in a
    no-IOMMU group: its ``noiommu-`` cdev and node are for no VMM)."""
    group_node = f"/dev/vfio/{fn.iommu_group}" if fn.iommu_group >= 0 else ""
    if group_node not in nodes:
        group_node = ""
    vfio = on_vfio(fn, variants)
    iommufd = IOMMU_NODE in nodes
    recommended: Literal["iommufd", "group", "none"]
    if vfio and fn.vfio_cdev and iommufd and not fn.vfio_cdev.startswith(NOIOMMU_CDEV_PREFIX):
        recommended = "iommufd"
    elif vfio and group_node:
        recommended = "group"
    else:
        recommended = "none"
    return {"addr": fn.addr, "driver": fn.driver, "on_vfio": vfio, "group_node": group_node,
            "cdev_node": fn.vfio_cdev, "iommufd": iommufd, "recommended": recommended}


# --------------------------------------------------------------------------- one fresh scan


class FreshFunction(NamedTuple):
    """A `PciFunction` as plain data, its fields in the same order (`FUNCTION_KEYS`)."""

    addr: str
    vendor_id: str
    device_id: str
    class_: str
    class_label: str
    driver: str
    iommu_group: int
    vfio_dev: str
    vfio_cdev: str
    sriov: dict[str, Any] | None
    physfn: str
    vgpu: dict[str, Any] | None
    health: str


#: `PciFunction`'s JSON names, in its field order.
FUNCTION_KEYS = ("addr", "vendor_id", "device_id", "class", "class_label", "driver",
                 "iommu_group", "vfio_dev", "vfio_cdev", "sriov", "physfn", "vgpu", "health")
#: The actions `FreshHost.answer` answers: the model's own, not the live ones (/proc, plan).
FRESH_ACTIONS = frozenset((*WATCHED_PROBES, "vfio-group-accessible", "display-driver",
                           "current-mode", "group-in-mode", "vfio-backend"))


def function_json(fn: FreshFunction) -> dict[str, Any]:
    return dict(zip(FUNCTION_KEYS, fn, strict=True))


class FunctionOutline(NamedTuple):
    """What a direct probe reads of every function: enough to place it (its class says
    whether it is a GPU, its group who its group members are, its cdev who reports which
    node). Its full `PciSeen` is read only when an answer reports the function."""

    addr: str
    devpath: str
    klass: str
    iommu_group: int
    vfio_cdev: str


#: Reads one outlined function in full, as the scan would (None: it went away meanwhile).
FullRead = Callable[[FunctionOutline], "PciSeen | None"]


class FunctionGone(DeviceNotFound):
    """A function outlined a moment ago could not be read in full: the host is changing
    under the probe (the caller starts again the long way)."""


class _Functions(Mapping[str, FreshFunction]):
    """The host's functions by address, each made a `FreshFunction` when first looked up."""

    def __init__(self, host: FreshHost) -> None:
        self._host = host

    def __getitem__(self, addr: str) -> FreshFunction:
        return self._host.record(addr)

    def __contains__(self, addr: object) -> bool:
        return addr in self._host.outlines

    def __iter__(self) -> Iterator[str]:
        return iter(self._host.outlines)

    def __len__(self) -> int:
        return len(self._host.outlines)


class FreshHost:
    """The answers of one full scan, as `HostState` built from the same snapshot gives them
    (JSON values instead of records).

    ``functions``: the scan's functions, each a full `PciSeen` or a `FunctionOutline` that
    ``read`` completes when an answer reports it (its fields, its group's); by default the
    snapshot's own.
    """

    def __init__(self, snapshot: Snapshot, tables: TablesView, uid: int, gids: frozenset[int],
                 functions: Iterable[PciSeen | FunctionOutline] | None = None,
                 read: FullRead | None = None, *, dac_override: bool | None = None) -> None:
        self.snapshot = snapshot
        self.uid, self.gids = uid, gids
        #: Whether the asking process holds CAP_DAC_OVERRIDE (None: not known).
        self.dac_override = dac_override
        self.gpu_vendors: Collection[str] = tables.gpu_vendors
        self.labels = tables.pci_class_labels
        self.pattern_res = compiled_patterns(tuple(tables.device_patterns))
        self.variants = variant_keys(tables.vfio_variant_drivers)
        self.nodes = {p: st for p, st in snapshot.nodes.nodes
                      if is_watched_node(p, self.pattern_res)}
        self._read = read
        self.outlines: dict[str, PciSeen | FunctionOutline] = {}
        # A cdev is reported once its node exists, by the function that names it last.
        self._cdev_owner: dict[str, str] = {}
        self.groups: dict[int, list[str]] = {}
        for seen in snapshot.functions if functions is None else functions:
            self.outlines[seen.addr] = seen
            if seen.vfio_cdev:
                self._cdev_owner[seen.vfio_cdev] = seen.addr
            if seen.iommu_group >= 0:
                self.groups.setdefault(seen.iommu_group, []).append(seen.addr)
        self.gpu_addrs = sorted(a for a, o in self.outlines.items() if is_gpu_class(o.klass))
        self._records: dict[str, FreshFunction] = {}
        self.functions: Mapping[str, FreshFunction] = _Functions(self)
        self.drm = {node.name: node for node in snapshot.drm}

    def record(self, addr: str) -> FreshFunction:
        """The function at ``addr`` (`KeyError` when the scan saw none), read in full now if
        it was only outlined."""
        fn = self._records.get(addr)
        if fn is not None:
            return fn
        seen = self.outlines[addr]
        if isinstance(seen, FunctionOutline):
            full = self._read(seen) if self._read is not None else None
            if full is None:
                raise FunctionGone(addr)
            seen = full
        # a VF the copy of a tree left out is no VF to list (`vfs_in_tree`)
        sriov = None if seen.sriov is None else vfs_in_tree(seen.sriov, self.outlines)
        cdev = seen.vfio_cdev
        if not (cdev and cdev in self.nodes and VFIO_CDEV_RE.match(cdev)
                and self._cdev_owner.get(cdev) == addr):
            cdev = ""
        fn = self._records[addr] = FreshFunction(
            seen.addr, seen.vendor_id, seen.device_id, seen.klass,
            class_label(self.labels, seen.klass) if seen.klass else "", seen.driver,
            seen.iommu_group, seen.vfio_dev, cdev,
            None if sriov is None else {"totalvfs": sriov.totalvfs, "numvfs": sriov.numvfs,
                                        "vfs": sriov.vfs},
            seen.physfn,
            None if seen.vgpu is None else {"type": seen.vgpu.type,
                                            "creatable": seen.vgpu.creatable},
            "ok",  # health comes from uevents; a fresh scan has seen none
        )
        return fn

    def function(self, addr: str | None) -> FreshFunction:
        if (addr or "") not in self.outlines:
            raise no_such_function(addr)
        return self.record(addr or "")

    def group_members(self, fn: FreshFunction) -> list[FreshFunction]:
        if fn.iommu_group < 0:
            return [fn]
        return [self.record(a) for a in sorted(self.groups.get(fn.iommu_group, (fn.addr,)))]

    def answer(self, action: str, *, group: int | None = None, addr: str | None = None,
               mode: str | None = None) -> Any:
        """One action of `FRESH_ACTIONS` for a request `check_params` accepted (``addr``
        normalised). No such function is `DeviceNotFound`."""
        if action == "detect-vfio":
            return self.detect_vfio()
        if action == "detect-gpu":
            return self.detect_gpu()
        if action == "detect-amd-gpu":
            return self.detect_amd_gpu()
        if action == "amd-gfx-version":
            return first_gfx_version(self.snapshot.kfd.nodes)
        if action == "amd-gfx-target":
            return first_gfx_target(self.snapshot.kfd.nodes)
        if action == "detect-host-devices":
            return self.detect_host_devices()
        if action == "vfio-group-accessible":
            access = group_access(self.nodes, self.uid, self.gids, self.dac_override)
            return group is not None and access.get(group, False)
        fn = self.function(addr)
        if action == "display-driver":
            return fn.driver
        if action == "current-mode":
            return current_mode(fn)
        if action == "group-in-mode":
            return group_in_mode(self.group_members(fn), parse_mode(mode), self.variants)
        if action == "vfio-backend":
            return vfio_backend_fields(fn, self.nodes, self.variants)
        raise UsageError(f"action {action!r} is not answered from a fresh scan")

    def detect_vfio(self) -> dict[str, Any]:
        gpus = []
        for addr in self.gpu_addrs:
            fn = self.record(addr)
            info = function_json(fn)
            info["group_members"] = [function_json(m) for m in self.group_members(fn)]
            gpus.append(info)
        iommu = self.snapshot.iommu
        return {"iommu_enabled": iommu.enabled, "iommu_kind": iommu.kind,
                "iommufd": IOMMU_NODE in self.nodes, "gpus": gpus}

    def detect_gpu(self) -> bool:
        nvidia_gpu = any(self.record(a).driver == "nvidia" for a in self.gpu_addrs)
        return nvidia_usable(self.snapshot.modules, self.snapshot.cdi, nvidia_gpu)

    def detect_amd_gpu(self) -> bool:
        return any(is_amd_card(name, node, self.functions) for name, node in self.drm.items())

    def detect_host_devices(self) -> dict[str, Any]:
        amd = self.detect_amd_gpu()
        kfd = self.snapshot.kfd.nodes
        devices = ordered_devices(self.nodes, self.pattern_res)

        def vendor_of(name: str) -> str | None:
            node = self.drm.get(name)
            return None if node is None else drm_vendor(node, self.functions)

        return {
            "gpu": self.detect_gpu(),
            "amd_gpu": amd,
            "amd_gfx_version": first_gfx_version(kfd) if amd else "",
            "amd_gfx_target": first_gfx_target(kfd) if amd else "",
            "devices": devices,
            "render_node": choose_render_node(devices, vendor_of, self.gpu_vendors),
        }


__all__ = [
    "ACTIONS",
    "FRESH_ACTIONS",
    "FUNCTION_KEYS",
    "IOMMU_NODE",
    "WATCHED_PROBES",
    "BoolAction",
    "FreshFunction",
    "FreshHost",
    "FullRead",
    "FunctionGone",
    "FunctionOutline",
    "FunctionView",
    "TextAction",
    "check_params",
    "choose_render_node",
    "compiled_patterns",
    "drm_driver",
    "drm_vendor",
    "glob_regex",
    "group_access",
    "is_amd_card",
    "is_watched_node",
    "may_read_write",
    "no_such_function",
    "nvidia_usable",
    "ordered_devices",
    "vfio_backend_fields",
]
