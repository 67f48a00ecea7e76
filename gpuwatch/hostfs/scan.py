"""Reading the tree into observations: one device after a uevent, or the whole host.

`observe` is the per-event edge (reads only the device the uevent names, so an event's cost
does not grow with the host) and `scan` the full one (initial model, resync, reconcile).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import re
import stat as stat_mod
import struct
import sys
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from gpuwatch.core.kfd import parse_gfx_target_version
from gpuwatch.core.modes import is_vfio_driver, variant_keys
from gpuwatch.core.observations import (
    CdiSeen,
    DriversSeen,
    DrmGone,
    DrmSeen,
    FramebufferGone,
    FramebufferSeen,
    IommuSeen,
    KfdSeen,
    ModuleSeen,
    NodeSeen,
    NodesSeen,
    NodeStat,
    Observation,
    PciGone,
    PciSeen,
    Snapshot,
    SriovSeen,
    VgpuSeen,
    VgpusSeen,
    vfs_in_tree,
)
from gpuwatch.core.pci import class_prefix, is_gpu_class, is_pci_addr, parse_group, pci_id
from gpuwatch.core.probes import FunctionOutline
from gpuwatch.core.tabledata import TablesView
from gpuwatch.core.uevent import UEvent
from gpuwatch.hostfs.bootvga import (
    HostConsole,
    console_of,
    framebuffer_names,
    framebuffer_owner,
    is_framebuffer,
    listed_console,
)
from gpuwatch.hostfs.files import (
    driver_name,
    group_name,
    in_root,
    in_tree,
    link_in_root,
    link_name,
    list_dir,
    pci_attr,
    present,
    read_attr,
    read_bytes,
    read_kernel_attr,
    read_text,
    resolve_in_root,
    rooted_target,
    small_count,
    tree_dir,
)
from gpuwatch.hostfs.hostkind import read_host_kind
from gpuwatch.hostfs.hostview import host_which

_DRM_NODE_RE = re.compile(r"^(card|renderD)[0-9]+$")
#: A function's VFIO device: ``vfioN``, or ``noiommu-vfioN`` in a no-IOMMU group.
_VFIO_DEV_RE = re.compile(r"^(?:noiommu-)?vfio[0-9]+$")
_VIRTFN_RE = re.compile(r"^virtfn([0-9]+)$")
_VGPU_ID_RE = re.compile(r"^\s*([0-9]+)\b")
_NO_VFIO_DEV = ("", "")
_NO_LINKS = (-1, False)
_tuple_new = tuple.__new__
#: The strings a function's record holds that many functions share (ids, class, driver),
#: each read afresh per function: one object per value instead (a large host's model held
#: ~1.3 MB of equal copies). Interned strings still go when nothing holds them.
_intern = sys.intern

CDI_SPECS = ("etc/cdi/nvidia.yaml", "var/run/cdi/nvidia.yaml")
#: Uevent actions that announce a driver link change and nothing else.
_DRIVER_ACTIONS = frozenset(("bind", "unbind"))
#: Filesystems whose inode numbers are not reused: kernfs ids carry a generation, tmpfs counts
#: up. (ext4 and xfs hand a freed number to the next directory at once.)
STABLE_INODE_FS = frozenset(("sysfs", "tmpfs"))
_MOUNTINFO = "/proc/self/mountinfo"
_OCTAL_ESCAPE_RE = re.compile(r"\\([0-7]{3})")


#: (path, device id) → filesystem type: a device id names one mounted filesystem, so while
#: ``path`` still sits on the same device its type cannot have changed. A one-shot scan pays
#: one ``stat`` instead of parsing mountinfo (~100 µs on a host with a few dozen mounts).
_FS_TYPES: dict[tuple[str, int], str] = {}


def fs_type(path: str) -> str:
    """The type of the filesystem mounted at ``path`` (from mountinfo); ``""`` when unknown."""
    target = os.path.realpath(path)
    try:
        key = (target, os.stat(target).st_dev)
    except (OSError, ValueError):
        return ""
    kind = _FS_TYPES.get(key)
    if kind is None:
        kind = _FS_TYPES[key] = _mountinfo_type(target)
        if len(_FS_TYPES) > 64:  # bounded: roots come and go in tests and benchmarks
            _FS_TYPES.pop(next(iter(_FS_TYPES)))
    return kind


def _mountinfo_type(target: str) -> str:
    try:
        lines = read_bytes(_MOUNTINFO, 4 << 20).decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    longest, kind = -1, ""
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        mount = _OCTAL_ESCAPE_RE.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= longest:  # the last of stacked mounts is the visible one
            longest, kind = len(mount), tail[0]
    return kind


class HostPaths:
    """Absolute paths under one root, computed once (string ops are the hot path here)."""

    def __init__(self, root: str | os.PathLike[str], *, host_namespaces: bool = False) -> None:
        self.root = os.path.abspath(os.fspath(root))
        #: The ``host_namespaces`` setting: the host's commands run in its namespaces, so a
        #: tool is looked for on the host's PATH (`host_which`), not ours (`read_cdi`).
        self.host_namespaces = host_namespaces
        # The root's own links read as in a chroot (`tree_dir`): never the host's sysfs.
        self.sys = tree_dir(self.root, "sys")
        self.bus_pci = os.path.join(self.sys, "bus/pci/devices")
        self.class_drm = os.path.join(self.sys, "class/drm")
        self.class_graphics = os.path.join(self.sys, "class/graphics")
        self.module = os.path.join(self.sys, "module")
        self.iommu_groups = os.path.join(self.sys, "kernel/iommu_groups")
        self.class_iommu = os.path.join(self.sys, "class/iommu")
        self.dev = tree_dir(self.root, "dev")
        self.proc = tree_dir(self.root, "proc")
        self.cmdline = os.path.join(self.proc, "cmdline")
        #: Function directory → (st_dev, st_ino, vendor, device, class, is a PF, physfn,
        #: boot_vga) from its
        #: last full read.
        #: The kernel reads a function's ids from config space once, when it creates the
        #: directory: they cannot change while that directory (that inode) lives. So a
        #: bind/unbind re-reads only what it can change (see `read_function_known`).
        self.identity: dict[str, tuple[int, int, str, str, str, bool, str, bool]] = {}
        #: Function directory → (IOMMU group as last read, whether a bind or unbind may still
        #: change it), for the same shortcut.
        self.links: dict[str, tuple[int, bool]] = {}
        #: Function directory → what its last full read found, for the functions whose bind
        #: or unbind changes nothing but the driver (see `observe_batch`).
        self.plain: dict[str, PlainFunction] = {}
        #: Address → devpath of the functions the last `function_entries` found by walking
        #: ``sys/devices`` (a captured tree without the bus listing); empty when it had one.
        self.walked: dict[str, str] = {}
        #: Address → devpath from a walk of ``sys/devices``, made the first time a listed
        #: entry of one `function_entries` leads to no function (`read_bus_entry`); None
        #: until then.
        self.rewalked: dict[str, str] | None = None
        #: Parent folder → {VF: PF} of the VFs there whose links a capture dropped
        #: (`pf_beside`), for the reads of one `function_entries`.
        self.beside: dict[str, dict[str, str]] = {}
        self._sys_type: str | None = None

    def _fs(self) -> str:
        """The type of the filesystem ``sys`` is on, asked once (`fs_type`)."""
        if self._sys_type is None:
            self._sys_type = fs_type(self.sys)
        return self._sys_type

    def stable_inodes(self) -> bool:
        """Whether ``sys`` lives on a filesystem that never hands a new directory the inode
        number of a deleted one, so that an inode number names one directory for good."""
        return self._fs() in STABLE_INODE_FS

    @property
    def live(self) -> bool:
        """Whether ``sys`` is the kernel's own sysfs, not a copy: then its links are the
        truth, no file a capture may have dropped is looked for, and no special file can be
        where an attribute is (`read_kernel_attr`)."""
        return self._fs() == "sysfs"

    def under(self, host_path: str) -> str:
        """``/dev/kvm`` → ``<root>/dev/kvm``, through the tree's own ``dev`` (`tree_dir`, read
        once): a string join, as a node uevent asks it each time."""
        if host_path.startswith("/dev/"):
            return self.dev + host_path[len("/dev"):]
        return os.path.join(self.root, host_path.lstrip("/"))


# --------------------------------------------------------------------------- PCI


def kernel_devpath(devpath: str) -> bool:
    """Whether ``devpath`` is spelled as the kernel spells one: under ``/devices/``, with no
    empty, ``.`` or ``..`` component, so that read under ``sys/`` it stays there. A line
    written by hand (a JSONL source) may hold anything: ``/../../tmp/x`` would lead out of
    the tree and pass a folder there off as the device."""
    return devpath.startswith("/devices/") and "//" not in devpath and "/." not in devpath


def read_function(paths: HostPaths, addr: str, devpath: str | None = None) -> PciSeen | PciGone:
    """Read one PCI function. Tries the uevent's DEVPATH (when spelled as the kernel's,
    `kernel_devpath`), then the bus entry (flat layouts)."""
    if devpath and kernel_devpath(devpath):
        candidate = paths.sys + devpath
        try:
            st = os.stat(candidate)  # before the reads: a later replacement cannot be cached
        except (OSError, ValueError):
            st = None
        if st is not None and stat_mod.S_ISDIR(st.st_mode):
            seen = _read_function_dir(candidate, addr, devpath, told=False)
            if seen.vendor_id or seen.device_id or seen.klass:
                if paths.stable_inodes():
                    _remember(paths, candidate, st, seen)
                _remember_plain(paths, candidate, seen)
                return seen
            return seen if os.path.isdir(candidate) else PciGone(addr)
    directory = function_dir(paths, addr)
    devpath = _devpath_of_bus_entry(paths, addr)
    if not devpath or not os.path.isdir(directory):
        return PciGone(addr)  # no folder, or its bus entry leads out of the tree
    seen = _read_function_dir(directory, addr, devpath, told=False)
    if not (seen.vendor_id or seen.device_id or seen.klass) and not os.path.isdir(directory):
        return PciGone(addr)  # vanished while we read it
    return seen


def _remember(paths: HostPaths, directory: str, st: os.stat_result, seen: PciSeen) -> None:
    """What a later bind/unbind of this directory needs (`read_function_known`): its identity
    from a stat taken *before* the full read ``seen``, so that a directory replaced after the
    stat can only fail the next comparison, never pair a new inode with old ids."""
    # A group seen under a bound driver may be no-IOMMU VFIO's, which goes with the driver:
    # the next bind/unbind looks again (once; from then on it knows where the group came from).
    paths.links[directory] = (seen.iommu_group, seen.iommu_group >= 0 and bool(seen.driver))
    paths.identity[directory] = (
        st.st_dev,
        st.st_ino,
        seen.vendor_id,
        seen.device_id,
        seen.klass,
        seen.sriov is not None,
        seen.physfn,
        seen.boot_vga,
    )


class PlainFunction(NamedTuple):
    """A function whose bind or unbind can change only its driver and what that driver brings
    (a VFIO device, a vGPU): no SR-IOV on either side of it, and an IOMMU group that is the
    IOMMU's, fixed for the directory's life. Kept from its last full read, with the ids its
    uevents carry as the kernel spells them (``PCI_ID`` ``%04X:%04X``, ``PCI_CLASS`` ``%04X``
    less the programming interface)."""

    pci_id: str
    pci_class: str
    seen: PciSeen


def _remember_plain(paths: HostPaths, directory: str, seen: PciSeen) -> None:
    """Record (or forget) ``seen`` as a `PlainFunction`. A group present under no driver, or
    under one that brings no VFIO, is the IOMMU's (no-IOMMU VFIO's group comes and goes with
    a VFIO driver); one seen only under a VFIO driver qualifies at its first unbind."""
    ids = plain_ids(seen) if (
        seen.sriov is None and not seen.physfn and seen.iommu_group >= 0
        and (not seen.driver or not _vfio_capable(seen.driver, frozenset()))
    ) else None
    if ids is None:
        paths.plain.pop(directory, None)
    else:
        paths.plain[directory] = PlainFunction(ids[0], ids[1], seen)


def forget_function(paths: HostPaths, devpath: str) -> None:
    """Drop what the reads of a function that is gone kept about its directory (`identity`,
    `links`, `plain`): a daemon that sees devices come and go for weeks, with no rescan to
    clear them, would otherwise keep one entry per directory it ever read."""
    directory = paths.sys + devpath
    paths.identity.pop(directory, None)
    paths.links.pop(directory, None)
    paths.plain.pop(directory, None)


def plain_ids(seen: PciSeen) -> tuple[str, str] | None:
    """(``PCI_ID``, ``PCI_CLASS`` less its last byte) as a PCI uevent spells them, from the
    ids read; None if they do not parse."""
    try:
        vendor, device = int(seen.vendor_id, 16), int(seen.device_id, 16)
        klass = int(seen.klass, 16)
    except ValueError:
        return None
    return _intern(f"{vendor:04X}:{device:04X}"), _intern(f"{klass << 8:04X}"[:-2])


def observe_batch(paths: HostPaths, tables: TablesView, reads: Sequence[UEvent],
                  devpaths: Mapping[str, str]) -> list[Observation]:
    """`observe` for each (already collapsed) uevent, in order, except that a bind or unbind
    of a `PlainFunction` reads its driver link and nothing else (but what a VFIO-capable
    driver may bring: a VFIO device, a vGPU), and a run of those that found nothing more
    becomes one `DriversSeen`. ``devpaths`` is the model's address → DEVPATH.

    The uevent vouches for the card: it must name the model's DEVPATH for the address and
    carry the ``PCI_ID`` and ``PCI_CLASS`` of the last full read (a new card in the slot sends
    other ids, or an ``add`` first, which reads it in full), and no ``DEVNAME`` (a node
    `observe` would look at); anything else goes to `observe`.
    """
    out: list[Observation] = []
    run: list[tuple[str, str]] = []
    plain, sysdir = paths.plain, paths.sys
    variants = _variant_keys(tables.vfio_variant_drivers)
    access, F_OK = os.access, os.F_OK
    for event in reads:
        action, devpath, subsystem, props = event
        if subsystem == "pci" and (action == "unbind" or action == "bind"):
            directory = sysdir + devpath
            known = plain.get(directory)
            if (known is not None and variants and known.seen.driver
                    and _vfio_capable(known.seen.driver, variants)):
                # Read under a vfio-pci variant only the tables name (`_remember_plain` knows
                # no tables): its group may be no-IOMMU VFIO's, gone with the driver.
                del plain[directory]
                known = None
            if (
                known is not None
                and props.get("PCI_ID") == known.pci_id
                and props.get("PCI_CLASS", "")[:-2] == known.pci_class
                and devpaths.get(known.seen.addr) == devpath
                and "DEVNAME" not in props  # (a hand-written line's) node: `observe` reads it
            ):
                link = directory + "/driver"
                if action == "unbind" and not access(link, F_OK, follow_symlinks=False):
                    driver = ""  # what an unbind leaves: no failed readlink (an exception)
                else:
                    driver = _intern(link_name(link))
                if driver or access(directory, F_OK):
                    if not driver or not _vfio_capable(driver, variants):
                        run.append((known.seen.addr, driver))
                        continue
                    # A driver that may bring a VFIO device or a vGPU: look for them.
                    vfio_dev, vfio_cdev = read_vfio_dev(directory)
                    vgpu = read_vgpu(directory) if driver == "nvidia" else None
                    if not vfio_dev and vgpu is None:
                        run.append((known.seen.addr, driver))  # it brought none (yet)
                        continue
                    if run:
                        out.append(DriversSeen(tuple(run)))
                        run = []
                    seen = known.seen
                    # seen._replace(...) without its Python-level map over every field.
                    out.append(_tuple_new(PciSeen, (
                        seen.addr, devpath, seen.vendor_id, seen.device_id, seen.klass, driver,
                        seen.iommu_group, vfio_dev, vfio_cdev, None, "", vgpu, seen.boot_vga)))
                    continue
                # No driver because no device: it went between the uevent and this read (a
                # surprise removal). `observe` reads that as the removal it is, not as an
                # unbind of a function that stays in the model.
        if run:
            out.append(DriversSeen(tuple(run)))
            run = []
        seen_now = observe(paths, tables, event)
        for obs in seen_now:
            if type(obs) is PciGone and obs.addr in devpaths:
                forget_function(paths, devpaths[obs.addr])
        out.extend(seen_now)
    if run:
        out.append(DriversSeen(tuple(run)))
    return out


def read_function_known(paths: HostPaths, addr: str, devpath: str, action: str = "bind",
                        variants: frozenset[str] = frozenset()) -> PciSeen | PciGone:
    """`read_function` for a bind/unbind: when the directory is the very inode fully read
    before, its ids are known (see `HostPaths.identity`) and only what a bind can change is
    read: the driver link, and what a VFIO driver brings with it (`_vfio_capable`). Anything
    else falls back to the full read.

    The IOMMU group is the kernel's from the moment the device is added until it is removed,
    so it is re-read only where a bind or unbind can make or drop one: a function that had
    none yet (an IOMMU probed late, or no-IOMMU VFIO about to make one) and one whose group
    came with a VFIO driver (no-IOMMU VFIO drops its group on unbind). A VFIO device exists
    only under a VFIO-capable driver, so only then is ``vfio-dev`` listed.
    """
    candidate = paths.sys + devpath
    known = paths.identity.get(candidate)
    if known is not None:
        try:
            st = os.stat(candidate)
        except (OSError, ValueError):
            st = None
        if st is not None and st.st_ino == known[1] and st.st_dev == known[0]:
            link = candidate + "/driver"
            if action == "unbind" and not os.access(link, os.F_OK, follow_symlinks=False):
                driver = ""  # what an unbind leaves: no failed readlink (an exception) to pay
            else:
                driver = _intern(link_name(link))
            vfio = bool(driver) and _vfio_capable(driver, variants)
            group, may_go = paths.links.get(candidate, _NO_LINKS)
            if group < 0 or may_go:
                seen_group = parse_group(link_name(candidate + "/iommu_group"))
                # A group that appears under a VFIO driver may be no-IOMMU VFIO's, and go
                # with it; one that appears otherwise, or outlives the VFIO driver, is the
                # IOMMU's, fixed for the directory's life.
                may_go = seen_group >= 0 and vfio
                group = seen_group
                paths.links[candidate] = (group, may_go)
            vfio_dev, vfio_cdev = read_vfio_dev(candidate) if vfio else _NO_VFIO_DEV
            # PciSeen(...) without the NamedTuple's Python-level __new__ (all 13 fields given).
            seen: PciSeen = _tuple_new(PciSeen, (
                addr,
                devpath,
                known[2],
                known[3],
                known[4],
                driver,
                group,
                vfio_dev,
                vfio_cdev,
                # A physical function is one for the directory's life; its VFs come and go.
                read_sriov(candidate) if known[5] else None,
                known[6],
                read_vgpu(candidate) if driver == "nvidia" else None,
                known[7],
            ))
            if not driver and candidate not in paths.plain:
                # Unbound and its group still there: the IOMMU's (see `_remember_plain`).
                _remember_plain(paths, candidate, seen)
            return seen
    return read_function(paths, addr, devpath)


_variant_keys = functools.lru_cache(maxsize=16)(variant_keys)


@functools.lru_cache(maxsize=256)
def _vfio_capable(driver: str, variants: frozenset[str]) -> bool:
    """Whether ``driver`` may register a VFIO device (``vfio-dev``) on its function, or a
    no-IOMMU group: vfio-pci and its variants (`is_vfio_driver`), any driver named for VFIO,
    and nvidia (its vGPU VFs get one once a vGPU type is chosen)."""
    return "vfio" in driver or driver == "nvidia" or is_vfio_driver(driver, variants)


def _read_function_dir(directory: str, addr: str, devpath: str, *, told: bool = True,
                       live: bool = False) -> PciSeen:
    """One function's record. ``told``: a link a capture dropped (``driver``,
    ``iommu_group``) is taken from what the kernel's other files say (`driver_name`,
    `group_name`), as a scan of a copied tree does; a re-read after a uevent, or any read
    of the kernel's own sysfs (`HostPaths.live`), (``told`` False) trusts the links alone:
    a live kernel's links are the truth the moment they change, while a fixture's other
    files may lag behind them. ``live``: the kernel's own sysfs (`read_kernel_attr`)."""
    read = read_kernel_attr if live else read_attr
    klass = _intern(class_prefix(pci_attr(directory, "class", read)))
    driver = _intern(driver_name(directory) if told else link_name(directory + "/driver"))
    vfio_dev, vfio_cdev = read_vfio_dev(directory)
    return PciSeen(
        addr=addr,
        devpath=devpath,
        vendor_id=_intern(pci_id(pci_attr(directory, "vendor", read))),
        device_id=_intern(pci_id(pci_attr(directory, "device", read))),
        klass=klass,
        driver=driver,
        iommu_group=parse_group(group_name(directory) if told
                                else link_name(directory + "/iommu_group")),
        vfio_dev=vfio_dev,
        vfio_cdev=vfio_cdev,
        sriov=read_sriov(directory, recover=told),
        physfn=link_addr(directory + "/physfn"),
        vgpu=read_vgpu(directory) if driver == "nvidia" else None,
        # Only display functions have it: one read more for them, none for the rest.
        boot_vga=is_gpu_class(klass) and read(directory + "/boot_vga") == "1",
    )


def link_addr(path: str) -> str:
    """The PCI address a link such as ``physfn`` or ``virtfn0`` names (a directory copied in
    its place too, see `link_name`); ``""`` when absent or not an address."""
    if not present(path, follow_symlinks=False):
        return ""
    name = link_name(path)
    return name if is_pci_addr(name) else ""


def read_vfio_dev(directory: str) -> tuple[str, str]:
    """``(vfio_dev, cdev path)``: ``vfio-dev/vfioN`` (``noiommu-vfioN`` in a no-IOMMU group)
    and, when that entry has a ``dev`` file (a kernel built with the VFIO device cdev),
    ``/dev/vfio/devices/`` and its name."""
    if not present(directory + "/vfio-dev"):
        return _NO_VFIO_DEV
    names = sorted(n for n in list_dir(directory + "/vfio-dev") if _VFIO_DEV_RE.match(n))
    if not names:
        return "", ""
    name = names[0]
    has_dev = os.path.exists(f"{directory}/vfio-dev/{name}/dev")
    return name, f"/dev/vfio/devices/{name}" if has_dev else ""


def read_sriov(directory: str, *, recover: bool = False) -> SriovSeen | None:
    """A physical function's ``sriov_totalvfs`` and its ``virtfnN`` links in N order.

    ``sriov_numvfs`` is not read: its read takes the device lock, held for the whole of a
    VF enable. The VFs the links name are what the kernel has added so far: their number is
    ``numvfs``, kept where a scan drops a VF that is not in the tree from ``vfs``
    (`vfs_in_tree`). ``recover`` (a scan of any tree): with no ``virtfnN`` link, the VFs a
    capture kept beside the PF are its VFs: those whose ``physfn`` link still names it
    (`vfs_naming`) and those that lost both links (`vfs_beside`).
    """
    path = directory + "/sriov_totalvfs"
    total = read_text(path) if present(path) else None
    if total is None:
        return None
    vfs: list[tuple[int, str]] = []
    for name in list_dir(directory):
        m = _VIRTFN_RE.match(name)
        if m is not None:
            vf = link_addr(f"{directory}/{name}")
            if vf:
                vfs.append((int(m.group(1)), vf))
    totalvfs = small_count(total)
    if recover and not vfs:
        linked = vfs_naming(directory)
        beside = vfs_beside(directory, totalvfs)
        if linked:
            beside = tuple(sorted({*linked, *beside}, key=_rid))
        return SriovSeen(totalvfs=totalvfs, vfs=beside, numvfs=len(beside))
    return SriovSeen(
        totalvfs=totalvfs,
        vfs=tuple(vf for _, vf in sorted(vfs)),
        numvfs=len(vfs),
    )


def vfs_beside(directory: str, totalvfs: int) -> tuple[str, ...]:
    """The VFs of the PF at ``directory`` where a capture dropped both the PF's ``virtfnN``
    and the VFs' ``physfn`` links: VF *i* has routing id PF + ``sriov_offset`` + *i* ·
    ``sriov_stride`` and its folder sits beside the PF's, under the same parent (the kernel
    adds a VF on a higher bus number as a child bus of the PF's, with no bridge of its own).
    VFs are added in index order and removed in reverse, so the run stops at the first
    index with no folder there, one that has a ``physfn`` link (then the kernel's links
    are the truth, and they name none yet), or one whose ``vendor``, or ``device`` against
    ``sriov_vf_device``, is not the VF's. ``sriov_numvfs`` is not read (see `read_sriov`)."""
    parent, _, addr = directory.rpartition("/")
    offset = small_count(read_attr(directory + "/sriov_offset")) if is_pci_addr(addr) else 0
    if not offset or totalvfs <= 0:
        return ()
    domain = addr.split(":", 1)[0]
    first = _rid(addr) + offset
    if first > 0xFFFF or not os.path.isdir(f"{parent}/{_rid_addr(domain, first)}"):
        return ()  # no VF 0: a PF with no VFs (the common case) pays this one look
    stride = small_count(read_attr(directory + "/sriov_stride"))
    vendor = pci_id(pci_attr(directory, "vendor"))
    vf_device = pci_id(read_attr(directory + "/sriov_vf_device"))
    found: list[str] = []
    for i in range(totalvfs if stride else 1):
        rid = first + stride * i
        vf = _rid_addr(domain, rid)
        folder = f"{parent}/{vf}"
        if (rid > 0xFFFF or not os.path.isdir(folder) or os.path.lexists(folder + "/physfn")
                or pci_id(pci_attr(folder, "vendor")) != vendor
                or (vf_device and pci_id(pci_attr(folder, "device")) != vf_device)):
            break
        found.append(vf)
    return tuple(found)


def vfs_naming(directory: str) -> tuple[str, ...]:
    """The functions beside the PF at ``directory`` whose ``physfn`` link (or the folder a
    capture copied in its place) names it, in routing-id order (a VF's index order): a
    copy that dropped the PF's ``virtfnN`` links but kept its VFs' folders with theirs. The
    kernel makes a VF's ``virtfnN`` before its ``physfn`` and removes it first, and its own
    sysfs is never read so (``recover``): only a copy shows this. Only folders past the
    PF's routing id in its domain are looked into (a VF's is PF + ``sriov_offset`` + …,
    ``sriov_offset`` at least 1)."""
    parent, _, addr = directory.rpartition("/")
    if not is_pci_addr(addr):
        return ()
    domain, rid = addr.split(":", 1)[0], _rid(addr)
    found = [name for name in list_dir(parent)
             if is_pci_addr(name) and name.startswith(domain + ":") and _rid(name) > rid
             and os.path.lexists(f"{parent}/{name}/physfn")
             and link_addr(f"{parent}/{name}/physfn") == addr]
    return tuple(sorted(found, key=_rid))


def _rid(addr: str) -> int:
    """The routing id (bus · 256 + device · 8 + function) of a canonical PCI address."""
    _, bus, rest = addr.rsplit(":", 2)
    return int(bus, 16) << 8 | int(rest[:2], 16) << 3 | int(rest[3])


def _rid_addr(domain: str, rid: int) -> str:
    """The address of routing id ``rid`` (bus · 256 + device · 8 + function) in ``domain``."""
    return f"{domain}:{rid >> 8:02x}:{rid >> 3 & 0x1F:02x}.{rid & 7}"


def pf_beside(paths: HostPaths, directory: str) -> str:
    """The PF whose `vfs_beside` names the function at ``directory``: a capture that dropped
    its ``physfn`` link (and the PF's ``virtfnN``) still holds its PF beside it. ``""``
    when none does. Each parent folder is looked through once per `function_entries`."""
    parent, _, addr = directory.rpartition("/")
    owners = paths.beside.get(parent)
    if owners is None:
        owners = {}
        for name in sorted(list_dir(parent)):
            pf = f"{parent}/{name}"
            if (is_pci_addr(name) and os.path.lexists(pf + "/sriov_offset")
                    and not any(_VIRTFN_RE.match(n) for n in list_dir(pf))):
                for vf in vfs_beside(pf, small_count(read_attr(pf + "/sriov_totalvfs"))):
                    owners.setdefault(vf, name)
        if len(paths.beside) >= 256:  # bounded: a long-lived HostPaths reads many folders
            paths.beside.clear()
        paths.beside[parent] = owners
    return owners.get(addr, "")


def read_vgpu(directory: str) -> VgpuSeen | None:
    """NVIDIA vGPU on SR-IOV: ``nvidia/current_vgpu_type`` (an id, 0 for none) and the ids in
    ``nvidia/creatable_vgpu_types`` (``ID : name`` lines, a header line aside)."""
    current = read_text(directory + "/nvidia/current_vgpu_type")
    if current is None:
        return None
    creatable = read_attr(directory + "/nvidia/creatable_vgpu_types")
    ids: list[int] = []
    for line in creatable.splitlines()[:4096]:
        m = _VGPU_ID_RE.match(line)
        if m is not None and len(m.group(1)) <= 9:
            ids.append(int(m.group(1)))
    token = current.split(None, 1)[0] if current.split() else ""
    return VgpuSeen(
        type=small_count(token),
        creatable=tuple(dict.fromkeys(ids)),
    )


def read_vgpus(paths: HostPaths, addrs: list[str] | tuple[str, ...]) -> VgpusSeen:
    """The vGPU files of ``addrs`` only: what the cheap poll re-reads (no uevent says when
    ``current_vgpu_type`` or ``creatable_vgpu_types`` change)."""
    return VgpusSeen(tuple((a, read_vgpu(function_dir(paths, a))) for a in addrs))


def _devpath_of_bus_entry(paths: HostPaths, addr: str) -> str:
    """``/devices/pci0000:00/…/<addr>`` from the bus symlink; the bus path itself when flat.

    ``""`` for a link that leads out of ``sys`` when read as in a chroot at the root
    (`resolve_in_root`: ``..`` stops at the root, an absolute target starts there): only a
    damaged tree has one, nothing of the function is there, and a read through the link
    would read wherever it leads in the host running us."""
    entry = os.path.join(paths.bus_pci, addr)
    try:
        target = os.readlink(entry)
    except OSError:
        # No link: a flat layout's folder, or a tree without the listing (`function_entries`)
        return paths.walked.get(addr) or "/bus/pci/devices/" + addr
    devpath = target[8:]
    if (target.startswith("../../../devices/") and "/." not in devpath and "//" not in devpath
            and devpath[-1] != "/"):
        return devpath  # the kernel's spelling: under sys/devices, no path arithmetic
    return _devpath_of_link(paths, entry, target)


def _devpath_of_link(paths: HostPaths, link: str, target: str) -> str:
    """The devpath (the path under ``sys``) that ``link``, whose target is ``target``, names
    when read as in a chroot at the root: an absolute spelling names a place under the root
    (`in_root`), one that climbs past the root is followed there (`resolve_in_root`). ``""``
    when it leads out of ``sys``."""
    resolved = os.path.normpath(os.path.join(
        os.path.dirname(link) if target[:1] != "/" else paths.root, target.lstrip("/")))
    if not resolved.startswith(paths.sys + "/"):
        try:
            resolved = resolve_in_root(paths.root, link, follow_last=True)
        except (OSError, ValueError):
            return ""
    return resolved[len(paths.sys) :] if resolved.startswith(paths.sys + "/") else ""


def scan_functions(paths: HostPaths) -> list[PciSeen]:
    """Every PCI function listed in ``sys/bus/pci/devices``; non-address entries ignored."""
    found: list[PciSeen] = []
    paths.links.clear()
    paths.identity.clear()  # a full scan is the fresh truth: no older read may outlive it
    paths.plain.clear()
    # Where inode numbers name one directory for good, each directory's identity is taken
    # (one stat, before its reads) so that the first bind/unbind after a scan already reads
    # only its driver link instead of the whole function again.
    stable = paths.stable_inodes()
    live = paths.live
    for name, devpath in function_entries(paths):
        # Read through the resolved directory, not the bus symlink: on sysfs every read
        # through the link pays its resolution again (11 µs against 8 per attribute).
        directory = paths.sys + devpath
        st: os.stat_result | None = None
        if stable:
            try:
                st = os.stat(directory)
            except (OSError, ValueError):
                st = None
        seen = _read_function_dir(directory, name, devpath, told=not live, live=live)
        if seen.vendor_id or seen.device_id or seen.klass:
            if st is not None and stat_mod.S_ISDIR(st.st_mode):
                _remember(paths, directory, st, seen)
            _remember_plain(paths, directory, seen)
            found.append(seen)
            continue
        listed = read_bus_entry(paths, name, devpath)
        if listed is not None:
            found.append(listed)
    return _pfs_of_unlinked_vfs(paths, _vfs_in_tree(found))


def _vfs_in_tree(found: list[PciSeen]) -> list[PciSeen]:
    """``found`` with each PF's VFs only those ``found`` holds (`vfs_in_tree`). On the
    kernel's own sysfs a VF named but not found was added while the scan read: its ``add``
    re-reads the PF."""
    addrs = {seen.addr for seen in found}
    return [seen if seen.sriov is None else seen._replace(sriov=vfs_in_tree(seen.sriov, addrs))
            for seen in found]


def _pfs_of_unlinked_vfs(paths: HostPaths, found: list[PciSeen]) -> list[PciSeen]:
    """``found`` with the PF of each VF a PF's `vfs_beside` named (a capture that dropped the
    VF's ``physfn`` link) set as its ``physfn``."""
    owner = {vf: pf.addr for pf in found if pf.sriov is not None for vf in pf.sriov.vfs}
    out: list[PciSeen] = []
    for seen in found:
        pf = owner.get(seen.addr, "")
        if pf and not seen.physfn:
            seen = seen._replace(physfn=pf)
            paths.plain.pop(paths.sys + seen.devpath, None)  # no longer plain: it is a VF
        out.append(seen)
    return out


def function_entries(paths: HostPaths) -> list[tuple[str, str]]:
    """``(address, devpath)`` of every function ``sys/bus/pci/devices`` lists, in address
    order; non-address entries ignored. A tree whose bus listing is missing or lists no
    function (a capture that left out every link) is walked instead (`walk_functions`)."""
    listed = [(name, _devpath_of_bus_entry(paths, name))
              for name in sorted(list_dir(paths.bus_pci)) if is_pci_addr(name)]
    paths.walked = {} if listed else dict(walk_functions(paths.sys))
    paths.rewalked = None if listed else paths.walked
    paths.beside.clear()
    for i, (name, devpath) in enumerate(listed):
        if devpath.rpartition("/")[2] != name:
            # A link to another address's folder or out of the tree, which no kernel makes:
            # the folder of this address, where a damaged tree still holds one
            # (`read_bus_entry`); none, and the function is not there.
            listed[i] = (name, _rewalk(paths).get(name, devpath))
    return [entry for entry in listed if entry[1]] or sorted(paths.walked.items())


def _rewalk(paths: HostPaths) -> dict[str, str]:
    """`walk_functions`, once per `function_entries`, for a listing that misleads."""
    if paths.rewalked is None:
        paths.rewalked = dict(walk_functions(paths.sys))
    return paths.rewalked


#: PCI root buses (``pci0000:00``, VMD's ``pci10000:00``, Hyper-V's ``pci7d0c:00``): what
#: a walk of ``sys/devices`` looks for, wherever the platform put them.
_ROOT_BUS_RE = re.compile(r"pci[0-9a-f]{4,8}:[0-9a-f]{2}")
#: Bounds of that walk: folders listed, depth below ``sys/devices``, functions found. A real
#: host lists a few thousand folders outside ``devices/virtual`` and ``devices/system``.
WALK_MAX_DIRS = 65536
WALK_MAX_DEPTH = 32
WALK_MAX_FUNCTIONS = 16384
#: Folders that never lead to a root bus of their own: the kernel's non-PCI trees, and the
#: names of links a copier followed into folders (a copy of a device found there is not it).
_WALK_SKIP = frozenset(("virtual", "system", "power", "driver", "subsystem", "device",
                        "firmware_node", "of_node", "iommu", "iommu_group", "physfn",
                        "software", "breakpoint", "tracepoint", "kprobe", "uprobe"))
_WALK_SKIP_PREFIXES = ("physical_node", "supplier:", "consumer:")


def walk_functions(sysdir: str) -> list[tuple[str, str]]:
    """``(address, devpath)`` of the PCI function folders under ``sysdir/devices``, for a tree
    without the bus listing. A function is a folder named as an address, holding ``class``,
    ``vendor`` or ``config``, that sits in a root bus (``pciDDDD:BB``) or in another function (a
    bridge's children; VMD's root bus in its function): a folder of that name anywhere else
    is a copy a capture made of a link. Breadth first, so that the first folder of an
    address is the one nearest ``devices/``; links are never followed (``is_dir`` of the
    entry itself), so the walk stays in the tree and finite; special files are not opened.
    Bounded by `WALK_MAX_DIRS`, `WALK_MAX_DEPTH` and `WALK_MAX_FUNCTIONS`."""
    found: dict[str, str] = {}
    cut = len(sysdir)
    if os.path.islink(sysdir + "/devices"):
        return []  # no kernel makes it a link: one to /sys/devices would leave the tree
    queue: deque[tuple[str, int, bool]] = deque([(sysdir + "/devices", 0, False)])
    listed = 0
    while queue and listed < WALK_MAX_DIRS and len(found) < WALK_MAX_FUNCTIONS:
        folder, depth, in_pci = queue.popleft()
        listed += 1
        try:
            with os.scandir(folder) as entries:
                names = sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
        except (OSError, ValueError):
            continue  # gone under us, unreadable, or not a folder after all
        if depth >= WALK_MAX_DEPTH:
            continue
        for name in names:
            path = folder + "/" + name
            if is_pci_addr(name):
                if (in_pci and name not in found and len(found) < WALK_MAX_FUNCTIONS
                        and (os.path.lexists(path + "/class")
                             or os.path.lexists(path + "/vendor")
                             or os.path.lexists(path + "/config"))):
                    found[name] = path[cut:]
                    queue.append((path, depth + 1, True))
            elif _ROOT_BUS_RE.fullmatch(name):
                queue.append((path, depth + 1, True))
            elif not (in_pci or name in _WALK_SKIP or name.startswith(_WALK_SKIP_PREFIXES)):
                queue.append((path, depth + 1, False))
    return sorted(found.items())


def function_dir(paths: HostPaths, addr: str) -> str:
    """The folder of the function at ``addr``: its bus entry (`in_root`), or in a tree
    without one, where the walk of ``sys/devices`` found it (`function_entries`)."""
    entry = in_root(paths.root, paths.bus_pci + "/" + addr)
    devpath = paths.walked.get(addr)
    if devpath is None or os.path.lexists(entry):
        return entry
    return paths.sys + devpath


def iommu_groups_now(paths: HostPaths, addrs: Iterable[str]) -> dict[str, int]:
    """The IOMMU group number of each function of ``addrs`` that is there (absent: gone),
    read from its ``iommu_group`` link alone; -1 for none, and for no-IOMMU VFIO's own groups
    (named ``vfio-noiommu``, made and dropped with the bind): a switch checks that the
    functions it planned are still there, in the group whose lock it holds."""
    out: dict[str, int] = {}
    for addr in addrs:
        directory = function_dir(paths, addr)
        if not os.path.isdir(directory):
            continue
        group = parse_group(link_name(directory + "/iommu_group"))
        if group >= 0 and read_attr(os.path.join(paths.iommu_groups, str(group),
                                                 "name")) == "vfio-noiommu":
            group = -1
        out[addr] = group
    return out


def copied_entries(paths: HostPaths, addrs: Iterable[str]) -> list[tuple[str, bool]]:
    """``(address, whether its bus entry is a folder)`` of the functions among ``addrs`` that
    show the tree is a copy: a bus entry (``sys/bus/pci/devices/<addr>``) that is a folder,
    not the kernel's link to the device (a tree a capture tool copied with its links
    flattened, or one built flat), or a function folder with no ``vendor`` attribute (one
    copied with ``rsync -a``, which keeps the links and drops every text attribute; its ids
    came from ``config``). Reading such a tree is fine; a write to it (a
    ``driver_override``, an ``unbind``) lands in the copy, never in a device, so the switch
    refuses it. In a live sysfs every bus entry is a link and every function has a
    ``vendor``."""
    found: list[tuple[str, bool]] = []
    for addr in addrs:
        entry = os.path.join(paths.bus_pci, addr)
        if not os.path.islink(entry) and os.path.isdir(entry):
            found.append((addr, True))
            continue
        folder = function_dir(paths, addr)
        if os.path.isdir(folder) and not os.path.lexists(folder + "/vendor"):
            found.append((addr, False))
    return found


def read_listed(paths: HostPaths, name: str, devpath: str) -> PciSeen | None:
    """One function the bus lists, read as a scan reads it; None when its entry dangles."""
    directory = paths.sys + devpath
    seen = _read_function_dir(directory, name, devpath, told=not paths.live, live=paths.live)
    if seen.vendor_id or seen.device_id or seen.klass:
        if not (seen.physfn or paths.live or os.path.lexists(directory + "/physfn")):
            pf = pf_beside(paths, directory)  # a VF whose links a capture dropped
            if pf:
                seen = seen._replace(physfn=pf)
        return seen
    return read_bus_entry(paths, name, devpath)


def read_bus_entry(paths: HostPaths, name: str, devpath: str) -> PciSeen | None:
    """A listed function whose resolved directory held nothing: a root whose components are
    links themselves (the resolution is lexical), or a dangling link (None). Checked only
    then, not with a stat up front.

    The kernel adds the bus entry after the function's folder and removes it before, so an
    entry that leads nowhere (dangling, a file, a loop, a link to another folder) while a
    folder of that address sits in ``sys/devices`` is a damaged tree, not a function going
    away: that folder is read, as the watcher reads it by the DEVPATH of its uevents
    (`_walked_elsewhere`)."""
    entry = in_root(paths.root, paths.bus_pci + "/" + name)
    seen = _read_function_dir(entry, name, devpath)
    if seen.vendor_id or seen.device_id or seen.klass:
        return seen
    elsewhere = _walked_elsewhere(paths, name, devpath)
    if elsewhere is not None:
        return elsewhere
    if not os.path.isdir(entry):
        return None  # dangling link: the function went away under us
    return seen


def _walked_elsewhere(paths: HostPaths, name: str, devpath: str) -> PciSeen | None:
    """The function ``name`` read in the folder a walk of ``sys/devices`` finds for it
    (walked once per `function_entries`, and only for a tree whose listing misleads), when
    that is not ``devpath`` and holds its ids."""
    found = _rewalk(paths).get(name)
    if found is None or found == devpath:
        return None
    seen = _read_function_dir(paths.sys + found, name, found)
    return seen if seen.vendor_id or seen.device_id or seen.klass else None


def outline_function(paths: HostPaths, name: str, devpath: str) -> FunctionOutline | PciSeen | None:
    """What `read_listed` would read of the function's class, IOMMU group and VFIO cdev, in
    three reads of its eight or more: all a direct probe needs of a function whose full
    record it does not report. Without a class, the full read (which decides whether the
    function is there at all)."""
    directory = paths.sys + devpath
    klass = class_prefix(pci_attr(directory, "class"))
    if not klass:
        return read_listed(paths, name, devpath)
    return FunctionOutline(name, devpath, klass,
                           parse_group(group_name(directory)),
                           read_vfio_dev(directory)[1])


def read_console(root: str, gpus: Iterable[tuple[str, str, str]],
                 groups: Mapping[str, int] | None = None) -> HostConsole:
    """`gpuwatch.hostfs.bootvga.listed_console`, for a report that holds no scan (a daemon's
    answers carry neither ``boot_vga`` nor framebuffers): each function read in its folder
    (`function_dir`), a tree without the bus listing walked once for all. ``groups``: each
    GPU's IOMMU group (`gpuwatch.hostfs.bootvga.console_of`)."""
    gpus = list(gpus)
    listed = listed_console(root, gpus, groups)
    if listed is not None:
        return listed
    paths = HostPaths(root)
    if gpus and not any(is_pci_addr(n) for n in list_dir(paths.bus_pci)):
        paths.walked = dict(walk_functions(paths.sys))
    return console_of(gpus, lambda addr: function_dir(paths, addr), groups)


def scan_framebuffers(paths: HostPaths, functions: Sequence[PciSeen]
                      ) -> tuple[FramebufferSeen, ...]:
    """The framebuffer devices beneath each display function that is no SR-IOV virtual
    function (the displays `gpuwatch.core.hostkeep` asks about): one folder listing and a
    look one level down per display, nothing for the other functions."""
    return tuple(FramebufferSeen(name, fn.addr) for fn in functions
                 if is_gpu_class(fn.klass) and not fn.physfn
                 for name in framebuffer_names(function_dir(paths, fn.addr)))


def read_framebuffer(paths: HostPaths, name: str, devpath: str
                     ) -> FramebufferSeen | FramebufferGone:
    """One framebuffer device after its ``graphics`` uevent: there, beneath the PCI function
    its devpath names as a scan finds it (`framebuffer_owner`: ``…/0000:00:02.0/graphics/
    fb0``, ``…/0000:00:01.0/virtio0/graphics/fb0``), or else gone: one beneath no function
    (a virtual one, the firmware's on a platform device, a USB adapter's) is no display's
    console, and a scan records none. A devpath not spelled as the kernel's is taken from
    the ``sys/class/graphics`` entry."""
    if not kernel_devpath(devpath):
        devpath = _class_entry(paths, os.path.join(paths.class_graphics, name))[1]
        if not devpath:
            return FramebufferGone(name)
    addr = framebuffer_owner(devpath)
    if addr and (os.path.isdir(paths.sys + devpath) or _drm_on_bus(paths, devpath)):
        return FramebufferSeen(name, addr)
    return FramebufferGone(name)


# --------------------------------------------------------------------------- DRM


def read_drm(paths: HostPaths, name: str, devpath: str | None = None,
             functions: Mapping[str, PciSeen] | None = None) -> DrmSeen | DrmGone:
    """One DRM minor: at the uevent's DEVPATH (when spelled as the kernel's,
    `kernel_devpath`), else through its ``sys/class/drm`` entry. ``functions``: the PCI
    functions a scan has just read, whose vendor and driver its nodes' devices are (a card
    and its render node name one function: its files are not read again for each)."""
    directory = ""
    if devpath and not kernel_devpath(devpath):
        devpath = None
    if devpath and os.path.isdir(paths.sys + devpath):
        directory = paths.sys + devpath
    else:
        entry = os.path.join(paths.class_drm, name)
        rooted, class_devpath = _class_entry(paths, entry)
        if os.path.isdir(rooted):
            directory = rooted
            devpath = class_devpath
        else:
            devpath = devpath or class_devpath
            directory = _drm_on_bus(paths, devpath) if devpath else ""
    if not directory:
        return DrmGone(name)
    device_name, device = link_in_root(paths.root, directory + "/device")
    if not device_name and not os.path.lexists(directory + "/device"):
        device_name, device = _drm_parent(paths, name, devpath or "")
    function = functions.get(device_name) if functions is not None else None
    # A device copied as a folder in place of the link (a capture) is read there whatever
    # it is: only a PCI function's folder names it (``PCI_SLOT_NAME``), and a virtio or VMBus
    # device's (virtio-gpu's ``virtio0``, Hyper-V's synthetic video) has its own ``vendor``,
    # and a ``driver`` its ``uevent`` names, as through the link.
    copied = not device_name and os.path.isdir(device) and not os.path.islink(device)
    if function is not None:
        vendor, driver = function.vendor_id, function.driver
    elif device_name or copied:
        vendor, driver = pci_id(pci_attr(device, "vendor")), driver_name(device)
    else:
        vendor = driver = ""
    addr = device_name if is_pci_addr(device_name) else ""
    if addr and not vendor:
        # A captured tree can keep the kernel's relative spelling where it no longer resolves
        # (the link was copied into a flattened folder): the bus entry still names the device.
        entry = function_dir(paths, addr)
        vendor, driver = pci_id(pci_attr(entry, "vendor")), driver or driver_name(entry)
    return DrmSeen(
        name=name,
        devpath=devpath or "",
        device_addr=addr,
        device_vendor=vendor,
        device_driver=driver,
    )


def _drm_on_bus(paths: HostPaths, devpath: str) -> str:
    """The node's (a DRM minor's, a framebuffer device's) folder inside the copy of its PCI
    function in ``sys/bus/pci/devices``, for a tree that copied the functions there but not
    ``sys/devices``: the class entry's link then dangles, but its devpath
    (``…/0000:03:00.0/drm/card0``, ``…/0000:00:01.0/virtio0/drm/card0``) names the function
    and the way down from it. ``""`` when not there either."""
    parts = devpath.split("/")
    for i in range(len(parts) - 2, 0, -1):
        if is_pci_addr(parts[i]):
            folder = "/".join((in_root(paths.root, paths.bus_pci + "/" + parts[i]),
                               *parts[i + 1 :]))
            return folder if os.path.isdir(folder) else ""
    return ""


def _drm_parent(paths: HostPaths, name: str, devpath: str) -> tuple[str, str]:
    """``(name, folder)`` of the device a DRM node whose ``device`` link a capture dropped
    hangs under: the kernel puts the node in its parent's ``drm/`` folder, so its devpath
    (``…/0000:03:00.0/drm/card0``; in the flat layout ``/bus/pci/devices/0000:03:00.0/drm/
    card0``, the function's folder being there) names the parent; a node copied as a folder
    (no devpath) is found in the ``drm/`` folder of the PCI function listing it. ``("", "")``
    when neither says."""
    parent, glue, node = devpath.rsplit("/", 2) if devpath.count("/") >= 3 else ("", "", "")
    flat = parent.startswith("/bus/pci/devices/") and is_pci_addr(parent[17:])
    if (glue == "drm" and node == name and (flat or parent.startswith("/devices/"))
            and parent != "/devices/virtual"):  # a virtual node has no parent device
        return parent.rpartition("/")[2], paths.sys + parent
    if devpath:
        return "", ""
    # The functions the bus lists, else (none: a capture that took no link, whatever else
    # the folder holds) those the walk found, as `function_entries` takes them.
    listed = [addr for addr in sorted(list_dir(paths.bus_pci)) if is_pci_addr(addr)]
    for addr in listed or sorted(paths.walked):
        entry = function_dir(paths, addr)
        if os.path.lexists(f"{entry}/drm/{name}"):
            return addr, entry
    return "", ""


def _class_entry(paths: HostPaths, entry: str) -> tuple[str, str]:
    """A ``sys/class`` entry read once: where it leads (`in_root`), and the devpath its link
    spells (``""`` for one that is no link or leads out of ``sys``)."""
    try:
        target = os.readlink(entry)
    except (OSError, ValueError):
        return entry, ""
    return rooted_target(paths.root, entry, target), _devpath_of_link(paths, entry, target)


def scan_drm(paths: HostPaths, functions: Mapping[str, PciSeen] | None = None
             ) -> list[DrmSeen]:
    """Every node ``sys/class/drm`` lists; in a tree that had no bus listing either (a
    capture that left out every link, `function_entries`), every node folder in the
    ``drm/`` folder of a function the walk found. ``functions``: as for `read_drm`."""
    found: list[DrmSeen] = []
    for name in sorted(list_dir(paths.class_drm)):
        if _DRM_NODE_RE.match(name):
            seen = read_drm(paths, name, functions=functions)
            if isinstance(seen, DrmSeen):
                found.append(seen)
    if found or not paths.walked:
        return found
    nodes: dict[str, str] = {}
    for devpath in paths.walked.values():
        for name in list_dir(f"{paths.sys}{devpath}/drm"):
            if _DRM_NODE_RE.match(name):
                nodes.setdefault(name, f"{devpath}/drm/{name}")
    for name, devpath in sorted(nodes.items()):
        seen = read_drm(paths, name, devpath, functions)
        if isinstance(seen, DrmSeen):
            found.append(seen)
    return found


# --------------------------------------------------------------------------- KFD, modules, IOMMU


def read_kfd(paths: HostPaths) -> KfdSeen:
    """The KFD topology nodes in numeric order up to the first with a gfx target version:
    the only one any answer takes (`first_gfx_version`). The watcher reads the topology again
    with every bind and unbind by amdgpu, so the nodes after it are not read at all."""
    base = in_root(paths.root, paths.sys + "/class/kfd/kfd")
    if not os.path.isdir(base):  # a copy without the class link (or with it dangling)
        base = paths.sys + "/devices/virtual/kfd/kfd"
    # amdkfd takes every node folder down and builds them all again, numbered anew, whenever
    # a GPU comes or goes, then counts up generation_id: a read that saw the count change
    # may have mixed two numberings (node 1 gone, node 2 already the next card), so it is
    # made again, as libhsakmt does. A copied tree's count never moves: one read.
    generation = f"{base}/topology/generation_id"
    nodes: list[tuple[int, int]] = []
    for _ in range(_KFD_READ_TRIES):
        before = read_text(generation)
        nodes = _kfd_nodes(base + "/topology/nodes")
        if before is None or read_text(generation) == before:
            break  # (no count to compare: no KFD at all, or a copy without the file)
    return KfdSeen(nodes=tuple(nodes))


#: Reads of the KFD topology while amdkfd keeps renumbering it, before taking the last.
_KFD_READ_TRIES = 3


def _kfd_nodes(base: str) -> list[tuple[int, int]]:
    """One pass over the node folders in numeric order, up to the first GPU's."""
    nodes: list[tuple[int, int]] = []
    for name in sorted((n for n in list_dir(base) if n.isascii() and n.isdigit()), key=int):
        version = parse_gfx_target_version(read_text(f"{base}/{name}/properties") or "")
        nodes.append((int(name), version))
        if version:
            break
    return nodes


def read_modules(paths: HostPaths) -> frozenset[str]:
    return frozenset(list_dir(paths.module))


def read_iommu(paths: HostPaths) -> IommuSeen:
    enabled = bool(list_dir(paths.iommu_groups))
    units = list_dir(paths.class_iommu)
    if not units and not paths.live:
        # A live sysfs lists every IOMMU the kernel registered in the class; only a copy
        # may have lost those links and needs the search of the devices.
        units = iommu_units_in_devices(paths.sys + "/devices")
    host = read_host_kind(paths.root)
    return IommuSeen(enabled=enabled, kind=iommu_kind(units, read_attr(paths.cmdline)),
                     arch=host.arch, hypervisor=host.hypervisor)


#: How far below ``devices/platform`` an IOMMU's own platform device may sit, and how many
#: folders that search lists: a device-tree SoC nests its devices in bus folders
#: (``soc/``, ``soc@0/``, Tegra's ``bus@0/``, ``axi/``), one or two levels deep.
PLATFORM_IOMMU_DEPTH = 3
PLATFORM_IOMMU_MAX_DIRS = 4096


def iommu_units_in_devices(devices: str) -> list[str]:
    """The hardware IOMMUs of a copy without the ``class/iommu`` links, where the kernel
    registers them: Intel's DMAR units with no parent (``virtual/iommu/dmar0``), AMD's under
    the IOMMU's own PCI function on a root bus (``pci0000:00/0000:00:00.2/iommu/ivhd0``), an
    ARM SMMU under its platform device (``platform/arm-smmu-v3.0.auto/iommu/smmu3.0x…``; on
    a device-tree board inside its bus folder, ``platform/soc@0/15000000.iommu/…``,
    ``platform/bus@0/12000000.iommu/…``). A few directory listings, not a walk of the tree:
    the platform folders are searched `PLATFORM_IOMMU_DEPTH` deep, links never followed."""
    units = list_dir(devices + "/virtual/iommu")
    if units:
        return units
    parents: list[str] = []
    for top in list_dir(devices):
        if top.startswith("pci"):
            parents.extend(f"{devices}/{top}/{fn}" for fn in list_dir(f"{devices}/{top}")
                           if is_pci_addr(fn))
    parents.extend(_platform_folders(devices + "/platform"))
    for parent in parents:
        units.extend(list_dir(parent + "/iommu"))
    return units


def _platform_folders(platform: str) -> list[str]:
    """The device folders under ``platform`` down to `PLATFORM_IOMMU_DEPTH`, breadth first
    and bounded by `PLATFORM_IOMMU_MAX_DIRS`: real folders only (a link to a driver, a
    subsystem or a supplier leads elsewhere), and none of the kernel's own glue folders."""
    found: list[str] = []
    queue: deque[tuple[str, int]] = deque([(platform, 0)])
    while queue and len(found) < PLATFORM_IOMMU_MAX_DIRS:
        folder, depth = queue.popleft()
        try:
            with os.scandir(folder) as entries:
                names = sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
        except (OSError, ValueError):
            continue
        for name in names:
            if name in _WALK_SKIP or name.startswith(_WALK_SKIP_PREFIXES):
                continue
            path = f"{folder}/{name}"
            found.append(path)
            if depth + 1 < PLATFORM_IOMMU_DEPTH and not _ROOT_BUS_RE.fullmatch(name):
                queue.append((path, depth + 1))
    return found


def iommu_kind(units: list[str], cmdline: str) -> str:
    """Hardware units first (what the kernel really drives), then what was asked on the cmdline."""
    for unit in sorted(units):
        if unit.startswith("dmar"):
            return "intel"
        if unit.startswith("ivhd"):
            return "amd"
        if "smmu" in unit:
            return "arm"
    if _asked_on(cmdline, "intel_iommu="):
        return "intel"
    if _asked_on(cmdline, "amd_iommu="):
        return "amd"
    return ""


def _asked_on(cmdline: str, param: str) -> bool:
    """Whether the command line turns ``param`` on. The kernel reads its value as a comma
    list (``intel_iommu=on,igfx_off``, ``intel_iommu=on,sm_on``) and each ``on`` or ``off``,
    in order and over repeats of the parameter, overrides the one before."""
    on = False
    for token in cmdline.split():
        if token.startswith(param):
            for option in token[len(param):].split(","):
                if option in ("on", "off"):
                    on = option == "on"
    return on


# --------------------------------------------------------------------------- /dev and CDI


#: The xattr holding a file's access ACL, and the version its binary form starts with.
_ACL_XATTR = "system.posix_acl_access"
_ACL_VERSION = 2
_ACL_HEADER = struct.Struct("<I")
_ACL_ENTRY = struct.Struct("<HHI")


def parse_posix_acl(raw: bytes) -> tuple[tuple[int, int, int], ...]:
    """``(tag, perm, id)`` of each entry of a ``system.posix_acl_access`` value
    (``struct posix_acl_xattr_header`` then ``posix_acl_xattr_entry``s, little-endian);
    ``()`` for anything the kernel would not have written."""
    head = _ACL_HEADER.size
    if (len(raw) < head or (len(raw) - head) % _ACL_ENTRY.size
            or _ACL_HEADER.unpack_from(raw)[0] != _ACL_VERSION):
        return ()
    return tuple((tag, perm & 0o7, ident)
                 for tag, perm, ident in _ACL_ENTRY.iter_unpack(raw[head:]))


def node_stat(paths: HostPaths, host_path: str) -> NodeStat | None:
    """A node's owner and mode, with its POSIX ACL for the VFIO nodes (whose access
    `gpuwatch.core.probes.may_read_write` decides); None when it is absent."""
    try:
        path = paths.under(host_path)
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    acl: tuple[tuple[int, int, int], ...] = ()
    if host_path.startswith("/dev/vfio/"):
        # ENODATA: none (the mode says all); ENOTSUP: a tree without xattrs.
        with contextlib.suppress(OSError):
            acl = parse_posix_acl(os.getxattr(path, _ACL_XATTR))
    return NodeStat(mode=stat_mod.S_IMODE(st.st_mode), uid=st.st_uid, gid=st.st_gid, acl=acl)


def scan_nodes(paths: HostPaths, tables: TablesView) -> NodesSeen:
    """Every device path matching a pattern, plus the VFIO nodes: ``/dev/vfio/<N>`` groups,
    ``/dev/vfio/devices/vfio<N>`` device cdevs and ``/dev/iommu``."""
    found: dict[str, NodeStat] = {}
    escaped_dev = glob.escape(paths.dev)
    for pattern in tables.device_patterns:  # each "/dev/…", no "." or ".." part (`Tables`)
        if not glob.has_magic(pattern):  # one path (/dev/kvm): its stat says it all
            st = node_stat(paths, pattern)
            if st is not None:
                found[pattern] = st
            continue
        for hit in glob.glob(escaped_dev + pattern[len("/dev"):]):
            host_path = "/dev" + hit[len(paths.dev) :]
            st = node_stat(paths, host_path)
            if st is not None:
                found[host_path] = st
    for name in list_dir(os.path.join(paths.dev, "vfio")):
        if name.isascii() and name.isdigit():
            st = node_stat(paths, "/dev/vfio/" + name)
            if st is not None:
                found["/dev/vfio/" + name] = st
    for name in list_dir(os.path.join(paths.dev, "vfio/devices")):
        if _VFIO_DEV_RE.match(name):
            st = node_stat(paths, "/dev/vfio/devices/" + name)
            if st is not None:
                found["/dev/vfio/devices/" + name] = st
    st = node_stat(paths, "/dev/iommu")
    if st is not None:
        found["/dev/iommu"] = st
    return NodesSeen(nodes=tuple(sorted(found.items())))


def cdi_spec_exists(root: str, rel: str) -> bool:
    """Whether the tree holds the spec ``rel``, its links (``var/run`` → ``/run``) read as in
    a chroot at ``root`` (`in_tree`)."""
    path = in_tree(root, rel)
    return bool(path) and os.path.exists(path)


def read_cdi(paths: HostPaths) -> CdiSeen:
    """CDI is reachable when a spec exists or ``nvidia-ctk`` (which can make one) is on PATH:
    the host's PATH with ``host_namespaces`` (`host_which`: the one ``ensure-cdi`` and the
    switch run there, the image has none), else ours."""
    return CdiSeen(
        etc_spec=cdi_spec_exists(paths.root, CDI_SPECS[0]),
        var_spec=cdi_spec_exists(paths.root, CDI_SPECS[1]),
        ctk_on_path=(host_which(paths.root, "nvidia-ctk") is not None
                     if paths.host_namespaces else on_path("nvidia-ctk")),
    )


def on_path(name: str) -> bool:
    """``shutil.which(name) is not None`` (an executable file, not a folder, in a folder of
    ``$PATH``, or of the system's default path when it is unset), asked with one ``access``
    per folder: ``which`` stats each candidate and pays an exception for every folder
    without it, a tenth of a whole scan of a small host, which the CDI poll makes twice a
    second."""
    search = os.environ.get("PATH")
    if search is None:
        try:
            search = os.confstr("CS_PATH") or ""
        except (AttributeError, ValueError):
            search = os.defpath
    for folder in dict.fromkeys(search.split(os.pathsep) if search else ()):
        candidate = os.path.join(folder, name)
        try:
            if os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
                return True
        except ValueError:  # a NUL in $PATH: no file has that name
            continue
    return False


# --------------------------------------------------------------------------- whole host, one event


def scan(paths: HostPaths, tables: TablesView) -> Snapshot:
    return scan_host(paths, tables, tuple(scan_functions(paths)))


def scan_host(paths: HostPaths, tables: TablesView, functions: tuple[PciSeen, ...]) -> Snapshot:
    """The whole host read now but for the PCI functions, which are ``functions``."""
    return Snapshot(
        functions=functions,
        drm=tuple(scan_drm(paths, {f.addr: f for f in functions})),
        framebuffers=scan_framebuffers(paths, functions),
        modules=read_modules(paths),
        kfd=read_kfd(paths),
        nodes=scan_nodes(paths, tables),
        cdi=read_cdi(paths),
        iommu=read_iommu(paths),
    )


def observe(paths: HostPaths, tables: TablesView, event: UEvent) -> list[Observation]:
    """What one uevent says to look at, read now. Sysfs is the truth; the action is a hint
    (for bind/unbind, a hint that only the driver link can have changed: `read_function_known`).

    What sysfs does not keep (PCI error recovery, a DRM wedge, a fresh bind) is not read here:
    `gpuwatch.core.uevent_facts` takes it from every uevent, since the watcher reads each
    device only once per batch but must keep every one of those.
    """
    name = event.devpath.rsplit("/", 1)[-1]
    subsystem = event.subsystem
    out: list[Observation] = []
    devname = event.properties.get("DEVNAME")  # the mapping itself: one call less per event
    if subsystem == "pci":
        addr = name if is_pci_addr(name) else event.get("PCI_SLOT_NAME")
        # Checked once, not twice, per event; `addr is name` holds for two empty strings too.
        if (addr is name and name) or is_pci_addr(addr):
            devpath = event.devpath
            if not (addr is name and devpath.startswith("/devices/")
                    and "//" not in devpath and "/." not in devpath):
                # A hand-written spelling (the bus entry, `..`, another name): the model keeps
                # the device's own path, the one a scan records, however a line spelled it.
                devpath = _devpath_of_bus_entry(paths, addr)
            if event.action in _DRIVER_ACTIONS:
                seen = read_function_known(paths, addr, devpath, event.action,
                                           _variant_keys(tables.vfio_variant_drivers))
            else:
                seen = read_function(paths, addr, devpath)
            out.append(seen)
            if isinstance(seen, PciSeen) and seen.physfn:
                # A VF came, went or rebound: its PF's virtfnN links say so, no PF event does.
                out.append(read_function(paths, seen.physfn))
    elif subsystem == "drm":
        if _DRM_NODE_RE.match(name):
            out.append(read_drm(paths, name, event.devpath))
    elif subsystem == "graphics":
        # A DRM driver's fbdev emulation, or the firmware's framebuffer, came or went: the
        # host's console moved (`gpuwatch.core.hostkeep`). ``fbcon`` is no framebuffer.
        if is_framebuffer(name):
            out.append(read_framebuffer(paths, name, event.devpath))
    elif subsystem == "vfio-dev":
        # .../<addr>/vfio-dev/vfioN. On add the node first, so the function sees it exists;
        # on remove the function first, so it lets go of its cdev in one change.
        if devname and event.action != "remove":
            out.append(_node_seen(paths, devname))
            devname = None
        parts = event.devpath.rsplit("/", 3)
        if len(parts) == 4 and parts[2] == "vfio-dev" and is_pci_addr(parts[1]):
            out.append(read_function(paths, parts[1], parts[0] + "/" + parts[1]))
    elif subsystem == "module":
        if name:
            out.append(ModuleSeen(name, os.path.isdir(os.path.join(paths.module, name))))
            # Loading kvm, fuse, tun… creates misc nodes that send no event we follow.
            out.append(scan_nodes(paths, tables))
    elif subsystem == "kfd":
        out.append(read_kfd(paths))
    if devname:
        out.append(_node_seen(paths, devname))
    return out


def _node_seen(paths: HostPaths, devname: str) -> NodeSeen:
    host_path = devname if devname.startswith("/dev/") else "/dev/" + devname.lstrip("/")
    if "/." in host_path or "//" in host_path:
        # No node the kernel names: a hand-written ``..`` would stat a file out of the tree.
        return NodeSeen(host_path, None)
    return NodeSeen(host_path, node_stat(paths, host_path))
