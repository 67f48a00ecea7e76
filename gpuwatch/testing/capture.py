"""Capture the parts of a live host that gpuwatch reads, sanitized, as one tar archive.

A bug report or a test fixture needs the host's tree as the kernel lays it out: sysfs links kept
as links (a copy that follows them loops, or flattens what gpuwatch reads from the link itself),
attribute files read once with a bound, nothing that names the machine or its owner. This walks
only the folders gpuwatch reads, never follows a link, never opens a file that reading can change
or block (``vpd``, ``rom``, ``resource*``), and replaces every UUID with a stable stand-in.
``/dev`` nodes become empty files, listed with their type, numbers and mode in
``capture.json``.

    python -m gpuwatch.testing.capture OUT.tar.gz [--root /]

`extract` lays such an archive out under a folder for ``--root``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import stat
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field

#: The most bytes kept of any one file: sysfs attributes are a page at most.
MAX_FILE = 64 * 1024
#: PCI config space past its standard header and capabilities holds serial numbers (DSN).
CONFIG_BYTES = 256
#: A guard against a tree far larger than any host's GPU side.
MAX_ENTRIES = 200_000
MAX_DEPTH = 24

_UUID = re.compile(rb"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_PCI_ADDR = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_ROOT_BUS = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")
#: Files never opened: reading them can block, wake or reset hardware, or they name the machine.
_NEVER_READ = re.compile(
    r"^(vpd|rom|resource\d*(_wc)?|config_space|.*serial.*|.*uuid.*|address|perm_addr|"
    r"remove|rescan|reset|bind|unbind|new_id|remove_id|drivers_probe|eeprom|nvmem)$")
#: Below a PCI function, the children gpuwatch reads (other children are links or left out).
_PCI_CHILDREN = re.compile(
    r"^(drm|graphics|vfio-dev|mdev_supported_types|iommu|kfd|accel|sriov_.*|card\d+.*|"
    r"renderD\d+|controlD\d+|fb\d+|vfio\d+|noiommu-.*|ivhd\d+|dmar\d+|[0-9a-f-]{36}|"
    r"nvidia-\d+|i915-\w+|devices)$")
#: Every folder a PCI tree is walked into: functions, root buses and the children above.
_PCI_TREE = re.compile("|".join(p.pattern for p in (_PCI_ADDR, _ROOT_BUS, _PCI_CHILDREN)))
_VIRTUAL = ("drm", "vfio", "vfio-dev", "kfd", "iommu", "graphics", "accel", "misc/vfio")
_CLASSES = ("drm", "graphics", "vfio", "vfio-dev", "iommu", "kfd", "accel", "mdev_bus", "dmi")
_DMI_KEPT = frozenset({"sys_vendor", "product_name", "product_family", "product_version",
                       "board_vendor", "board_name", "bios_vendor", "chassis_vendor",
                       "chassis_type", "uevent", "modalias"})
#: Kernel command-line keys kept: those about IOMMUs, VFIO, GPUs and drivers; the rest dropped.
_CMDLINE_KEPT = re.compile(
    r"^(iommu|intel_iommu|amd_iommu|iommu\.[a-z_]+|vfio[-_.].*|vfio|kvm[-_.].*|pci|pcie_[a-z_]+|"
    r"modprobe\.blacklist|module_blacklist|rd\.driver\.[a-z]+|nvidia.*|nouveau\..*|amdgpu\..*|"
    r"i915\..*|xe\..*|video|nomodeset|efifb|vga|sysfb_init\..*|initcall_blacklist)$")
_DEV_NODES = re.compile(
    r"^(dri/.*|nvidia.*|nvidia-caps/.*|vfio/.*|kfd|kvm|iommu|fb\d+|accel/.*|vhost-.*|udmabuf|"
    r"fuse|net/tun|hwrng|snd/.*)$")
#: The folders of ``/dev`` walked for the nodes above.
_DEV_DIRS = frozenset({"dri", "vfio", "nvidia-caps", "accel", "net", "snd"})


@dataclass
class _Capture:
    """What is gathered, archive path → member, with the one UUID map that keeps ids stable."""

    members: dict[str, tarfile.TarInfo] = field(default_factory=dict)
    data: dict[str, bytes] = field(default_factory=dict)
    uuids: dict[bytes, bytes] = field(default_factory=dict)
    dev: list[dict[str, object]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def _stand_in(self, match: re.Match[bytes]) -> bytes:
        real = match.group(0).lower()
        if real not in self.uuids:
            n = len(self.uuids) + 1
            self.uuids[real] = b"00000000-0000-4000-8000-%012x" % n
        return self.uuids[real]

    def sanitize(self, data: bytes) -> bytes:
        return _UUID.sub(self._stand_in, data)

    def name(self, rel: str) -> str:
        """``rel`` as the archive names it: a UUID in a name (a mediated device's folder, a
        link to it) replaced as in the links' targets, so those still lead to it."""
        return os.fsdecode(self.sanitize(os.fsencode(rel)))

    def _dirs_to(self, rel: str) -> None:
        parent = os.path.dirname(rel)
        while parent and parent not in self.members:
            info = tarfile.TarInfo(parent)
            info.type, info.mode = tarfile.DIRTYPE, 0o755
            self.members[parent] = info
            parent = os.path.dirname(parent)

    def add_dir(self, rel: str) -> None:
        rel = self.name(rel)
        self._dirs_to(rel)
        info = tarfile.TarInfo(rel)
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        self.members.setdefault(rel, info)

    def add_link(self, rel: str, target: str) -> None:
        rel = self.name(rel)
        self._dirs_to(rel)
        info = tarfile.TarInfo(rel)
        info.type = tarfile.SYMTYPE
        info.linkname = os.fsdecode(self.sanitize(os.fsencode(target)))
        self.members[rel] = info

    def add_file(self, rel: str, data: bytes, mode: int = 0o444) -> None:
        rel = self.name(rel)
        self._dirs_to(rel)
        info = tarfile.TarInfo(rel)
        info.size, info.mode = len(data), mode
        self.members[rel], self.data[rel] = info, data


def _read(path: str, limit: int = MAX_FILE) -> bytes | None:
    """One bounded, non-blocking read of a regular file; None where it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def _children(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def _walk(cap: _Capture, root: str, rel: str, depth: int,
          descend: re.Pattern[str] | None = None) -> None:
    """Record ``rel`` (a link as a link, a file read once); folders below it where ``descend``
    admits their name (or every folder where it is None)."""
    if len(cap.members) >= MAX_ENTRIES or depth > MAX_DEPTH:
        cap.skipped.append(cap.name(rel))
        return
    path = os.path.join(root, rel)
    try:
        st = os.lstat(path)
    except OSError:
        return
    name = os.path.basename(rel)
    if stat.S_ISLNK(st.st_mode):
        with contextlib.suppress(OSError):  # gone since the lstat
            cap.add_link(rel, os.readlink(path))
    elif stat.S_ISDIR(st.st_mode):
        cap.add_dir(rel)
        for child in _children(path):
            child_rel = f"{rel}/{child}"
            if child == "power" or child == "msi_irqs":
                continue
            try:
                child_st = os.lstat(os.path.join(root, child_rel))
            except OSError:
                continue
            if (stat.S_ISDIR(child_st.st_mode) and descend is not None
                    and not descend.match(child)):
                continue
            _walk(cap, root, child_rel, depth + 1, descend)
    elif stat.S_ISREG(st.st_mode):
        if _NEVER_READ.match(name):
            return
        data = _read(path, CONFIG_BYTES if name == "config" else MAX_FILE)
        if data is None:  # write-only (a driver's bind): keep its place, empty
            cap.add_file(rel, b"", stat.S_IMODE(st.st_mode))
        else:
            cap.add_file(rel, data if name == "config" else cap.sanitize(data),
                         stat.S_IMODE(st.st_mode) or 0o444)


def _capture_sys(cap: _Capture, root: str) -> None:
    for top in _children(os.path.join(root, "sys/devices")):
        if _ROOT_BUS.match(top):
            _walk(cap, root, f"sys/devices/{top}", 0, _PCI_TREE)
    for name in _VIRTUAL:
        _walk(cap, root, f"sys/devices/virtual/{name}", 0)
    for name in _children(os.path.join(root, "sys/devices/platform")):
        if "framebuffer" in name or name.startswith(("efifb", "vesafb", "simple-framebuffer")):
            _walk(cap, root, f"sys/devices/platform/{name}", 0)
    dmi = "sys/devices/virtual/dmi/id"
    for name in _children(os.path.join(root, dmi)):
        if name in _DMI_KEPT:
            _walk(cap, root, f"{dmi}/{name}", 0)
    for name in _CLASSES:
        _walk(cap, root, f"sys/class/{name}", 0, re.compile(r"^$"))
    _walk(cap, root, "sys/bus/pci/devices", 0)
    for driver in _children(os.path.join(root, "sys/bus/pci/drivers")):
        _walk(cap, root, f"sys/bus/pci/drivers/{driver}", 0, re.compile(r"^$"))
    _walk(cap, root, "sys/kernel/iommu_groups", 0)
    for module in _children(os.path.join(root, "sys/module")):
        for part in ("refcnt", "initstate", "holders", "drivers"):
            if os.path.lexists(os.path.join(root, "sys/module", module, part)):
                _walk(cap, root, f"sys/module/{module}/{part}", 0)
    for rel in ("sys/hypervisor/type", "sys/devices/system/cpu/modalias",
                "sys/firmware/devicetree/base/compatible", "sys/kernel/mm/transparent_hugepage"):
        if os.path.lexists(os.path.join(root, rel)) and not os.path.isdir(os.path.join(root, rel)):
            _walk(cap, root, rel, 0)


def _cmdline(text: str) -> str:
    kept = [w for w in text.split() if _CMDLINE_KEPT.match(w.split("=", 1)[0])]
    return " ".join(kept) + "\n"


def _cpuinfo(text: str) -> str:
    """The first two stanzas: what tells a guest (``hypervisor``) and the architecture."""
    return "".join(stanza + "\n\n" for stanza in text.split("\n\n")[:2] if stanza.strip())


def _capture_proc(cap: _Capture, root: str) -> None:
    for rel in ("proc/modules", "proc/devices", "proc/sys/kernel/osrelease",
                "proc/sys/kernel/random/boot_id", "proc/driver/nvidia/version"):
        data = _read(os.path.join(root, rel))
        if data is not None:
            cap.add_file(rel, cap.sanitize(data))
    for rel, shape in (("proc/cmdline", _cmdline), ("proc/cpuinfo", _cpuinfo)):
        data = _read(os.path.join(root, rel), 1 << 20)
        if data is not None:
            cap.add_file(rel, shape(data.decode("utf-8", "replace")).encode())
    gpus = "proc/driver/nvidia/gpus"
    for gpu in _children(os.path.join(root, gpus)):
        data = _read(os.path.join(root, gpus, gpu, "information"))
        if data is not None:
            cap.add_file(f"{gpus}/{gpu}/information", cap.sanitize(data))


def _dev_nodes(root: str) -> Iterator[tuple[str, os.stat_result]]:
    dev = os.path.join(root, "dev")
    for top, dirs, files in os.walk(dev):
        dirs[:] = [d for d in dirs if top != dev or d in _DEV_DIRS]
        for name in sorted(files + [d for d in dirs if os.path.islink(os.path.join(top, d))]):
            path = os.path.join(top, name)
            rel = os.path.relpath(path, dev)
            if _DEV_NODES.match(rel):
                try:
                    yield rel, os.lstat(path)
                except OSError:
                    continue


def _capture_dev(cap: _Capture, root: str) -> None:
    for rel, st in _dev_nodes(root):
        entry: dict[str, object] = {"path": "/dev/" + rel, "mode": oct(stat.S_IMODE(st.st_mode))}
        if stat.S_ISLNK(st.st_mode):
            entry["type"] = "link"
            entry["target"] = os.readlink(os.path.join(root, "dev", rel))
            cap.add_link(f"dev/{rel}", str(entry["target"]))
        else:
            entry["type"] = "char" if stat.S_ISCHR(st.st_mode) else (
                "block" if stat.S_ISBLK(st.st_mode) else "other")
            entry["rdev"] = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
            cap.add_file(f"dev/{rel}", b"", 0o666)
        cap.dev.append(entry)


def _capture_cdi(cap: _Capture, root: str) -> None:
    for folder in ("etc/cdi", "var/run/cdi", "run/cdi"):
        if os.path.islink(os.path.join(root, folder)):
            continue
        for name in _children(os.path.join(root, folder)):
            if name.endswith((".yaml", ".yml", ".json")):
                data = _read(os.path.join(root, folder, name), 1 << 20)
                if data is not None:
                    cap.add_file(f"{folder}/{name}", cap.sanitize(data))


def capture(root: str = "/") -> tuple[bytes, dict[str, object]]:
    """The archive's bytes (gzip) and its manifest, of the host at ``root``."""
    cap = _Capture()
    _capture_sys(cap, root)
    _capture_proc(cap, root)
    _capture_dev(cap, root)
    _capture_cdi(cap, root)
    manifest: dict[str, object] = {
        "format": 1, "entries": len(cap.members), "dev": cap.dev,
        "skipped": cap.skipped[:100], "uuids_replaced": len(cap.uuids)}
    cap.add_file("capture.json", json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n")
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for rel in sorted(cap.members):
            info = cap.members[rel]
            info.mtime = 0
            data = cap.data.get(rel)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue(), manifest


def extract(archive: str, dest: str) -> dict[str, object]:
    """Lay a capture out under ``dest`` (links stay links); returns its manifest."""
    if not hasattr(tarfile, "data_filter"):  # Python 3.11.0-3.11.3: no safe extraction
        raise RuntimeError("extracting a capture needs Python 3.11.4 or newer (tarfile's "
                           "data filter)")
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(dest, filter="data")
    with open(os.path.join(dest, "capture.json"), encoding="utf-8") as f:
        manifest: dict[str, object] = json.load(f)
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuwatch.testing.capture",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out", help="archive to write (.tar.gz)")
    parser.add_argument("--root", default="/", help="host root to read (default /)")
    args = parser.parse_args(argv)
    data, manifest = capture(args.root)
    with open(args.out, "wb") as f:
        f.write(data)
    print(f"{args.out}: {manifest['entries']} entries, {len(data)} bytes, "
          f"{manifest['uuids_replaced']} UUIDs replaced", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
