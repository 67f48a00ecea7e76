"""The stdlib-only ``gpuwatch probe`` path: nothing heavy imported before the reply is printed,
and byte for byte the full command's output; anything it cannot answer goes to the full one."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import anyio
import pytest

from gpuwatch.cli.fast import parse_holders, parse_plan, parse_probe, socket_path
from gpuwatch.cli.main import build_parser
from gpuwatch.service.testing import served_watcher, short_socket_dir
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
        # The file `service install` writes names no root: the daemon answers, the fast way.
        # So does another release's (other comments), while an edited one is read in full.
        shipped = (REPO / "gpuwatch/data/config.yaml").read_text()
        older = shipped.replace("log_keep: 5 ", "log_keep: 5 # kept ") + "# socket: /s\n"
        for text, fast in ((shipped, True), (older, True), (shipped + "verbose: true\n", False)):
            config.write_text(text)
            code, out, err = await anyio.to_thread.run_sync(
                run_spied, ["probe", "detect-gpu"], env)
            assert (code, out) == (0, b'{"action":"detect-gpu","result":true}\n')
            assert ("HEAVY=\n" in err) == fast, text


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
            assert said == [f"gpuwatch: {config}: log_keep: must be at least 1, not 0"], argv


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
