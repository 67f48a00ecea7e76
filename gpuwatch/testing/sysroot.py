"""Fake Linux host trees (sysfs, procfs, /dev) under a root folder, laid out as the kernel does.

Every test, the benchmarks and the simulated kernel read hosts built here, so the layout must
be the real one: relative symlinks with the kernel's exact ``..`` depth, kernel file formats
(trailing newlines, ``uevent`` lines, KFD ``key value`` lines, ``/proc/<pid>/stat``), and the
same cross links on both sides (``driver`` ↔ ``drivers/<drv>/<addr>``, ``iommu_group`` ↔
``iommu_groups/<N>/devices/<addr>``).

Two rules shape the code:

* Nothing is ever written outside ``root``. Every name that becomes a path component is
  validated, and files are opened with ``O_NOFOLLOW`` so a planted link cannot redirect a write.
* Building must be fast (benchmarks build hosts of thousands of functions), so the hot path is
  plain ``os`` calls on strings; ``pathlib`` only appears at the API edge.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import stat
import struct
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal

from gpuwatch.core.pci import is_driver_name, is_pci_addr
from gpuwatch.errors import CallerError

__all__ = [
    "CDI_SPEC",
    "DeviceExistsError",
    "SysRoot",
    "UnknownDeviceError",
    "copy_attr",
    "example_gpu_host",
    "synthetic_host",
]

Layout = Literal["symlink", "flat"]

DRM_MAJOR = 226
#: The framebuffer devices' major (``FB_MAJOR`` in include/uapi/linux/major.h).
FB_MAJOR = 29
KFD_MAJOR = 238
VFIO_GROUP_MAJOR = 243
VFIO_CDEV_MAJOR = 511

_ROOT_DIRS = (
    "sys/devices",
    "sys/bus/pci/devices",
    "sys/bus/pci/drivers",
    "sys/kernel/iommu_groups",
    "sys/class/drm",
    "sys/class/graphics",
    "sys/class/iommu",
    "sys/module",
    "proc",
    "dev",
    "etc",
    "var/run",
)
_ROOT_COMPLEX_RE = re.compile(r"^(?:/devices/)?(pci[0-9a-f]{4,8}:[0-9a-f]{2})$")
_DRM_MINOR_RE = re.compile(r"^(card|renderD)([0-9]+)$")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:+@-]+$")
_NO_FDS: Mapping[int, str] = MappingProxyType({})

_PROC_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "disk sleep",
    "T": "stopped",
    "t": "tracing stop",
    "X": "dead",
    "Z": "zombie",
    "P": "parked",
    "I": "idle",
}

#: A minimal valid nvidia CDI spec, as nvidia-ctk writes one.
CDI_SPEC = """\
---
cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: "0"
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
- name: GPU-4c5b8a5e-2f0d-4d1b-9c3e-6a7f8e9d0c1b
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
- name: all
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
containerEdits:
  env:
  - NVIDIA_VISIBLE_DEVICES=void
  deviceNodes:
  - path: /dev/nvidiactl
"""

# KFD node properties in the kernel's print order (kfd_topology.c), GPU and CPU defaults.
_KFD_GPU_PROPS: tuple[tuple[str, int], ...] = (
    ("cpu_cores_count", 0),
    ("simd_count", 384),
    ("mem_banks_count", 1),
    ("caches_count", 206),
    ("io_links_count", 1),
    ("p2p_links_count", 0),
    ("cpu_core_id_base", 0),
    ("simd_id_base", 2147487744),
    ("max_waves_per_simd", 16),
    ("lds_size_in_kb", 64),
    ("gds_size_in_kb", 0),
    ("num_gws", 64),
    ("wave_front_size", 32),
    ("array_count", 12),
    ("simd_arrays_per_engine", 2),
    ("cu_per_simd_array", 8),
    ("simd_per_cu", 2),
    ("max_slots_scratch_cu", 32),
    ("gfx_target_version", 0),
    ("vendor_id", 4098),
    ("device_id", 29772),
    ("location_id", 768),
    ("domain", 0),
    ("drm_render_minor", 128),
    ("hive_id", 0),
    ("num_sdma_engines", 2),
    ("num_sdma_xgmi_engines", 0),
    ("num_sdma_queues_per_engine", 6),
    ("num_cp_queues", 8),
    ("max_engine_clk_fcompute", 2482),
    ("local_mem_size", 0),
    ("fw_version", 2250),
    ("capability", 671588992),
    ("debug_prop", 1495),
    ("sdma_fw_version", 21),
    ("unique_id", 0),
    ("num_xcc", 1),
    ("max_engine_clk_ccompute", 2200),
)
_KFD_CPU_OVERRIDES = {
    "cpu_cores_count": 16,
    "simd_count": 0,
    "caches_count": 0,
    "simd_id_base": 0,
    "max_waves_per_simd": 0,
    "lds_size_in_kb": 0,
    "num_gws": 0,
    "wave_front_size": 0,
    "array_count": 0,
    "simd_arrays_per_engine": 0,
    "cu_per_simd_array": 0,
    "simd_per_cu": 0,
    "max_slots_scratch_cu": 0,
    "vendor_id": 0,
    "device_id": 0,
    "location_id": 0,
    "drm_render_minor": 0,
    "num_sdma_engines": 0,
    "num_sdma_queues_per_engine": 0,
    "num_cp_queues": 0,
    "max_engine_clk_fcompute": 0,
    "fw_version": 0,
    "capability": 0,
    "debug_prop": 0,
    "sdma_fw_version": 0,
    "num_xcc": 0,
    "max_engine_clk_ccompute": 3000,
}


class UnknownDeviceError(CallerError, LookupError):
    """The address, devpath or name does not name anything this SysRoot built."""


class DeviceExistsError(CallerError, ValueError):
    """Something with that address or name was already added (remove it first)."""


# --------------------------------------------------------------------------- small helpers


def _kernel_rel(target: str, link: str) -> str:
    """The relative target sysfs gives a link, both paths root-relative and normalised.

    The kernel climbs from the link's directory to the nearest common ancestor of the *target's
    parent*, so a link to an ancestor spells the ancestor's name (``drm/card0/device`` →
    ``../../../0000:00:02.0``) where ``os.path.relpath`` would say ``../..``. Both resolve the
    same; this keeps readlink output identical to a real host.
    """
    tparent, _, tname = target.rpartition("/")
    ldir = link.rpartition("/")[0]
    t = tparent.split("/") if tparent else []
    lparts = ldir.split("/") if ldir else []
    i = 0
    while i < len(t) and i < len(lparts) and t[i] == lparts[i]:
        i += 1
    return "/".join([".."] * (len(lparts) - i) + t[i:] + [tname])


def _write(path: str, data: bytes, mode: int = 0o644) -> None:
    """Create/truncate a regular file without following a final symlink (root containment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def copy_attr(source: str, dest: str) -> None:
    """Copy one attribute file as a capture tool does. A write-only attribute (``bind``,
    ``remove``, mode 0200) cannot be read by anyone on real sysfs, so its copy is an empty
    file of the same mode; under a fixture root only a non-root process is refused, and the
    copy must not depend on who builds it."""
    try:
        shutil.copyfile(source, dest)
    except PermissionError:
        mode = os.stat(source).st_mode & 0o7777
        if mode & 0o444:
            raise  # a readable attribute we may not read is a real error, not a capture rule
        _write(dest, b"", mode)


def _hex(text: str) -> int:
    """Hex id from an attribute string; 0 for garbage so uevents can still be formed."""
    try:
        return int(text.strip(), 16)
    except ValueError:
        return 0


def _check_name(name: str, what: str) -> None:
    """A single safe path component: no separators, no dot-dot, nothing exotic."""
    if not _NAME_RE.match(name) or name in (".", ".."):
        raise ValueError(f"invalid {what}: {name!r}")


def _check_addr(addr: str) -> None:
    if not is_pci_addr(addr):
        raise ValueError(f"not a canonical PCI address: {addr!r}")


def read_small(path: str) -> str:
    """A fixture attribute's text, stripped; ``""`` when absent."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read(4096).strip()
    except OSError:
        return ""


def _as_bytes(text: str | bytes) -> bytes:
    return text if isinstance(text, bytes) else text.encode("utf-8", "surrogateescape")


# --------------------------------------------------------------------------- records


@dataclass(slots=True)
class _Function:
    addr: str
    devpath: str
    rel: str  # root-relative directory, e.g. "sys/devices/pci0000:00/0000:00:02.0"
    vendor: str
    device: str
    klass: str
    subsystem_vendor: str
    subsystem_device: str
    driver: str | None = None
    group: int | None = None
    drm: list[str] = field(default_factory=list)
    vfio_dev: str | None = None  # "vfio3" while a vfio-dev entry exists
    physfn: str | None = None  # a VF's PF address
    virtfns: dict[int, str] = field(default_factory=dict)  # a PF's VFs by index


@dataclass(slots=True)
class _Node:
    """A non-PCI device (drm minor, module, vfio group, kfd, iommu unit) for uevent_props."""

    devpath: str
    rel: str
    props: dict[str, str]
    owner: str | None = None  # PCI address a drm minor hangs under
    dev_node: str | None = None  # root-relative /dev path we created for it


# --------------------------------------------------------------------------- SysRoot


class SysRoot:
    """Builder of a fake host tree under ``root``; every mutation keeps both link sides in step.

    ``layout="flat"`` puts PCI function directories directly in ``sys/bus/pci/devices`` (no
    ``sys/devices`` copy), as some container runtimes expose them; devpaths stay the kernel's.
    """

    def __init__(self, root: str | os.PathLike[str], *, layout: Layout = "symlink") -> None:
        if layout not in ("symlink", "flat"):
            raise ValueError(f"unknown layout: {layout!r}")
        self.root = Path(os.path.abspath(os.fspath(root)))
        self.layout: Layout = layout
        self._r = str(self.root)
        self._fns: dict[str, _Function] = {}
        self._fn_by_devpath: dict[str, _Function] = {}
        self._gone_fns: dict[str, _Function] = {}  # addr and devpath → last state (remove events)
        self._nodes: dict[str, _Node] = {}
        self._gone_nodes: dict[str, _Node] = {}
        self._drm: dict[str, str] = {}  # name → devpath
        self._fbs: dict[str, str] = {}  # framebuffer name → devpath
        self._modules: set[str] = set()
        self._roots: dict[str, str] = {}  # root complex name → its devpath
        self._iommu_units: dict[str, str] = {}  # unit name → its root-relative folder
        self._seqnum = 0
        self._vfio_minor = 0
        for rel in _ROOT_DIRS:
            os.makedirs(self._abs(rel), exist_ok=True)
        self._ensure_file("sys/class/drm/version", b"drm 1.1.0 20060810\n")
        for name in ("drivers_probe", "rescan", "drivers_autoprobe"):
            self._ensure_file(f"sys/bus/pci/{name}", b"1\n" if name == "drivers_autoprobe" else b"")

    # ----------------------------------------------------------------- internals

    def _abs(self, rel: str) -> str:
        return self._r + "/" + rel

    def _ensure_file(self, rel: str, data: bytes) -> None:
        if not os.path.lexists(self._abs(rel)):
            _write(self._abs(rel), data)

    def _link(self, target: str, link: str) -> None:
        """(Re)create ``link`` → ``target`` (both root-relative) the way sysfs spells it."""
        path = self._abs(link)
        try:
            os.symlink(_kernel_rel(target, link), path)
        except FileExistsError:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            os.symlink(_kernel_rel(target, link), path)

    def _unlink(self, rel: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._abs(rel))

    def _fn(self, addr_or_devpath: str) -> _Function:
        fn = self._fns.get(addr_or_devpath) or self._fn_by_devpath.get(addr_or_devpath)
        if fn is None:
            raise UnknownDeviceError(addr_or_devpath)
        return fn

    def _ensure_root(self, name: str) -> str:
        """The devpath of root complex ``name``, made at ``/devices/<name>`` on first use."""
        known = self._roots.get(name)
        if known is not None:
            return known
        self._roots[name] = f"/devices/{name}"
        if self.layout == "symlink":
            os.makedirs(self._abs(f"sys/devices/{name}"), exist_ok=True)
            self._ensure_file(f"sys/devices/{name}/uevent", b"")
        return self._roots[name]

    def add_vmd_domain(self, vmd_addr: str, domain: str = "10000") -> str:
        """A PCI domain behind an Intel VMD controller (``vmd_addr``, bound to ``vmd``): its
        root complex ``pci<domain>:00`` sits *inside* the controller's directory, and the
        functions behind it are named ``<domain>:BB:DD.F`` (5 to 8 hex digits). Returns the
        root complex name, to pass as ``parent``."""
        if not re.fullmatch(r"[0-9a-f]{4,8}", domain):
            raise ValueError(f"not a PCI domain: {domain!r}")
        name = f"pci{domain}:00"
        if name in self._roots:
            raise DeviceExistsError(name)
        vmd = self._fn(vmd_addr)
        self._roots[name] = f"{vmd.devpath}/{name}"
        if self.layout == "symlink":
            os.makedirs(self._abs(f"{vmd.rel}/{name}"), exist_ok=True)
            self._ensure_file(f"{vmd.rel}/{name}/uevent", b"")
        return name

    def add_root_bus(self, name: str, under: str) -> str:
        """A PCI root bus (``pci0002:00``) whose host bridge is a device elsewhere than at the
        top of ``sys/devices``: a device-tree ARM board's PCIe controller
        (``/devices/platform/bus@0/14160000.pcie``), Hyper-V's VMBus channel. ``under`` is
        that device's devpath; its folders are made (each with an empty ``uevent``) when not
        there. Returns the root bus name, to pass as ``parent``."""
        if _ROOT_COMPLEX_RE.fullmatch(name) is None or name.startswith("/"):
            raise ValueError(f"not a root bus name: {name!r}")
        if name in self._roots:
            raise DeviceExistsError(name)
        parts = under.split("/")
        if parts[:2] != ["", "devices"] or len(parts) < 3:
            raise ValueError(f"not a devpath under /devices: {under!r}")
        for part in parts[2:]:
            _check_name(part, "device")
        self._roots[name] = f"{under}/{name}"
        if self.layout == "symlink":
            for depth in range(3, len(parts) + 1):
                rel = "sys" + "/".join(parts[:depth])
                os.makedirs(self._abs(rel), exist_ok=True)
                self._ensure_file(rel + "/uevent", b"")
            os.makedirs(self._abs(f"sys{under}/{name}"), exist_ok=True)
            self._ensure_file(f"sys{under}/{name}/uevent", b"")
        return name

    def _ensure_driver(self, driver: str) -> str:
        rel = f"sys/bus/pci/drivers/{driver}"
        path = self._abs(rel)
        if not os.path.isdir(path):
            os.mkdir(path)
            for name in ("bind", "unbind", "new_id", "remove_id", "uevent"):
                _write(f"{path}/{name}", b"", 0o200 if name != "uevent" else 0o644)
        return rel

    @staticmethod
    def _modalias(fn: _Function) -> str:
        klass = _hex(fn.klass)
        ven, dev = _hex(fn.vendor), _hex(fn.device)
        sven, sdev = _hex(fn.subsystem_vendor), _hex(fn.subsystem_device)
        return (f"pci:v{ven:08X}d{dev:08X}sv{sven:08X}sd{sdev:08X}"
                f"bc{klass >> 16 & 0xFF:02X}sc{klass >> 8 & 0xFF:02X}i{klass & 0xFF:02X}")

    def _uevent_text(self, fn: _Function) -> bytes:
        lines = [f"DRIVER={fn.driver}"] if fn.driver else []
        klass = _hex(fn.klass)
        ven, dev = _hex(fn.vendor), _hex(fn.device)
        sven, sdev = _hex(fn.subsystem_vendor), _hex(fn.subsystem_device)
        lines += [
            f"PCI_CLASS={klass:X}",
            f"PCI_ID={ven:04X}:{dev:04X}",
            f"PCI_SUBSYS_ID={sven:04X}:{sdev:04X}",
            f"PCI_SLOT_NAME={fn.addr}",
            f"MODALIAS={self._modalias(fn)}",
        ]
        return ("\n".join(lines) + "\n").encode()

    def _join_group(self, fn: _Function, group: int) -> None:
        grel = f"sys/kernel/iommu_groups/{group}"
        gpath = self._abs(grel)
        if not os.path.isdir(gpath):
            os.mkdir(gpath)
            os.mkdir(gpath + "/devices")
            _write(gpath + "/type", b"DMA\n")
        self._link(fn.rel, f"{grel}/devices/{fn.addr}")
        self._link(grel, f"{fn.rel}/iommu_group")
        fn.group = group

    def _leave_group(self, fn: _Function) -> None:
        if fn.group is None:
            return
        grel = f"sys/kernel/iommu_groups/{fn.group}"
        self._unlink(f"{grel}/devices/{fn.addr}")
        self._unlink(f"{fn.rel}/iommu_group")
        try:
            empty = not os.listdir(self._abs(grel + "/devices"))
        except FileNotFoundError:
            empty = False
        if empty:  # the kernel frees a group with its last device
            shutil.rmtree(self._abs(grel))
        fn.group = None

    def _dev_rel(self, path: str) -> str:
        parts = path.lstrip("/").split("/")
        if parts[0] != "dev" or len(parts) < 2 or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"not a /dev path: {path!r}")
        return "/".join(parts)

    def _register(self, node: _Node) -> None:
        self._nodes[node.devpath] = node
        self._gone_nodes.pop(node.devpath, None)

    def _retire(self, devpath: str) -> _Node | None:
        node = self._nodes.pop(devpath, None)
        if node is not None:
            self._gone_nodes[devpath] = node
        return node

    # ----------------------------------------------------------------- PCI functions

    @property
    def functions(self) -> tuple[str, ...]:
        """Addresses of the present PCI functions, in the order they were added."""
        return tuple(self._fns)

    def add_bridge(
        self,
        addr: str,
        *,
        parent: str | None = None,
        domain_root: str = "pci0000:00",
        iommu_group: int | None = None,
        vendor: str = "0x8086",
        device: str = "0x1901",
        driver: str | None = "pcieport",
    ) -> str:
        """A PCI-to-PCI bridge (class 0x060400, bound to pcieport like a real root port)."""
        if parent is None:
            m = _ROOT_COMPLEX_RE.match(domain_root)
            if m is None:
                raise ValueError(f"not a root complex name: {domain_root!r}")
            parent = m.group(1)
        return self.add_function(
            addr,
            vendor=vendor,
            device=device,
            klass="0x060400",
            driver=driver,
            iommu_group=iommu_group,
            parent=parent,
            subsystem_vendor=vendor,
            subsystem_device="0x0000",
        )

    def add_function(
        self,
        addr: str,
        *,
        vendor: str = "0x10de",
        device: str = "0x2330",
        klass: str = "0x030000",
        driver: str | None = None,
        iommu_group: int | None = None,
        parent: str | None = None,
        subsystem_vendor: str = "0x10de",
        numa_node: int = -1,
        subsystem_device: str | None = None,
    ) -> str:
        """Add a PCI function and return its DEVPATH.

        ``parent`` is a bridge's address or devpath, or a root complex (``pci0000:40``);
        without one the function sits on root complex ``pci<domain>:00``.
        """
        _check_addr(addr)
        if addr in self._fns:
            raise DeviceExistsError(addr)
        if driver is not None and not is_driver_name(driver):
            raise ValueError(f"invalid driver name: {driver!r}")
        if parent is None:
            root_name = f"pci{addr.rsplit(':', 2)[0]}:00"
        else:
            m = _ROOT_COMPLEX_RE.match(parent)
            root_name = m.group(1) if m else ""
        if root_name:
            devpath = f"{self._ensure_root(root_name)}/{addr}"
        else:
            devpath = f"{self._fn(parent or '').devpath}/{addr}"
        flat = self.layout == "flat"
        rel = f"sys/bus/pci/devices/{addr}" if flat else "sys" + devpath
        fn = _Function(
            addr=addr,
            devpath=devpath,
            rel=rel,
            vendor=vendor,
            device=device,
            klass=klass,
            subsystem_vendor=subsystem_vendor,
            subsystem_device=device if subsystem_device is None else subsystem_device,
        )
        path = self._abs(rel)
        os.mkdir(path)
        files: list[tuple[str, str]] = [
            ("vendor", vendor),
            ("device", device),
            ("class", klass),
            ("subsystem_vendor", subsystem_vendor),
            ("subsystem_device", fn.subsystem_device),
            ("numa_node", str(numa_node)),
            ("driver_override", "(null)"),
            ("enable", "1"),
        ]
        if klass.startswith("0x0300"):
            files.append(("boot_vga", "0"))
        for name, text in files:
            _write(f"{path}/{name}", (text + "\n").encode())
        for name in ("remove", "rescan"):
            _write(f"{path}/{name}", b"", 0o200)
        self._link("sys/bus/pci", rel + "/subsystem")
        if not flat:
            self._link(rel, f"sys/bus/pci/devices/{addr}")
        self._fns[addr] = fn
        self._fn_by_devpath[devpath] = fn
        self._gone_fns.pop(addr, None)
        self._gone_fns.pop(devpath, None)
        if driver is not None:
            drel = self._ensure_driver(driver)
            self._link(drel, rel + "/driver")
            self._link(rel, f"{drel}/{addr}")
            fn.driver = driver
        _write(path + "/uevent", self._uevent_text(fn))
        _write(path + "/modalias", (self._modalias(fn) + "\n").encode())
        if iommu_group is not None:
            self._join_group(fn, iommu_group)
        return devpath

    def devpath(self, addr: str) -> str:
        return self._fn(addr).devpath

    def device_dir(self, addr: str) -> Path:
        return Path(self._abs(self._fn(addr).rel))

    def add_driver(self, driver: str) -> Path:
        """Register a driver with no devices (what ``modprobe vfio-pci`` leaves behind)."""
        if not is_driver_name(driver):
            raise ValueError(f"invalid driver name: {driver!r}")
        return Path(self._abs(self._ensure_driver(driver)))

    def remove_driver(self, driver: str) -> None:
        """Unregister a driver; its devices are unbound first, as module unload does."""
        for fn in list(self._fns.values()):
            if fn.driver == driver:
                self.unbind(fn.addr)
        if is_driver_name(driver):
            shutil.rmtree(self._abs(f"sys/bus/pci/drivers/{driver}"), ignore_errors=True)

    def bind(self, addr: str, driver: str) -> None:
        if not is_driver_name(driver):
            raise ValueError(f"invalid driver name: {driver!r}")
        fn = self._fn(addr)
        if fn.driver is not None and fn.driver != driver:
            self._unlink(f"sys/bus/pci/drivers/{fn.driver}/{addr}")
        drel = self._ensure_driver(driver)
        self._link(drel, fn.rel + "/driver")
        self._link(fn.rel, f"{drel}/{addr}")
        fn.driver = driver
        _write(self._abs(fn.rel + "/uevent"), self._uevent_text(fn))

    def unbind(self, addr: str) -> None:
        fn = self._fn(addr)
        if fn.driver is None:
            return
        if fn.vfio_dev is not None:  # the VFIO device goes with the vfio driver's binding
            self.remove_vfio_dev(addr)
        self._unlink(f"sys/bus/pci/drivers/{fn.driver}/{addr}")
        self._unlink(fn.rel + "/driver")
        fn.driver = None
        _write(self._abs(fn.rel + "/uevent"), self._uevent_text(fn))

    def set_iommu_group(self, addr: str, group: int | None) -> None:
        fn = self._fn(addr)
        if fn.group == group:
            return
        self._leave_group(fn)
        if group is not None:
            self._join_group(fn, group)

    def set_attr(self, addr: str, name: str, content: str | bytes) -> None:
        """Overwrite (or create) any attribute file, e.g. garbage in ``vendor``.

        A link or directory of that name is replaced by the file. The in-memory identity used
        for uevents is left alone: the kernel's own struct does not change when a file lies.
        """
        fn = self._fn(addr)
        parts = name.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"invalid attribute name: {name!r}")
        path = self._abs(f"{fn.rel}/{name}")
        if len(parts) > 1:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        if os.path.islink(path):
            os.unlink(path)
        elif os.path.isdir(path):
            shutil.rmtree(path)
        _write(path, _as_bytes(content))

    def remove_function(self, addr: str) -> None:
        """Remove a function and everything pointing at it; a bridge takes its subtree along."""
        fn = self._fn(addr)
        prefix = fn.devpath + "/"
        children = [c for c in self._fns.values() if c.devpath.startswith(prefix)]
        children.sort(key=lambda c: c.devpath.count("/"), reverse=True)
        for child in [*children, fn]:
            self._remove_one(child)

    def _remove_one(self, fn: _Function) -> None:
        for name in list(fn.drm):
            self.remove_drm(name)
        if fn.vfio_dev is not None:
            self.remove_vfio_dev(fn.addr)
        pf = self._fns.get(fn.physfn) if fn.physfn else None
        if pf is not None:  # the kernel drops the PF's virtfnN link before the VF
            for index, vf in list(pf.virtfns.items()):
                if vf == fn.addr:
                    self._unlink(f"{pf.rel}/virtfn{index}")
                    del pf.virtfns[index]
            _write(self._abs(pf.rel + "/sriov_numvfs"), f"{len(pf.virtfns)}\n".encode())
        if fn.driver is not None:
            self._unlink(f"sys/bus/pci/drivers/{fn.driver}/{fn.addr}")
        group = fn.group
        self._leave_group(fn)
        fn.group = group  # remembered for the remove uevent / post-mortem
        if self.layout == "symlink":
            self._unlink(f"sys/bus/pci/devices/{fn.addr}")
        shutil.rmtree(self._abs(fn.rel), ignore_errors=True)
        del self._fns[fn.addr]
        del self._fn_by_devpath[fn.devpath]
        self._gone_fns[fn.addr] = fn
        self._gone_fns[fn.devpath] = fn

    # ----------------------------------------------------------------- VFIO cdev, SR-IOV, vGPU

    def add_vfio_dev(self, addr: str, index: int, *, cdev: bool = True,
                     noiommu: bool = False) -> str:
        """``<function>/vfio-dev/vfio<index>`` as vfio registers it; with ``cdev`` (a kernel
        built with CONFIG_VFIO_DEVICE_CDEV) its ``dev`` file and ``/dev/vfio/devices/vfioN``.
        ``noiommu``: a device of a no-IOMMU group, which the kernel names ``noiommu-vfioN``.
        Returns the entry's devpath (its uevent: `uevent_props`)."""
        fn = self._fn(addr)
        if index < 0:
            raise ValueError(f"negative vfio device index: {index}")
        if fn.vfio_dev is not None:
            raise DeviceExistsError(f"{addr} already has {fn.vfio_dev}")
        name = f"{'noiommu-' if noiommu else ''}vfio{int(index)}"
        rel = f"{fn.rel}/vfio-dev/{name}"
        path = self._abs(rel)
        os.makedirs(path)
        props: dict[str, str] = {}
        if cdev:
            props = {"MAJOR": str(VFIO_CDEV_MAJOR), "MINOR": str(index),
                     "DEVNAME": f"vfio/devices/{name}"}
            _write(path + "/dev", f"{VFIO_CDEV_MAJOR}:{index}\n".encode())
        _write(path + "/uevent", "".join(f"{k}={v}\n" for k, v in props.items()).encode())
        os.makedirs(self._abs("sys/class/vfio-dev"), exist_ok=True)
        self._link("sys/class/vfio-dev", rel + "/subsystem")
        self._link(fn.rel, rel + "/device")
        self._link(rel, f"sys/class/vfio-dev/{name}")
        devpath = f"{fn.devpath}/vfio-dev/{name}"
        node = _Node(devpath, rel, {"SUBSYSTEM": "vfio-dev", **props}, owner=addr)
        if cdev:
            node.dev_node = self._dev_rel(f"dev/vfio/devices/{name}")
            self.add_dev_node(node.dev_node)
        self._register(node)
        fn.vfio_dev = name
        return devpath

    def remove_vfio_dev(self, addr: str) -> str:
        """Remove the function's ``vfio-dev`` entry (and cdev node); returns its devpath."""
        fn = self._fn(addr)
        if fn.vfio_dev is None:
            raise UnknownDeviceError(f"{addr} has no vfio-dev entry")
        name, fn.vfio_dev = fn.vfio_dev, None
        devpath = f"{fn.devpath}/vfio-dev/{name}"
        node = self._retire(devpath)
        self._unlink(f"sys/class/vfio-dev/{name}")
        shutil.rmtree(self._abs(f"{fn.rel}/vfio-dev"), ignore_errors=True)
        if node is not None and node.dev_node:
            self._unlink(node.dev_node)
        return devpath

    def enable_sriov(self, addr: str, totalvfs: int, *, vf_device: str | None = None,
                     offset: int = 1, stride: int = 1) -> None:
        """Make the function an SR-IOV physical function (the ``sriov_*`` attributes)."""
        fn = self._fn(addr)
        files = {
            "sriov_totalvfs": str(int(totalvfs)),
            "sriov_numvfs": str(len(fn.virtfns)),
            "sriov_offset": str(int(offset)),
            "sriov_stride": str(int(stride)),
            "sriov_vf_device": (vf_device or fn.device).removeprefix("0x"),
            "sriov_drivers_autoprobe": "1",
            "sriov_vf_total_msix": "0",
        }
        for name, text in files.items():
            _write(self._abs(f"{fn.rel}/{name}"), (text + "\n").encode())

    def add_vfs(self, addr: str, count: int, *, driver: str | None = None,
                first_group: int | None = None) -> list[str]:
        """What a write of ``count`` to ``sriov_numvfs`` makes the kernel do: VFs at the PF's
        routing id + offset + stride·i, each with ``physfn`` and the PF's ``virtfnN`` link.
        Each VF gets its own IOMMU group from ``first_group`` on. Returns their addresses."""
        pf = self._fn(addr)
        text = self.device_dir(addr) / "sriov_offset"
        if not text.exists():
            raise ValueError(f"{addr} is not an SR-IOV physical function (enable_sriov first)")
        base = pf.rel
        offset = int(read_small(self._abs(base + "/sriov_offset")) or 1)
        stride = int(read_small(self._abs(base + "/sriov_stride")) or 1)
        vf_device = "0x" + (read_small(self._abs(base + "/sriov_vf_device")) or pf.device[2:])
        domain, bus, rest = addr.split(":")
        slot, func = rest.split(".")
        rid = int(bus, 16) << 8 | int(slot, 16) << 3 | int(func)
        parent = pf.devpath.rsplit("/", 1)[0]
        added: list[str] = []
        for i in range(len(pf.virtfns), len(pf.virtfns) + count):
            vrid = rid + offset + stride * i
            vf_addr = f"{domain}:{vrid >> 8 & 0xFF:02x}:{vrid >> 3 & 0x1F:02x}.{vrid & 7}"
            self.add_function(
                vf_addr, vendor=pf.vendor, device=vf_device, klass=pf.klass, driver=driver,
                iommu_group=None if first_group is None else first_group + i, parent=parent,
                subsystem_vendor=pf.subsystem_vendor, subsystem_device=pf.subsystem_device,
            )
            vf = self._fns[vf_addr]
            vf.physfn = addr
            self._link(pf.rel, vf.rel + "/physfn")
            self._link(vf.rel, f"{pf.rel}/virtfn{i}")
            pf.virtfns[i] = vf_addr
            added.append(vf_addr)
        _write(self._abs(pf.rel + "/sriov_numvfs"), f"{len(pf.virtfns)}\n".encode())
        return added

    def remove_vfs(self, addr: str) -> list[str]:
        """``echo 0 > sriov_numvfs``: every VF removed, last first. Returns their addresses."""
        pf = self._fn(addr)
        gone = [pf.virtfns[i] for i in sorted(pf.virtfns, reverse=True)]
        for vf in gone:
            self.remove_function(vf)
        return gone

    def set_vgpu(self, addr: str, current: int, creatable: Sequence[tuple[int, str]]) -> None:
        """An NVIDIA vGPU VF's ``nvidia/current_vgpu_type`` and ``creatable_vgpu_types``."""
        table = "ID    : vGPU Name\n" + "".join(f"{i:<5} : {name}\n" for i, name in creatable)
        self.set_attr(addr, "nvidia/current_vgpu_type", f"{int(current)}\n")
        self.set_attr(addr, "nvidia/creatable_vgpu_types", table)

    def set_osrelease(self, release: str) -> None:
        _check_name(release, "kernel release")
        os.makedirs(self._abs("proc/sys/kernel"), exist_ok=True)
        _write(self._abs("proc/sys/kernel/osrelease"), (release + "\n").encode())

    def add_modules_alias(self, release: str, text: str) -> Path:
        """``lib/modules/<release>/modules.alias`` (as depmod writes it) and the osrelease."""
        self.set_osrelease(release)
        folder = self._abs(f"lib/modules/{release}")
        os.makedirs(folder, exist_ok=True)
        _write(folder + "/modules.alias", text.encode())
        return Path(folder + "/modules.alias")

    # ----------------------------------------------------------------- DRM

    def add_drm(self, name: str, addr: str | None, *, dev_node: bool = True) -> str:
        """A DRM minor (``card<N>``/``renderD<N>``) under a function; virtual when addr is None."""
        m = _DRM_MINOR_RE.match(name)
        if m is None:
            raise ValueError(f"not a DRM minor name: {name!r}")
        if name in self._drm:
            raise DeviceExistsError(name)
        minor = int(m.group(2))
        fn = None if addr is None else self._fn(addr)
        if fn is None:
            rel = f"sys/devices/virtual/drm/{name}"
            devpath = f"/devices/virtual/drm/{name}"
        else:
            rel = f"{fn.rel}/drm/{name}"
            devpath = f"{fn.devpath}/drm/{name}"
        path = self._abs(rel)
        os.makedirs(path)
        _write(path + "/dev", f"{DRM_MAJOR}:{minor}\n".encode())
        props = {
            "MAJOR": str(DRM_MAJOR),
            "MINOR": str(minor),
            "DEVNAME": f"dri/{name}",
            "DEVTYPE": "drm_minor",
        }
        _write(path + "/uevent", "".join(f"{k}={v}\n" for k, v in props.items()).encode())
        self._link("sys/class/drm", rel + "/subsystem")
        if fn is not None:
            self._link(fn.rel, rel + "/device")
            fn.drm.append(name)
        self._link(rel, f"sys/class/drm/{name}")
        node = _Node(devpath, rel, {"SUBSYSTEM": "drm", **props}, owner=addr)
        if dev_node:
            node.dev_node = self._dev_rel(f"dev/dri/{name}")
            self.add_dev_node(node.dev_node)
        self._register(node)
        self._drm[name] = devpath
        return devpath

    def remove_drm(self, name: str) -> None:
        devpath = self._drm.pop(name, None)
        if devpath is None:
            raise UnknownDeviceError(name)
        node = self._retire(devpath)
        if node is None:
            return
        self._unlink(f"sys/class/drm/{name}")
        shutil.rmtree(self._abs(node.rel), ignore_errors=True)
        if node.dev_node:
            self._unlink(node.dev_node)
        if node.owner is not None:
            fn = self._fns.get(node.owner)
            if fn is not None and name in fn.drm:
                fn.drm.remove(name)
            glue = os.path.dirname(self._abs(node.rel))
            with contextlib.suppress(OSError):
                os.rmdir(glue)  # the kernel drops the empty "drm" glue directory too

    # ----------------------------------------------------------------- framebuffers

    def add_framebuffer(self, name: str, addr: str | None, *, under: str = "",
                        fb_name: str = "", dev_node: bool = True) -> str:
        """A framebuffer device (``fbN``, ``graphics`` class) as register_framebuffer()
        makes it: in the ``graphics/`` folder of function ``addr`` (a DRM driver's fbdev
        emulation), or of the device ``under`` it (``virtio0`` for virtio-gpu,
        ``simple-framebuffer.0`` for the firmware's framebuffer of Linux 6.9 on; a bare
        folder is made for one not there yet); virtual when ``addr`` is None. ``fb_name``:
        its ``name`` attribute (``bochs-drmdrmfb``). Returns its DEVPATH."""
        m = re.fullmatch(r"fb([0-9]+)", name)
        if m is None:
            raise ValueError(f"not a framebuffer name: {name!r}")
        if name in self._fbs:
            raise DeviceExistsError(name)
        if under:
            _check_name(under, "device")
        fn = None if addr is None else self._fn(addr)
        if fn is None:
            parent_rel, parent_devpath = "sys/devices/virtual", "/devices/virtual"
        else:
            parent_rel = fn.rel + (f"/{under}" if under else "")
            parent_devpath = fn.devpath + (f"/{under}" if under else "")
            if under and not os.path.isdir(self._abs(parent_rel)):
                os.makedirs(self._abs(parent_rel))
                _write(self._abs(parent_rel) + "/uevent", b"")
        rel, devpath = f"{parent_rel}/graphics/{name}", f"{parent_devpath}/graphics/{name}"
        path = self._abs(rel)
        os.makedirs(path)
        minor = int(m.group(1))
        props = {"MAJOR": str(FB_MAJOR), "MINOR": str(minor), "DEVNAME": name}
        _write(path + "/dev", f"{FB_MAJOR}:{minor}\n".encode())
        _write(path + "/uevent", "".join(f"{k}={v}\n" for k, v in props.items()).encode())
        _write(path + "/name", f"{fb_name or name}\n".encode())
        self._link("sys/class/graphics", rel + "/subsystem")
        if fn is not None:
            self._link(parent_rel, rel + "/device")
        self._link(rel, f"sys/class/graphics/{name}")
        node = _Node(devpath, rel, {"SUBSYSTEM": "graphics", **props}, owner=addr)
        if dev_node:
            node.dev_node = self._dev_rel(f"dev/{name}")
            self.add_dev_node(node.dev_node)
        self._register(node)
        self._fbs[name] = devpath
        return devpath

    def remove_framebuffer(self, name: str) -> None:
        """What unregister_framebuffer() leaves: the device, its class entry and node gone."""
        devpath = self._fbs.pop(name, None)
        if devpath is None:
            raise UnknownDeviceError(name)
        node = self._retire(devpath)
        if node is None:
            return
        self._unlink(f"sys/class/graphics/{name}")
        shutil.rmtree(self._abs(node.rel), ignore_errors=True)
        if node.dev_node:
            self._unlink(node.dev_node)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self._abs(node.rel)))  # the empty "graphics" glue too

    # ----------------------------------------------------------------- KFD, IOMMU units

    def add_kfd_node(self, node: int, gfx_target_version: int | None, **extra_props: int) -> None:
        """A KFD topology node; GPU defaults when ``gfx_target_version`` is non-zero, else CPU.

        ``None`` omits the ``gfx_target_version`` line (old kernels); ``extra_props`` override
        or append ``key value`` lines.
        """
        if node < 0:
            raise ValueError(f"negative KFD node: {node}")
        base = "sys/devices/virtual/kfd/kfd"
        babs = self._abs(base)
        if not os.path.isdir(babs + "/topology/nodes"):
            os.makedirs(babs + "/topology/nodes")
            _write(babs + "/dev", f"{KFD_MAJOR}:0\n".encode())
            _write(babs + "/uevent", f"MAJOR={KFD_MAJOR}\nMINOR=0\nDEVNAME=kfd\n".encode())
            _write(babs + "/topology/generation_id", b"1\n")
            _write(
                babs + "/topology/system_properties",
                b"platform_oem 0\nplatform_id 0\nplatform_rev 0\n",
            )
            os.makedirs(self._abs("sys/class/kfd"), exist_ok=True)
            self._link(base, "sys/class/kfd/kfd")
            self._link("sys/class/kfd", base + "/subsystem")
            self._register(
                _Node(
                    "/devices/virtual/kfd/kfd",
                    base,
                    {"SUBSYSTEM": "kfd", "MAJOR": str(KFD_MAJOR), "MINOR": "0", "DEVNAME": "kfd"},
                )
            )
        gpu = bool(gfx_target_version)
        props = dict(_KFD_GPU_PROPS)
        if not gpu:
            props.update(_KFD_CPU_OVERRIDES)
        if gfx_target_version is None:
            del props["gfx_target_version"]
        else:
            props["gfx_target_version"] = gfx_target_version
        props.update(extra_props)
        nabs = f"{babs}/topology/nodes/{node}"
        if os.path.isdir(nabs):
            shutil.rmtree(nabs)
        os.makedirs(nabs + "/mem_banks")
        os.mkdir(nabs + "/caches")
        os.mkdir(nabs + "/io_links")
        _write(nabs + "/properties", "".join(f"{k} {v}\n" for k, v in props.items()).encode())
        gpu_id = (node * 7919 + (gfx_target_version or 0)) % 65521 + 1 if gpu else 0
        _write(nabs + "/gpu_id", f"{gpu_id}\n".encode())
        name = ""
        if gpu and gfx_target_version:
            v = gfx_target_version
            name = f"gfx{v // 10000}{v // 100 % 100}{v % 100:x}"
        _write(nabs + "/name", f"{name}\n".encode())

    def remove_kfd_node(self, node: int) -> None:
        shutil.rmtree(
            self._abs(f"sys/devices/virtual/kfd/kfd/topology/nodes/{int(node)}"),
            ignore_errors=True,
        )

    def add_iommu_unit(self, name: str, *, at: str | None = None) -> None:
        """A hardware IOMMU (``dmar0``, ``ivhd0``, ``smmu3.0x…``) in sys/class/iommu, its
        folder where the kernel registers it: with no parent (``at`` None: Intel's DMAR units,
        ``devices/virtual/iommu``), under the IOMMU's own PCI function (``at`` an address
        added before: AMD's ``0000:00:00.2/iommu/ivhd0``), or under a platform device
        (``at`` its name, made here: an ARM SMMU's ``platform/arm-smmu-v3.0.auto/iommu/…``;
        on a device-tree board its path below ``platform``, ``bus@0/12000000.iommu``)."""
        _check_name(name, "IOMMU unit name")
        if at is None:
            parent = "sys/devices/virtual"
        elif at in self._fns:
            parent = self._fns[at].rel
        else:
            parent = "sys/devices/platform"
            for part in at.split("/"):
                _check_name(part, "platform device name")
                parent += "/" + part
                os.makedirs(self._abs(parent), exist_ok=True)
                self._ensure_file(parent + "/uevent", b"")
        rel = f"{parent}/iommu/{name}"
        os.makedirs(self._abs(rel + "/devices"), exist_ok=True)
        _write(self._abs(rel + "/uevent"), b"")
        self._link("sys/class/iommu", rel + "/subsystem")
        self._link(rel, f"sys/class/iommu/{name}")
        self._iommu_units[name] = rel
        self._register(_Node("/" + rel[len("sys/"):], rel, {"SUBSYSTEM": "iommu"}))

    def remove_iommu_unit(self, name: str) -> None:
        _check_name(name, "IOMMU unit name")
        rel = self._iommu_units.pop(name, f"sys/devices/virtual/iommu/{name}")
        self._unlink(f"sys/class/iommu/{name}")
        shutil.rmtree(self._abs(rel), ignore_errors=True)
        self._retire("/" + rel[len("sys/"):])

    # ----------------------------------------------------------------- modules

    def add_module(self, name: str, *, refcnt: int = 0, holders: Sequence[str] = ()) -> str:
        """A loaded module; ``holders/<h>`` are links to ``../../<h>`` as the kernel makes them."""
        _check_name(name, "module name")
        for holder in holders:
            _check_name(holder, "module name")
        rel = f"sys/module/{name}"
        path = self._abs(rel)
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.makedirs(path + "/holders")
        _write(path + "/refcnt", f"{refcnt}\n".encode())
        _write(path + "/initstate", b"live\n")
        _write(path + "/uevent", b"", 0o200)
        for holder in holders:
            self._link(f"sys/module/{holder}", f"{rel}/holders/{holder}")
        self._modules.add(name)
        devpath = f"/module/{name}"
        self._register(_Node(devpath, rel, {"SUBSYSTEM": "module"}))
        return devpath

    def remove_module(self, name: str) -> None:
        """Unload: the module's directory and its entry in other modules' ``holders``."""
        _check_name(name, "module name")
        shutil.rmtree(self._abs(f"sys/module/{name}"), ignore_errors=True)
        self._modules.discard(name)
        for other in self._modules:
            self._unlink(f"sys/module/{other}/holders/{name}")
        self._retire(f"/module/{name}")

    # ----------------------------------------------------------------- /dev, vfio, CDI

    def add_dev_node(self, path: str) -> Path:
        """An empty regular file standing for a device node (``/dev/kvm`` or ``dev/kvm``)."""
        rel = self._dev_rel(path)
        full = self._abs(rel)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        os.close(fd)
        return Path(full)

    def remove_dev_node(self, path: str) -> None:
        self._unlink(self._dev_rel(path))

    def add_vfio_group(self, group: int, *, mode: int = 0o600) -> str:
        """``/dev/vfio/<group>`` (with ``mode``) plus its sysfs class device; returns devpath."""
        if group < 0:
            raise ValueError(f"negative IOMMU group: {group}")
        group = int(group)
        container = self._abs("dev/vfio/vfio")
        if not os.path.lexists(container):
            self.add_dev_node("dev/vfio/vfio")
            os.chmod(container, 0o666)
        node_path = self.add_dev_node(f"dev/vfio/{group}")
        os.chmod(node_path, mode)
        rel = f"sys/devices/virtual/vfio/{group}"
        path = self._abs(rel)
        os.makedirs(path, exist_ok=True)
        minor = self._vfio_minor
        self._vfio_minor += 1
        props = {"MAJOR": str(VFIO_GROUP_MAJOR), "MINOR": str(minor), "DEVNAME": f"vfio/{group}"}
        _write(path + "/dev", f"{VFIO_GROUP_MAJOR}:{minor}\n".encode())
        _write(path + "/uevent", "".join(f"{k}={v}\n" for k, v in props.items()).encode())
        os.makedirs(self._abs("sys/class/vfio"), exist_ok=True)
        self._link("sys/class/vfio", rel + "/subsystem")
        self._link(rel, f"sys/class/vfio/{group}")
        devpath = f"/devices/virtual/vfio/{group}"
        node = _Node(devpath, rel, {"SUBSYSTEM": "vfio", **props}, dev_node=f"dev/vfio/{group}")
        self._register(node)
        return devpath

    def remove_vfio_group(self, group: int) -> None:
        group = int(group)
        self._unlink(f"dev/vfio/{group}")
        self._unlink(f"sys/class/vfio/{group}")
        shutil.rmtree(self._abs(f"sys/devices/virtual/vfio/{group}"), ignore_errors=True)
        self._retire(f"/devices/virtual/vfio/{group}")

    def _cdi_rel(self, where: Literal["etc", "var"]) -> str:
        if where == "etc":
            return "etc/cdi/nvidia.yaml"
        if where == "var":
            return "var/run/cdi/nvidia.yaml"
        raise ValueError(f"CDI location must be 'etc' or 'var', not {where!r}")

    def add_cdi_spec(
        self, where: Literal["etc", "var"] = "etc", *, content: str | None = None
    ) -> Path:
        """A minimal valid nvidia CDI spec (or ``content`` verbatim) where nvidia-ctk puts it."""
        full = self._abs(self._cdi_rel(where))
        os.makedirs(os.path.dirname(full), exist_ok=True)
        _write(full, (CDI_SPEC if content is None else content).encode())
        return Path(full)

    def remove_cdi_spec(self, where: Literal["etc", "var"] = "etc") -> None:
        self._unlink(self._cdi_rel(where))

    # ----------------------------------------------------------------- procfs

    def set_cmdline(self, text: str) -> None:
        _write(self._abs("proc/cmdline"), (text if text.endswith("\n") else text + "\n").encode())

    def set_cpuinfo(self, text: str) -> None:
        """``proc/cpuinfo`` (`gpuwatch.testing.machines.x86_cpuinfo`, ``ARM64_CPUINFO``): the
        CPU's architecture, and on x86 whether the ``hypervisor`` flag says it is a guest."""
        _write(self._abs("proc/cpuinfo"), text.encode())

    def set_dmi(self, sys_vendor: str, product_name: str) -> None:
        """The firmware's DMI strings where the kernel keeps them (``devices/virtual/dmi/id``)
        and its ``class/dmi/id`` link: a guest's name its hypervisor (``QEMU``, ``Microsoft
        Corporation``/``Virtual Machine``)."""
        rel = "sys/devices/virtual/dmi/id"
        os.makedirs(self._abs(rel), exist_ok=True)
        for name, text in (("sys_vendor", sys_vendor), ("product_name", product_name)):
            _write(self._abs(f"{rel}/{name}"), (text + "\n").encode())
        os.makedirs(self._abs("sys/class/dmi"), exist_ok=True)
        self._link(rel, "sys/class/dmi/id")

    def set_boot_id(self, boot_id: str) -> None:
        os.makedirs(self._abs("proc/sys/kernel/random"), exist_ok=True)
        _write(self._abs("proc/sys/kernel/random/boot_id"), (boot_id.strip() + "\n").encode())

    def add_process(
        self,
        pid: int,
        comm: str | bytes,
        *,
        fds: Mapping[int, str] = _NO_FDS,
        maps: Sequence[str] = (),
        state: str = "S",
        stack: str = "",
    ) -> None:
        """``/proc/<pid>`` with comm, fd links, maps, stat, status, stack (replacing any old one).

        fd targets are absolute *host* strings (``/dev/nvidia0``, ``socket:[123]``) and are not
        rebased under root, as on a real host. A ``maps`` entry that is only a path is expanded
        into a full maps line; anything else is written verbatim.
        """
        pid = int(pid)
        if pid <= 0:
            raise ValueError(f"invalid pid: {pid}")
        if state not in _PROC_STATES:
            raise ValueError(f"unknown process state: {state!r}")
        raw = _as_bytes(comm)
        base = self._abs(f"proc/{pid}")
        if os.path.lexists(base):
            shutil.rmtree(base)
        os.makedirs(base + "/fd")
        _write(base + "/comm", raw + b"\n")
        _write(base + "/cmdline", raw + b"\0")
        for fd, target in fds.items():
            if int(fd) < 0:
                raise ValueError(f"invalid fd: {fd}")
            os.symlink(target, f"{base}/fd/{int(fd)}")
        lines: list[str] = []
        for i, entry in enumerate(maps):
            if entry.startswith(("/", "[")):
                start = 0x7F0000000000 + i * 0x10000
                lines.append(f"{start:x}-{start + 0x1000:x} rw-s 00000000 00:05 {1000 + i} {entry}")
            else:
                lines.append(entry)
        _write(base + "/maps", "".join(line + "\n" for line in lines).encode())
        tail = (
            f" {state} 1 {pid} {pid} 0 -1 4194560 120 0 0 0 3 1 0 0 20 0 1 0 4242 "
            "12345678 256 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0 "
            "0 0 0 0 0 0 0 0\n"
        )
        _write(base + "/stat", f"{pid} (".encode() + raw + b")" + tail.encode())
        name = raw.replace(b"\\", b"\\\\").replace(b"\n", b"\\n")
        status = (
            f"\nUmask:\t0022\nState:\t{state} ({_PROC_STATES[state]})\nTgid:\t{pid}\n"
            f"Ngid:\t0\nPid:\t{pid}\nPPid:\t1\nTracerPid:\t0\nUid:\t0\t0\t0\t0\n"
            f"Gid:\t0\t0\t0\t0\nFDSize:\t64\nGroups:\t\nVmRSS:\t    1024 kB\nThreads:\t1\n"
        )
        _write(base + "/status", b"Name:\t" + name + status.encode())
        _write(base + "/stack", stack.encode(), 0o400)

    def add_thread(self, pid: int, tid: int, comm: str | bytes, *, state: str = "S",
                   stack: str = "") -> None:
        """``/proc/<pid>/task/<tid>`` of a process `add_process` made: a thread with its own
        comm, state (``stat``) and kernel stack, as the kernel shows each thread apart (a
        worker thread stuck in an unbind while the main thread sleeps)."""
        pid, tid = int(pid), int(tid)
        if tid <= 0 or tid == pid:
            raise ValueError(f"invalid thread id: {tid}")
        if state not in _PROC_STATES:
            raise ValueError(f"unknown process state: {state!r}")
        base = self._abs(f"proc/{pid}")
        if not os.path.isdir(base):
            raise ValueError(f"no process {pid}: add_process it first")
        raw = _as_bytes(comm)
        task = f"{base}/task/{tid}"
        if os.path.lexists(task):
            shutil.rmtree(task)
        os.makedirs(task)
        _write(task + "/comm", raw + b"\n")
        _write(task + "/stat", f"{tid} (".encode() + raw + f") {state} 1 {pid} {pid} 0 -1 "
               "4194624 120 0 0 0 3 1 0 0 20 0 4 0 4242\n".encode())
        _write(task + "/stack", stack.encode(), 0o400)

    def remove_process(self, pid: int) -> None:
        shutil.rmtree(self._abs(f"proc/{int(pid)}"), ignore_errors=True)

    # ----------------------------------------------------------------- captured trees

    def flatten_link(self, rel: str, *, nested: Sequence[str] = ()) -> None:
        """Do to one link what capture tools do when they copy a host's sysfs: replace the
        symlink at ``rel`` (root-relative, e.g. ``sys/class/drm/card0/device``) with a real
        directory holding a copy of what it points to. Files are copied; links inside keep
        the kernel's relative spelling (from their new place they may no longer resolve),
        except those named in ``nested`` (``driver``, ``iommu_group``…), flattened in turn.
        """
        parts = rel.split("/")
        if not rel or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"invalid path: {rel!r}")
        path = self._abs(rel)
        if not os.path.islink(path):
            raise ValueError(f"not a link: {rel!r}")
        target = os.path.realpath(path)
        if not (target + "/").startswith(self._r + "/") or not os.path.isdir(target):
            raise ValueError(f"{rel!r} does not lead to a folder under the root")
        os.unlink(path)
        self._copy_flat(target, path, frozenset(nested), depth=0)

    def _copy_flat(self, source: str, dest: str, nested: frozenset[str], depth: int) -> None:
        os.mkdir(dest)
        for entry in os.scandir(source):
            out = f"{dest}/{entry.name}"
            if entry.is_symlink():
                real = os.path.realpath(entry.path)
                if entry.name in nested and depth < 4 and os.path.isdir(real):
                    self._copy_flat(real, out, nested, depth + 1)
                else:
                    os.symlink(os.readlink(entry.path), out)
            elif entry.is_dir():
                shutil.copytree(entry.path, out, symlinks=True, copy_function=copy_attr)
            elif entry.is_file():
                copy_attr(entry.path, out)

    def capture(self, *, nested: Sequence[str] = ("device", "driver", "iommu_group")) -> None:
        """The whole tree as a capture tool leaves it: every ``sys/class/drm/*`` node, every
        ``sys/class/graphics/*`` framebuffer and every ``sys/bus/pci/devices/*`` entry a real
        directory (`flatten_link`), with their
        ``device``, ``driver`` and ``iommu_group`` links flattened too. The builder's own
        bookkeeping stays as it was: call it last."""
        for base in ("sys/class/drm", "sys/class/graphics", "sys/bus/pci/devices",
                     "sys/class/kfd"):
            for name in sorted(os.listdir(self._abs(base)) if os.path.isdir(self._abs(base))
                               else ()):
                if os.path.islink(self._abs(f"{base}/{name}")):
                    self.flatten_link(f"{base}/{name}", nested=nested)

    def pad_like_tar(self, size: int = 4096) -> None:
        """What GNU tar leaves of sysfs attributes: it archives the ``size`` bytes ``stat``
        reports for every attribute (4096), gets a shorter read, and pads the rest with NUL
        bytes ("File shrank by N bytes; padding with zeros"). Every regular file under
        ``sys/`` shorter than ``size`` is padded so. Call it last, after `capture` for a
        ``tar -h`` (links followed) capture."""
        for dirpath, _dirs, files in os.walk(self._abs("sys")):
            for name in files:
                path = f"{dirpath}/{name}"
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode) or st.st_size >= size:
                    continue
                os.chmod(path, 0o600)
                with open(path, "r+b") as f:
                    f.seek(0, os.SEEK_END)
                    f.write(b"\0" * (size - st.st_size))
                os.chmod(path, stat.S_IMODE(st.st_mode))

    def add_config(self, *, size: int = 256) -> None:
        """A ``config`` file for every present function, as sysfs hands config space out:
        its first ``size`` bytes (64 to a non-root reader, 256 or 4096 to root), made of the
        function's ids. Header type 1 for a bridge (class 0x0604), with a Subsystem ID
        capability at 0x40 naming its subsystem ids; 0 otherwise."""
        for fn in self._fns.values():
            config = bytearray(max(size, 0x48))
            klass = _hex(fn.klass)
            struct.pack_into("<HHIB", config, 0, _hex(fn.vendor), _hex(fn.device), 0, 0)
            config[9:12] = klass.to_bytes(3, "little")
            sven, sdev = _hex(fn.subsystem_vendor), _hex(fn.subsystem_device)
            if klass >> 8 == 0x0604:
                config[0x0E] = 1
                config[0x06] = 0x10  # a capability list, at 0x40: Subsystem ID
                config[0x34] = 0x40
                struct.pack_into("<BBHHH", config, 0x40, 0x0D, 0, 0, sven, sdev)
            else:
                struct.pack_into("<HH", config, 0x2C, sven, sdev)
            path = self._abs(fn.rel + "/config")
            _write(path, bytes(config[:size]))

    def drop_like_rsync(self) -> None:
        """What ``rsync -a`` leaves of sysfs: every link, and of the regular files only those
        whose read fills the size ``stat`` reports (``config``, see `add_config`): each text
        attribute reports 4096 bytes, reads fewer, and is dropped. Call it last."""
        for dirpath, _dirs, files in os.walk(self._abs("sys")):
            for name in files:
                path = f"{dirpath}/{name}"
                if name != "config" and stat.S_ISREG(os.lstat(path).st_mode):
                    os.unlink(path)

    # ----------------------------------------------------------------- uevents

    def uevent_props(self, action: str, addr_or_devpath: str, **extra: str) -> dict[str, str]:
        """The property map the kernel would broadcast for this device now.

        Works after removal too (the last state is kept), so a test can remove a function and
        then emit its ``remove`` event. ``extra`` adds or overrides keys; SEQNUM increments.
        """
        key = addr_or_devpath
        fn = (
            self._fns.get(key)
            or self._fn_by_devpath.get(key)
            or (None if key in self._nodes else self._gone_fns.get(key))
        )
        props: dict[str, str] = {"ACTION": action}
        if fn is not None:
            props["DEVPATH"] = fn.devpath
            props["SUBSYSTEM"] = "pci"
            for line in self._uevent_text(fn).decode().splitlines():
                k, _, v = line.partition("=")
                if k == "DRIVER" and action in ("unbind", "remove"):
                    continue
                props[k] = v
        else:
            node = self._nodes.get(key) or self._gone_nodes.get(key)
            if node is None:
                raise UnknownDeviceError(key)
            props["DEVPATH"] = node.devpath
            props.update(node.props)
        props.update(extra)
        if "SEQNUM" not in extra:
            self._seqnum += 1
            props["SEQNUM"] = str(self._seqnum)
        return props


# --------------------------------------------------------------------------- canned hosts

EXAMPLE_BOOT_ID = "6a8f1d9e-3c2b-4f5a-9e7d-0b1c2d3e4f50"


def example_gpu_host(root: str | os.PathLike[str], *, layout: Layout = "symlink") -> SysRoot:
    """A typical Intel passthrough workstation: NVIDIA dGPU + HDMI audio, iGPU, one NIC.

    Functions: 00:00.0 host bridge (group 1), 00:01.0 root port (group 2), 00:02.0 iGPU (i915,
    group 0, boot_vga), 00:1c.0 PCH root port (group 9), 01:00.0 GPU (nvidia, group 13),
    01:00.1 audio (snd_hda_intel, group 13), 02:00.0 NIC (igb, group 14).
    """
    s = SysRoot(root, layout=layout)
    s.add_function(
        "0000:00:00.0",
        vendor="0x8086",
        device="0x3e30",
        klass="0x060000",
        subsystem_vendor="0x1458",
        subsystem_device="0x5000",
        iommu_group=1,
        numa_node=-1,
    )
    s.add_bridge("0000:00:01.0", iommu_group=2)
    s.add_function(
        "0000:00:02.0",
        vendor="0x8086",
        device="0x3e92",
        klass="0x030000",
        driver="i915",
        iommu_group=0,
        subsystem_vendor="0x1458",
        subsystem_device="0xd000",
    )
    s.set_attr("0000:00:02.0", "boot_vga", "1\n")
    s.add_bridge("0000:00:1c.0", device="0xa290", iommu_group=9)
    s.add_function(
        "0000:01:00.0",
        parent="0000:00:01.0",
        vendor="0x10de",
        device="0x2204",
        klass="0x030000",
        driver="nvidia",
        iommu_group=13,
        subsystem_vendor="0x1458",
        subsystem_device="0x403b",
    )
    s.add_function(
        "0000:01:00.1",
        parent="0000:00:01.0",
        vendor="0x10de",
        device="0x1aef",
        klass="0x040300",
        driver="snd_hda_intel",
        iommu_group=13,
        subsystem_vendor="0x1458",
        subsystem_device="0x403b",
    )
    s.add_function(
        "0000:02:00.0",
        parent="0000:00:1c.0",
        vendor="0x8086",
        device="0x1533",
        klass="0x020000",
        driver="igb",
        iommu_group=14,
        subsystem_vendor="0x8086",
        subsystem_device="0x0001",
    )
    s.add_drm("card0", "0000:00:02.0")
    s.add_drm("renderD128", "0000:00:02.0")
    s.add_drm("card1", "0000:01:00.0")
    s.add_drm("renderD129", "0000:01:00.0")
    s.add_iommu_unit("dmar0")
    s.set_cmdline("intel_iommu=on iommu=pt")
    s.add_module("nvidia", refcnt=2, holders=("nvidia_modeset", "nvidia_uvm"))
    s.add_module("nvidia_modeset", refcnt=1, holders=("nvidia_drm",))
    s.add_module("nvidia_drm", refcnt=0)
    s.add_module("nvidia_uvm", refcnt=0)
    s.add_module("vfio", refcnt=1, holders=("vfio_pci",))
    s.add_module("vfio_pci", refcnt=0)
    for node in ("/dev/kvm", "/dev/vhost-net", "/dev/fuse", "/dev/net/tun", "/dev/nvidia0",
                 "/dev/nvidiactl"):
        s.add_dev_node(node)
    s.add_cdi_spec("etc")
    s.set_boot_id(EXAMPLE_BOOT_ID)
    return s


# (vendor, gpu device, audio device, native driver, gfx_target_version for AMD)
_GPU_MODELS: tuple[tuple[str, str, str, str, int], ...] = (
    ("0x10de", "0x2204", "0x1aef", "nvidia", 0),  # RTX 3090
    ("0x10de", "0x2684", "0x22ba", "nvidia", 0),  # RTX 4090
    ("0x1002", "0x744c", "0xab30", "amdgpu", 110000),  # RX 7900 XTX, gfx1100
    ("0x1002", "0x73bf", "0xab28", "amdgpu", 100300),  # RX 6900 XT, gfx1030
    ("0x8086", "0x56a0", "0x4f90", "i915", 0),  # Arc A770
)
_GPU_WEIGHTS = (3, 2, 2, 1, 2)
# single endpoint kinds: (vendor, device, class, driver, functions)
_NIC_MODELS = (("0x8086", "0x10fb", "ixgbe"), ("0x15b3", "0x1017", "mlx5_core"))
_INTEGRATED = (
    ("0x1022", "0x790b", "0x0c0500", "piix4_smbus"),
    ("0x1022", "0x790e", "0x060100", None),
    ("0x1022", "0x7901", "0x010601", "ahci"),
    ("0x1022", "0x148a", "0x130000", None),
)
_PORTS_PER_ROOT = 63  # downstream buses root_bus+1 … root_bus+0x3f
_INTEGRATED_SLOTS = 128  # root-bus devices 0x10-0x1f, eight functions each


@dataclass(slots=True)
class _RootComplex:
    domain: int
    bus: int
    name: str
    numa: int
    ports: int = 0
    integrated: int = 0


def synthetic_host(
    root: str | os.PathLike[str], n_functions: int, *, seed: int = 0, layout: Layout = "symlink"
) -> SysRoot:
    """A deterministic, realistic host of exactly ``n_functions`` PCI functions (benchmarks).

    Four root complexes per PCI domain (``pciDDDD:00/40/80/c0``), each with a host bridge and
    up to 63 root ports. Behind the ports: GPUs with HDMI audio in one IOMMU group (about 1/8 of
    all functions are GPUs; some bound to vfio-pci with a /dev/vfio node, some unbound, the
    rest native with DRM card+render nodes, KFD nodes for AMD), dual-port NICs, NVMe and USB
    controllers. Integrated root-bus devices and host bridges pad to the exact count.
    """
    if n_functions < 0:
        raise ValueError(f"negative function count: {n_functions}")
    rng = random.Random(seed)
    s = SysRoot(root, layout=layout)
    budget = n_functions
    used = 0
    gpus = 0
    group = 0
    rc: _RootComplex | None = None
    rc_index = 0
    card = 0
    kfd_node = 1
    native_drivers: set[str] = set()
    drivers: set[str] = set()
    vfio_groups = 0

    def next_group() -> int:
        nonlocal group
        group += 1
        return group - 1

    def add(addr: str, vendor: str, device: str, klass: str, driver: str | None,
            grp: int, parent: str, numa: int, sub_vendor: str | None = None) -> None:
        s.add_function(addr, vendor=vendor, device=device, klass=klass, driver=driver,
                       iommu_group=grp, parent=parent, numa_node=numa,
                       subsystem_vendor=sub_vendor or vendor)
        if driver:
            drivers.add(driver)

    while budget > 0:
        if rc is None:
            domain, quarter = divmod(rc_index, 4)
            bus = quarter * 0x40
            rc = _RootComplex(domain, bus, f"pci{domain:04x}:{bus:02x}", numa=rc_index % 2)
            rc_index += 1
            add(f"{domain:04x}:{bus:02x}:00.0", "0x1022", "0x1480", "0x060000", None,
                next_group(), rc.name, rc.numa)
            budget -= 1
            used += 1
            continue
        ports_free = rc.ports < _PORTS_PER_ROOT
        slots_free = rc.integrated < _INTEGRATED_SLOTS
        kind: str | None = None
        if ports_free and budget >= 3 and gpus * 8 < used + 3:
            kind = "gpu"
        else:
            options = [
                (k, w)
                for k, size, w, needs_port in (
                    ("nic", 3, 2, True),
                    ("nvme", 2, 3, True),
                    ("usb", 2, 1, True),
                    ("integrated", 1, 1, False),
                )
                if size <= budget and (ports_free if needs_port else slots_free)
            ]
            if options:
                kind = rng.choices([k for k, _ in options], [w for _, w in options])[0]
        if kind is None:
            rc = None  # this root complex is full: open the next one
            continue
        if kind == "integrated":
            dev, fnum = divmod(rc.integrated, 8)
            rc.integrated += 1
            vendor, device, klass, driver = rng.choice(_INTEGRATED)
            add(f"{rc.domain:04x}:{rc.bus:02x}:{0x10 + dev:02x}.{fnum}", vendor, device, klass,
                driver, next_group(), rc.name, rc.numa)
            budget -= 1
            used += 1
            continue
        pdev, pfn = divmod(rc.ports, 8)
        rc.ports += 1
        sec = rc.bus + rc.ports
        port = f"{rc.domain:04x}:{rc.bus:02x}:{1 + pdev:02x}.{pfn}"
        s.add_bridge(port, domain_root=rc.name, iommu_group=next_group(), vendor="0x1022",
                     device="0x1483")
        drivers.add("pcieport")
        ep = f"{rc.domain:04x}:{sec:02x}:00"
        if kind == "gpu":
            vendor, gdev, adev, native, gfx = rng.choices(_GPU_MODELS, _GPU_WEIGHTS)[0]
            roll = rng.random()
            driver = "vfio-pci" if roll < 0.25 else (None if roll < 0.30 else native)
            audio_driver = "vfio-pci" if driver == "vfio-pci" else "snd_hda_intel"
            grp = next_group()
            add(f"{ep}.0", vendor, gdev, "0x030000", driver, grp, port, rc.numa)
            add(f"{ep}.1", vendor, adev, "0x040300", audio_driver, grp, port, rc.numa)
            if driver == "vfio-pci":
                s.add_vfio_group(grp)
                vfio_groups += 1
            elif driver is not None:
                native_drivers.add(native)
                s.add_drm(f"card{card}", f"{ep}.0")
                s.add_drm(f"renderD{128 + card}", f"{ep}.0")
                if native == "nvidia":
                    s.add_dev_node(f"/dev/nvidia{card}")
                if native == "amdgpu":
                    s.add_kfd_node(
                        kfd_node,
                        gfx,
                        vendor_id=0x1002,
                        device_id=int(gdev, 16),
                        location_id=sec << 8,
                        domain=rc.domain,
                        drm_render_minor=128 + card,
                    )
                    kfd_node += 1
                card += 1
            gpus += 1
            size = 3
        elif kind == "nic":
            vendor, device, driver = rng.choice(_NIC_MODELS)
            for f in (0, 1):
                add(f"{ep}.{f}", vendor, device, "0x020000", driver, next_group(), port, rc.numa)
            size = 3
        elif kind == "nvme":
            add(f"{ep}.0", "0x144d", "0xa808", "0x010802", "nvme", next_group(), port, rc.numa)
            size = 2
        else:
            add(f"{ep}.0", "0x1022", "0x149c", "0x0c0330", "xhci_hcd", next_group(), port,
                rc.numa)
            size = 2
        budget -= size
        used += size

    if kfd_node > 1:
        s.add_kfd_node(0, 0)
        s.add_dev_node("/dev/kfd")
    for i in range(rc_index):
        s.add_iommu_unit(f"ivhd{i}")
    s.set_cmdline("amd_iommu=on iommu=pt")
    modules: dict[str, tuple[str, ...]] = {"kvm": ("kvm_amd",), "kvm_amd": ()}
    if "nvidia" in native_drivers:
        modules.update(nvidia=("nvidia_modeset", "nvidia_uvm"), nvidia_modeset=("nvidia_drm",),
                       nvidia_drm=(), nvidia_uvm=())
        s.add_dev_node("/dev/nvidiactl")
    if vfio_groups or "vfio-pci" in drivers:
        modules.update(vfio=("vfio_pci_core", "vfio_iommu_type1"), vfio_pci_core=("vfio_pci",),
                       vfio_pci=(), vfio_iommu_type1=())
    for drv in sorted(drivers - {"pcieport", "vfio-pci", "nvidia"}):
        modules.setdefault(drv, ())
    for name, holders in modules.items():
        s.add_module(name, refcnt=len(holders), holders=holders)
    s.add_dev_node("/dev/kvm")
    s.set_boot_id(str(uuid.UUID(int=rng.getrandbits(128), version=4)))
    return s
