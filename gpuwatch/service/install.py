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
import errno
import grp
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources

from gpuwatch.errors import SERVICE, HostError
from gpuwatch.hostfs.files import NotARegularFile, read_bytes, write_atomic
from gpuwatch.service.udev_rules import DEFAULT_GROUP as VFIO_GROUP
from gpuwatch.service.udev_rules import RULES_FILE, TRIGGERS, render_rules

UNIT_NAME = "gpuwatch.service"
UNIT_FILE = "/etc/systemd/system/gpuwatch.service"
UNIT_DROPINS = "/etc/systemd/system/gpuwatch.service.d"
CONFIG_FILE = "/etc/gpuwatch/config.yaml"
#: Where the unit's ``ReadWritePaths=-/etc/cdi`` lets the daemon write the NVIDIA CDI spec. The
#: "-" skips a missing path, and under ``ProtectSystem=strict`` the daemon could not create it.
CDI_DIR = "/etc/cdi"
#: What ``systemctl mask`` puts where the unit goes.
MASK_TARGET = "/dev/null"
GROUP_FILE = "/etc/group"
GSHADOW_FILE = "/etc/gshadow"
SOCKET_GROUP = "gpuwatch"
#: Kept by ``uninstall``: the event log subscribers replay from, and the poison state.
KEPT_DIRS = ("/var/log/gpuwatch", "/var/lib/gpuwatch")
#: The template's placeholder for the program; replaced by the gpuwatch that installs.
TEMPLATE_EXEC = "/usr/bin/gpuwatch"
#: groupadd --system picks the highest free gid at or below SYS_GID_MAX (login.defs).
SYS_GID_MAX, SYS_GID_MIN = 999, 100
#: Files read to plan: at most this much each (a unit, rules, config, /etc/group).
READ_CAP = 1 << 20
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
    """One ExecStart= argument: specifiers (%) and variables ($) escaped, quoted when needed."""
    word = word.replace("%", "%%").replace("$", "$$")
    if word and not re.search(r"[\s\"'\\;]", word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


#: What systemd refuses in an executable's path ("Executable name contains special
#: characters": a fatal error, the unit never starts), and ``$``: the path is taken
#: literally (``$$`` would name another file) while the argv[0] passed is expanded.
_UNRUNNABLE = re.compile(r"[\x00-\x1f\x7f\"'\\$]")


def systemd_program(path: str) -> str:
    """ExecStart='s first word, the program: only specifiers escaped (systemd expands no
    variable there), quoted when it holds a space or ``;``."""
    if _UNRUNNABLE.search(path):
        raise InstallError(f"systemd cannot start a program whose path holds a quote, a "
                           f"backslash, a $ or a control character ({path!r}): install "
                           f"gpuwatch elsewhere (a venv in /opt, or pipx)")
    word = path.replace("%", "%%")
    return f'"{word}"' if re.search(r"[\s;]", word) else word


def render_unit(exec_argv: Sequence[str], program_paths: Sequence[str] = (),
                template: str | None = None) -> str:
    """The shipped unit with ``ExecStart=`` running ``exec_argv`` (absolute). A program (or
    its interpreter, ``program_paths``) in a home directory needs ``ProtectHome=read-only``:
    ``yes`` would hide it from the service."""
    if not exec_argv or not os.path.isabs(exec_argv[0]):
        raise InstallError(f"ExecStart needs an absolute program path, not {exec_argv!r}")
    text = template if template is not None else shipped_unit()
    exec_words = " ".join([systemd_program(exec_argv[0]),
                           *(systemd_quote(w) for w in exec_argv[1:])])
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
    hidden = [path for path in paths if path.startswith(_TMP_PREFIXES)]
    if hidden:  # each named: moving the first alone would only meet the next
        raise InstallError(
            f"{', '.join(hidden)} {'is' if len(hidden) == 1 else 'are'} under a temporary "
            "directory, which the service does not see (PrivateTmp=yes): install gpuwatch "
            "elsewhere (a venv in /opt, or pipx)")


# --------------------------------------------------------------------------- plans


@dataclass(frozen=True)
class Write:
    path: str  # as on the host ("/etc/..."); the executor puts it under the root
    content: str
    mode: int = 0o644
    why: str = ""
    #: Replacing a file of the system's (/etc/group, /etc/gshadow): the new one gets the old
    #: one's mode and owner (gshadow is root:shadow 0640 on Debian), not ours.
    keep_attrs: bool = False
    #: The text there is already this, but not its mode or owner (``why`` says which).
    rewrite: bool = False


@dataclass(frozen=True)
class MakeDir:
    path: str
    mode: int = 0o755
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


Step = Write | MakeDir | Keep | Remove | Run | Skip


@dataclass(frozen=True)
class Facts:
    """What the plans depend on, read by `gather_facts` (or made up by a test)."""

    root: str  # "/" for the running host
    exec_argv: tuple[str, ...] = ()
    program_paths: tuple[str, ...] = ()  # where the program and its interpreter really live
    existing: dict[str, str | None] = field(default_factory=dict)  # host path -> text
    #: Host paths where something other than a regular file or directory stands: what it is
    #: ("a FIFO", "a link to /x, which does not exist", "masked (a link to /dev/null)").
    odd: dict[str, str] = field(default_factory=dict)
    #: Host paths in a ``--root`` tree that are links leading out of it, there or not (an
    #: absolute ``/etc/...``, or ``../`` enough times), and where each points.
    links_out: dict[str, str] = field(default_factory=dict)
    #: Host path -> (lstat ``st_mode``, ``st_uid``) of what stands there (the files only).
    attrs: dict[str, tuple[int, int]] = field(default_factory=dict)
    #: Who owns what install writes: root on the running host; in a ``--root`` tree, the
    #: user running it (a new file is its writer's, and install does not chown its own).
    owner: int = 0
    group_exists: bool = False
    #: Whether the udev rules' group (kvm) exists.
    vfio_group_exists: bool = True
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


def _write_if_changed(facts: Facts, path: str, content: str, why: str,
                      mode: int = 0o644) -> Write | Keep:
    """Installing again writes nothing that is already so: a rerun changes no file, and
    works on a tree that has since been made read-only (an image). The right text with
    the wrong mode or owner is not so: a unit root runs, writable by anyone (0666, another
    owner), runs what anyone puts in it; so is a link, whose target may change under it."""
    if facts.existing.get(path) != content:
        return Write(path, content, mode=mode, why=why)
    wrong = _wrong_attrs(facts, path, mode)
    if wrong:
        return Write(path, content, mode=mode, why=wrong, rewrite=True)
    return Keep(path, "unchanged")


def _wrong_attrs(facts: Facts, path: str, mode: int) -> str:
    """How what stands at ``path`` differs from what install writes there ("" if not, or
    if unknown)."""
    if path not in facts.attrs:
        return ""
    st_mode, uid = facts.attrs[path]
    if stat.S_ISLNK(st_mode):
        return "a link, not a regular file"
    wrong = []
    if stat.S_IMODE(st_mode) != mode:
        wrong.append(f"mode {stat.S_IMODE(st_mode):04o}, not {mode:04o}")
    if uid != facts.owner:
        wrong.append(f"owner uid {uid}, not {facts.owner}")
    return "; ".join(wrong)


def replaces_unit(facts: Facts, unit: str | None = None) -> bool:
    """Whether install puts another text where a unit was: a daemon running from the old one
    must be restarted to run this gpuwatch (`enable --now` starts only a stopped one)."""
    old = facts.existing.get(UNIT_FILE)
    if unit is None:
        unit = render_unit(facts.exec_argv, facts.program_paths)
    return old is not None and old != unit


def _plan_groups(facts: Facts) -> list[Step]:
    """The socket's group and the rules' group, each added only when missing: without
    the rules' group udev ignores their GROUP= and the nodes stay root's. In a tree, one
    write of each group file adds both."""
    wanted = ((SOCKET_GROUP, facts.group_exists, "the group that may read through the socket"),
              (VFIO_GROUP, facts.vfio_group_exists, "the group the udev rules give /dev/vfio"))
    steps: list[Step] = [Keep(f"group {name}", "exists") for name, there, _ in wanted if there]
    missing = [(name, why) for name, there, why in wanted if not there]
    if facts.host:
        return steps + [Run(("groupadd", "--system", name), why=why) for name, why in missing]
    if not missing:
        return steps
    text, shadow, said = facts.group_file or "", facts.gshadow_file, []
    for name, _ in missing:
        text, gid = _add_group_line(text, name)
        said.append(f"group {name} added, gid {gid}")
    steps.append(Write(GROUP_FILE, text, why="; ".join(said), keep_attrs=True))
    if shadow is not None:
        named = {line.split(":", 1)[0] for line in shadow.splitlines()}
        new = [name for name, _ in missing if name not in named]
        if new:
            if shadow and not shadow.endswith("\n"):
                shadow += "\n"
            steps.append(Write(GSHADOW_FILE, shadow + "".join(f"{n}:!::\n" for n in new),
                               mode=0o640, why="; ".join(f"group {n}" for n in new),
                               keep_attrs=True))
    return steps


def plan_install(facts: Facts, *, now: bool) -> list[Step]:
    """Unit, udev rules, config (only when absent), group (only when missing), then, with
    ``now``, the commands that make systemd and udev use them.

    Refused before anything is written: a masked unit (the admin's ``systemctl mask``), and a
    config path holding something the daemon would refuse to read (a FIFO, a directory, a
    dangling link): it is never overwritten, so the service could not start. So is a link
    out of a ``--root`` tree where the unit or the rules go: replacing it would be following
    it as much as writing through it is (what it names is the host's, not the tree's)."""
    root_hint = "" if facts.host else f" --root={facts.root}"
    if facts.odd.get(UNIT_FILE, "").startswith("masked"):
        raise InstallError(f"{under(facts.root, UNIT_FILE)} is {facts.odd[UNIT_FILE]}: run "
                           f"`systemctl{root_hint} unmask {UNIT_NAME}` first if it should run")
    for path in (UNIT_FILE, RULES_FILE):
        if path in facts.links_out:
            raise InstallError(f"{under(facts.root, path)} is a link out of {facts.root} (to "
                               f"{facts.links_out[path]}), never followed nor replaced: "
                               "remove it, then run this again")
    if CONFIG_FILE in facts.odd:
        raise InstallError(f"{under(facts.root, CONFIG_FILE)} is {facts.odd[CONFIG_FILE]}, "
                           "not a config file the daemon can read, and it is never "
                           "overwritten: remove it (or make it a regular file), then run this "
                           "again")
    unit = render_unit(facts.exec_argv, facts.program_paths)
    steps: list[Step] = [
        _write_if_changed(facts, UNIT_FILE, unit, "the systemd unit"),
        _write_if_changed(facts, RULES_FILE, render_rules(VFIO_GROUP),
                          f"udev rules: group {VFIO_GROUP} may use /dev/vfio nodes"),
    ]
    if facts.existing.get(CONFIG_FILE) is None:
        steps.append(Write(CONFIG_FILE, shipped_config(), why="the daemon's settings"))
    else:
        steps.append(Keep(CONFIG_FILE, "exists; never overwritten"))
    if facts.existing.get(CDI_DIR) is None and CDI_DIR not in facts.odd:
        steps.append(MakeDir(CDI_DIR, why="for NVIDIA's CDI spec: the unit may write there "
                                          "only if it exists"))
    steps.extend(_plan_groups(facts))
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
    if replaces_unit(facts, unit):
        # `enable --now` leaves a running daemon alone: the one started from the old unit
        # (another program, other flags) would run on until the next reboot.
        steps.append(Run(("systemctl", "try-restart", "gpuwatch"),
                         why="a daemon running from the old unit restarts on this one"))
    steps.append(Run(("systemctl", "enable", "--now", "gpuwatch")))
    if facts.have_udevadm:
        steps.append(Run(("udevadm", "control", "--reload")))
        vfio_nodes, iommu_node = TRIGGERS
        steps.append(Run(vfio_nodes, why="existing /dev/vfio nodes get the rules' group"))
        steps.append(Run(iommu_node, why="an existing /dev/iommu gets the rules' group"))
    else:
        steps.append(Skip("udevadm control --reload", "udevadm is not installed"))
    return steps


def _out_of(facts: Facts, path: str) -> str:
    return f"a link out of {facts.root} (to {facts.links_out[path]}): never followed nor removed"


def plan_uninstall(facts: Facts) -> list[Step]:
    """Stop and disable, remove what install wrote (an edited config stays), keep the log,
    the state and the group."""
    steps: list[Step] = []
    unit = facts.existing.get(UNIT_FILE)
    if facts.host and unit is not None and facts.have_systemctl and facts.systemd_running:
        steps.append(Run(("systemctl", "disable", "--now", "gpuwatch")))
    elif not facts.host and facts.have_systemctl and unit is not None:
        steps.append(Run(("systemctl", f"--root={facts.root}", "disable", UNIT_NAME),
                         why="disabled offline in the fixture root"))
    else:
        # No systemd to ask (a container: the unit was enabled offline), or the unit is gone
        # already: its links would be left dangling.
        steps.extend(Remove(link, "enablement link") for link in facts.wants_links)
    if unit is not None:
        steps.append(Remove(UNIT_FILE, "the systemd unit"))
    elif facts.odd.get(UNIT_FILE, "").startswith("masked"):
        steps.append(Keep(UNIT_FILE, f"{facts.odd[UNIT_FILE]}: `systemctl unmask` removes it"))
    elif UNIT_FILE in facts.links_out:
        steps.append(Keep(UNIT_FILE, _out_of(facts, UNIT_FILE)))
    else:
        steps.append(Skip(UNIT_FILE, "not installed"))
    rules = facts.existing.get(RULES_FILE)
    if RULES_FILE in facts.links_out:
        steps.append(Keep(RULES_FILE, _out_of(facts, RULES_FILE)))
    elif rules is None:
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


_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def inspect_path(path: str, *, folder: bool = False,
                 inside: str | None = None) -> tuple[str | None, str | None]:
    """``(text, odd)`` of what stands at ``path``: the text of a regular file (links
    followed; ``""`` for a directory when ``folder``), else None and, unless nothing is
    there, what it is. With ``inside`` (a tree being installed into), a link that leads
    out of it is what it is, not the host's file it names (``etc/group -> /etc/group``).

    Opened without blocking and only when regular: a FIFO planted where the unit goes must
    not hang the installer, and a device node's open runs its driver."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"unreadable ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(path)
        if target == MASK_TARGET:
            return None, f"masked, a link to {MASK_TARGET}"
        try:
            st = os.stat(path)
        except OSError:
            return None, f"a link to {target}, which does not exist"
        if inside is not None and link_out(path, inside) is not None:
            return None, f"a link out of {inside} (to {target})"
    if stat.S_ISDIR(st.st_mode):
        return ("", None) if folder else (None, "a directory")
    for test, what in _KINDS:
        if test(st.st_mode):
            return None, what
    try:
        data = read_bytes(path, READ_CAP)
    except NotARegularFile:
        return None, "not a regular file"
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            return None, f"larger than {READ_CAP} bytes"
        return None, f"unreadable ({exc.strerror or exc})"
    return data.decode("utf-8", errors="replace"), None


def link_out(path: str, inside: str) -> str | None:
    """Where ``path`` points when it is a link whose chain leaves ``inside`` (whether what
    it names exists or not), else None."""
    try:
        target = os.readlink(path)
    except OSError:
        return None  # not a link (or not there)
    top, lands = os.path.realpath(inside), os.path.realpath(path)
    return target if os.path.commonpath([top, lands]) != top else None


def _host_has_group(name: str) -> bool:
    try:
        grp.getgrnam(name)
    except KeyError:
        return False
    return True


def gather_facts(root: str, exec_argv: Sequence[str] = (),
                 program_paths: Sequence[str] = ()) -> Facts:
    host = os.path.normpath(root) == "/"
    existing: dict[str, str | None] = {}
    odd: dict[str, str] = {}
    links_out: dict[str, str] = {}
    attrs: dict[str, tuple[int, int]] = {}
    files = [UNIT_FILE, RULES_FILE, CONFIG_FILE] + ([] if host else [GROUP_FILE, GSHADOW_FILE])
    for path in [*files, CDI_DIR, UNIT_DROPINS, *KEPT_DIRS]:
        existing[path], what = inspect_path(under(root, path), folder=path not in files,
                                            inside=None if host else root)
        if what is not None:
            odd[path] = what
        target = None if host else link_out(under(root, path), root)
        if target is not None:
            links_out[path] = target
        if path in files:
            with contextlib.suppress(OSError):
                st = os.lstat(under(root, path))
                attrs[path] = (st.st_mode, st.st_uid)
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
        group_exists = _host_has_group(SOCKET_GROUP)
        vfio_group_exists = _host_has_group(VFIO_GROUP)
    else:
        for path in (GROUP_FILE, GSHADOW_FILE):
            # Rewritten whole when the group is added: a part of one must never be written.
            if path in odd:
                raise InstallError(f"{under(root, path)} is {odd[path]}: cannot add the "
                                   "group to it")
        group_file, gshadow = existing[GROUP_FILE], existing[GSHADOW_FILE]
        names = {line.split(":", 1)[0] for line in (group_file or "").splitlines()}
        group_exists, vfio_group_exists = SOCKET_GROUP in names, VFIO_GROUP in names
    return Facts(
        root=root, exec_argv=tuple(exec_argv), program_paths=tuple(program_paths),
        existing=existing, odd=odd, links_out=links_out, attrs=attrs,
        owner=0 if host else os.geteuid(), group_exists=group_exists,
        vfio_group_exists=vfio_group_exists,
        group_file=group_file, gshadow_file=gshadow, wants_links=tuple(wants),
        have_systemctl=shutil.which("systemctl") is not None,
        systemd_running=os.path.isdir("/run/systemd/system"),
        have_udevadm=shutil.which("udevadm") is not None,
    )


def check_inside(root: str, steps: Sequence[Step]) -> None:
    """Every path a plan writes, removes or keeps stays inside ``root``: a link in a tree
    being built (``etc/udev/rules.d -> /etc/udev/rules.d``) must not carry a write to the
    host, nor make the host's file pass for the tree's."""
    if os.path.normpath(root) == "/":
        return
    top = os.path.realpath(root)
    for step in steps:
        if isinstance(step, Write | MakeDir | Remove | Keep) and step.path.startswith("/"):
            full = under(root, step.path)
            parent = os.path.realpath(os.path.dirname(full))
            if os.path.commonpath([top, parent]) != top:
                raise InstallError(f"{os.path.dirname(full)} leads outside {root} (to "
                                   f"{parent}): nothing was changed")


@dataclass
class _Undo:
    """What one run changed, to put back when a later step fails before any command ran."""

    #: path, what stood there (its lstat, None when nothing did), and its content (bytes)
    #: or link target (str).
    files: list[tuple[str, os.stat_result | None, bytes | str | None]] = field(
        default_factory=list)
    dirs: list[str] = field(default_factory=list)

    def save(self, path: str) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            self.files.append((path, None, None))
            return
        if stat.S_ISLNK(st.st_mode):
            self.files.append((path, st, os.readlink(path)))
        elif stat.S_ISREG(st.st_mode):
            self.files.append((path, st, read_bytes(path, 64 * READ_CAP)))
        else:
            self.files.append((path, st, None))

    def makedirs(self, folder: str) -> None:
        """``os.makedirs`` with each new directory 0755 whatever the umask, remembered."""
        missing: list[str] = []
        while not os.path.lexists(folder):
            missing.append(folder)
            folder = os.path.dirname(folder)
        for path in reversed(missing):
            os.mkdir(path, 0o755)
            os.chmod(path, 0o755)
            self.dirs.append(path)

    def undo(self, say: Callable[[str], None]) -> None:
        """Best effort, newest first: a failure here is said, never raised over the error
        that caused the roll-back."""
        for path, st, old in reversed(self.files):
            try:
                said = self._put_back(path, st, old)
            except OSError as exc:
                say(f"could not roll back {path}: {exc.strerror or exc}")
                continue
            if said:
                say(f"rolled back {path} ({said})")
        for folder in reversed(self.dirs):
            with contextlib.suppress(OSError):
                os.rmdir(folder)

    @staticmethod
    def _put_back(path: str, st: os.stat_result | None, old: bytes | str | None) -> str:
        now = os.lstat(path) if os.path.lexists(path) else None
        if st is not None and now is not None and (now.st_dev, now.st_ino) == (
                st.st_dev, st.st_ino):
            return ""  # never replaced (a directory stays one): nothing to put back
        if st is None:
            if now is None:
                return ""  # the write that failed never made it: nothing was, nothing is
            os.unlink(path)
            return "removed"
        if now is not None:
            os.unlink(path)
        if isinstance(old, str):
            os.symlink(old, path)
        elif isinstance(old, bytes):
            write_atomic(path, old, stat.S_IMODE(st.st_mode), owner=st)
        elif stat.S_ISFIFO(st.st_mode):
            os.mkfifo(path, stat.S_IMODE(st.st_mode))
        else:
            return "removed"  # a socket or device node there is not remade
        return "restored"


def describe(step: Step, root: str, *, dry_run: bool) -> str:
    """One output line per step: what was (or would be) done, to which real path."""
    would = "would " if dry_run else ""
    if isinstance(step, Write):
        verb = ("rewrite" if dry_run else "rewrote") if step.rewrite else (
            "write" if dry_run else "wrote")
        line = f"{would}{verb} {under(root, step.path)}"
    elif isinstance(step, MakeDir):
        verb = "create" if dry_run else "created"
        line = f"{would}{verb} {under(root, step.path)}/"
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
    """Carry the plan out in order, saying each step; the first failure stops it.

    A failure before any command has run puts back every file and directory this run
    wrote or removed, so a full disk or a read-only ``/etc`` never leaves half an install.
    Once a command ran (groupadd, systemctl), what it did stays, and so do the files it
    was given: run the same command again once the cause is fixed."""
    check_inside(root, steps)
    undo: _Undo | None = _Undo()
    for step in steps:
        if not dry_run:
            try:
                _carry_out(step, root, undo)
            except InstallError:
                if undo is not None and (undo.files or undo.dirs):
                    undo.undo(say)
                raise
            if isinstance(step, Run):
                undo = None
        say(describe(step, root, dry_run=dry_run))


def _carry_out(step: Step, root: str, undo: _Undo | None) -> None:
    journal = undo if undo is not None else _Undo()
    path = under(root, getattr(step, "path", "/"))
    try:
        if isinstance(step, Write):
            journal.makedirs(os.path.dirname(path))
            owner = None
            if step.keep_attrs:
                with contextlib.suppress(OSError):
                    owner = os.stat(path)
            journal.save(path)
            mode = stat.S_IMODE(owner.st_mode) if owner is not None else step.mode
            write_atomic(path, step.content, mode, owner=owner)
        elif isinstance(step, MakeDir):
            journal.makedirs(path)
        elif isinstance(step, Remove):
            if os.path.lexists(path):
                journal.save(path)
                os.unlink(path)
        elif isinstance(step, Run):
            _run(step.argv)
    except OSError as exc:
        verb = {Write: "write", MakeDir: "create", Remove: "remove"}.get(type(step), "change")
        raise InstallError(f"cannot {verb} {path}: {exc.strerror or exc}") from None


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
    "MakeDir",
    "Remove",
    "Run",
    "Skip",
    "Step",
    "Write",
    "check_inside",
    "check_program",
    "describe",
    "execute",
    "gather_facts",
    "inspect_path",
    "link_out",
    "plan_install",
    "plan_uninstall",
    "render_unit",
    "replaces_unit",
    "shipped_config",
    "shipped_unit",
    "systemd_program",
    "systemd_quote",
    "under",
]
