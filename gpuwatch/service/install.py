"""``gpuwatch service install|uninstall``: put the daemon under systemd, and take it away again.

Planning is pure (`plan_install`, `plan_uninstall`: facts in, a list of steps out), so tests
check every file and command for any host without touching one; `gather_facts` reads the
host (or a fixture root) and `execute` carries a plan out, printing each step as it goes.

Why the care: the unit must start *this* gpuwatch (pip, pipx and venvs each put it somewhere
else), an edited config must never be overwritten, and with ``--root`` nothing of the real
host may change (the group goes into ``<root>/etc/group``, not through ``groupadd``).
"""

from __future__ import annotations

import contextlib
import grp
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources

from gpuwatch.errors import SERVICE, HostError
from gpuwatch.service.udev_rules import DEFAULT_GROUP as VFIO_GROUP
from gpuwatch.service.udev_rules import RULES_FILE, render_rules

UNIT_NAME = "gpuwatch.service"
UNIT_FILE = "/etc/systemd/system/gpuwatch.service"
UNIT_DROPINS = "/etc/systemd/system/gpuwatch.service.d"
CONFIG_FILE = "/etc/gpuwatch/config.yaml"
GROUP_FILE = "/etc/group"
GSHADOW_FILE = "/etc/gshadow"
SOCKET_GROUP = "gpuwatch"
#: Kept by ``uninstall``: the event log subscribers replay from, and the poison state.
KEPT_DIRS = ("/var/log/gpuwatch", "/var/lib/gpuwatch")
#: The template's placeholder for the program; replaced by the gpuwatch that installs.
TEMPLATE_EXEC = "/usr/bin/gpuwatch"
#: groupadd --system picks the highest free gid at or below SYS_GID_MAX (login.defs).
SYS_GID_MAX, SYS_GID_MIN = 999, 100
_HOME_PREFIXES = ("/home/", "/root/", "/run/user/")
_TMP_PREFIXES = ("/tmp/", "/var/tmp/")


class InstallError(HostError):
    """The service cannot be installed or removed as asked (exit 1)."""

    code = SERVICE


def shipped_unit() -> str:
    return resources.files("gpuwatch").joinpath("data/gpuwatch.service").read_text("utf-8")


def shipped_config() -> str:
    return resources.files("gpuwatch").joinpath("data/config.yaml").read_text("utf-8")


# --------------------------------------------------------------------------- the unit


def systemd_quote(word: str) -> str:
    """One ExecStart= word: specifiers (%) and variables ($) escaped, quoted when needed."""
    word = word.replace("%", "%%").replace("$", "$$")
    if word and not re.search(r"[\s\"'\\;]", word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_unit(exec_argv: Sequence[str], program_paths: Sequence[str] = (),
                template: str | None = None) -> str:
    """The shipped unit with ``ExecStart=`` running ``exec_argv`` (absolute). A program (or
    its interpreter, ``program_paths``) in a home directory needs ``ProtectHome=read-only``:
    ``yes`` would hide it from the service."""
    if not exec_argv or not os.path.isabs(exec_argv[0]):
        raise InstallError(f"ExecStart needs an absolute program path, not {exec_argv!r}")
    text = template if template is not None else shipped_unit()
    exec_words = " ".join(systemd_quote(w) for w in exec_argv)
    old = f"ExecStart={TEMPLATE_EXEC} "
    if text.count(old) != 1:
        raise InstallError("the shipped unit has no single ExecStart= line to fill in")
    text = text.replace(old, f"ExecStart={exec_words} ")
    if any(p.startswith(_HOME_PREFIXES) for p in (exec_argv[0], *program_paths)):
        text = text.replace(
            "ProtectHome=yes\n",
            "# gpuwatch runs from a home directory (a venv or pipx there): visible, read-only.\n"
            "ProtectHome=read-only\n",
        )
    return text


def check_program(paths: Sequence[str]) -> None:
    """The unit has PrivateTmp=yes: a gpuwatch under /tmp would not exist for the service."""
    for path in paths:
        if path.startswith(_TMP_PREFIXES):
            raise InstallError(
                f"{path} is under a temporary directory, which the service does not see "
                f"(PrivateTmp=yes): install gpuwatch elsewhere (a venv in /opt, or pipx)")


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class Write:
    path: str  # as on the host ("/etc/..."); the executor puts it under the root
    content: str
    mode: int = 0o644
    why: str = ""


@dataclass(frozen=True)
class Keep:
    path: str
    why: str


@dataclass(frozen=True)
class Remove:
    path: str
    why: str = ""


@dataclass(frozen=True)
class Run:
    argv: tuple[str, ...]
    why: str = ""


@dataclass(frozen=True)
class Skip:
    what: str
    why: str


Step = Write | Keep | Remove | Run | Skip


@dataclass(frozen=True)
class Facts:
    """What the plans depend on, read by `gather_facts` (or made up by a test)."""

    root: str  # "/" for the running host
    exec_argv: tuple[str, ...] = ()
    program_paths: tuple[str, ...] = ()  # where the program and its interpreter really live
    existing: dict[str, str | None] = field(default_factory=dict)  # host path -> text
    group_exists: bool = False
    group_file: str | None = None  # <root>/etc/group text (fixture roots only)
    gshadow_file: str | None = None
    wants_links: tuple[str, ...] = ()  # host paths of *.wants/gpuwatch.service links
    have_systemctl: bool = False
    systemd_running: bool = False
    have_udevadm: bool = False

    @property
    def host(self) -> bool:
        return os.path.normpath(self.root) == "/"


def _add_group_line(text: str, name: str) -> tuple[str, int]:
    used: set[int] = set()
    for line in text.splitlines():
        parts = line.split(":")
        if len(parts) >= 3 and parts[2].isdigit():
            used.add(int(parts[2]))
    for gid in range(SYS_GID_MAX, SYS_GID_MIN - 1, -1):
        if gid not in used:
            break
    else:
        raise InstallError(f"no free system gid in {SYS_GID_MIN}-{SYS_GID_MAX} for {name}")
    if text and not text.endswith("\n"):
        text += "\n"
    return text + f"{name}:x:{gid}:\n", gid


def plan_install(facts: Facts, *, now: bool) -> list[Step]:
    """Unit, udev rules, config (only when absent), group (only when missing), then, with
    ``now``, the commands that make systemd and udev use them."""
    steps: list[Step] = [
        Write(UNIT_FILE, render_unit(facts.exec_argv, facts.program_paths),
              why="the systemd unit"),
        Write(RULES_FILE, render_rules(VFIO_GROUP),
              why=f"udev rules: group {VFIO_GROUP} may use /dev/vfio nodes"),
    ]
    if facts.existing.get(CONFIG_FILE) is None:
        steps.append(Write(CONFIG_FILE, shipped_config(), why="the daemon's settings"))
    else:
        steps.append(Keep(CONFIG_FILE, "exists; never overwritten"))
    if facts.group_exists:
        steps.append(Keep(f"group {SOCKET_GROUP}", "exists"))
    elif facts.host:
        steps.append(Run(("groupadd", "--system", SOCKET_GROUP),
                         why="the group that may read through the socket"))
    else:
        text, gid = _add_group_line(facts.group_file or "", SOCKET_GROUP)
        steps.append(Write(GROUP_FILE, text, why=f"group {SOCKET_GROUP} added, gid {gid}"))
        if facts.gshadow_file is not None:
            shadow = facts.gshadow_file
            if shadow and not shadow.endswith("\n"):
                shadow += "\n"
            steps.append(Write(GSHADOW_FILE, shadow + f"{SOCKET_GROUP}:!::\n", mode=0o640,
                               why=f"group {SOCKET_GROUP}"))
    if not now:
        return steps
    if not facts.host:
        if facts.have_systemctl:
            steps.append(Run(("systemctl", f"--root={facts.root}", "enable", UNIT_NAME),
                             why="enabled offline in the fixture root"))
        else:
            steps.append(Skip(f"systemctl --root={facts.root} enable {UNIT_NAME}",
                              "systemctl is not installed"))
        steps.append(Skip("systemctl daemon-reload, start, udevadm",
                          f"{facts.root} is not the running system"))
        return steps
    if not facts.have_systemctl or not facts.systemd_running:
        raise InstallError("--now needs systemd running on this host (no /run/systemd/system): "
                           "run `gpuwatch watch --socket` under your init system instead")
    steps.append(Run(("systemctl", "daemon-reload")))
    steps.append(Run(("systemctl", "enable", "--now", "gpuwatch")))
    if facts.have_udevadm:
        steps.append(Run(("udevadm", "control", "--reload")))
        steps.append(Run(("udevadm", "trigger", "--subsystem-match=vfio",
                          "--subsystem-match=vfio-dev", "--action=add"),
                         why="existing /dev/vfio nodes get the rules' group"))
    else:
        steps.append(Skip("udevadm control --reload", "udevadm is not installed"))
    return steps


def plan_uninstall(facts: Facts) -> list[Step]:
    """Stop and disable, remove what install wrote (an edited config stays), keep the log,
    the state and the group."""
    steps: list[Step] = []
    unit = facts.existing.get(UNIT_FILE)
    if facts.host and unit is not None and facts.have_systemctl and facts.systemd_running:
        steps.append(Run(("systemctl", "disable", "--now", "gpuwatch")))
    elif not facts.host and (unit is not None or facts.wants_links):
        if facts.have_systemctl and unit is not None:
            steps.append(Run(("systemctl", f"--root={facts.root}", "disable", UNIT_NAME),
                             why="disabled offline in the fixture root"))
        else:
            steps.extend(Remove(link, "enablement link") for link in facts.wants_links)
    if unit is not None:
        steps.append(Remove(UNIT_FILE, "the systemd unit"))
    else:
        steps.append(Skip(UNIT_FILE, "not installed"))
    rules = facts.existing.get(RULES_FILE)
    if rules is None:
        steps.append(Skip(RULES_FILE, "not installed"))
    elif "gpuwatch udev-rules" in rules:
        steps.append(Remove(RULES_FILE, "the udev rules"))
    else:
        steps.append(Keep(RULES_FILE, "not written by gpuwatch"))
    config = facts.existing.get(CONFIG_FILE)
    if config is not None and config == shipped_config():
        steps.append(Remove(CONFIG_FILE, "unchanged since install"))
    elif config is not None:
        steps.append(Keep(CONFIG_FILE, "edited since install"))
    if facts.existing.get(UNIT_DROPINS) is not None:
        steps.append(Keep(UNIT_DROPINS, "your `systemctl edit` drop-ins"))
    steps.extend(Keep(d, "event log and state are kept") for d in KEPT_DIRS
                 if facts.existing.get(d) is not None)
    if facts.group_exists:
        steps.append(Keep(f"group {SOCKET_GROUP}", f"`groupdel {SOCKET_GROUP}` removes it"))
    if facts.host and unit is not None and facts.have_systemctl and facts.systemd_running:
        steps.append(Run(("systemctl", "daemon-reload")))
    if facts.host and rules is not None and facts.have_udevadm:
        steps.append(Run(("udevadm", "control", "--reload")))
    return steps


# --------------------------------------------------------------------------- the host


def under(root: str, path: str) -> str:
    """``path`` (absolute, as on a host) inside ``root``."""
    return os.path.join(root, path.lstrip("/")) if os.path.normpath(root) != "/" else path


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(1 << 20)
    except IsADirectoryError:
        return ""
    except OSError:
        return None


def gather_facts(root: str, exec_argv: Sequence[str] = (),
                 program_paths: Sequence[str] = ()) -> Facts:
    host = os.path.normpath(root) == "/"
    existing: dict[str, str | None] = {}
    for path in (UNIT_FILE, RULES_FILE, CONFIG_FILE, UNIT_DROPINS, *KEPT_DIRS):
        existing[path] = _read(under(root, path))
    wants: list[str] = []
    sysdir = under(root, "/etc/systemd/system")
    try:
        entries = sorted(os.listdir(sysdir))
    except OSError:
        entries = []
    for entry in entries:
        link = os.path.join(sysdir, entry, UNIT_NAME)
        if entry.endswith((".wants", ".requires")) and os.path.islink(link):
            wants.append(f"/etc/systemd/system/{entry}/{UNIT_NAME}")
    group_file = gshadow = None
    if host:
        try:
            grp.getgrnam(SOCKET_GROUP)
            group_exists = True
        except KeyError:
            group_exists = False
    else:
        group_file = _read(under(root, GROUP_FILE))
        gshadow = _read(under(root, GSHADOW_FILE))
        group_exists = any(line.split(":", 1)[0] == SOCKET_GROUP
                           for line in (group_file or "").splitlines())
    return Facts(
        root=root, exec_argv=tuple(exec_argv), program_paths=tuple(program_paths),
        existing=existing, group_exists=group_exists,
        group_file=group_file, gshadow_file=gshadow, wants_links=tuple(wants),
        have_systemctl=shutil.which("systemctl") is not None,
        systemd_running=os.path.isdir("/run/systemd/system"),
        have_udevadm=shutil.which("udevadm") is not None,
    )


def _write_atomic(path: str, content: str, mode: int) -> None:
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    tmp = f"{path}.gpuwatch-new"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def describe(step: Step, root: str, *, dry_run: bool) -> str:
    """One output line per step: what was (or would be) done, to which real path."""
    would = "would " if dry_run else ""
    if isinstance(step, Write):
        verb = "write" if dry_run else "wrote"
        line = f"{would}{verb} {under(root, step.path)}"
    elif isinstance(step, Remove):
        verb = "remove" if dry_run else "removed"
        line = f"{would}{verb} {under(root, step.path)}"
    elif isinstance(step, Run):
        verb = "run" if dry_run else "ran"
        line = f"{would}{verb} {' '.join(step.argv)}"
    elif isinstance(step, Keep):
        what = step.path if step.path.startswith("group ") else under(root, step.path)
        return f"kept {what} ({step.why})"
    else:
        return f"skipped {step.what} ({step.why})"
    return f"{line} ({step.why})" if step.why else line


def execute(steps: Sequence[Step], root: str, *, dry_run: bool,
            say: Callable[[str], None] = print) -> None:
    """Carry the plan out in order, saying each step; the first failure stops it."""
    for step in steps:
        if not dry_run:
            if isinstance(step, Write):
                try:
                    _write_atomic(under(root, step.path), step.content, step.mode)
                except OSError as exc:
                    raise InstallError(f"cannot write {under(root, step.path)}: "
                                       f"{exc.strerror or exc}") from None
            elif isinstance(step, Remove):
                try:
                    os.unlink(under(root, step.path))
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    raise InstallError(f"cannot remove {under(root, step.path)}: "
                                       f"{exc.strerror or exc}") from None
            elif isinstance(step, Run):
                _run(step.argv)
        say(describe(step, root, dry_run=dry_run))


def _run(argv: Sequence[str]) -> None:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL, check=False)
    except FileNotFoundError:
        raise InstallError(f"{argv[0]} is not installed") from None
    except subprocess.TimeoutExpired:
        raise InstallError(f"`{' '.join(argv)}` did not finish in 120 s") from None
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().splitlines()
        raise InstallError(f"`{' '.join(argv)}` failed (exit {proc.returncode})"
                           + (f": {detail[-1]}" if detail else ""))


__all__ = [
    "CONFIG_FILE",
    "UNIT_FILE",
    "Facts",
    "InstallError",
    "Keep",
    "Remove",
    "Run",
    "Skip",
    "Step",
    "Write",
    "check_program",
    "describe",
    "execute",
    "gather_facts",
    "plan_install",
    "plan_uninstall",
    "render_unit",
    "shipped_config",
    "shipped_unit",
    "systemd_quote",
    "under",
]
