"""FIFOs, sockets and device nodes planted where a file is expected: in sysfs, procfs and the
config file. Each is read as unreadable (its documented empty value, or a config error) and
none ever blocks a scan, the loop or the daemon's start."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cli_helpers import run_cli, run_main
from daemon_helpers import Daemon, env, gpuwatch_cmd, probe

from gpuwatch.errors import ConfigError
from gpuwatch.hostfs.files import present, read_bytes, read_text, write_atomic
from gpuwatch.hostfs.scan import HostPaths, on_path, scan
from gpuwatch.service.testing import short_socket_dir
from gpuwatch.settings import CONFIG_MAX_BYTES, load_settings, load_tables, read_config_file
from gpuwatch.testing import SysRoot

NV = "0000:01:00.0"


@pytest.fixture
def sockdir() -> Iterator[str]:
    with short_socket_dir() as path:
        yield path


def plant(path: Path, kind: str) -> None:
    """Replace ``path`` with a special file of ``kind``."""
    if path.exists() or path.is_symlink():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        with short_socket_dir() as short, socket.socket(socket.AF_UNIX) as s:
            s.bind(f"{short}/s")  # bound where the path is short enough, then moved
            os.rename(f"{short}/s", path)  # the socket file stays; nothing listens
    elif kind == "chardev":
        if os.geteuid() != 0:
            pytest.skip("mknod needs root")
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))  # /dev/zero: endless bytes
    else:
        raise AssertionError(kind)


KINDS = ["fifo", "socket", "chardev"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_special_file_reads_as_unreadable_at_once(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "vendor"
    plant(path, kind)
    assert read_text(str(path)) is None
    with pytest.raises(OSError, match="not a regular file"):
        read_bytes(str(path))


def test_reads_are_size_capped(tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.write_bytes(b"x" * 5000)
    assert read_bytes(str(big), 5000) == b"x" * 5000
    with pytest.raises(OSError, match="longer than 4999"):
        read_bytes(str(big), 4999)


@pytest.mark.parametrize("kind", KINDS)
def test_the_scan_treats_planted_attributes_as_unreadable(host: SysRoot, kind: str) -> None:
    dev = host.device_dir(NV)
    for attr in ("vendor", "class", "driver_override", "boot_vga", "numa_node"):
        plant(dev / attr, kind)
    plant(host.root / "proc" / "cmdline", kind)
    snapshot = scan(HostPaths(host.root), load_tables())  # returns: nothing waits on a writer
    fn = next(f for f in snapshot.functions if f.addr == NV)
    assert fn.vendor_id == "" and fn.driver == "nvidia"


@pytest.mark.parametrize("kind", KINDS)
def test_a_daemon_over_a_planted_tree_starts_and_answers(
    host: SysRoot, tmp_path: Path, sockdir: str, kind: str
) -> None:
    dev = host.device_dir(NV)
    for attr in ("vendor", "device", "class", "driver_override"):
        plant(dev / attr, kind)
    with Daemon(host.root, tmp_path, f"{sockdir}/gw.sock") as d:
        assert probe(d.sock, "current-mode", addr="0000:02:00.0")["result"] == "vfio"
        assert "result" in probe(d.sock, "detect-vfio")


@pytest.mark.parametrize("kind", KINDS)
def test_a_planted_poison_file_reads_as_no_poison(host: SysRoot, kind: str) -> None:
    from gpuwatch.switch.poison import DEFAULT_POISON_FILE, PoisonStore

    path = host.root / DEFAULT_POISON_FILE
    path.parent.mkdir(parents=True)
    plant(path, kind)
    assert PoisonStore(str(host.root)).load() == {}  # returns: nothing waits on a writer
    proc = subprocess.run(gpuwatch_cmd("mode", "--root", str(host.root), "--addr", NV),
                          capture_output=True, text=True, env=env(), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "poisoned" not in proc.stdout


def test_garbage_in_the_poison_file_is_ignored(host: SysRoot) -> None:
    from gpuwatch.switch.poison import DEFAULT_POISON_FILE, PoisonStore

    store = PoisonStore(str(host.root))
    path = host.root / DEFAULT_POISON_FILE
    path.parent.mkdir(parents=True)
    entry = {"addr": NV, "to_mode": "vfio", "error": "wedged", "time": ""}
    groups = {"--13": entry, "-": entry, "9" * 5000: entry, "\u0663": entry, "13": entry}
    path.write_text(json.dumps({"boot_id": store.boot_id(), "groups": groups}))
    assert list(store.load()) == [13]
    path.write_text("[" * 100_000 + "]" * 100_000)  # deeper than the JSON parser recurses
    assert store.load() == {}


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("kind", KINDS)
def test_a_special_config_file_is_a_config_error(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "config.yaml"
    plant(path, kind)
    with pytest.raises(ConfigError, match="not a regular file"):
        read_config_file(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a: " + "[" * 1000 + "]" * 1000, "nested deeper than 32"),
        ("a:\n" + "".join("  " * i + "- \n" for i in range(1, 200)), "nested deeper than 32"),
        ("x" * (CONFIG_MAX_BYTES + 1), f"larger than {CONFIG_MAX_BYTES} bytes"),
        ("a: [1, 2", "not valid YAML"),
        ("!!python/object:os.system {}\n", "not valid YAML"),
    ],
)
def test_hostile_config_files_are_one_line_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        read_config_file(path)
    assert "\n" not in str(info.value)


@pytest.fixture
def config_reads(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """The paths of every read of a config file from here on, in this process."""
    import gpuwatch.settings as settings_module

    reads: list[object] = []
    # Every read of the file goes through `read_config_file_as_read` (`read_config_file` too).
    real = settings_module.read_config_file_as_read

    def counting(p: object) -> object:
        reads.append(p)
        return real(p)  # type: ignore[arg-type]

    monkeypatch.setattr(settings_module, "read_config_file_as_read", counting)
    return reads


def test_the_config_file_is_read_once(tmp_path: Path, config_reads: list[object]) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("log_keep: 3\ngpu_vendors:\n  '0x10de': NVIDIA\n")
    settings = load_settings(config=str(path), env={}, resolve_groups=False)
    assert settings.log_keep == 3 and settings.tables().gpu_vendors == {"0x10de": "NVIDIA"}
    assert len(config_reads) == 1


def only_env(monkeypatch: pytest.MonkeyPatch, extra_env: dict[str, str]) -> None:
    """``extra_env`` the only ``GPUWATCH_*`` variables of this process, for the test."""
    for name in [n for n in os.environ if n.startswith("GPUWATCH_")]:
        monkeypatch.delenv(name)
    for name, value in extra_env.items():
        monkeypatch.setenv(name, value)


#: A config file with a table, a setting the commands use and (``{root}``) the host's root.
READ_ONCE = ("gpu_vendors:\n  '0x10de': NVIDIA\n  '0x8086': Intel\n  '0x1002': AMD\n"
             "proc_read_timeout: 3\nroot: {root}\n")


@pytest.mark.parametrize("argv", [
    ["status"],
    ["status", "--json", "--config", "{config}", "--root", "{root}"],
    ["list", "--json"],
    ["probe", "detect-gpu", "--no-daemon"],
    ["probe", "detect-vfio", "--no-daemon", "--config", "{config}"],
    ["probe", "detect-gpu", "--fresh"],
    ["holders", "--addr", NV, "--json"],
    ["plan", "vfio", "--json"],
])
def test_a_command_reads_its_config_file_once(
    host: SysRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], config_reads: list[object], argv: list[str]
) -> None:
    """A command read the file in force 3-4 times (checked whole, then for its root, its
    tables, its ``proc_read_timeout``), each read a YAML parse, and each a chance to use a
    file written over the one it checked: once now, for all of them."""
    config = tmp_path / "config.yaml"
    config.write_text(READ_ONCE.format(root=host.root))
    argv = [w.format(config=config, root=host.root) for w in argv]
    only_env(monkeypatch, {"GPUWATCH_CONFIG": str(config)})
    code, out, err = run_main(capsys, *argv)
    assert code == 0 and out and err == "", (argv, code, err)
    assert config_reads == [str(config)], (argv, len(config_reads))


async def test_a_command_the_daemon_answers_the_full_way_reads_its_config_file_once(
    host: SysRoot, tmp_path: Path, sockdir: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], config_reads: list[object]
) -> None:
    """``$GPUWATCH_CONFIG`` naming a file the daemon did not read: the fast way is no proof,
    so the full command checks the file and asks the daemon with its tables, one read."""
    from gpuwatch.cli import status_cmd
    from gpuwatch.service.testing import served_watcher

    config = tmp_path / "config.yaml"
    config.write_text(READ_ONCE.format(root=host.root))
    asked: list[bool] = []
    real_ask = status_cmd.ask_daemon

    def ask(*args: object, **kwargs: object) -> object:
        answer = real_ask(*args, **kwargs)  # type: ignore[arg-type]
        asked.append(answer is not None)
        return answer

    monkeypatch.setattr(status_cmd, "ask_daemon", ask)
    async with served_watcher(str(host.root), f"{sockdir}/gw.sock") as served:
        config_reads.clear()  # (the daemon's own start is not the command's)
        only_env(monkeypatch, {"GPUWATCH_CONFIG": str(config)})
        for argv in (["status", "--socket", served.path],
                     ["status", "--json", "--socket", served.path, "--root", str(host.root)]):
            code, out, err = await run_cli(capsys, *argv)
            assert code == 0 and out and err == "", (argv, code, err)
            assert asked == [True], argv  # the daemon answered, through the full command
            assert config_reads == [str(config)], (argv, len(config_reads))
            asked.clear()
            config_reads.clear()


def test_the_daemon_reads_its_config_file_once(
    host: SysRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], config_reads: list[object]
) -> None:
    """``gpuwatch watch`` takes its settings, root and tables from one read, as before."""
    config = tmp_path / "config.yaml"
    config.write_text(READ_ONCE.format(root=host.root))
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    only_env(monkeypatch, {})
    code, _out, err = run_main(
        capsys, "watch", "--source", "file:/dev/null", "--log", str(tmp_path / "events.jsonl"),
        "--config", str(config))
    assert code == 0, err
    assert config_reads == [str(config)]


def test_the_library_reads_the_file_it_is_given_each_time_once(
    host: SysRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    config_reads: list[object]
) -> None:
    """`gpuwatch.scan` reads its ``config`` once per call, for the tables, the root and
    ``proc_read_timeout`` alike, and anew on the next call: nothing is kept between calls,
    so an edit is seen by the next scan."""
    import gpuwatch

    only_env(monkeypatch, {})
    config = tmp_path / "config.yaml"
    config.write_text(READ_ONCE.format(root=host.root))
    model = gpuwatch.scan(config=str(config))
    assert model.proc_deadline == 3 and config_reads == [str(config)]
    config.write_text(READ_ONCE.format(root=host.root).replace("proc_read_timeout: 3",
                                                               "proc_read_timeout: 4"))
    assert gpuwatch.scan(config=str(config)).proc_deadline == 4
    assert config_reads == [str(config)] * 2


@pytest.mark.parametrize("case", ["deep", "huge", "fifo", "chardev"])
def test_watch_with_a_hostile_config_exits_2_at_once(
    host: SysRoot, tmp_path: Path, case: str
) -> None:
    path = tmp_path / "config.yaml"
    if case == "deep":
        path.write_text("gpu_vendors: " + "[" * 100_000 + "]" * 100_000)
    elif case == "huge":
        path.write_text("# " + "x" * (2 << 20))
    else:
        plant(path, case)
    started = time.monotonic()
    proc = subprocess.run(
        gpuwatch_cmd("watch", "--root", str(host.root), "--source", "file:/dev/null",
                     "--config", str(path)),
        capture_output=True, text=True, env=env(), timeout=60)
    elapsed = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and str(path) in proc.stderr, proc.stderr
    assert elapsed < 30  # bounded (a hang would hit the timeout); the speed is a benchmark's


def test_the_atomic_write_never_opens_what_is_planted_and_never_loses_a_writer(
    tmp_path: Path,
) -> None:
    """Records, unit files and the NFD features file share one atomic write: a FIFO planted
    at a likely temporary name is never opened (an open would wait for a reader), the mode
    is the one asked for, writers at once each rename a whole file of their own (two
    `gpuwatch mode` runs record their poison together), and nothing temporary is left."""
    import threading

    path = tmp_path / "record.json"
    path.write_text("old\n")
    planted = tmp_path / ".record.json.gpuwatch-new"
    os.mkfifo(planted)
    write_atomic(str(path), '{"new": 1}\n', 0o600, sync_dir=True)
    assert path.read_text() == '{"new": 1}\n'
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_ISFIFO(planted.stat().st_mode)  # left alone
    planted.unlink()

    errors: list[BaseException] = []
    torn: list[str] = []

    def writer(k: int) -> None:
        try:
            for i in range(100):
                write_atomic(str(path), json.dumps({"writer": k, "i": i, "pad": "x" * 4000}))
        except BaseException as exc:
            errors.append(exc)

    def reader() -> None:
        for _ in range(400):
            text = path.read_text()
            try:
                json.loads(text)
            except ValueError:
                torn.append(text[:40])

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    threads.append(threading.Thread(target=reader))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and not torn
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.json"]

    target_dir = tmp_path / "a-directory"
    (target_dir / "inside").mkdir(parents=True)  # os.replace onto a non-empty directory fails
    with pytest.raises(OSError):
        write_atomic(str(target_dir), b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-directory", "record.json"]


def test_present_asks_without_reading(tmp_path: Path) -> None:
    """What a scan asks before it reads what most functions lack: a link counts as itself
    only when not followed, and a path no file can have is simply absent."""
    (tmp_path / "sriov_totalvfs").write_text("8\n")
    (tmp_path / "physfn").symlink_to("../nowhere")
    plant(tmp_path / "fifo", "fifo")
    assert present(str(tmp_path / "sriov_totalvfs"))
    assert present(str(tmp_path / "fifo"))  # there; what it is, the read decides
    assert not present(str(tmp_path / "physfn"))  # dangling, followed
    assert present(str(tmp_path / "physfn"), follow_symlinks=False)
    assert not present(str(tmp_path / "vfio-dev"))
    assert not present(str(tmp_path) + "/vendor\0")


def _executable(path: Path) -> None:
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)


@pytest.mark.parametrize("search", [None, "", "{a}", "{b}:{a}", "{b}::{a}", "{a}:{a}", "{c}",
                                    "{d}:{b}", "{e}", "{f}", "relative", ":", "{b}:{c}:{d}"])
def test_on_path_is_which(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          search: str | None) -> None:
    """What the CDI probe asks of ``$PATH`` answers as ``shutil.which`` does: an executable
    file (a link to one too), never a folder, a plain file or a dangling link; an empty entry
    is the working directory; an unset ``PATH`` is the system's default path."""
    name = "nvidia-ctk"
    folders = {k: tmp_path / k for k in "abcdef"}
    for folder in folders.values():
        folder.mkdir()
    _executable(folders["a"] / name)  # found
    (folders["b"] / name).write_text("not executable\n")
    (folders["c"] / name).mkdir()  # a folder of that name
    (folders["d"] / name).symlink_to(folders["a"] / name)  # a link to an executable
    (folders["e"] / name).symlink_to(tmp_path / "nowhere")  # dangling
    (folders["f"] / name).mkdir(mode=0o755)
    (tmp_path / "relative").mkdir()
    _executable(tmp_path / name)  # in the working directory: what an empty entry finds
    monkeypatch.chdir(tmp_path)
    if search is None:
        monkeypatch.delenv("PATH", raising=False)
    else:
        monkeypatch.setenv("PATH", search.format(**{k: str(v) for k, v in folders.items()}))
    assert on_path(name) == (shutil.which(name) is not None)
