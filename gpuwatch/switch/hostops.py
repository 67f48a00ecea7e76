"""The one seam through which the switch changes the host: sysfs writes and host commands.

Everything the switch does to a host goes through a `HostOps`: `RealHostOps` here, the
simulated kernel (`gpuwatch.testing.simkernel`) in tests. Both run the same allow-list checks
first (`check_write`, `check_command`), so a malformed address or driver name is refused
before anything is written, whichever side of the seam is plugged in.

Why a child process per write: a sysfs write can block forever in the kernel (nvidia's remove
waiting on a client, holding the device lock). A thread stuck there can never be joined and
keeps the interpreter from exiting; a child process can be abandoned after a timeout while
the caller goes on. Commands are argument lists run without a shell, each under a timeout.

In a container (the Kubernetes switching overlay) the commands are the host's, not the
image's: with the ``host_namespaces`` setting `make_backend` wraps the ops in
`InHostNamespaces`, which runs each one as ``nsenter --target 1 --mount --uts --ipc --pid --
COMMAND…``. systemctl then reaches the host's systemd, modprobe reads the host's
``/lib/modules`` and ``/etc/modprobe.d`` (its options and softdeps), nvidia-modprobe makes the
host's ``/dev/nvidia*`` and nvidia-ctk writes the host's CDI spec. sysfs writes stay as they
are, under the root.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import anyio
import anyio.to_thread

from gpuwatch.core.pci import DRIVER_NAME_RE, PCI_ADDR_PATTERN, PCI_ADDR_RE
from gpuwatch.errors import ConfigError, HostStepError, StepTimedOut, UnsafeStep
from gpuwatch.hostfs.files import resolve_in_root, tree_dir
from gpuwatch.hostfs.hostview import HOST_PATH, host_which
from gpuwatch.settings import ConfigInForce, host_namespaces_in_force
from gpuwatch.sources import EventSource

if TYPE_CHECKING:
    from gpuwatch.core.tables import Tables

_ADDR = PCI_ADDR_PATTERN
_DRV = r"[A-Za-z0-9_.-]+"
_OVERRIDE_RE = re.compile(rf"^/sys/bus/pci/devices/({_ADDR})/driver_override$")
_DRIVER_FILE_RE = re.compile(rf"^/sys/bus/pci/drivers/({_DRV})/(?:unbind|bind)$")
_PROBE_PATH = "/sys/bus/pci/drivers_probe"
_MODULE_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_ALLOWED_DIRS = frozenset({"/etc/cdi"})
#: The host commands the switch may run, and nothing else.
ALLOWED_COMMANDS = frozenset({"modprobe", "nvidia-modprobe", "nvidia-ctk", "systemctl"})
#: nsenter's arguments before every host command with ``host_namespaces`` on: the mount, UTS,
#: IPC and PID namespaces of PID 1 (the host's init, with the pod's ``hostPID: true``).
NSENTER_ARGS = ("--target", "1", "--mount", "--uts", "--ipc", "--pid", "--")
#: How long a killed child gets to go away before it is abandoned (a D-state task never does).
_REAP_GRACE = 0.5

# Children killed after a timeout that did not exit (stuck in the kernel). Kept referenced so
# that no finaliser ever waits on them; the kernel reaps them if their write ever returns.
_ABANDONED: list[subprocess.Popen[bytes]] = []


@dataclass(frozen=True, slots=True)
class CommandResult:
    returncode: int
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def message(self) -> str:
        """The command's own last words, for a one-line error."""
        text = (self.stderr or self.stdout).strip().splitlines()
        return text[-1] if text else f"exit status {self.returncode}"


@runtime_checkable
class HostOps(Protocol):
    """Host side effects. Paths are host paths (``/sys/…``) resolved under the ops' root."""

    async def write(self, path: str, value: str, timeout: float) -> None:
        """Write ``value`` to a sysfs file; `StepTimedOut` if it does not return in time,
        `HostStepError` with the errno's text if the kernel said no."""
        ...

    async def run(self, argv: Sequence[str], timeout: float) -> CommandResult:
        """Run an allowed command; `StepTimedOut` if it does not finish in time."""
        ...

    async def makedirs(self, path: str) -> None:
        ...

    def which(self, name: str) -> str | None:
        ...


# --------------------------------------------------------------------------- allow-lists


def check_write(path: str, value: str) -> None:
    """Refuse (`UnsafeStep`) any write the switch never makes: only ``driver_override`` (a
    driver name, or a newline to clear it), a driver's ``bind``/``unbind`` and
    ``drivers_probe`` (a canonical address)."""
    if _OVERRIDE_RE.fullmatch(path):
        if value != "\n" and (not DRIVER_NAME_RE.fullmatch(value) or value in (".", "..")):
            raise UnsafeStep(f"refusing to write {value!r} to {path}: not a driver name")
        return
    driver_file = _DRIVER_FILE_RE.fullmatch(path)
    if driver_file is not None and driver_file.group(1) in (".", ".."):
        raise UnsafeStep(f"refusing to write to {path!r}: not a driver's folder")
    if driver_file is not None or path == _PROBE_PATH:
        if not PCI_ADDR_RE.fullmatch(value):
            raise UnsafeStep(f"refusing to write {value!r} to {path}: not a PCI address")
        return
    raise UnsafeStep(f"refusing to write to {path!r}: not a file the switch writes")


def split_namespaced(argv: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(prefix, command)`` of an argument list: the prefix is ``nsenter`` (an absolute path)
    with exactly `NSENTER_ARGS`, or empty. Any other use of nsenter is refused (`UnsafeStep`)."""
    argv = tuple(argv)
    if argv and os.path.basename(argv[0]) == "nsenter":
        end = 1 + len(NSENTER_ARGS)
        if not os.path.isabs(argv[0]) or argv[1:end] != NSENTER_ARGS:
            raise UnsafeStep(f"refusing to run {list(argv)!r}: nsenter only as "
                             f"PATH {' '.join(NSENTER_ARGS)} COMMAND")
        return argv[:end], argv[end:]
    return (), argv


def check_command(argv: Sequence[str]) -> None:
    """Refuse (`UnsafeStep`) any command outside the switch's few, with odd arguments; one
    run in the host's namespaces (`split_namespaced`) is checked without its prefix."""
    argv = split_namespaced(argv)[1]
    if not argv or argv[0] not in ALLOWED_COMMANDS:
        raise UnsafeStep(f"refusing to run {list(argv)!r}: not one of {sorted(ALLOWED_COMMANDS)}")
    args = list(argv[1:])
    if any("\0" in a or "\n" in a for a in args):
        raise UnsafeStep(f"refusing to run {list(argv)!r}: control characters in an argument")
    name = argv[0]
    if name == "modprobe":
        names = args[1:] if args[:1] == ["-r"] else args
        if not names or not all(_MODULE_RE.fullmatch(n) for n in names):
            raise UnsafeStep(f"refusing to run {list(argv)!r}: malformed module name")
    elif name == "systemctl":
        if len(args) != 2 or args[0] not in ("stop", "start") or args[1] != "nvidia-persistenced":
            raise UnsafeStep(f"refusing to run {list(argv)!r}: only nvidia-persistenced")
    elif name == "nvidia-ctk":
        if (args[:2] != ["cdi", "generate"] or len(args) != 3
                or not args[2].startswith("--output=/")):
            raise UnsafeStep(f"refusing to run {list(argv)!r}: only cdi generate --output=PATH")
    elif name == "nvidia-modprobe" and not all(re.fullmatch(r"-[cu]|[0-9]+", a) for a in args):
        raise UnsafeStep(f"refusing to run {list(argv)!r}: unexpected argument")


def check_dir(path: str) -> None:
    if path not in _ALLOWED_DIRS:
        raise UnsafeStep(f"refusing to create {path!r}: not a folder the switch makes")


def under_root(root: str, host_path: str) -> str:
    """``/sys/x`` under ``root``; the host path must be absolute and free of ``..``."""
    if not host_path.startswith("/") or "/../" in host_path + "/" or "\0" in host_path:
        raise UnsafeStep(f"refusing path {host_path!r}")
    return os.path.join(os.path.abspath(root), host_path.lstrip("/"))


def write_target(root: str, host_path: str, *, folder: bool = False) -> str:
    """Where a write to ``host_path`` lands under ``root``, every link on the way read as in a
    chroot (`resolve_in_root`), and checked to lie in the tree: a fixture or captured tree
    whose links are spelled absolute (``/sys/devices/…``) must never lead a switch's write to
    the sysfs of the host running it. The last component is opened with ``O_NOFOLLOW``; for a
    ``folder`` to make it is read as in a chroot too (``etc/cdi`` a link to ``/run/cdi`` is the
    tree's ``run/cdi``: followed by this host, it would name the ``/run`` gpuwatch runs in)."""
    root = os.path.abspath(root)
    try:
        target = resolve_in_root(root, under_root(root, host_path), follow_last=folder)
    except (OSError, ValueError) as exc:
        raise UnsafeStep(f"refusing to write {host_path!r} under {root}: {exc}") from None
    real_root = os.path.realpath(root)
    real_parent = os.path.realpath(os.path.dirname(target))
    if real_root != "/" and not (real_parent + "/").startswith(real_root.rstrip("/") + "/"):
        raise UnsafeStep(f"refusing to write {host_path!r}: under {root} it leads to "
                         f"{real_parent}, outside the tree")
    return target


# --------------------------------------------------------------------------- child processes

_CHILD_WRITE = """\
import os, sys
path, value = sys.argv[1], sys.argv[2]
try:
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        data = value.encode()
        if os.write(fd, data) != len(data):
            raise OSError(5, "short write")
    finally:
        os.close(fd)
except OSError as exc:
    sys.stderr.write("%d\\t%s\\n" % (exc.errno or 0, exc.strerror or exc))
    sys.exit(3)
"""


def _python() -> str:
    return sys.executable or shutil.which("python3") or "python3"


def _finish(proc: subprocess.Popen[bytes], timeout: float) -> tuple[bytes, bytes]:
    """communicate() under ``timeout``; on expiry kill it and whatever it started (its own
    session: a hung ``nvidia-ctk`` or a wrapper script's children would otherwise run on
    after the step gave up, holding our pipes), give it a moment, then abandon it."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # started with start_new_session: pgid == pid
        except OSError:  # gone already, or not a group of its own
            proc.kill()
        try:
            proc.communicate(timeout=_REAP_GRACE)
        except subprocess.TimeoutExpired:
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
            _ABANDONED.append(proc)
        raise


def write_in_child(target: str, value: str, timeout: float) -> None:
    """Write ``value`` to the file ``target`` from a child process, bounded by ``timeout``.

    Blocking, but never for longer than ``timeout`` plus a short grace: a child stuck in
    the kernel is killed and abandoned, the caller gets `StepTimedOut`.
    """
    proc = subprocess.Popen(
        [_python(), "-I", "-S", "-c", _CHILD_WRITE, target, value],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        close_fds=True, start_new_session=True, env={"LC_ALL": "C"},
    )
    try:
        _, err = _finish(proc, timeout)
    except subprocess.TimeoutExpired:
        raise StepTimedOut(f"write {value!r} to {target}", timeout) from None
    if proc.returncode == 0:
        return
    text = err.decode("utf-8", "replace").strip()
    code, _, message = text.partition("\t")
    errno = int(code) if code.isdigit() else 0
    raise HostStepError(errno, f"write {value!r} to {target}: {message or text or 'failed'}")


def run_bounded(argv: Sequence[str], timeout: float, *, path: str | None = None) -> CommandResult:
    """Run an argument list (no shell) under ``timeout``; kill and abandon it on expiry.
    ``path``: its PATH (default ours)."""
    env = {"PATH": path or os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
           "LC_ALL": "C"}
    try:
        proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, close_fds=True, start_new_session=True, env=env,
        )
    except FileNotFoundError:
        return CommandResult(127, "", f"{argv[0]}: command not found")
    except OSError as exc:
        return CommandResult(126, "", f"{argv[0]}: {exc.strerror or exc}")
    try:
        out, err = _finish(proc, timeout)
    except subprocess.TimeoutExpired:
        raise StepTimedOut("command " + " ".join(argv), timeout) from None
    return CommandResult(proc.returncode, out.decode("utf-8", "replace"),
                         err.decode("utf-8", "replace"))


# --------------------------------------------------------------------------- the real host


def _unescape_mount(text: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def is_real_sysfs(root: str, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """True when ``<root>/sys`` is a mounted sysfs: ``root`` is a view of a live host (``/``,
    or the host's root mounted into a container), not a fixture tree."""
    # Its own link read as in a chroot (`tree_dir`): a fixture whose ``sys`` is a link to
    # ``/sys`` is no view of this host, and may never run a command on it.
    want = os.path.realpath(tree_dir(root, "sys"))
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as fh:
            lines = fh.readlines()
    except OSError:
        return False
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5:
            continue
        if _unescape_mount(fields[4]) == want and right.split()[:1] == ["sysfs"]:
            return True
    return False


class RealHostOps:
    """Writes in child processes under ``root``; commands only where ``root`` is a live host.

    Commands (modprobe, systemctl, nvidia-*) act on the running kernel whatever the root, so
    they are refused unless ``<root>/sys`` is a mounted sysfs (or ``allow_commands`` says so):
    a fixture root can never load or unload a real module by mistake.
    """

    def __init__(self, root: str | os.PathLike[str] = "/", *,
                 allow_commands: bool | None = None) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self._allow_commands = allow_commands

    @property
    def allow_commands(self) -> bool:
        if self._allow_commands is None:
            self._allow_commands = is_real_sysfs(self.root)
        return self._allow_commands

    async def write(self, path: str, value: str, timeout: float) -> None:
        check_write(path, value)
        target = write_target(self.root, path)
        await anyio.to_thread.run_sync(write_in_child, target, value, timeout)

    async def run(self, argv: Sequence[str], timeout: float) -> CommandResult:
        check_command(argv)
        if not self.allow_commands:
            raise UnsafeStep(f"refusing to run {argv[0]}: {self.root}/sys is not a mounted "
                             "sysfs, and host commands act on the running kernel")
        # One in the host's namespaces looks its command up on the host's PATH (nsenter
        # itself is an absolute path): where `InHostNamespaces.which` found it.
        path = HOST_PATH if split_namespaced(argv)[0] else None
        return await anyio.to_thread.run_sync(
            lambda: run_bounded(list(argv), timeout, path=path))

    async def makedirs(self, path: str) -> None:
        check_dir(path)
        os.makedirs(write_target(self.root, path, folder=True), exist_ok=True)

    def which(self, name: str) -> str | None:
        return shutil.which(name)


# --------------------------------------------------------------------------- host namespaces


class NsenterMissing(ConfigError):
    """``host_namespaces`` is on, and this machine (the image) has no nsenter."""


def find_nsenter(where: str = "host_namespaces") -> str:
    """nsenter's absolute path on our PATH, else `NsenterMissing` (exit 2) naming the setting
    that asked for it: found before anything is written, never a command that fails half way."""
    found = shutil.which("nsenter")
    if found is None:
        raise NsenterMissing(f"{where} is on, but nsenter is not on PATH (util-linux): host "
                             "commands cannot run in the host's namespaces")
    return os.path.abspath(found)


_log = logging.getLogger(__name__)


#: This process's own ``/proc``, whose PID 1 is the one nsenter enters.
OWN_PROC = "/proc"


def nsenter_target_is_hosts(root: str, proc: str | None = None) -> bool | None:
    """Whether the PID 1 nsenter enters (``proc``'s, this process's PID namespace) is the
    host's init: its mount namespace is that of ``<root>/proc/1`` (the host's ``/proc``,
    mounted under the root, shows the host's PIDs whatever ours are). False in a pod without
    ``hostPID: true``, whose PID 1 is its own first process (or its pause container's): the
    commands would run there, with the image's tools. None where nothing tells (the root is
    ``/``, a fixture without ``proc/1``, a read refused)."""
    if os.path.abspath(root) == "/":
        return None
    try:
        host = os.readlink(os.path.join(root, "proc/1/ns/mnt"))
        target = os.readlink(os.path.join(proc or OWN_PROC, "1/ns/mnt"))
    except OSError:
        return None
    return host == target


class InHostNamespaces:
    """`HostOps` whose commands run in the host's namespaces: each as ``NSENTER
    NSENTER_ARGS… COMMAND…`` through the ops it wraps, checked by the same allow-list first.
    Writes and folders are the wrapped ops' own (under the root); tools are looked for on
    the host (`host_which`); a path argument under the root (``--output=ROOT/etc/cdi/…``)
    is given as the host's own path, which is what it names in the host's mount namespace."""

    def __init__(self, inner: HostOps, nsenter: str, root: str) -> None:
        self.inner = inner
        self.nsenter = nsenter
        self.root = os.path.abspath(root)

    async def write(self, path: str, value: str, timeout: float) -> None:
        await self.inner.write(path, value, timeout)

    async def makedirs(self, path: str) -> None:
        await self.inner.makedirs(path)

    def which(self, name: str) -> str | None:
        return host_which(self.root, name)

    def host_argv(self, argv: Sequence[str]) -> tuple[str, ...]:
        """``argv`` prefixed with nsenter, its ``--output=`` path made the host's."""
        check_command(argv)
        if split_namespaced(argv)[0]:
            raise UnsafeStep(f"refusing to run {list(argv)!r}: already in the host's namespaces")
        args = []
        for arg in argv:
            flag, sep, value = arg.partition("=")
            if sep and flag == "--output":
                arg = f"{flag}={self._host_path(value)}"
            args.append(arg)
        return (self.nsenter, *NSENTER_ARGS, *args)

    def _host_path(self, path: str) -> str:
        if self.root == "/":
            return path
        rel = os.path.relpath(os.path.normpath(path), self.root)
        if rel == ".." or rel.startswith("../") or not os.path.isabs(path):
            raise UnsafeStep(f"refusing to name {path!r} in the host's namespaces: not under "
                             f"{self.root}")
        return "/" if rel == "." else "/" + rel

    async def run(self, argv: Sequence[str], timeout: float) -> CommandResult:
        return await self.inner.run(self.host_argv(argv), timeout)


# --------------------------------------------------------------------------- backend hook


@dataclass
class Backend:
    """What a command needs to switch: the ops, where uevents come from, who we are."""

    ops: HostOps
    source: EventSource | str = "auto"
    geteuid: Callable[[], int] = field(default=os.geteuid)


def default_backend(root: str) -> Backend:
    return Backend(RealHostOps(root), "auto", os.geteuid)


#: The CLI builds its backend through this; tests replace it with a simulated kernel.
backend_factory: Callable[[str], Backend] = default_backend


def make_backend(root: str, *, host_namespaces: bool | None = None,
                 config: str | os.PathLike[str] | Tables | ConfigInForce | None = None
                 ) -> Backend:
    """The backend of ``root``; with ``host_namespaces`` (None: the setting in force, read
    from the environment and ``config`` as the daemon reads it) its commands run in the
    host's namespaces (`InHostNamespaces`), and a missing nsenter is `NsenterMissing` now,
    naming where the setting was set."""
    where = "host_namespaces"
    if host_namespaces is None:
        host_namespaces, where = host_namespaces_in_force(config)
    nsenter = find_nsenter(where) if host_namespaces else None
    backend = backend_factory(root)
    if nsenter is None:
        return backend
    if nsenter_target_is_hosts(root) is False:
        _log.warning("%s is on, but PID 1 here is not the host's init (its mount namespace is "
                     "not that of %s/proc/1): host commands would run in this container's "
                     "namespaces; run the pod with hostPID: true", where, root)
    return replace(backend, ops=InHostNamespaces(backend.ops, nsenter, root))


__all__ = [
    "ALLOWED_COMMANDS",
    "HOST_PATH",
    "NSENTER_ARGS",
    "Backend",
    "CommandResult",
    "HostOps",
    "InHostNamespaces",
    "NsenterMissing",
    "RealHostOps",
    "backend_factory",
    "check_command",
    "check_dir",
    "check_write",
    "default_backend",
    "find_nsenter",
    "host_which",
    "is_real_sysfs",
    "make_backend",
    "nsenter_target_is_hosts",
    "run_bounded",
    "split_namespaced",
    "under_root",
    "write_in_child",
    "write_target",
]
