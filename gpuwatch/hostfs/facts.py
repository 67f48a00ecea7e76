"""Reading what the planner needs: modules, holders of the card's nodes, persistenced, CDI.

The I/O edge of `gpuwatch.core.plan`. Everything here reads ``/proc`` and ``/sys`` under the
root; nothing reads ``driver_override`` or any attribute whose read takes the device lock.
Reads of ``/proc/<pid>/maps`` can still block behind a stuck task, so the switch calls this
through `call_bounded`, never on its event loop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel

from gpuwatch.core.hostkind import UNKNOWN_HOST, HostKind
from gpuwatch.core.modalias import (
    VFIO_PCI_MODULE,
    VfioAlias,
    best_vfio_alias,
    parse_vfio_aliases,
)
from gpuwatch.core.modes import Mode, driver_key, target_driver
from gpuwatch.core.pci import PCI_ADDR_RE
from gpuwatch.core.plan import (
    AUDIO_CLASS,
    CDI_OUTPUT,
    PERSISTENCED_UNIT,
    HostFacts,
    NodeScope,
    VfioTarget,
    card_scope,
    holder_scope,
)
from gpuwatch.core.results import Holding, PciFunction
from gpuwatch.core.state import HostState, RecoveryMark
from gpuwatch.errors import StepTimedOut
from gpuwatch.hostfs.bootstate import stopped_services
from gpuwatch.hostfs.files import (
    in_tree,
    list_dir,
    open_regular,
    pci_attr,
    place_in_root,
    read_attr,
    read_bytes,
    read_text,
    small_count,
    tree_dir,
)
from gpuwatch.hostfs.procfs import (
    DEFAULT_PROC_DEADLINE,
    DELETED,
    held_node,
    numbered_scope,
    open_files,
    pids,
    read_comm,
    read_each,
    task_dirs,
)
from gpuwatch.hostfs.scan import (
    CDI_SPECS,
    HostPaths,
    cdi_spec_exists,
    function_dir,
    read_modules,
)

T = TypeVar("T")

_MINOR_RE = re.compile(r"^Device Minor:\s*([0-9]{1,9})\s*$", re.MULTILINE)
_SND_CARD_RE = re.compile(r"^card([0-9]+)$")
_SND_NODE_RE = re.compile(r"^(?:controlC|hwC|pcmC|midiC|comprC)([0-9]+)(?:D|$)")
_PERSISTENCED_COMM = "nvidia-persist"  # comm is cut at 15 bytes: "nvidia-persiste"


def is_persistenced(comm: str) -> bool:
    return comm.startswith(_PERSISTENCED_COMM)


# --------------------------------------------------------------------------- holders


#: A maps line is at most a path (PATH_MAX, a newline in it escaped as ``\\012``) and its
#: 70-odd columns: anything longer is no line of the kernel's and is skipped.
_MAPS_LINE_CAP = 4 * 4096 + 256


def _open_maps(path: str) -> int | None:
    """A descriptor of a ``maps`` file; None where it cannot be opened (the process is gone,
    or another user's and we are not root: the kernel refuses at the open)."""
    try:
        return open_regular(path)
    except (OSError, ValueError):
        return None


def _maps_blocks(fd: int) -> Iterator[bytes]:
    """The ``maps`` file open at ``fd`` (closed at the end), read to its end, in blocks of
    whole lines. The kernel hands ``/proc/<pid>/maps`` out a page or so per read (one read
    saw its first 30-odd lines: a CUDA process's ``/dev/nvidia*`` mappings come hundreds of
    lines later), and a CUDA process maps far more than one attribute's worth. Blocks, not
    lines, so that the lines that matter are picked out at C speed (`_picked_lines`); memory
    stays one chunk whatever the file's size, the time is bounded by the scan's deadline
    (`read_each`)."""
    try:
        tail, skipping = b"", False
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:  # the process exited under the read
                return
            if not data:
                break
            if skipping:  # the rest of an overlong line
                cut = data.find(b"\n")
                if cut < 0:
                    continue
                data, skipping = data[cut + 1:], False
            block = tail + data
            cut = block.rfind(b"\n") + 1
            if cut:
                yield block[:cut]
            tail = block[cut:]
            if len(tail) > _MAPS_LINE_CAP:
                tail, skipping = b"", True
        if tail and not skipping:
            yield tail
    finally:
        os.close(fd)


def mapped_files(proc: str, pid: int, within: Iterable[str] = ("/",)
                 ) -> Iterator[tuple[str, str]]:
    """``(handle, path)`` of the files a process has mapped (``/proc/<pid>/maps``, read
    whole) whose path starts with one of ``within`` (every file by default), each file once:
    a CUDA context maps /dev/nvidia* and keeps the card busy even after closing the fd.
    ``handle`` is the mapping's ``map_files`` link, whose stat reaches the mapped file itself
    (its device numbers: maps's own ``dev`` column is the device of the filesystem the node
    lies on, not the node's). A process whose own maps reads empty (its main thread exited
    while the others run on: `task_dirs`) is read through the first of its threads that
    shows any (threads share one memory), by that thread's ``/proc/<tid>``."""
    fd = _open_maps(f"{proc}/{pid}/maps")
    if fd is None:
        return
    paths = {os.fsencode(w) for w in within if w.startswith("/")}
    # a path under another one wanted is found with it (``/dev/nvidia0`` under ``/dev/``)
    wanted = tuple(sorted(p for p in paths if not any(p != q and p.startswith(q) for q in paths)))
    if not wanted:
        os.close(fd)
        return
    seen: set[tuple[bytes, bytes, bytes]] = set()
    lines = False
    for block in _maps_blocks(fd):
        lines = True
        yield from _mapped_files(block, wanted, f"{proc}/{pid}", seen)
    for task in () if lines else task_dirs(proc, pid):
        fd = _open_maps(f"{task}/maps")
        base = f"{proc}/{task.rpartition('/')[2]}"  # the thread's own /proc/<tid>: map_files
        for block in () if fd is None else _maps_blocks(fd):
            lines = True
            yield from _mapped_files(block, wanted, base, seen)
        if lines:
            return


def _picked_lines(block: bytes, wanted: tuple[bytes, ...]) -> Iterator[bytes]:
    """The lines of ``block`` that hold `` <one of wanted>`` (a path is preceded by the
    spaces that pad the columns before it), each once, in order: found by ``bytes.find``,
    not by a loop over every line (a process maps hundreds of libraries, none of them a
    device node)."""
    starts: set[int] = set()
    for path in wanted:
        needle = b" " + path
        at = block.find(needle)
        while at >= 0:
            starts.add(block.rfind(b"\n", 0, at) + 1)
            end = block.find(b"\n", at)
            if end < 0:
                break
            at = block.find(needle, end)
    for start in sorted(starts):
        end = block.find(b"\n", start)
        yield block[start:] if end < 0 else block[start:end]


def _mapped_files(block: bytes, wanted: tuple[bytes, ...], base: str,
                  seen: set[tuple[bytes, bytes, bytes]]) -> Iterator[tuple[str, str]]:
    """The files of a block of maps lines whose path starts with one of ``wanted``
    (``[heap]``, anonymous memory: none), each not yet ``seen`` (the same ``dev inode
    path`` is the same file, mapped again)."""
    for raw in _picked_lines(block, wanted):
        parts = raw.split(None, 5)
        if len(parts) == 6 and parts[5].startswith(wanted):
            key = (parts[3], parts[4], parts[5])
            if key not in seen:
                seen.add(key)
                yield (f"{base}/map_files/{parts[0].decode('ascii', 'replace')}",
                       parts[5].decode("utf-8", "replace").removesuffix(DELETED))


def mapped_within(scope: NodeScope) -> tuple[str, ...]:
    """The path prefixes of every mapping `held_node` can count for ``scope``: its exact
    nodes, its prefixes, and, where it has device numbers, all of ``/dev/`` (a renamed node).
    The rest of a process's maps (its libraries: hundreds of lines) is skipped unparsed."""
    numbered = ("/dev/",) if scope.numbered else ()
    return (*scope.exact, *scope.prefixes, *numbered)


@dataclass(frozen=True, slots=True)
class ProcScan:
    """One bounded pass over ``/proc``: the holders of the nodes in scope (processes that
    could not be read in time among them, ``unreadable``), and nvidia-persistenced."""

    holders: tuple[Holding, ...] = ()
    persistenced: bool = False
    #: persistenced's open files of ``/dev/nvidia*`` (each one counts in nvidia's refcnt).
    persistenced_fds: int = 0


def scan_procs(root: str, scope: NodeScope, *,
               deadline: float = DEFAULT_PROC_DEADLINE) -> ProcScan:
    """Read every process's comm, fds and maps, all within ``deadline`` (`read_each`); an
    fd or mapping holds a node of ``scope`` by its device numbers where the root's ``/dev``
    gives them, else by its path (`held_node`: a container's renamed node)."""
    proc = tree_dir(root, "proc")

    scope = numbered_scope(root, scope) if scope else scope
    within = mapped_within(scope)

    def read(pid: int) -> tuple[str, set[str], int]:
        comm = read_comm(proc, pid)
        files = list(open_files(proc, pid))
        nodes: set[str] = set()
        if scope:
            for handle, path in (*files, *mapped_files(proc, pid, within)):
                if (node := held_node(scope, handle, path)) is not None:
                    nodes.add(node)
        nvidia_fds = sum(1 for _, target in files if target.startswith("/dev/nvidia"))
        return comm, nodes, nvidia_fds

    seen, stuck = read_each(pids(proc), read, deadline=deadline, scope=proc)
    found: list[Holding] = []
    persistenced, persistenced_fds = False, 0
    for pid, (comm, nodes, nvidia_fds) in sorted(seen.items()):
        if is_persistenced(comm):
            persistenced, persistenced_fds = True, persistenced_fds + nvidia_fds
        found.extend(Holding(pid=pid, comm=comm, node=node) for node in sorted(nodes))
    for pid in stuck:
        comm = read_comm(proc, pid)  # no lock a stuck task holds: comm still answers
        persistenced = persistenced or is_persistenced(comm)
        found.append(Holding(pid=pid, comm=comm, unreadable=True))
    found.sort(key=lambda h: (h.pid, h.node))
    return ProcScan(tuple(found), persistenced, persistenced_fds)


def scan_holders(root: str, scope: NodeScope, *,
                 deadline: float = DEFAULT_PROC_DEADLINE) -> list[Holding]:
    """Every (pid, comm, node) with an fd on, or a mapping of, a node in ``scope``, and every
    process that could not be read within ``deadline`` (``unreadable``: it may hold one)."""
    if not scope:
        return []
    return list(scan_procs(root, scope, deadline=deadline).holders)


def persistenced_running(root: str, *, deadline: float = DEFAULT_PROC_DEADLINE) -> bool:
    return scan_procs(root, NodeScope(), deadline=deadline).persistenced


# --------------------------------------------------------------------------- card facts


def nvidia_minor(root: str, addr: str) -> int | None:
    """This card's ``/dev/nvidiaN`` from the driver's own ``information`` file."""
    text = read_text(os.path.join(tree_dir(root, "proc"), "driver/nvidia/gpus", addr,
                                  "information"))
    m = _MINOR_RE.search(text or "")
    return int(m.group(1)) if m else None


def snd_nodes(paths: HostPaths, addr: str) -> tuple[str, ...]:
    """``/dev/snd/*`` of the sound card(s) the kernel registered under this function."""
    entry = function_dir(paths, addr)
    cards = {m.group(1) for n in list_dir(os.path.join(entry, "sound"))
             if (m := _SND_CARD_RE.fullmatch(n))}
    if not cards:
        return ()
    return tuple(sorted(f"/dev/snd/{n}" for n in list_dir(os.path.join(paths.dev, "snd"))
                        if (m := _SND_NODE_RE.match(n)) and m.group(1) in cards))


def dri_nodes(state: HostState, addrs: Iterable[str]) -> dict[str, tuple[str, ...]]:
    wanted = set(addrs)
    out: dict[str, list[str]] = {}
    for name, node in state.drm.items():
        if node.device_addr in wanted:
            out.setdefault(node.device_addr, []).append(f"/dev/dri/{name}")
    return {a: tuple(sorted(v)) for a, v in out.items()}


#: The PCI drivers nvidia.ko registers: unloading the module unbinds their devices too. On
#: HGX/DGX boards the NVSwitches (class 0x0680) are bound to ``nvidia-nvswitch``.
NVIDIA_MODULE_DRIVERS = frozenset(("nvidia", "nvidia-nvswitch"))


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """The facts the model already knows: taken on the event loop, handed to the reader thread
    (the model's dicts must not be iterated from another thread while uevents change them)."""

    other_nvidia: tuple[str, ...]
    dri_nodes: dict[str, tuple[str, ...]]
    vfio_variants: frozenset[str] = frozenset()
    wedge_recovery: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    kept_for_host: str = ""
    poisoned: str = ""
    recovery_age: dict[str, float] = dataclasses.field(default_factory=dict)
    recovery_failed_above: dict[str, str] = dataclasses.field(default_factory=dict)
    recovery_above: dict[str, str] = dataclasses.field(default_factory=dict)
    failed_bridge: dict[str, str] = dataclasses.field(default_factory=dict)
    #: ``sys/kernel/iommu_groups`` has entries (detect-vfio's ``iommu_enabled``).
    iommu_groups: bool = False
    #: The IOMMU's kind and the machine's (`gpuwatch.core.observations.IommuSeen`).
    iommu_kind: str = ""
    host_kind: HostKind = UNKNOWN_HOST


def model_facts(state: HostState, members: Iterable[PciFunction],
                poisoned: str = "") -> ModelFacts:
    addrs = {fn.addr for fn in members}
    found = recovery_facts(state, addrs)
    return ModelFacts(
        other_nvidia=tuple(sorted(a for a, fn in state.functions.items()
                                  if fn.driver in NVIDIA_MODULE_DRIVERS and a not in addrs)),
        dri_nodes=dri_nodes(state, addrs),
        vfio_variants=state.vfio_variants,
        wedge_recovery={a: r for a, r in state.wedge_recovery.items() if a in addrs},
        kept_for_host=state.kept_for_host(min(addrs)) if addrs else "",
        poisoned=poisoned,
        recovery_age=found.age,
        recovery_failed_above=found.failed_above,
        recovery_above=found.above,
        failed_bridge=found.failed_bridge,
        iommu_groups=state.iommu.enabled,
        iommu_kind=state.iommu.kind,
        host_kind=HostKind(state.iommu.arch, state.iommu.hypervisor),
    )


def health_facts(state: HostState, members: Iterable[PciFunction]) -> HostFacts:
    """Just what `gpuwatch.core.plan.unhealthy_reason` needs, read from the model: the
    early health check of a switch, before anything else is read."""
    addrs = {fn.addr for fn in members}
    found = recovery_facts(state, addrs)
    return HostFacts(wedge_recovery={a: r for a, r in state.wedge_recovery.items() if a in addrs},
                     recovery_age=found.age, recovery_failed_above=found.failed_above,
                     recovery_above=found.above, failed_bridge=found.failed_bridge)


@dataclass(frozen=True, slots=True)
class RecoveryFacts:
    """What `recovery_facts` found (see `gpuwatch.core.plan.HostFacts` for each field)."""

    age: dict[str, float] = dataclasses.field(default_factory=dict)
    failed_above: dict[str, str] = dataclasses.field(default_factory=dict)
    above: dict[str, str] = dataclasses.field(default_factory=dict)
    failed_bridge: dict[str, str] = dataclasses.field(default_factory=dict)


def recovery_facts(state: HostState, addrs: Iterable[str],
                   now: float | None = None) -> RecoveryFacts:
    """PCI error recoveries that concern the functions ``addrs``: for a ``recovering``
    function, the nearest bridge above it that reported ``FAILED_RECOVERY`` after the
    function's ``BEGIN_RECOVERY`` (the kernel reports a failed recovery on that bridge only,
    so the function's own end never comes; an older failure of the bridge is no outcome of
    this recovery); for any function, the nearest bridge above it that is ``recovering``
    (the kernel resets the link below it, and a function whose driver has no error handler
    gets no uevent of its own); for a function not failed at a bridge that way, the
    nearest ``failed`` bridge above it whose ``FAILED_RECOVERY`` came after the function's
    last sign of life (its own recovery uevent, a bind: see `HostState.alive_marks`), since
    the kernel sends the failure on the bridge alone and the link below it may be down; and
    the seconds since the ``BEGIN_RECOVERY`` of each of those recovering functions and
    bridges, on the monotonic clock the state stamped it with (``now``: that clock's
    reading, else the state's clock is read; unknown without
    one), never the wall clock, which NTP may step during a recovery."""
    if now is None and state.clock is not None:
        now = state.clock()
    functions, marks = state.functions, state.recovery_marks
    found = RecoveryFacts()

    def age(addr: str) -> None:
        mark = marks.get(addr)
        if mark is None or mark.at is None or now is None or addr in found.age:
            return
        found.age[addr] = max(0.0, now - mark.at)

    for addr in addrs:
        fn = functions.get(addr)
        if fn is None:
            continue
        above = [p for p in reversed(state.devpaths.get(addr, "").split("/")[:-1])
                 if PCI_ADDR_RE.fullmatch(p) and p in functions]
        if fn.health == "recovering":
            age(addr)
            began = marks.get(addr)
            bridge = next((b for b in above if functions[b].health == "failed"
                           and _failed_after(marks.get(b), began)), "")
            if bridge:
                found.failed_above[addr] = bridge
        if addr not in found.failed_above:
            bridge = next((b for b in above if functions[b].health == "failed"
                           and not _alive_since(state, b, addr)), "")
            if bridge:
                found.failed_bridge[addr] = bridge
        bridge = next((b for b in above if functions[b].health == "recovering"), "")
        if bridge:
            found.above[addr] = bridge
            age(bridge)
    return found


def _alive_since(state: HostState, bridge: str, addr: str) -> bool:
    """``addr``, or a function sharing the link below ``bridge`` with it (another function
    of the card, a device further down), showed a sign of life after the bridge's
    ``FAILED_RECOVERY``: a bind, or a PCI error recovery uevent of its own (the kernel
    reaches it, so the link is up again). A failure with no mark, never ranked, is not
    outlived."""
    failed = state.recovery_marks.get(bridge)
    if failed is None:
        return False
    marks, alive = state.recovery_marks, state.alive_marks
    below = f"/{bridge}/"
    devpaths = state.devpaths
    for other in (addr, *(a for a, path in devpaths.items() if below in path and a != addr)):
        own = marks.get(other)
        if max(own.order if own is not None else 0, alive.get(other, 0)) > failed.order:
            return True
    return False


def _failed_after(failed: RecoveryMark | None, began: RecoveryMark | None) -> bool:
    """A bridge's ``FAILED_RECOVERY`` applied after a function's ``BEGIN_RECOVERY`` (with
    no begin known, any failure counts, as it always did)."""
    return began is None or (failed is not None and failed.order > began.order)


# --------------------------------------------------------------------------- VFIO driver choice

#: modules.alias holds tens of thousands of lines; more than this is no depmod output.
_ALIAS_FILE_CAP = 64 * 1024 * 1024
_alias_cache: dict[str, tuple[tuple[int, int], tuple[VfioAlias, ...]]] = {}


def modules_alias_path(paths: HostPaths) -> str:
    """``lib/modules/<release>/modules.alias`` for the release in ``proc/sys/kernel/osrelease``
    (``""`` when the release is unreadable or not a plain name)."""
    release = read_attr(os.path.join(paths.proc, "sys/kernel/osrelease"))
    if not release or "/" in release or release in (".", "..") or not release.isprintable():
        return ""
    # ``lib`` is a link to ``usr/lib`` on merged-/usr systems, spelled absolute on some.
    return in_tree(paths.root, f"lib/modules/{release}/modules.alias")


def read_vfio_aliases(paths: HostPaths) -> tuple[VfioAlias, ...]:
    """The ``vfio_pci:`` aliases depmod wrote for the running kernel; cached per file version."""
    path = modules_alias_path(paths)
    if not path:
        return ()
    try:
        st = os.stat(path)
    except OSError:
        return ()
    key = (st.st_mtime_ns, st.st_size)
    cached = _alias_cache.get(path)
    if cached is not None and cached[0] == key:
        return cached[1]
    try:
        data = read_bytes(path, _ALIAS_FILE_CAP)  # a regular file only: a FIFO never blocks
    except OSError:
        return ()
    text = data.decode("utf-8", "replace")
    aliases = parse_vfio_aliases(line for line in text.splitlines() if "vfio_pci:" in line)
    _alias_cache[path] = (key, aliases)
    return aliases


def driver_name(paths: HostPaths, module: str) -> str:
    """The PCI driver name ``module`` registers, as the kernel spells it (``driver_override``
    is compared with it byte for byte): a registered driver of that name, else the module's
    own ``drivers/pci:<name>`` link, else ``vfio-pci`` for vfio_pci, else the module name."""
    key = driver_key(module)
    for name in list_dir(paths.sys + "/bus/pci/drivers"):
        if driver_key(name) == key:
            return name
    for entry in list_dir(os.path.join(paths.module, key, "drivers")):
        if entry.startswith("pci:"):
            return entry[4:]
    return "vfio-pci" if key == VFIO_PCI_MODULE else module


def vfio_targets(paths: HostPaths, members: Iterable[PciFunction], mode: Mode, *,
                 vfio_driver: str | None = None) -> dict[str, VfioTarget]:
    """The VFIO driver each function that ``mode`` sends to VFIO would get: ``vfio_driver``
    for the display functions when asked, else the most specific ``vfio_pci:`` alias of its
    ``modalias``, else vfio-pci."""
    aliases = read_vfio_aliases(paths)
    out: dict[str, VfioTarget] = {}
    for fn in members:
        if target_driver(fn, mode) != "vfio-pci":
            continue
        if vfio_driver and fn.class_.startswith("0x03"):
            module = driver_key(vfio_driver)
            out[fn.addr] = VfioTarget(driver_name(paths, vfio_driver), module, "", exact=True)
            continue
        modalias = pci_attr(function_dir(paths, fn.addr), "modalias")
        best = best_vfio_alias(aliases, modalias)
        if best is not None and driver_key(best.module) != VFIO_PCI_MODULE:
            out[fn.addr] = VfioTarget(driver_name(paths, best.module), driver_key(best.module),
                                      best.pattern)
        else:
            out[fn.addr] = VfioTarget(driver_name(paths, VFIO_PCI_MODULE), VFIO_PCI_MODULE,
                                      best.pattern if best is not None else "")
    return out


def gather_facts(paths: HostPaths, members: Iterable[PciFunction], mode: Mode, known: ModelFacts,
                 *, euid: int, which: Callable[[str], str | None],
                 vfio_driver: str | None = None,
                 deadline: float = DEFAULT_PROC_DEADLINE) -> HostFacts:
    """Read everything `plan_switch` needs for this group and direction, holders last (their
    scope depends on the rest). nvidia-persistenced is not counted: the plan stops it.

    Reads files only, so it may run in a worker thread; /proc within ``deadline``.
    """
    fns = tuple(members)
    facts = _card_facts(paths, fns, mode, known, euid=euid, which=which,
                        vfio_driver=vfio_driver)
    procs = scan_procs(paths.root, holder_scope(fns, mode, facts), deadline=deadline)
    holders = [h for h in procs.holders if h.unreadable or not is_persistenced(h.comm)]
    return dataclasses.replace(facts, holders=tuple(holders), persistenced=procs.persistenced,
                               persistenced_fds=procs.persistenced_fds)


def _card_facts(paths: HostPaths, fns: tuple[PciFunction, ...], mode: Mode, known: ModelFacts,
                *, euid: int, which: Callable[[str], str | None],
                vfio_driver: str | None = None) -> HostFacts:
    """Everything but /proc: modules, refcnt, the GPUs' minors and nodes, CDI."""
    nvidia_dir = os.path.join(paths.module, "nvidia")
    return HostFacts(
        root=paths.root,
        modules=read_modules(paths),
        nvidia_refcnt=small_count(read_attr(os.path.join(nvidia_dir, "refcnt"))),
        nvidia_module_holders=tuple(sorted(list_dir(os.path.join(nvidia_dir, "holders")))),
        other_nvidia=known.other_nvidia,
        nvidia_minors={fn.addr: minor for fn in fns if fn.driver == "nvidia"
                       and (minor := nvidia_minor(paths.root, fn.addr)) is not None},
        dri_nodes=known.dri_nodes,
        snd_nodes={fn.addr: snd_nodes(paths, fn.addr) for fn in fns if fn.class_ == AUDIO_CLASS},
        cdi_spec=any(cdi_spec_exists(paths.root, s) for s in CDI_SPECS),
        ctk_on_path=which("nvidia-ctk") is not None,
        cdi_output=cdi_output(paths.root),
        holders_complete=euid == 0,
        vfio_targets=vfio_targets(paths, fns, mode, vfio_driver=vfio_driver),
        vfio_variants=known.vfio_variants,
        wedge_recovery=known.wedge_recovery,
        recovery_age=known.recovery_age,
        recovery_failed_above=known.recovery_failed_above,
        recovery_above=known.recovery_above,
        failed_bridge=known.failed_bridge,
        iommu_groups=known.iommu_groups,
        iommu_kind=known.iommu_kind,
        host_kind=known.host_kind,
        kept_for_host=known.kept_for_host,
        poisoned=known.poisoned,
        persistenced_stopped=mode == "nvidia"
        and PERSISTENCED_UNIT in stopped_services(paths.root),
    )


def card_holders(paths: HostPaths, known: ModelFacts, members: Iterable[PciFunction], *,
                 deadline: float = DEFAULT_PROC_DEADLINE) -> list[Holding]:
    """Every holder of every node of the card, nvidia-persistenced included; one bounded
    pass over /proc. ``known``: `model_facts` of the card, taken from the model beforehand
    (this reads files only, so it may run in a worker thread)."""
    fns = tuple(members)
    facts = _card_facts(paths, fns, "vfio", known, euid=0, which=lambda _: None)
    return scan_holders(paths.root, card_scope(fns, facts), deadline=deadline)


def cdi_output(root: str) -> str:
    """Where ``nvidia-ctk cdi generate --output=…`` writes the spec: ``root/etc/cdi/
    nvidia.yaml`` with the tree's links read as in a chroot (`place_in_root`). nvidia-ctk
    runs outside the root and follows links as the host does: a host root at ``/host`` whose
    ``etc/cdi`` is a link to ``/run/cdi`` would have it write the ``/run`` of the container
    running gpuwatch, where no container runtime of the host looks. So is the spec's own
    name: one that is a link left dangling (``nvidia.yaml`` → ``/run/cdi/nvidia.yaml``, that
    folder not there yet) names the tree's ``run/cdi/nvidia.yaml``, never the host's."""
    return place_in_root(root, CDI_OUTPUT, follow_last=True)


# --------------------------------------------------------------------------- bounded reads


async def call_bounded(fn: Callable[[], T], timeout: float, what: str) -> T:
    """Run a blocking read in a daemon thread; `StepTimedOut` after ``timeout``.

    Not ``anyio.to_thread``: its worker threads are joined at exit, and a read stuck behind
    a wedged task would then hang the process. A daemon thread is simply left behind.
    """
    token = anyio.lowlevel.current_token()
    done = anyio.Event()
    box: list[tuple[bool, object]] = []

    def target() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # handed back to the caller as is
            box.append((False, exc))
        # The loop may be gone (the caller gave up and left): nobody waits any more. Only
        # that (a RuntimeError) is quiet: anything else would leave the caller waiting out
        # its whole timeout for a result already in the box.
        with contextlib.suppress(RuntimeError):
            anyio.from_thread.run_sync(done.set, token=token)

    threading.Thread(target=target, name=f"gpuwatch {what}", daemon=True).start()
    with anyio.move_on_after(timeout):
        await done.wait()
    if not box:
        raise StepTimedOut(what, timeout)
    ok, value = box[0]
    if not ok:
        assert isinstance(value, BaseException)
        raise value
    return value  # type: ignore[return-value]


__all__ = [
    "ModelFacts",
    "ProcScan",
    "RecoveryFacts",
    "call_bounded",
    "card_holders",
    "cdi_output",
    "dri_nodes",
    "gather_facts",
    "health_facts",
    "is_persistenced",
    "mapped_files",
    "model_facts",
    "nvidia_minor",
    "persistenced_running",
    "recovery_facts",
    "scan_holders",
    "scan_procs",
    "snd_nodes",
]
