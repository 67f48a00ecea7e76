"""A simulated kernel over a `SysRoot`: the switch's writes and commands, given their meaning.

`SimKernel` implements the switch's `HostOps` seam for tests. A write to ``driver_override``,
a driver's ``unbind``/``bind`` or ``drivers_probe`` moves the ``driver`` links in the fixture
tree exactly as the PCI core would and pushes the matching uevents into a `MemorySource`
that the test's watcher reads; ``modprobe``/``modprobe -r`` change ``sys/module`` (with
refcounts, EBUSY while a process holds ``/dev/nvidia*``, and the driver's devices unbound
on unload); ``nvidia-modprobe``, ``nvidia-ctk`` and ``systemctl`` do what they do to a host.

The hazards are modelled too, because the switch exists to avoid them: an unbind whose
driver still has open files never returns (nvidia's remove, snd_hda_intel's, vfio-pci's or a
variant's with a VM on the group node or the device cdev, or a userspace driver on a
no-IOMMU group's node), and ``wedge_unbind`` makes a driver's unbind hang regardless. A hung
write leaves a task in D state with the driver's remove path in its ``/proc/<pid>/stack``
(nvidia's for nvidia), as a real wedge does. Every write and command is recorded, in order,
*after* the same allow-list checks the real seam makes, so a test can assert that something
was never written.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import pickle
import re
import stat
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
from pydantic import BaseModel

from gpuwatch.core.modes import is_vfio_driver
from gpuwatch.core.plan import module_of
from gpuwatch.core.uevent import UEvent
from gpuwatch.errors import ConfigError, HostStepError, StepTimedOut
from gpuwatch.hostfs.files import link_name, list_dir, read_attr, resolve_in_root
from gpuwatch.hostfs.scan import HostPaths, read_function
from gpuwatch.sources import EventSource, SourceOverflow
from gpuwatch.sources.memory import MemorySource
from gpuwatch.switch.hostops import (
    Backend,
    CommandResult,
    check_command,
    check_dir,
    check_write,
    split_namespaced,
    write_target,
)
from gpuwatch.testing.sysroot import CDI_SPEC, SysRoot

if TYPE_CHECKING:
    from gpuwatch.host import Host
    from gpuwatch.switch.engine import SwitchEngine

__all__ = ["DEFAULT_TOOLS", "SIMKERNEL_ENV", "SimKernel", "install_saved_backend", "load_backend",
           "save_for_subprocess", "simulated_switch"]

#: Tests only: the path of a simulated kernel saved by `save_for_subprocess`. A switch command
#: of ``python -m gpuwatch`` (``mode``, ``recover``…) run with it set switches that saved
#: fixture instead of a host, so a test can drive a real process (signals and all). Never set
#: it elsewhere: the command then acts on the fixture, not on the machine.
SIMKERNEL_ENV = "GPUWATCH_TESTING_SIMKERNEL"

DEFAULT_TOOLS = frozenset({"modprobe", "nvidia-modprobe", "nvidia-ctk", "systemctl"})

_OVERRIDE_RE = re.compile(r"^/sys/bus/pci/devices/([^/]+)/driver_override$")
_DRIVER_FILE_RE = re.compile(r"^/sys/bus/pci/drivers/([^/]+)/(unbind|bind)$")
#: Modules that take a reference on another when loaded (user → used).
_DEPENDS = {"nvidia_uvm": "nvidia", "nvidia_modeset": "nvidia", "nvidia_drm": "nvidia_modeset",
            "nvidia_peermem": "nvidia", "vfio_pci": "vfio"}
_REMOVE_TAIL = ("[<0>] pci_device_remove+0x3e/0xb0\n"
                "[<0>] device_release_driver_internal+0x1b/0x30\n"
                "[<0>] unbind_store+0xd9/0x100\n")
_NVIDIA_STACK = ("[<0>] os_delay+0x3c/0x60 [nvidia]\n"
                 "[<0>] nv_pci_remove+0x1b4/0x380 [nvidia]\n" + _REMOVE_TAIL)
#: vfio-pci-core's remove, waiting for the VM to release the device (variants share it).
_VFIO_STACK = ("[<0>] vfio_unregister_group_dev+0x9c/0x160 [vfio]\n"
               "[<0>] vfio_pci_core_unregister_device+0x1d/0x70 [vfio_pci_core]\n"
               "[<0>] vfio_pci_remove+0x15/0x30 [vfio_pci]\n" + _REMOVE_TAIL)
_OTHER_STACK = _REMOVE_TAIL


def _error(code: int, what: str) -> HostStepError:
    return HostStepError(code, f"{what}: {os.strerror(code)}")


class SimKernel:
    """The switch's `HostOps` over a fixture tree, with uevents into ``source``."""

    def __init__(self, sysroot: SysRoot, source: MemorySource | None = None, *,
                 tools: Iterable[str] = DEFAULT_TOOLS) -> None:
        self.sys = sysroot
        self.root = str(sysroot.root)
        self.paths = HostPaths(self.root)
        self._source = source
        #: Every write, command and mkdir, in order: ``("write", path, value)``,
        #: ``("command", *argv)``, ``("mkdir", path)``.
        self.record: list[tuple[str, ...]] = []
        #: Drivers whose unbind never returns, holders or not.
        self.wedge_unbind: set[str] = set()
        #: Model the kernel's remove waiting for open files (the real hazard). On by default.
        self.unbind_waits_for_holders = True
        #: Drop ``bind`` uevents (and the ``vfio-dev`` adds of the bind): the tree changes but
        #: the watcher is not told.
        self.lose_bind_events = False
        #: Drop ``unbind`` uevents (and the ``vfio-dev`` removes of the unbind) the same way:
        #: with both lost, a rebind to the same driver leaves no trace but the tree.
        self.lose_unbind_events = False
        #: ``modprobe NAME`` of these fails (module not found).
        self.fail_modules: set[str] = set()
        self.tools = set(tools)
        self.stuck: list[tuple[str, str, int]] = []  # (addr, driver, pid of the D task)
        self._overrides: dict[str, str] = {}
        self._next_stuck_pid = 31337
        self._persistenced_refs: dict[int, int] = {}  # pid → nvidia refcnt its files hold
        #: Whether the simulated kernel has the VFIO device cdev (``vfio-dev/vfioN/dev``).
        self.vfio_cdev = True
        self._next_vfio_dev = 0
        #: Seconds each write and command takes (a slow host: lets a test interrupt a switch
        #: part-way).
        self.step_delay = 0.0
        #: Seconds the switch's read of the host facts takes (a slow holder scan: lets a test
        #: signal a switch before it begins), and a file touched when that read starts.
        self.facts_delay = 0.0
        self.facts_marker = ""
        #: A write or command (its record, ``("write", path, value)`` or ``("command",
        #: *argv)``) after whose effect the kernel stops: the file `pause_marker` is touched
        #: and the caller sleeps for ever, so that a test can kill the process at exactly
        #: that step (SIGKILL). Once only.
        self.pause_on: tuple[str, ...] | None = None
        self.pause_marker = ""
        #: Where a test subprocess's kernel is saved after every write and command (set by
        #: `load_backend`): a process killed with SIGKILL runs no exit handler, and the next
        #: command must find the kernel as the killed one left it.
        self.save_path = ""

    def __getstate__(self) -> dict[str, Any]:
        """A live queue is no state: the next run makes its own."""
        return {**self.__dict__, "_source": None}

    @property
    def source(self) -> MemorySource:
        """Where the uevents go; made on first use (an unused one would never be closed)."""
        if self._source is None:
            self._source = MemorySource()
        return self._source

    @source.setter
    def source(self, value: MemorySource) -> None:
        self._source = value

    def new_source(self) -> EventSource:
        """An event source for one watcher: on ``start`` it becomes where uevents go. Nothing
        is allocated until then, so a command that never watches leaves nothing open."""
        return _SimSource(self)

    # ----------------------------------------------------------------- records

    @property
    def writes(self) -> list[tuple[str, str]]:
        return [(r[1], r[2]) for r in self.record if r[0] == "write"]

    @property
    def commands(self) -> list[tuple[str, ...]]:
        return [r[1:] for r in self.record if r[0] == "command"]

    @property
    def overrides(self) -> dict[str, str]:
        """Each function's ``driver_override`` now (the kernel's state, not a record): a
        function absent here has none."""
        return dict(self._overrides)

    # ----------------------------------------------------------------- fixture helpers

    def add_holder(self, pid: int, comm: str, node: str, *, via: str = "fd") -> None:
        """A process keeping ``node`` open (``via="fd"``) or mapped (``via="maps"``)."""
        if via == "fd":
            self.sys.add_process(pid, comm, fds={3: node})
        else:
            self.sys.add_process(pid, comm, maps=[node])

    def start_persistenced(self, pid: int = 777) -> None:
        """nvidia-persistenced holding ``/dev/nvidiactl`` and ``/dev/nvidia0`` open; as in the
        kernel, each open file takes a reference on the nvidia module (``refcnt``)."""
        nodes = [n for n in ("/dev/nvidiactl", "/dev/nvidia0")
                 if os.path.exists(self.paths.under(n))]
        self.sys.add_process(pid, "nvidia-persiste", fds={3 + i: n for i, n in enumerate(nodes)})
        if self._module_loaded("nvidia"):
            self._set_refcnt("nvidia", self._refcnt("nvidia") + len(nodes))
        self._persistenced_refs[pid] = len(nodes) if self._module_loaded("nvidia") else 0

    def release_stuck(self) -> None:
        """The hung unbinds finally return (their holders went away): finish them."""
        stuck, self.stuck = self.stuck, []
        for addr, driver, pid in stuck:
            self.sys.remove_process(pid)
            if self._driver(addr) == driver:
                self._unbind(addr)

    def reboot(self, boot_id: str) -> None:
        """A new boot: a new boot id, and no stuck task survives it."""
        for _addr, _driver, pid in self.stuck:
            self.sys.remove_process(pid)
        self.stuck = []
        self.sys.set_boot_id(boot_id)

    # ----------------------------------------------------------------- HostOps

    def which(self, name: str) -> str | None:
        """Where a tool is. Asked once per read of the host facts (off the event loop),
        so `facts_delay` slows that read down here."""
        if self.facts_delay:
            if self.facts_marker:
                with open(self.facts_marker, "a", encoding="utf-8"):
                    pass
            time.sleep(self.facts_delay)
        return f"/usr/bin/{name}" if name in self.tools else None

    async def makedirs(self, path: str) -> None:
        check_dir(path)
        self.record.append(("mkdir", path))
        os.makedirs(write_target(self.root, path, folder=True), exist_ok=True)

    async def write(self, path: str, value: str, timeout: float) -> None:
        check_write(path, value)
        self.record.append(("write", path, value))
        await anyio.sleep(self.step_delay)
        try:
            await self._write(path, value, timeout)
        finally:
            await self._stepped(("write", path, value))

    async def _stepped(self, entry: tuple[str, ...]) -> None:
        """After a write or command: save the kernel (`save_path`), then stop for ever when
        this was the step to stop at (`pause_on`)."""
        pause = self.pause_on is not None and entry == self.pause_on
        if pause:
            self.pause_on = None
        if self.save_path:
            with contextlib.suppress(OSError):
                _save(self, self.save_path)
        if pause:
            if self.pause_marker:
                with open(self.pause_marker, "a", encoding="utf-8"):
                    pass
            await anyio.sleep_forever()

    async def _write(self, path: str, value: str, timeout: float) -> None:
        if m := _OVERRIDE_RE.fullmatch(path):
            addr = m.group(1)
            self._require(addr, path)
            name = value.split("\n", 1)[0]
            if name:
                self._overrides[addr] = name
            else:
                self._overrides.pop(addr, None)
            self.sys.set_attr(addr, "driver_override", (name or "(null)") + "\n")
            return
        if path == "/sys/bus/pci/drivers_probe":
            self._require(value, path)
            self._probe(value)
            return
        m = _DRIVER_FILE_RE.fullmatch(path)
        assert m is not None  # check_write allows nothing else
        driver, op = m.group(1), m.group(2)
        addr = value
        self._require(addr, path)
        if op == "bind":
            if self._driver(addr):
                raise _error(errno.EBUSY, f"write {addr} to {path}")
            if not self._module_loaded(module_of(driver)):
                raise _error(errno.ENODEV, f"write {addr} to {path}")
            self._bind(addr, driver)
            return
        if self._driver(addr) != driver:
            raise _error(errno.ENODEV, f"write {addr} to {path}")
        if driver in self.wedge_unbind or (self.unbind_waits_for_holders
                                           and self._unbind_blocked(addr, driver)):
            await self._hang(addr, driver, path, value, timeout)
        self._unbind(addr)

    async def run(self, argv: Sequence[str], timeout: float) -> CommandResult:
        check_command(argv)
        self.record.append(("command", *argv))
        await anyio.sleep(self.step_delay)
        try:
            return self._run(list(argv))
        finally:
            await self._stepped(("command", *argv))

    def _run(self, argv: list[str]) -> CommandResult:
        # A command through nsenter (`InHostNamespaces`) runs in the host's namespaces: the
        # same tools, and paths that are the host's own (the tree's, read from its root).
        prefix, command = split_namespaced(argv)
        name, args = command[0], list(command[1:])
        if name not in self.tools:
            return CommandResult(127, "", f"{name}: command not found")
        if name == "modprobe":
            return self._modprobe(args)
        if name == "nvidia-modprobe":
            for node in ("/dev/nvidiactl", "/dev/nvidia0"):
                self.sys.add_dev_node(node)
            if "-u" in args:
                self._load("nvidia_uvm")
                self.sys.add_dev_node("/dev/nvidia-uvm")
                self.sys.add_dev_node("/dev/nvidia-uvm-tools")
            return CommandResult(0)
        if name == "nvidia-ctk":
            # nvidia-ctk runs outside the root: it follows the tree's links as this host
            # does. A write that would land outside the tree is refused here, never made.
            # The spec's own name is followed too, when it is a link (dangling: a spec
            # that is there was never regenerated).
            output = args[2].partition("=")[2]
            if prefix:  # the host's path, every link on the way read as the host reads it
                output = resolve_in_root(self.root, os.path.join(self.root, output.lstrip("/")),
                                         follow_last=True)
            real = os.path.realpath(output)
            real_dir = os.path.dirname(real)
            inside = (real_dir + "/").startswith(os.path.realpath(self.root).rstrip("/") + "/")
            if os.path.basename(output) != "nvidia.yaml" or not inside:
                return CommandResult(1, "", f"level=error msg=\"cannot write {output}\" "
                                            f"(it leads to {real_dir}, outside the tree)")
            if not os.path.isdir(real_dir):
                return CommandResult(1, "", f"level=error msg=\"no such directory for {output}\"")
            with open(real, "w", encoding="utf-8") as fh:
                fh.write(CDI_SPEC)
            return CommandResult(0, "", f"level=info msg=\"Generated CDI spec with version 0.5.0\" "
                                        f"output={output}")
        if name == "systemctl":
            if args[0] == "stop":
                for pid in self._pids():
                    if read_attr(f"{self.root}/proc/{pid}/comm").startswith("nvidia-persist"):
                        self.sys.remove_process(pid)
                        refs = self._persistenced_refs.pop(pid, 0)
                        if refs and self._module_loaded("nvidia"):
                            self._set_refcnt("nvidia", max(self._refcnt("nvidia") - refs, 0))
            else:
                self.start_persistenced()
            return CommandResult(0)
        return CommandResult(127, "", f"{name}: command not found")

    # ----------------------------------------------------------------- PCI core

    def _require(self, addr: str, path: str) -> None:
        if addr not in self.sys.functions:
            raise _error(errno.ENODEV, f"write to {path}")

    def _driver(self, addr: str) -> str:
        return link_name(os.path.join(self.paths.bus_pci, addr, "driver"))

    def _natural(self, addr: str) -> str:
        """The driver whose id table matches the device (what binds without an override)."""
        seen = read_function(self.paths, addr)
        klass = getattr(seen, "klass", "")
        if klass.startswith("0x03") and getattr(seen, "vendor_id", "") == "0x10de":
            return "nvidia"
        if klass == "0x0403":
            return "snd_hda_intel"
        return ""

    def _probe(self, addr: str) -> None:
        if self._driver(addr):
            return  # already bound: drivers_probe does nothing and says nothing
        driver = self._overrides.get(addr) or self._natural(addr)
        if driver and self._module_loaded(module_of(driver)):
            self._bind(addr, driver)

    def _bind(self, addr: str, driver: str) -> None:
        self.sys.bind(addr, driver)
        if is_vfio_driver(driver):  # vfio-pci or a variant: vfio-pci-core registers both
            group = self._group(addr)
            if group >= 0 and not os.path.exists(self.paths.under(f"/dev/vfio/{group}")):
                devpath = self.sys.add_vfio_group(group)
                self.source.push(self.sys.uevent_props("add", devpath))
            devpath = self.sys.add_vfio_dev(addr, self._next_vfio_dev, cdev=self.vfio_cdev)
            self._next_vfio_dev += 1
            if not self.lose_bind_events:  # lost with the bind it belongs to
                self.source.push(self.sys.uevent_props("add", devpath))
        if not self.lose_bind_events:
            self.source.push(self.sys.uevent_props("bind", addr))

    def _unbind(self, addr: str) -> None:
        driver = self._driver(addr)
        if os.path.isdir(os.path.join(self.paths.bus_pci, addr, "vfio-dev")):
            devpath = self.sys.remove_vfio_dev(addr)
            if not self.lose_unbind_events:  # lost with the unbind it belongs to
                self.source.push(self.sys.uevent_props("remove", devpath))
        self.sys.unbind(addr)
        if not self.lose_unbind_events:
            self.source.push(self.sys.uevent_props("unbind", addr))
        if is_vfio_driver(driver):
            group = self._group(addr)
            still = [a for a in self.sys.functions
                     if self._group(a) == group and is_vfio_driver(self._driver(a))]
            if group >= 0 and not still and os.path.exists(self.paths.under(f"/dev/vfio/{group}")):
                self.sys.remove_vfio_group(group)
                self.source.push(self.sys.uevent_props("remove", f"/devices/virtual/vfio/{group}"))

    def _group(self, addr: str) -> int:
        name = link_name(os.path.join(self.paths.bus_pci, addr, "iommu_group"))
        return int(name) if name.isdigit() else -1

    async def _hang(self, addr: str, driver: str, path: str, value: str, timeout: float) -> None:
        """The write never returns: a task sits in D state until the caller gives up."""
        pid = self._next_stuck_pid
        self._next_stuck_pid += 1
        stack = (_NVIDIA_STACK if driver == "nvidia" else _VFIO_STACK
                 if is_vfio_driver(driver) else _OTHER_STACK)
        self.sys.add_process(pid, "python3", state="D", stack=stack)
        self.stuck.append((addr, driver, pid))
        await anyio.sleep(timeout)
        raise StepTimedOut(f"write {value!r} to {path}", timeout)

    # ----------------------------------------------------------------- holders

    def _pids(self) -> list[int]:
        return sorted(int(n) for n in list_dir(f"{self.root}/proc") if n.isdigit())

    def _held(self, matches: re.Pattern[str]) -> bool:
        """Does any process have an fd on, or a mapping of, a matching node?"""
        for pid in self._pids():
            base = f"{self.root}/proc/{pid}"
            for fd in list_dir(f"{base}/fd"):
                try:
                    if matches.match(os.readlink(f"{base}/fd/{fd}")):
                        return True
                except OSError:
                    continue
            try:
                with open(f"{base}/maps", encoding="utf-8", errors="replace") as fh:
                    for line in fh:
                        parts = line.split(None, 5)
                        if len(parts) == 6 and matches.match(parts[5].strip()):
                            return True
            except OSError:
                continue
        return False

    def _unbind_blocked(self, addr: str, driver: str) -> bool:
        if driver == "nvidia":
            info = read_attr(f"{self.root}/proc/driver/nvidia/gpus/{addr}/information")
            minor = re.search(r"^Device Minor:\s*([0-9]+)", info, re.MULTILINE)
            if minor is None:  # no way to tell the card's clients apart: any client blocks
                return self._held(re.compile(r"^/dev/nvidia"))
            return self._held(re.compile(rf"^/dev/nvidia{minor.group(1)}$"))
        if is_vfio_driver(driver):
            # vfio-pci-core's remove (variants share it) waits for the VM to let go, whether
            # it opened the group node or the device's cdev (iommufd).
            group = self._group(addr)
            names = [f"/dev/vfio/{group}", f"/dev/vfio/noiommu-{group}"]
            names += [f"/dev/vfio/devices/{n}" for n in list_dir(
                os.path.join(self.paths.bus_pci, addr, "vfio-dev"))
                if n.startswith(("vfio", "noiommu-vfio"))]
            return self._held(re.compile("^(" + "|".join(map(re.escape, names)) + ")$"))
        if driver == "snd_hda_intel":
            return self._held(re.compile(r"^/dev/snd/"))
        return False

    # ----------------------------------------------------------------- modules

    def _module_dir(self, name: str) -> str:
        return os.path.join(self.paths.module, name)

    def _module_loaded(self, name: str) -> bool:
        return os.path.isdir(self._module_dir(name))

    def _refcnt(self, name: str) -> int:
        text = read_attr(os.path.join(self._module_dir(name), "refcnt"))
        return int(text) if text.isdigit() else 0

    def _set_refcnt(self, name: str, value: int) -> None:
        with open(os.path.join(self._module_dir(name), "refcnt"), "w", encoding="ascii") as fh:
            fh.write(f"{max(0, value)}\n")

    def _modprobe(self, args: list[str]) -> CommandResult:
        if args[:1] == ["-r"]:
            for raw in args[1:]:
                name = raw.replace("-", "_")
                if not self._module_loaded(name):
                    return CommandResult(1, "", f"modprobe: FATAL: Module {name} is not "
                                                "currently loaded.")
                if self._module_busy(name):
                    return CommandResult(1, "", f"modprobe: FATAL: Module {name} is in use.")
                self._unload(name)
            return CommandResult(0)
        for raw in args:
            name = raw.replace("-", "_")
            if name in self.fail_modules:
                return CommandResult(1, "", f"modprobe: FATAL: Module {name} not found in "
                                            "directory /lib/modules/6.8.0")
            if not self._module_loaded(name):
                self._load(name)
        return CommandResult(0)

    def _module_busy(self, name: str) -> bool:
        if self._refcnt(name) > 0:
            return True
        if name == "nvidia":
            return self._held(re.compile(r"^/dev/nvidia"))
        if name == "nvidia_uvm":
            return self._held(re.compile(r"^/dev/nvidia-uvm"))
        return False

    def _load(self, name: str) -> None:
        used = _DEPENDS.get(name)
        if used is not None and not self._module_loaded(used):
            self._load(used)
        devpath = self.sys.add_module(name)
        if used is not None:
            holder = os.path.join(self._module_dir(used), "holders", name)
            if not os.path.lexists(holder):
                os.symlink(f"../../{name}", holder)
            self._set_refcnt(used, self._refcnt(used) + 1)
        self.source.push(self.sys.uevent_props("add", devpath))
        driver = "vfio-pci" if name == "vfio_pci" else name
        for addr in self.sys.functions:
            if self._driver(addr):
                continue
            wanted = self._overrides.get(addr) or self._natural(addr)
            if wanted == driver:
                self._bind(addr, driver)

    def _unload(self, name: str) -> None:
        for addr in self.sys.functions:
            if module_of(self._driver(addr)) == name:
                self._unbind(addr)
        if name == "nvidia_drm":
            self._remove_nvidia_drm_nodes()
        for other in list_dir(self.paths.module):
            if os.path.lexists(os.path.join(self._module_dir(other), "holders", name)):
                self._set_refcnt(other, self._refcnt(other) - 1)
        self.sys.remove_module(name)
        self.source.push(self.sys.uevent_props("remove", f"/module/{name}"))

    def _remove_nvidia_drm_nodes(self) -> None:
        for name in sorted(list_dir(self.paths.class_drm)):
            if not re.match(r"^(card|renderD)[0-9]+$", name):
                continue
            owner = link_name(os.path.join(self.paths.class_drm, name, "device"))
            if owner and self._driver(owner) == "nvidia":
                real = os.path.realpath(os.path.join(self.paths.class_drm, name))
                devpath = real[len(os.path.realpath(self.paths.sys)):]
                self.sys.remove_drm(name)
                self.source.push(self.sys.uevent_props("remove", devpath))


def save_for_subprocess(sim: SimKernel, path: str | os.PathLike[str], *, euid: int = 0) -> None:
    """Save ``sim`` (its fixture's bookkeeping included) for a ``gpuwatch`` subprocess run
    with ``GPUWATCH_TESTING_SIMKERNEL=path`` (`SIMKERNEL_ENV`); ``euid`` is who it runs as."""
    if sim._source is not None:
        raise ValueError("save the simulated kernel before any watcher uses it")
    if os.path.realpath(sim.root) == "/":
        raise ValueError("the simulated kernel runs over a fixture root, never the real one")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as fh:
        pickle.dump({"sim": sim, "euid": euid, "root": os.path.realpath(sim.root)}, fh)


def _save(sim: SimKernel, path: str) -> None:
    """Save a test subprocess's kernel back, in place of the file it was loaded from
    (atomically: a process killed half-way through leaves the last whole save)."""
    with open(path, "rb") as fh:
        saved: dict[str, Any] = pickle.load(fh)
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as fh:
        pickle.dump({**saved, "sim": sim}, fh)
    os.replace(tmp, path)


def install_saved_backend(path: str) -> None:
    """Make every switch command of this process use the kernel saved at ``path`` (what
    ``python -m gpuwatch`` does when `SIMKERNEL_ENV` is set)."""
    from gpuwatch.switch import hostops

    hostops.backend_factory = lambda root: load_backend(path, root)


def _load_own_file(path: str) -> dict[str, Any]:
    """Unpickle only a regular file this user owns and nobody else may write, and never for
    the real root: a stray or planted variable must not run code or simulate over /sys."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigError(f"{SIMKERNEL_ENV}: cannot open {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise ConfigError(f"{SIMKERNEL_ENV}: {path} is not a private regular file of this user")
        saved: dict[str, Any] = pickle.load(fh)  # a file the test itself wrote (test-only)
    if saved.get("root") in (None, "/"):
        raise ConfigError(f"{SIMKERNEL_ENV}: {path} does not name a fixture root")
    return saved


def load_backend(path: str, root: str) -> Backend:
    """The switch backend of a test subprocess: the kernel `save_for_subprocess` left at
    ``path``, for the same ``root`` only. What the run changes is saved back at exit, so the
    next command finds the fixture's bookkeeping in step with its tree."""
    saved = _load_own_file(path)
    sim: SimKernel = saved["sim"]
    if saved["root"] != os.path.realpath(root):
        raise ConfigError(f"{SIMKERNEL_ENV}: {path} simulates {saved['root']}, not {root}")
    euid: int = saved["euid"]
    sim.save_path = path

    def save_back() -> None:
        with contextlib.suppress(OSError):
            _save(sim, path)

    atexit.register(save_back)
    return Backend(sim, sim.new_source(), lambda: euid)


class _SimSource:
    name = "memory"

    def __init__(self, sim: SimKernel) -> None:
        self.warnings: list[str] = []
        self._sim = sim
        self._src: MemorySource | None = None

    def start(self) -> None:
        if self._src is None:
            self._src = MemorySource()
            self._sim.source = self._src

    def batches(self) -> AsyncIterator[list[UEvent] | SourceOverflow]:
        self.start()
        assert self._src is not None
        return self._src.batches()

    def close(self) -> None:
        if self._src is not None:
            self._src.close()


@asynccontextmanager
async def simulated_switch(
    host: SysRoot, *, euid: int = 0, sim: SimKernel | None = None,
    poison_path: str | os.PathLike[str] | None = None, step_timeout: float = 30.0,
    scan_timeout: float = 10.0, tree_check_after: float = 5.0,
) -> AsyncIterator[tuple[Host, SimKernel, SwitchEngine, list[BaseModel]]]:
    """A `Host` over ``host`` fed and switched by a simulated kernel.

    Yields ``(host, sim, engine, events)``; ``events`` collects every published event.
    ``euid`` is who the engine believes it runs as (0: root).
    """
    from gpuwatch.host import open_host

    kernel = sim if sim is not None else SimKernel(host)
    kernel.source = MemorySource()  # a watcher closes its source: each one gets its own
    async with open_host(host.root, source=kernel.source, ops=kernel, geteuid=lambda: euid,
                         poison_path=poison_path, step_timeout=step_timeout,
                         scan_timeout=scan_timeout, tree_check_after=tree_check_after,
                         reconcile_interval=0, cdi_poll_interval=0) as gpu_host:
        events: list[BaseModel] = []
        gpu_host.listeners.append(events.append)
        yield gpu_host, kernel, gpu_host.engine, events
