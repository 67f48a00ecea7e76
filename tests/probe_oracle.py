"""A deliberately naive reading of the probe contract (docs/probes.md), for differential tests.

Every call reads the fixture root's files anew with ``os``, following the contract's words,
not gpuwatch's code: nothing of ``gpuwatch.hostfs`` or ``gpuwatch.core`` is used, only the
embedded data tables (``gpuwatch/data/tables.yaml``). Where docs/probes.md extends the first
contract (bridges on ``pcieport``, vfio-pci variants, captured trees, NUL padding, the spelling
of ids, the chroot reading of ``var/run``), the comment at that spot names the documented rule.
It is written for the trees the differential test generates, not for every hostile tree.
"""

from __future__ import annotations

import fnmatch
import os
import re
import resource
import shutil
import stat
from dataclasses import dataclass
from importlib import resources
from typing import Any

import yaml

ADDR_RE = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
#: Bridges that stay on pcieport in either mode (docs/probes.md, group-in-mode).
BRIDGE_CLASSES = ("0x0604", "0x0609", "0x0607")
#: The answer for an address that is no PCI function (exit 1, `gpuwatch.DeviceNotFound`).
NOT_FOUND = "<no such function>"


def tables() -> dict[str, Any]:
    """The embedded data tables, read as plain YAML (the data, none of the logic)."""
    text = resources.files("gpuwatch").joinpath("data/tables.yaml").read_text()
    data: dict[str, Any] = yaml.safe_load(text)
    return data


TABLES = tables()


@dataclass(frozen=True)
class Oracle:
    """The contract's answers for the host tree under ``root``, as this process sees it."""

    root: str
    euid: int
    gids: frozenset[int]

    # ------------------------------------------------------------------ reading

    def p(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    @staticmethod
    def attr(path: str) -> str | None:
        """An attribute's text: NUL padding (GNU tar) dropped, odd bytes U+FFFD, the kernel's
        trailing newline dropped; None when it cannot be read."""
        try:
            with open(path, "rb") as fh:
                raw = fh.read()
        except OSError:
            return None
        text = raw.rstrip(b"\0").decode("utf-8", "replace")
        return text.removesuffix("\n")

    def function_dirs(self) -> dict[str, str]:
        """Address → folder, from the ``sys/bus/pci/devices`` listing (links followed, or the
        folders a capture left); entries that are not addresses ignored. Documented later
        (docs/probes.md, "No bus listing", "A bus listing that misleads"): a listing with no
        function is replaced by a walk of ``sys/devices``, and an entry that leads to no
        folder is read in the folder of its address the walk finds (none: gone)."""
        bus = self.p("sys/bus/pci/devices")
        try:
            names = [n for n in os.listdir(bus) if ADDR_RE.match(n)]
        except OSError:
            names = []
        if not names:
            return self.walk()
        out: dict[str, str] = {}
        walked: dict[str, str] | None = None
        for name in names:
            path = os.path.join(bus, name)
            if os.path.isdir(path):
                out[name] = path
                continue
            walked = self.walk() if walked is None else walked
            if name in walked:
                out[name] = walked[name]
        return out

    def walk(self) -> dict[str, str]:
        """The PCI function folders of ``sys/devices``, nearest first: a folder named as an
        address, holding ``class`` or ``vendor``, in a root bus (``pciDDDD:BB``) or in
        another function. Links are not followed."""
        found: dict[str, str] = {}
        level = [self.p("sys/devices")]
        for _depth in range(32):
            below: list[str] = []
            for folder in level:
                try:
                    names = sorted(os.listdir(folder))
                except OSError:
                    continue
                parent = os.path.basename(folder)
                parent_is_pci = bool(ADDR_RE.match(parent)
                                     or re.fullmatch(r"pci[0-9a-f]{4,8}:[0-9a-f]{2}", parent))
                for name in names:
                    path = os.path.join(folder, name)
                    if os.path.islink(path) or not os.path.isdir(path):
                        continue
                    below.append(path)
                    if (ADDR_RE.match(name) and parent_is_pci and name not in found
                            and (os.path.lexists(path + "/class")
                                 or os.path.lexists(path + "/vendor"))):
                        found[name] = path
            level = below
        return found

    def uevent(self, folder: str) -> dict[str, str] | None:
        text = self.attr(os.path.join(folder, "uevent"))
        if text is None:
            return None
        pairs = (line.partition("=") for line in text.splitlines())
        return {k: v for k, _, v in pairs}

    def driver_of(self, folder: str, addr: str = "") -> str:
        """Basename of the ``driver`` link; a captured folder or no link: the ``DRIVER=``
        line of the device's ``uevent``, or without a ``uevent``, the driver folder that
        lists the function (docs/probes.md, captured trees)."""
        link = os.path.join(folder, "driver")
        if os.path.islink(link):
            return os.path.basename(os.readlink(link).rstrip("/"))
        uevent = self.uevent(folder)
        if uevent is not None:
            return uevent.get("DRIVER", "")
        drivers = self.p("sys/bus/pci/drivers")
        try:
            names = sorted(os.listdir(drivers))
        except OSError:
            return ""
        for name in names:
            if addr and os.path.lexists(os.path.join(drivers, name, addr)):
                return name
        return ""

    def group_of(self, addr: str, folder: str) -> int:
        """The number the ``iommu_group`` link names, -1 for none or not a number; a
        captured folder or no link: the ``iommu_groups/<N>/devices/<addr>`` entry."""
        link = os.path.join(folder, "iommu_group")
        if os.path.islink(link):
            name = os.path.basename(os.readlink(link).rstrip("/"))
            return int(name) if name.isascii() and name.isdigit() else -1
        groups = self.p("sys/kernel/iommu_groups")
        try:
            names = os.listdir(groups)
        except OSError:
            return -1
        for name in names:
            if os.path.lexists(os.path.join(groups, name, "devices", addr)):
                return int(name) if name.isascii() and name.isdigit() else -1
        return -1

    @staticmethod
    def id_text(text: str | None) -> str:
        """``vendor``/``device``: as written, four hex digits in the kernel's spelling."""
        if text is None:
            return ""
        if re.fullmatch(r"(0[xX])?[0-9a-fA-F]{4}", text):
            return "0x" + text[-4:].lower()
        return text

    @staticmethod
    def class_text(text: str | None) -> str:
        """First six characters; six hex digits in another spelling read as the kernel's."""
        if text is None:
            return ""
        if re.fullmatch(r"(0[xX])?[0-9a-fA-F]{6}", text):
            return "0x" + text[-6:-2].lower()
        return text[:6] if len(text) >= 6 else ""

    def function(self, addr: str, folder: str) -> dict[str, Any]:
        klass = self.class_text(self.attr(os.path.join(folder, "class")))
        return {
            "addr": addr,
            "vendor_id": self.id_text(self.attr(os.path.join(folder, "vendor"))),
            "device_id": self.id_text(self.attr(os.path.join(folder, "device"))),
            "class": klass,
            "class_label": TABLES["pci_class_labels"].get(klass, klass),
            "driver": self.driver_of(folder, addr),
            "iommu_group": self.group_of(addr, folder),
            **self.vfio_entry(folder),
        }

    def vfio_entry(self, folder: str) -> dict[str, str]:
        """``vfio_dev``: the entry under ``vfio-dev/``; ``vfio_cdev``: its node when the entry
        has a ``dev`` file and the node exists under the root (docs/probes.md, the fields)."""
        try:
            names = os.listdir(os.path.join(folder, "vfio-dev"))
        except OSError:
            names = []
        if not names:
            return {"vfio_dev": "", "vfio_cdev": ""}
        name = names[0]
        node = f"/dev/vfio/devices/{name}"
        has_cdev = (os.path.exists(os.path.join(folder, "vfio-dev", name, "dev"))
                    and os.path.lexists(self.p(node.lstrip("/"))))
        return {"vfio_dev": name, "vfio_cdev": node if has_cdev else ""}

    def functions(self) -> dict[str, dict[str, Any]]:
        return {a: self.function(a, d) for a, d in sorted(self.function_dirs().items())}

    # ------------------------------------------------------------------ detect-vfio

    def iommu_kind(self) -> str:
        try:
            units = os.listdir(self.p("sys/class/iommu"))
        except OSError:
            units = []
        if any(u.startswith("dmar") for u in units):
            return "intel"
        if any(u.startswith("ivhd") for u in units):
            return "amd"
        if any("smmu" in u for u in units):
            return "arm"
        state: dict[str, bool] = {}
        for word in (self.attr(self.p("proc/cmdline")) or "").split():
            key, eq, value = word.partition("=")
            if eq and key in ("intel_iommu", "amd_iommu"):
                for part in value.split(","):  # the last on/off counts
                    if part in ("on", "off"):
                        state[key] = part == "on"
        if state.get("intel_iommu"):
            return "intel"
        if state.get("amd_iommu"):
            return "amd"
        return ""

    def members(self, fns: dict[str, dict[str, Any]], addr: str) -> list[dict[str, Any]]:
        group = fns[addr]["iommu_group"]
        if group == -1:
            return [fns[addr]]
        return [fns[a] for a in sorted(fns) if fns[a]["iommu_group"] == group]

    def detect_vfio(self) -> dict[str, Any]:
        fns = self.functions()
        try:
            enabled = bool(os.listdir(self.p("sys/kernel/iommu_groups")))
        except OSError:
            enabled = False
        gpus = [dict(fns[a], group_members=self.members(fns, a))
                for a in sorted(fns) if fns[a]["class"].startswith("0x03")]
        return {"iommu_enabled": enabled, "iommu_kind": self.iommu_kind(),
                "iommufd": os.path.lexists(self.p("dev/iommu")), "gpus": gpus}

    # ------------------------------------------------------------------ NVIDIA, AMD

    def exists_in_root(self, rel: str) -> bool:
        """``rel`` under the root, its links read as in a chroot there (docs/probes.md, the
        root: ``var/run`` a link to ``/run`` leads to the root's ``run``)."""
        path = self.root
        parts = rel.split("/")
        hops = 0
        while parts:
            part = parts.pop(0)
            nxt = os.path.join(path, part)
            if os.path.islink(nxt):
                hops += 1
                if hops > 40:
                    return False
                target = os.readlink(nxt)
                base = self.root if target.startswith("/") else path
                parts = [*target.strip("/").split("/"), *parts]
                path = base
                continue
            if part == "..":
                path = os.path.dirname(path) if path != self.root else path
                continue
            if part in ("", "."):
                continue
            if not os.path.lexists(nxt):
                return False
            path = nxt
        return True

    def detect_gpu(self) -> bool:
        """nvidia loaded, CDI reachable (a spec, or nvidia-ctk on PATH), and (docs/probes.md's
        later rule) a display function on nvidia."""
        cdi = (self.exists_in_root("etc/cdi/nvidia.yaml")
               or self.exists_in_root("var/run/cdi/nvidia.yaml")
               or shutil.which("nvidia-ctk") is not None)
        on_nvidia = any(f["class"].startswith("0x03") and f["driver"] == "nvidia"
                        for f in self.functions().values())
        return os.path.isdir(self.p("sys/module/nvidia")) and cdi and on_nvidia

    def drm_device(self, node: str) -> str:
        """The folder of a DRM node's device, ``""`` for none: its ``device`` link (or the
        folder a capture copied there); a link that no longer resolves names the function,
        read through the bus listing; with no ``device`` at all (docs/probes.md, captured
        trees), the folder whose ``drm/`` holds the node: the parent in its devpath, or for a
        node copied as a folder, the PCI function listing it in ``drm/``."""
        entry = self.p(f"sys/class/drm/{node}")
        device = os.path.join(entry, "device")
        if os.path.isdir(device):
            return device
        if os.path.islink(device):  # dangling: the name it spells
            name = os.path.basename(os.readlink(device).rstrip("/"))
            return self.function_dirs().get(name, "")
        if os.path.lexists(device) or not os.path.isdir(entry):
            return ""
        if os.path.islink(entry):
            glue = os.path.dirname(os.path.realpath(entry))
            parent = os.path.dirname(glue)
            virtual = os.path.realpath(self.p("sys/devices/virtual"))
            if os.path.basename(glue) == "drm" and not parent.startswith(virtual + "/"):
                return parent
            return ""
        for _addr, folder in sorted(self.function_dirs().items()):
            if os.path.lexists(os.path.join(folder, "drm", node)):
                return folder
        return ""

    def drm_driver(self, node: str) -> str:
        device = self.drm_device(node)
        if not device:
            return ""
        name = os.path.basename(device)
        if not ADDR_RE.match(name):
            name = (self.uevent(device) or {}).get("PCI_SLOT_NAME", "")
        return self.driver_of(device, name)

    def drm_vendor(self, node: str) -> str:
        device = self.drm_device(node)
        return self.id_text(self.attr(os.path.join(device, "vendor"))) if device else ""

    def detect_amd_gpu(self) -> bool:
        try:
            names = os.listdir(self.p("sys/class/drm"))
        except OSError:
            return False
        for name in names:
            if re.fullmatch(r"card[0-9]+", name) and self.drm_driver(name) == "amdgpu":
                return True
        return False

    def gfx_version_number(self) -> int:
        """The first non-zero ``gfx_target_version`` of the KFD nodes in numeric order; a
        value the kernel cannot write (not a u32 in ASCII decimal) is none."""
        base = self.p("sys/class/kfd/kfd/topology/nodes")
        if not os.path.isdir(self.p("sys/class/kfd/kfd")):  # documented: where the link leads
            base = self.p("sys/devices/virtual/kfd/kfd/topology/nodes")
        try:
            names = [n for n in os.listdir(base) if n.isascii() and n.isdigit()]
        except OSError:
            return 0
        for name in sorted(names, key=int):
            text = self.attr(os.path.join(base, name, "properties")) or ""
            for line in text.splitlines():
                key, _, value = line.partition(" ")
                if key == "gfx_target_version":
                    if re.fullmatch(r"[0-9]{1,10}", value) and int(value) < 2**32 and int(value):
                        return int(value)
                    break
        return 0

    def amd_gfx_version(self) -> str:
        v = self.gfx_version_number()
        return f"{v // 10000}.{v % 10000 // 100}.0" if v else ""

    def amd_gfx_target(self) -> str:
        v = self.gfx_version_number()
        return f"gfx{v // 10000}{v // 100 % 100:x}{v % 100:x}" if v else ""

    def devices(self) -> list[str]:
        out: list[str] = []
        for pattern in TABLES["device_patterns"]:
            folder, _, name = pattern.rpartition("/")
            try:
                entries = os.listdir(self.p(folder.lstrip("/")))
            except OSError:
                entries = []
            out += sorted(f"{folder}/{e}" for e in entries if fnmatch.fnmatchcase(e, name))
        return out

    def render_node(self, devices: list[str]) -> str:
        renders = [d for d in devices if os.path.basename(d).startswith("renderD")]
        for dev in renders:
            if self.drm_vendor(os.path.basename(dev)) in TABLES["gpu_vendors"]:
                return dev
        return renders[0] if renders else ""

    def detect_host_devices(self) -> dict[str, Any]:
        amd = self.detect_amd_gpu()
        devices = self.devices()
        return {"gpu": self.detect_gpu(), "amd_gpu": amd,
                "amd_gfx_version": self.amd_gfx_version() if amd else "",
                "amd_gfx_target": self.amd_gfx_target() if amd else "",
                "devices": devices, "render_node": self.render_node(devices)}

    # ------------------------------------------------------------------ live ones

    @staticmethod
    def memlock() -> dict[str, int | None]:
        soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        inf = resource.RLIM_INFINITY
        return {"soft": None if soft == inf else soft, "hard": None if hard == inf else hard}

    def vfio_group_accessible(self, group: int) -> bool:
        """The node's owner, group and mode against our euid and groups; root always may (the
        caller posed as holds CAP_DAC_OVERRIDE iff it is root)."""
        if group < 0:
            return False
        try:
            st = os.stat(self.p(f"dev/vfio/{group}"))
        except OSError:
            return False
        if self.euid == 0:
            return True
        if st.st_uid == self.euid:
            bits = stat.S_IRUSR | stat.S_IWUSR
        elif st.st_gid in self.gids:
            bits = stat.S_IRGRP | stat.S_IWGRP
        else:
            bits = stat.S_IROTH | stat.S_IWOTH
        return st.st_mode & bits == bits

    def nvidia_holders(self) -> list[dict[str, Any]]:
        out = []
        try:
            names = os.listdir(self.p("proc"))
        except OSError:
            return []
        for name in names:
            if not (name.isascii() and name.isdigit()):
                continue
            fd_dir = self.p(f"proc/{name}/fd")
            try:
                targets = [os.readlink(os.path.join(fd_dir, fd)) for fd in os.listdir(fd_dir)]
            except OSError:
                continue  # unreadable pid: skipped
            if any(fnmatch.fnmatchcase(t, "/dev/nvidia*") for t in targets):
                try:
                    with open(self.p(f"proc/{name}/comm"), "rb") as fh:
                        raw = fh.read()
                except OSError:
                    continue
                comm = raw.removesuffix(b"\n").decode("utf-8", "replace")
                out.append({"pid": int(name), "comm": comm})
        return sorted(out, key=lambda h: h["pid"])

    # ------------------------------------------------------------------ per address

    def display_driver(self, addr: str) -> str:
        return str(self.functions()[addr]["driver"])

    def current_mode(self, addr: str) -> str:
        return "nvidia" if self.display_driver(addr) == "nvidia" else "vfio"

    @staticmethod
    def on_vfio(driver: str) -> bool:
        """vfio-pci or a variant: a name ending in vfio_pci/vfio-pci, or one the table lists
        (docs/probes.md, vfio-backend; ``-`` and ``_`` compare equal). gpuwatch asks for a
        separator before ``vfio_pci`` (``acmevfio_pci`` is none): every real variant has one,
        and the generated trees name no other."""
        name = driver.replace("-", "_")
        variants = {v.replace("-", "_") for v in TABLES.get("vfio_variant_drivers") or ()}
        return name.endswith("vfio_pci") or name in variants

    def group_in_mode(self, addr: str, mode: str) -> bool:
        fns = self.functions()
        for fn in self.members(fns, addr):
            driver, klass = fn["driver"].replace("-", "_"), fn["class"]
            # Documented later: a bridge on pcieport or no driver, and anything on pcieport,
            # is where both modes want it. A function with a vfio-dev entry is on VFIO. "A
            # bridge on any other driver counts as a function that is not on VFIO" is read as
            # "is judged as any other function": one on vfio-pci counts as on VFIO (no kernel
            # makes one: vfio-pci refuses every header but a normal one).
            if driver == "pcieport" or (klass in BRIDGE_CLASSES and driver == ""):
                continue
            if mode == "vfio" or not (klass.startswith("0x03") or klass == "0x0403"):
                ok = self.on_vfio(driver) or bool(fn["vfio_dev"])
            elif klass.startswith("0x03"):
                ok = driver == "nvidia"
            else:
                ok = driver == "snd_hda_intel"
            if not ok:
                return False
        return True

    # ------------------------------------------------------------------ dispatch

    def answer(self, action: str, **kw: Any) -> Any:
        """The action's answer; `NOT_FOUND` for an address that is no PCI function."""
        if "addr" in kw and kw["addr"] not in self.function_dirs():
            return NOT_FOUND
        simple = {
            "detect-vfio": self.detect_vfio, "detect-gpu": self.detect_gpu,
            "detect-amd-gpu": self.detect_amd_gpu, "amd-gfx-version": self.amd_gfx_version,
            "amd-gfx-target": self.amd_gfx_target,
            "detect-host-devices": self.detect_host_devices, "memlock": self.memlock,
            "nvidia-holders": self.nvidia_holders,
        }
        if action in simple:
            return simple[action]()
        if action == "vfio-group-accessible":
            return self.vfio_group_accessible(kw["group"])
        if action == "display-driver":
            return self.display_driver(kw["addr"])
        if action == "current-mode":
            return self.current_mode(kw["addr"])
        if action == "group-in-mode":
            return self.group_in_mode(kw["addr"], kw["mode"])
        raise ValueError(f"the oracle does not answer {action!r}")
