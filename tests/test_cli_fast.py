"""The stdlib-only ``gpuwatch probe`` path: nothing heavy imported before the reply is printed,
and byte for byte the full command's output; anything it cannot answer goes to the full one."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import anyio
import pytest
from daemon_helpers import Daemon

from gpuwatch.cli.fast import (
    config_identity,
    parse_holders,
    parse_plan,
    parse_probe,
    socket_path,
)
from gpuwatch.cli.main import build_parser
from gpuwatch.service import protocol as P
from gpuwatch.service.daemon import served_config
from gpuwatch.service.testing import served_watcher, short_socket_dir
from gpuwatch.settings import file_identity, load_settings, read_config_file_as_read
from gpuwatch.testing import SysRoot
from gpuwatch.testing.machines import headless_host

NV, IGPU, NIC = "0000:01:00.0", "0000:00:02.0", "0000:02:00.0"
# The scan too: the daemon answers, so a report reads no more than a few files itself.
HEAVY = ("pydantic", "pydantic_core", "yaml", "anyio", "pyudev", "gpuwatch.hostfs.scan",
         "dataclasses")
REPO = Path(__file__).resolve().parents[1]

#: Runs the command as the installed script does, and reports which heavy modules were loaded
#: at the moment the reply was printed.
SPY = """
import builtins, sys
from gpuwatch.cli.main import main
real = builtins.print
def spy(*args, **kwargs):
    heavy = sorted(m for m in {heavy!r} if m in sys.modules)
    sys.stderr.write("HEAVY=" + ",".join(heavy) + "\\n")
    real(*args, **kwargs)
builtins.print = spy
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture
def sockdir() -> Iterator[str]:
    with short_socket_dir() as path:
        yield path


def run_spied(argv: list[str], extra_env: dict[str, str] | None = None
              ) -> tuple[int, bytes, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    env.update({"PYTHONPATH": str(REPO), **(extra_env or {})})
    done = subprocess.run(
        [sys.executable, "-c", SPY.format(heavy=HEAVY), *argv],
        capture_output=True, env=env, timeout=60,
    )
    return done.returncode, done.stdout, done.stderr.decode()


def run_full(argv: list[str]) -> bytes:
    """The full command, parser and all, without the fast path (its stdout)."""
    return run_full_both(argv)[0]


def run_full_both(argv: list[str], code: int = 0) -> tuple[bytes, str]:
    args = build_parser().parse_args(argv)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        assert args.func(args) == code
    return out.getvalue().encode(), err.getvalue()


async def test_a_probe_the_daemon_answers_imports_nothing_heavy_and_prints_the_same(
    host: SysRoot, sockdir: str
) -> None:
    host.add_vfio_group(13)
    root = str(host.root)
    async with served_watcher(root, f"{sockdir}/gw.sock") as served:
        sock = ["--socket", served.path, "--root", root]
        for argv in (
            ["probe", "detect-vfio", *sock],
            ["probe", "detect-host-devices", *sock],
            ["probe", "detect-gpu", *sock],
            ["probe", "vfio-group-accessible", "--group", "13", *sock],
            ["probe", "vfio-group-accessible", "--group=-1", *sock],
            ["probe", "display-driver", f"--addr={NIC}", *sock],
            ["probe", *sock, "current-mode", "--addr", NV.upper()],
            ["probe", "group-in-mode", "--addr", NV, "--mode", "vfio", *sock],
        ):
            code, out, err = await anyio.to_thread.run_sync(run_spied, argv)
            assert code == 0, (argv, err)
            assert "HEAVY=\n" in err, (argv, err)  # nothing heavy when the reply is printed
            full = await anyio.to_thread.run_sync(run_full, argv)
            assert out == full, argv


async def test_holders_and_plans_the_daemon_answers_are_the_full_commands_bytes(
    host: SysRoot, sockdir: str
) -> None:
    root = str(host.root)
    async with served_watcher(root, f"{sockdir}/gw.sock") as served:
        sock = ["--socket", served.path, "--root", root]
        for argv in (
            ["holders", *sock],  # the NVIDIA card by default
            ["holders", "--addr", NV, *sock],
            ["holders", "--json", f"--addr={NV.upper()}", *sock],
            ["plan", "vfio", *sock],
            ["plan", "nvidia", "--addr", NV, *sock],
            ["plan", "--json", "vfio", "--addr", NV, "--force", *sock],
            ["plan", "vfio", "--addr", IGPU, *sock],  # the host's only display: refused
        ):
            code, out, err = await anyio.to_thread.run_sync(run_spied, argv)
            assert code in (0, 1), (argv, err)
            assert "HEAVY=\n" in err, (argv, err)
            full_out, full_err = await anyio.to_thread.run_sync(run_full_both, argv, code)
            assert out == full_out, argv
            assert [ln for ln in err.splitlines() if not ln.startswith("HEAVY=")] == \
                full_err.splitlines(), argv


async def test_what_the_fast_path_cannot_answer_gets_the_full_commands_words(
    host: SysRoot, sockdir: str
) -> None:
    root = str(host.root)
    async with served_watcher(root, f"{sockdir}/gw.sock") as served:
        sock = ["--socket", served.path, "--root", root]
        # An error reply: the full command runs and says it in its words, with its exit code.
        code, out, err = await anyio.to_thread.run_sync(
            run_spied, ["probe", "display-driver", "--addr", "0000:0a:00.0", *sock])
        assert code == 1 and out == b""
        assert err.splitlines()[-1].startswith("gpuwatch: ") and "no PCI function" in err
        # A bad request never reaches the daemon from the fast path either.
        code, _, err = await anyio.to_thread.run_sync(
            run_spied, ["probe", "display-driver", "--addr", "nonsense", *sock])
        assert code == 2 and "not a PCI address" in err


async def test_a_config_file_naming_another_root_is_never_answered_by_the_daemon(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    """``$GPUWATCH_CONFIG`` naming a fixture root: `status` scanned that root, while `probe`,
    `holders` and `plan` took the stdlib path to the daemon at ``$GPUWATCH_SOCKET`` (another
    host) and answered for it."""
    other = headless_host(tmp_path / "headless")  # no GPU at all
    config = tmp_path / "config.yaml"
    config.write_text(f"root: {other.root}\n")
    async with served_watcher(str(host.root), f"{sockdir}/gw.sock") as served:
        env = {"GPUWATCH_CONFIG": str(config), "GPUWATCH_SOCKET": served.path}
        code, out, _ = await anyio.to_thread.run_sync(run_spied, ["probe", "detect-gpu"], env)
        assert (code, out) == (0, b'{"action":"detect-gpu","result":false}\n')  # the config's
        for argv in (["holders"], ["plan", "vfio"]):
            code, out, err = await anyio.to_thread.run_sync(run_spied, argv, env)
            assert code == 1 and "no card of vendor 0x10de" in err, argv
        # Even the file `service install` writes: this daemon read no file, so its answer
        # proves nothing of this one, and the full command reads it (valid, no root: the
        # daemon's answer). A daemon that read it is answered the fast way (below).
        config.write_text(SHIPPED)
        code, out, err = await anyio.to_thread.run_sync(run_spied, ["probe", "detect-gpu"], env)
        assert (code, out) == (0, b'{"action":"detect-gpu","result":true}\n')
        assert "HEAVY=\n" not in err


async def test_the_shipped_file_with_a_comment_no_reader_takes_is_refused_everywhere(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    """The shipped file's setting lines and a comment YAML refuses (a bell) or that is not
    UTF-8 (Latin-1 ``café``): taken for the shipped file by its setting lines alone, it was
    answered the fast way while every other command refused it (exit 2)."""
    config = tmp_path / "config.yaml"
    root = str(host.root)
    async with served_watcher(root, f"{sockdir}/gw.sock") as served:
        sock = ["--socket", served.path, "--root", root]
        for tail, said in ((b"# caf\xe9\n", "not UTF-8 text"), (b"# \x07\n", "not valid YAML")):
            config.write_bytes(SHIPPED.encode() + tail)
            for argv in (["probe", "detect-gpu", *sock], ["holders", *sock], ["status", *sock]):
                code, out, err = await anyio.to_thread.run_sync(
                    run_spied, argv, {"GPUWATCH_CONFIG": str(config)})
                lines = [line for line in err.splitlines() if not line.startswith("HEAVY=")]
                assert (code, out, len(lines)) == (2, b"", 1), (argv, err)
                assert lines[0].startswith(f"gpuwatch: {config}: {said}"), argv


# ---------------------------------------------------------------- a daemon that read the file

#: What `service install` writes: every setting commented out but two.
SHIPPED = (REPO / "gpuwatch/data/config.yaml").read_text()
#: The shipped file as an operator edits it: the socket to root alone, other values.
EDITED = SHIPPED.replace("log_keep: 5", "log_keep: 3") + "socket_group: ''\nverbose: false\n"
FAST_ARGVS = (["probe", "detect-vfio"], ["probe", "current-mode", "--addr", NV],
              ["holders", "--addr", NV], ["plan", "vfio", "--json"])


@contextmanager
def daemon_with(host: SysRoot, tmp_path: Path, config: Path, *,
                root_flag: bool = True) -> Iterator[str]:
    """A real ``gpuwatch watch`` that read ``config`` at start (``--root`` the fixture's
    unless ``root_flag`` is False); its socket."""
    with short_socket_dir() as sockdir:
        work = tmp_path / f"daemon-{len(list(tmp_path.glob('daemon-*')))}"
        work.mkdir()
        sock = f"{sockdir}/gw.sock"
        with Daemon(host.root, work, sock, "--config", str(config), root_flag=root_flag):
            yield sock


def assert_fast(argv: list[str], env: dict[str, str], fast: bool,
                full_argv: list[str] | None = None) -> None:
    """``argv`` with ``env`` answers as the full command does (``full_argv``, run in this
    process with no config file in force), nothing heavy imported when ``fast``."""
    code, out, err = run_spied(argv, env)
    full_out, full_err = run_full_both(full_argv or argv, code)
    assert ("HEAVY=\n" in err) == fast, (argv, err)
    assert out == full_out, argv
    assert [ln for ln in err.splitlines() if not ln.startswith("HEAVY=")] == \
        full_err.splitlines(), argv


def test_an_edited_config_the_daemon_read_is_answered_the_fast_way(
    host: SysRoot, tmp_path: Path
) -> None:
    """An operator's edit of the config file (socket_group, log_keep…) sent every `probe`,
    `holders` and `plan` the full way (about 10 times slower), though the daemon had read
    and checked that very file: its identity now shows it is that file, unchanged."""
    config = tmp_path / "config.yaml"
    config.write_text(EDITED)
    link = tmp_path / "link.yaml"
    link.symlink_to(config)  # followed, as the full command opens it: the same file
    with daemon_with(host, tmp_path, config) as sock:
        where = ["--socket", sock, "--root", str(host.root)]
        for path in (config, link):
            for argv in FAST_ARGVS:
                assert_fast([*argv, *where], {"GPUWATCH_CONFIG": str(path)}, True)
        # Edited again after the daemon started, to a valid value of the same length: not
        # the file the daemon read, so the full command reads and checks it.
        time.sleep(0.01)  # past the file system's clock tick: the edit moves the times
        config.write_text(EDITED.replace("log_keep: 3", "log_keep: 4"))
        for argv in FAST_ARGVS:
            assert_fast([*argv, *where], {"GPUWATCH_CONFIG": str(config)}, False)
        # ... and to a value every command refuses: exit 2 and one line, never the answer.
        config.write_text(EDITED.replace("log_keep: 3", "log_keep: 0"))
        for argv in FAST_ARGVS:
            code, out, err = run_spied([*argv, *where], {"GPUWATCH_CONFIG": str(config)})
            assert (code, out) == (2, b""), argv
            assert [ln for ln in err.splitlines() if not ln.startswith("HEAVY=")] == \
                [f"gpuwatch: {config}: log_keep: must be an integer from 1 to 1000, not 0"], argv


def test_a_config_file_the_daemon_did_not_read_is_the_full_commands(
    host: SysRoot, tmp_path: Path
) -> None:
    """``$GPUWATCH_CONFIG`` naming another file than the daemon's, even a copy of it byte
    for byte, is read by the full command; one it refuses is refused (exit 2, one line)."""
    config, copy, bad = (tmp_path / name for name in ("config.yaml", "copy.yaml", "bad.yaml"))
    config.write_text(EDITED)
    copy.write_text(EDITED)
    bad.write_text(EDITED.replace("verbose: false", "verbose: maybe"))
    with daemon_with(host, tmp_path, config) as sock:
        where = ["--socket", sock, "--root", str(host.root)]
        for argv in FAST_ARGVS:
            assert_fast([*argv, *where], {"GPUWATCH_CONFIG": str(copy)}, False)
            code, out, err = run_spied([*argv, *where], {"GPUWATCH_CONFIG": str(bad)})
            assert (code, out) == (2, b""), argv
            assert [ln for ln in err.splitlines() if not ln.startswith("HEAVY=")] == \
                [f"gpuwatch: {bad}: verbose: must be true or false (1/0, true/false, yes/no, "
                 "on/off), not 'maybe'"], argv


def test_the_root_a_config_file_names_is_the_one_the_daemon_took_from_it(
    host: SysRoot, tmp_path: Path
) -> None:
    """Without ``--root`` the config file's ``root`` is the command's. The daemon that took
    its root from the file it read says so: the fast way answers for that root. One whose
    ``--root`` overrode the file (another host) is no proof of what the file names."""
    config = tmp_path / "config.yaml"
    config.write_text(EDITED + f"root: {host.root}\n")
    with daemon_with(host, tmp_path, config, root_flag=False) as sock:
        env = {"GPUWATCH_CONFIG": str(config)}
        for argv in FAST_ARGVS:
            assert_fast([*argv, "--socket", sock], env, True,
                        [*argv, "--socket", sock, "--root", str(host.root)])
        # The default socket ($GPUWATCH_SOCKET) is asked for the host root only: this root
        # is a fixture, which the full command scans itself.
        code, out, err = run_spied(["probe", "detect-gpu"], {**env, "GPUWATCH_SOCKET": sock})
        assert (code, out) == (0, b'{"action":"detect-gpu","result":true}\n')
        assert "HEAVY=\n" not in err
    # The daemon's --root overrode the file's, which names no folder: every command
    # refuses that root, however the daemon is asked for (--socket, $GPUWATCH_SOCKET).
    gone = tmp_path / "gone"
    config.write_text(EDITED + f"root: {gone}\n")
    with daemon_with(host, tmp_path, config) as sock:  # --root the GPU host's
        for argv in FAST_ARGVS:
            for ask in ([*argv, "--socket", sock], argv):
                code, out, err = run_spied(
                    ask, {"GPUWATCH_CONFIG": str(config), "GPUWATCH_SOCKET": sock})
                assert (code, out) == (2, b""), ask
                assert [ln for ln in err.splitlines() if not ln.startswith("HEAVY=")] == \
                    [f"gpuwatch: {config}: root: '{gone}' is not a directory"], ask


async def test_a_daemon_without_the_config_method_is_no_proof(
    host: SysRoot, sockdir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon of an earlier release answers ``config`` with ``unknown-method``: the full
    command reads the file. (This in-process daemon says it read the file, to show that the
    method alone makes the difference.)"""
    config = tmp_path / "config.yaml"
    config.write_text(EDITED)
    root = str(host.root)
    said = served_config(load_settings(config=str(config), env={}, resolve_groups=False))
    async with served_watcher(root, f"{sockdir}/gw.sock", config=said) as served:
        argv = ["probe", "detect-gpu", "--socket", served.path, "--root", root]
        env = {"GPUWATCH_CONFIG": str(config)}
        for known, fast in ((P.METHODS, True), (P.METHODS - {"config"}, False)):
            monkeypatch.setattr(P, "METHODS", known)
            code, out, err = await anyio.to_thread.run_sync(run_spied, argv, env)
            assert (code, out) == (0, b'{"action":"detect-gpu","result":true}\n')
            assert ("HEAVY=\n" in err) == fast, known


def test_the_fast_path_and_the_loader_agree_on_a_files_identity(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(EDITED)
    _, identity = read_config_file_as_read(config)
    assert config_identity(str(config)) == list(identity) == list(file_identity(config.stat()))
    assert config_identity(str(tmp_path)) is None  # a folder: the full command's to refuse
    assert config_identity(str(tmp_path / "none.yaml")) is None
    os.mkfifo(tmp_path / "fifo.yaml")  # never opened (no writer: an open could block)
    assert config_identity(str(tmp_path / "fifo.yaml")) is None


async def test_a_config_file_the_daemon_would_refuse_is_refused_when_the_daemon_answers(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    """``log_keep: 0`` made `status` exit 2, while `probe`, `holders` and `plan` answered
    from the daemon, the file half used (docs/service.md: refused everywhere)."""
    config = tmp_path / "config.yaml"
    config.write_text("log_keep: 0\n")
    root = str(host.root)
    async with served_watcher(root, f"{sockdir}/gw.sock") as served:
        sock = ["--socket", served.path, "--root", root]
        for argv in (["probe", "detect-gpu", *sock], ["holders", *sock],
                     ["plan", "vfio", *sock], ["status", *sock]):
            code, out, err = await anyio.to_thread.run_sync(
                run_spied, argv, {"GPUWATCH_CONFIG": str(config)})
            assert (code, out) == (2, b""), argv
            said = [line for line in err.splitlines() if not line.startswith("HEAVY=")]
            assert said == [
                f"gpuwatch: {config}: log_keep: must be an integer from 1 to 1000, not 0"], argv


def test_only_plain_probe_command_lines_are_taken() -> None:
    assert parse_probe(["probe", "detect-vfio"]) == ("detect-vfio", {"action": "detect-vfio"},
                                                     "/", None)
    assert parse_probe(["probe", "--group=3", "vfio-group-accessible", "--socket", "/s"]) == (
        "vfio-group-accessible", {"action": "vfio-group-accessible", "group": 3}, "/", "/s")
    for argv in (
        ["status"],
        ["probe"],
        ["probe", "memlock"],  # this process's own limit, never the daemon's
        ["probe", "plan", "--mode", "vfio"],
        ["probe", "detect-vfio", "--fresh"],
        ["probe", "detect-vfio", "--config", "x.yaml"],
        ["probe", "detect-vfio", "--no-daemon"],
        ["probe", "detect-vfio", "--vendor", "0x10de"],
        ["probe", "detect-vfio", "--help"],
        ["probe", "detect-vfio", "extra"],
        ["probe", "vfio-group-accessible", "--group", "x"],
        ["probe", "vfio-group-accessible", "--group", "1", "--group", "2"],
        ["probe", "display-driver", "--addr", "1:00.0"],
        ["probe", "display-driver", "--addr"],
        ["probe", "display-driver", "--addr", "--root"],
        ["probe", "detect-vfio", "--gr", "1"],  # an abbreviation: argparse's business
    ):
        assert parse_probe(argv) is None, argv


def test_only_plain_holders_command_lines_are_taken() -> None:
    from gpuwatch.cli.fast import DEFAULT_VENDOR
    from gpuwatch.core.plan import NVIDIA_VENDOR

    assert DEFAULT_VENDOR == NVIDIA_VENDOR  # the full command's default card
    assert parse_holders(["holders"]) == ({"vendor": "0x10de"}, False, "/", None)
    assert parse_holders(["holders", "--json", "--addr", "0000:01:00.0"]) == (
        {"addr": "0000:01:00.0"}, True, "/", None)
    for argv in (
        ["holders", "--vendor", "0x1002"],  # the full command validates and sends it
        ["holders", "--addr", "1:00.0"],
        ["holders", "--json=yes"],
        ["holders", "--json", "--json"],
        ["holders", "extra"],
        ["holders", "--config", "x.yaml"],
        ["holders", "--no-daemon"],
    ):
        assert parse_holders(argv) is None, argv


def test_only_plain_plan_command_lines_are_taken() -> None:
    assert parse_plan(["plan", "vfio"]) == ({"mode": "vfio", "vendor": "0x10de"}, False, "/",
                                            None)
    assert parse_plan(["plan", "--force", "nvidia", "--addr", "0000:01:00.0", "--json"]) == (
        {"mode": "nvidia", "addr": "0000:01:00.0", "force": True}, True, "/", None)
    for argv in (
        ["plan"],  # the mode comes from the host: the full command decides
        ["plan", "vfio", "--vfio-driver", "vfio-pci"],
        ["plan", "vfio", "--vendor", "0x1002"],
        ["plan", "bogus"],
        ["plan", "vfio", "nvidia"],
        ["plan", "vfio", "--force=1"],
    ):
        assert parse_plan(argv) is None, argv


def test_the_default_socket_only_for_the_host_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GPUWATCH_SOCKET", raising=False)
    assert socket_path("/", None) == "/run/gpuwatch/gpuwatch.sock"
    assert socket_path(str(tmp_path), None) is None
    assert socket_path(str(tmp_path), "/x.sock") == "/x.sock"
    monkeypatch.setenv("GPUWATCH_SOCKET", "/elsewhere.sock")
    assert socket_path("/", None) == "/elsewhere.sock"


class _CountingServer:
    """A stdlib NDJSON server on a unix socket that counts connections and answers each
    request line with ``id * 10`` (or a wrong id when told to), in order."""

    def __init__(self, path: str, *, wrong_id: bool = False) -> None:
        import json
        import socket
        import threading

        self.accepts = 0
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen()
        self.listener.settimeout(10)

        def serve() -> None:
            try:
                while True:
                    conn, _ = self.listener.accept()
                    self.accepts += 1
                    with conn:
                        buf = b""
                        while chunk := conn.recv(65536):
                            buf += chunk
                            *lines, buf = buf.split(b"\n")
                            for line in lines:
                                rid = json.loads(line)["id"]
                                reply = {"id": rid + 1 if wrong_id else rid, "result": rid * 10}
                                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                return

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.listener.close()


def test_ask_many_pipelines_every_request_on_one_connection() -> None:
    from gpuwatch.cli.fast import ask, ask_many

    with short_socket_dir() as folder:
        server = _CountingServer(os.path.join(folder, "s.sock"))
        try:
            calls = [("probe", {"action": "vfio-group-accessible", "group": g}) for g in range(50)]
            assert ask_many(os.path.join(folder, "s.sock"), calls) == [i * 10 for i in range(1, 51)]
            assert server.accepts == 1
            assert ask(os.path.join(folder, "s.sock"), "probe", {"action": "detect-gpu"}) == 10
            assert server.accepts == 2
        finally:
            server.close()


def test_ask_many_refuses_replies_out_of_order() -> None:
    from gpuwatch.cli.fast import ask_many

    with short_socket_dir() as folder:
        server = _CountingServer(os.path.join(folder, "s.sock"), wrong_id=True)
        try:
            with pytest.raises(ValueError, match="not a result"):
                ask_many(os.path.join(folder, "s.sock"), [("probe", {}), ("probe", {})])
        finally:
            server.close()


@pytest.mark.timeout(60)
def test_ask_gives_up_at_its_timeout_however_the_bytes_drip(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A byte of a reply line that never ends, each within one read's timeout: the
    exchange's timeout bounds the whole wait, so the command falls back instead of hanging."""
    import socket
    import threading

    from gpuwatch.cli import fast

    monkeypatch.setattr(fast, "TIMEOUT", 1.0)
    with short_socket_dir() as folder:
        path = os.path.join(folder, "s.sock")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        listener.listen()
        stop = threading.Event()

        def drip() -> None:
            conn, _ = listener.accept()
            with conn:
                while not stop.wait(0.05):
                    try:
                        conn.sendall(b"{")
                    except OSError:
                        return

        thread = threading.Thread(target=drip, daemon=True)
        thread.start()
        try:
            with pytest.raises(TimeoutError):
                fast.ask(path, "probe", {"action": "detect-gpu"})
        finally:
            stop.set()
            thread.join(timeout=10)
            listener.close()
