"""The real CLI run by an unprivileged user (``nobody``) against a fixture root.

README: probes and the watcher need no privilege; switching drivers needs root. So as a
user: every probe answers (those that read what only root may read answer as documented
and say what they could not see), the commands that change the host refuse with their
documented line and exit code, the daemon's socket refuses a user outside its groups (and
the CLI then scans directly), and nothing is written where the user may not write.

The user gets its own copy of gpuwatch and its dependencies in a directory it can read
(the test's interpreter and packages may live under a home only root can enter), and an
interpreter it may run. Runs only as root, where such a user exists.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_helpers import Daemon

from gpuwatch.testing import SysRoot, example_gpu_host

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="running a command as another user needs root"),
]

REPO = Path(__file__).resolve().parents[1]
NV = "0000:01:00.0"
#: What gpuwatch imports, with their own dependencies found from their metadata.
DISTRIBUTIONS = ("pydantic", "PyYAML", "anyio", "pyudev", "prometheus_client")


def _user() -> pwd.struct_passwd:
    for name in ("nobody", "nfsnobody"):
        with contextlib.suppress(KeyError):
            entry = pwd.getpwnam(name)
            if entry.pw_uid != 0:
                return entry
    pytest.skip("no unprivileged user (nobody) on this host")


def _copy_distributions(dest: Path) -> None:
    """The files of each distribution gpuwatch needs, and of theirs, into ``dest``."""
    seen: set[str] = set()
    todo = list(DISTRIBUTIONS)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a requirement for other Pythons (exceptiongroup): not installed
        for req in dist.requires or ():
            if "extra ==" not in req:
                match = re.match(r"[A-Za-z0-9_.-]+", req)
                if match:
                    todo.append(match.group(0))
        for file in dist.files or ():
            src = Path(str(dist.locate_file(file)))
            if (str(file).startswith("..") or ".dist-info" in str(file)
                    or "__pycache__" in str(file) or not src.is_file()):
                continue
            (dest / file).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest / file)


def _readable_by_all(top: Path) -> None:
    for here, _dirs, files in os.walk(top):
        os.chmod(here, 0o755)
        for name in files:
            if not os.path.islink(os.path.join(here, name)):
                os.chmod(os.path.join(here, name), 0o644)


class AsUser:
    """Runs ``python -m gpuwatch`` as the user, with the copy on its path."""

    def __init__(self, work: Path, python: str, user: pwd.struct_passwd) -> None:
        self.work, self.python, self.user = work, python, user
        self.env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(work / "site"),
                    "HOME": str(work), "LC_ALL": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return self.python_c("import sys; from gpuwatch.cli.main import main; "
                             "sys.exit(main(sys.argv[1:]))", *argv, timeout=timeout)

    def python_c(self, code: str, *argv: str,
                 timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.python, "-c", code, *argv], capture_output=True, text=True,
                              env=self.env, cwd=self.work, timeout=timeout,
                              stdin=subprocess.DEVNULL, user=self.user.pw_uid,
                              group=self.user.pw_gid, extra_groups=[])


def _interpreters() -> Iterator[str]:
    """The test's own interpreter, then the system's of the same version (compiled modules
    such as pydantic_core are built for it)."""
    yield sys.executable
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (f"/usr/bin/python{version}", f"/usr/local/bin/python{version}"):
        if os.path.isfile(candidate):
            yield candidate


@pytest.fixture(scope="module")
def as_user() -> Iterator[AsUser]:
    user = _user()
    work = Path(tempfile.mkdtemp(prefix="gpuwatch-unpriv-", dir="/tmp"))
    try:
        shutil.copytree(REPO / "gpuwatch", work / "site" / "gpuwatch",
                        ignore=shutil.ignore_patterns("__pycache__"))
        _copy_distributions(work / "site")
        _readable_by_all(work)
        for python in _interpreters():
            runner = AsUser(work, python, user)
            try:
                done = runner.python_c("import gpuwatch.cli.main, gpuwatch.model, "
                                       "gpuwatch.service.server, gpuwatch.switch.engine; "
                                       "print(gpuwatch.__file__)")
            except OSError:
                continue
            if done.returncode == 0 and done.stdout.startswith(str(work)):
                yield runner
                return
        pytest.skip(f"no Python {sys.version_info.major}.{sys.version_info.minor} that "
                    f"{user.pw_name} may run with gpuwatch's dependencies")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _tree(top: Path) -> dict[str, tuple[int, int, int, str]]:
    """Every entry under ``top``: mode, owner, size, and a digest of a file's bytes or a
    link's target. Unchanged tree: nothing was written, created, removed or chmod-ed."""
    out: dict[str, tuple[int, int, int, str]] = {}
    for here, dirs, files in os.walk(top):
        for name in [*dirs, *files]:
            path = os.path.join(here, name)
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                digest = os.readlink(path)
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            else:
                digest = ""
            out[os.path.relpath(path, top)] = (st.st_mode, st.st_uid, st.st_size, digest)
    return out


@pytest.fixture
def machine(as_user: AsUser) -> Iterator[SysRoot]:
    """The example workstation in the user's reach (a dir it may enter, not write): nvidia
    loaded, a group node only root may open, a task wedged in nv_pci_remove (whose stack
    only root may read), Xorg holding the card."""
    where = Path(tempfile.mkdtemp(prefix="host-", dir=as_user.work))
    os.chmod(where, 0o755)
    s = example_gpu_host(where / "host")
    s.add_module("nvidia")
    s.add_module("vfio_pci")
    s.add_cdi_spec()
    s.add_vfio_group(13, mode=0o600)
    s.add_process(4242, "modprobe", state="D", stack="[<0>] nv_pci_remove+0x10/0x20\n")
    s.add_process(77, "Xorg", fds={3: "/dev/nvidia0"})
    assert stat.S_IMODE(os.stat(s.root / "proc/4242/stack").st_mode) == 0o400
    try:
        yield s
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _as_root(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "gpuwatch", *argv], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=60, stdin=subprocess.DEVNULL)


def _one_line(text: str) -> str:
    assert text.count("\n") == 1 and text.endswith("\n"), text
    assert "Traceback" not in text and "internal error" not in text, text
    return text


def test_probes_answer_as_a_user_and_say_what_only_root_may_see(
        as_user: AsUser, machine: SysRoot) -> None:
    root = ["--root", str(machine.root)]
    before = _tree(as_user.work)

    # What needs no privilege answers as for root.
    for line in (["probe", "detect-vfio"], ["probe", "detect-gpu"],
                 ["probe", "display-driver", "--addr", NV], ["list", "--json"]):
        mine = as_user.run(*line, *root)
        assert (mine.returncode, mine.stderr) == (0, ""), (line, mine.stderr)
        assert mine.stdout == _as_root(*line, *root).stdout, line

    # /proc/<pid>/stack is root's: the wedge goes unseen, and the command says so.
    wedge = ["probe", "wedge-detected", *root]
    assert json.loads(_as_root(*wedge).stdout)["result"] is True
    mine = as_user.run(*wedge)
    assert mine.returncode == 0 and json.loads(mine.stdout) == {
        "action": "wedge-detected", "result": False}
    assert "root only" in _one_line(mine.stderr)

    # A group node only root may open: accessible to root, not to the user.
    access = ["probe", "vfio-group-accessible", "--group", "13", *root]
    assert json.loads(_as_root(*access).stdout)["result"] is True
    mine = as_user.run(*access)
    assert (mine.returncode, mine.stderr) == (0, "")
    assert json.loads(mine.stdout)["result"] is False

    # Holders: other users' processes cannot be seen, so the list is not complete.
    mine = as_user.run("holders", "--json", *root)
    assert mine.returncode == 0, mine.stderr
    assert json.loads(mine.stdout)["complete"] is False
    assert "not root" in _one_line(mine.stderr)

    assert _tree(as_user.work) == before


@pytest.mark.parametrize("line", [
    ["mode", "vfio", "--addr", NV],
    ["recover", "--addr", NV],
    ["ensure-cdi"],
])
def test_what_changes_the_host_refuses_a_user_and_writes_nothing(
        as_user: AsUser, machine: SysRoot, line: list[str]) -> None:
    """docs/switch.md: exit 1, "not root", one line; nothing under the root touched."""
    before = _tree(as_user.work)
    mine = as_user.run(*line, "--root", str(machine.root), "--log",
                       str(as_user.work / "events.jsonl")) if line[0] != "ensure-cdi" else \
        as_user.run(*line, "--root", str(machine.root))
    assert mine.returncode == 1 and mine.stdout == ""
    assert "needs root" in _one_line(mine.stderr)
    assert _tree(as_user.work) == before


def test_service_install_refuses_a_user(as_user: AsUser) -> None:
    mine = as_user.run("service", "install")
    assert mine.returncode == 1 and "run it as root" in _one_line(mine.stderr)
    assert not os.path.exists("/etc/systemd/system/gpuwatch.service") or \
        os.stat("/etc/systemd/system/gpuwatch.service").st_uid == 0


@pytest.fixture
def closed_dir(as_user: AsUser) -> Iterator[Path]:
    """A directory of root's the user may enter and read, not write; with a log only root
    may read."""
    where = Path(tempfile.mkdtemp(prefix="closed-", dir=as_user.work))
    os.chmod(where, 0o755)
    log = where / "events.jsonl"
    log.write_text('{"seq":1,"time":"t","type":"ready"}\n')
    os.chmod(log, 0o600)
    yield where


def test_a_user_gets_one_line_and_the_documented_exit_where_it_may_not_read_or_write(
        as_user: AsUser, machine: SysRoot, closed_dir: Path) -> None:
    """docs/events.md and docs/socket.md: a log or ``--out`` that cannot be opened is exit 2,
    a log that cannot be read exit 1, a socket in a directory the daemon may not write to
    cannot work as configured (exit 2, not 75: no restart will make it writable)."""
    root = ["--root", str(machine.root)]
    before = _tree(closed_dir)
    cases: list[tuple[list[str], int, str]] = [
        (["watch", *root, "--source", "file:/dev/null", "--log",
          str(closed_dir / "new.jsonl")], 2, "Permission denied"),
        (["watch", *root, "--source", "file:/dev/null", "--log", "-", "--socket",
          str(closed_dir / "gw.sock")], 2, "Permission denied"),
        (["record", *root, "--source", "file:/dev/null", "--out",
          str(closed_dir / "rec.jsonl")], 2, "Permission denied"),
        (["events", str(closed_dir / "events.jsonl")], 1, "Permission denied"),
        (["events", "--follow", str(closed_dir / "events.jsonl")], 1, "Permission denied"),
    ]
    for line, code, why in cases:
        mine = as_user.run(*line, timeout=30)
        assert mine.returncode == code, (line, mine.returncode, mine.stderr)
        assert why in _one_line(mine.stderr), line
        assert mine.stdout == "", line
    assert _tree(closed_dir) == before


def test_the_socket_refuses_a_user_outside_its_groups_and_the_cli_scans_directly(
        as_user: AsUser, machine: SysRoot) -> None:
    """docs/socket.md: a user not in the socket's groups is refused: by the socket file's
    mode (0660), or, where the file lets it connect, at accept from SO_PEERCRED (one
    ``permission-denied`` line, ``"id": null``, and a warning naming its uid). Either way
    ``probe``, ``status`` and ``list`` scan directly (as ``--no-daemon``), and ``health``
    says the daemon does not answer this user (exit 1)."""
    sockdir = Path(tempfile.mkdtemp(prefix="sock-", dir=as_user.work))
    os.chmod(sockdir, 0o755)
    sock = str(sockdir / "gw.sock")
    uid = as_user.user.pw_uid
    root = ["--root", str(machine.root)]
    lines = (["probe", "detect-vfio"], ["probe", "vfio-group-accessible", "--group", "13"],
             ["status", "--json"], ["list"])
    direct = {tuple(line): as_user.run(*line, *root, "--no-daemon") for line in lines}
    with Daemon(machine.root, sockdir, sock) as daemon:
        for opened in (False, True):
            if opened:  # an operator's chmod: the kernel lets it connect, the daemon not
                os.chmod(sock, 0o666)
                told = as_user.python_c(
                    "import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.settimeout(10)\n"
                    "s.connect(sys.argv[1])\nbuf = b''\n"
                    "while not buf.endswith(b'\\n'):\n    chunk = s.recv(4096)\n"
                    "    if not chunk: break\n    buf += chunk\n"
                    "sys.stdout.write(buf.decode())\n", sock)
                assert told.returncode == 0, told.stderr
                refusal: dict[str, Any] = json.loads(told.stdout)
                assert refusal["id"] is None
                assert refusal["error"]["code"] == "permission-denied"
            for line in lines:
                mine = as_user.run(*line, *root, "--socket", sock)
                want = direct[tuple(line)]
                assert (mine.returncode, mine.stdout, mine.stderr) == (
                    want.returncode, want.stdout, want.stderr), (opened, line)
            health = as_user.run("health", "--socket", sock)
            assert health.returncode == 1 and health.stdout == ""
            _one_line(health.stderr)
    assert f"uid {uid}" in daemon.stderr or f"uid={uid}" in daemon.stderr, daemon.stderr
