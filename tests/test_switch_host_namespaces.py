"""``host_namespaces``: a switch run from a container (the Kubernetes switching overlay) runs
every host command in the host's namespaces, through ``nsenter --target 1 --mount --uts --ipc
--pid --``, so systemctl, modprobe (with the host's modprobe.d), nvidia-modprobe and nvidia-ctk
are the host's own. The image has none of them (and no /run/systemd): run there, a switch
to vfio was refused by a persistenced systemctl never stopped, and one back to nvidia made no
/dev/nvidia* and no CDI spec.

The simulated kernel stands behind every command (it takes the nsenter prefix as the host's
namespaces): nothing reaches the real host. A fake ``nsenter`` on PATH is found, never run,
except by the one test that runs it for real, where it only records its arguments."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import anyio
import pytest
from cli_helpers import run_cli, simulated_cli

from gpuwatch.cli.main import main
from gpuwatch.errors import UnsafeStep
from gpuwatch.host import open_host
from gpuwatch.service.testing import served_watcher, short_socket_dir
from gpuwatch.settings import config_in_force, load_settings
from gpuwatch.sources.memory import MemorySource
from gpuwatch.switch import hostops
from gpuwatch.switch.hostops import (
    HOST_PATH,
    NSENTER_ARGS,
    InHostNamespaces,
    NsenterMissing,
    RealHostOps,
    check_command,
    host_which,
)
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.testing.simkernel import DEFAULT_TOOLS, SimKernel

ENV = "GPUWATCH_HOST_NAMESPACES"


def executable(path: Path, text: str = "#!/bin/sh\nexit 99\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture
def nsenter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An ``nsenter`` alone on PATH (the image's, found by name; never run here)."""
    found = executable(tmp_path / "image-bin/nsenter")
    monkeypatch.setenv("PATH", str(found.parent))
    return str(found)


def host_tools(s: SysRoot, names: frozenset[str] = DEFAULT_TOOLS) -> None:
    """The host's own tools, where its init sees them (``proc/1/root/usr/bin``)."""
    for name in names:
        executable(s.root / "proc/1/root/usr/bin" / name)


def persistenced_host(s: SysRoot) -> SimKernel:
    """nvidia-persistenced holding the card, no CDI spec yet (nvidia-ctk makes one)."""
    kernel = SimKernel(s)
    kernel.start_persistenced()
    s.remove_cdi_spec("etc")
    host_tools(s)
    return kernel


def round_trip(host: SysRoot, monkeypatch: pytest.MonkeyPatch,
               capsys: pytest.CaptureFixture[str]) -> SimKernel:
    run, kernel = simulated_cli(host, monkeypatch, capsys, sim=persistenced_host(host))
    for mode in ("vfio", "nvidia"):
        code, out, err = run("mode", mode, "--json")
        assert (code, err) == (0, ""), err
        assert json.loads(out)["to_mode"] == mode
    return kernel


# --------------------------------------------------------------------------- the switch


def test_every_command_of_a_switch_runs_in_the_hosts_namespaces(
        host: SysRoot, tmp_path: Path, nsenter: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """nvidia → vfio → nvidia with persistenced running: each command is exactly nsenter's
    prefix and the command a switch runs without the setting, nvidia-ctk's output the
    host's own path; the switch stops persistenced, and the way back makes the host's
    /dev/nvidia* and CDI spec."""
    direct = round_trip(host, monkeypatch, capsys).commands
    assert ("systemctl", "stop", "nvidia-persistenced") in direct  # the commands to compare
    other = example_gpu_host(tmp_path / "other")
    monkeypatch.setenv(ENV, "1")
    kernel = round_trip(other, monkeypatch, capsys)
    prefix = (nsenter, *NSENTER_ARGS)
    assert kernel.commands, "no command ran"
    for argv in kernel.commands:
        assert argv[:len(prefix)] == prefix, argv
    ran = [argv[len(prefix):] for argv in kernel.commands]
    # The same commands, nvidia-ctk's --output the host's path (the tree's root is /).
    assert ran == [tuple(a.replace(str(host.root), "") for a in argv) for argv in direct]
    assert ("nvidia-ctk", "cdi", "generate", "--output=/etc/cdi/nvidia.yaml") in ran
    assert (other.root / "etc/cdi/nvidia.yaml").is_file()
    assert (other.root / "dev/nvidiactl").exists()


def test_the_plan_asks_the_hosts_path_for_its_tools(
        host: SysRoot, nsenter: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Which tools a plan uses is the host's answer, not the image's: with no nvidia-ctk
    on the host, the switch back says so and runs none."""
    monkeypatch.setenv(ENV, "true")
    kernel = persistenced_host(host)
    (host.root / "proc/1/root/usr/bin/nvidia-ctk").unlink()
    run, _ = simulated_cli(host, monkeypatch, capsys, sim=kernel)
    assert run("mode", "vfio")[0] == 0
    code, _, err = run("mode", "nvidia")
    assert code == 0 and "nvidia-ctk is not on PATH" in err
    assert not any("nvidia-ctk" in argv for argv in kernel.commands)
    assert any("nvidia-modprobe" in argv for argv in kernel.commands)


def test_through_the_daemon(host: SysRoot, nsenter: str, monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    """``gpuwatch mode`` answered by a daemon whose environment sets the setting (as the
    pod's does): its switch's commands are the host's."""
    monkeypatch.setenv(ENV, "yes")
    kernel = persistenced_host(host)
    simulated_cli(host, monkeypatch, capsys, sim=kernel)

    async def go() -> None:
        with short_socket_dir() as sockdir:
            sock = f"{sockdir}/gw.sock"
            async with served_watcher(host.root, sock, source=kernel.source):
                code, out, err = await run_cli(capsys, "mode", "vfio", "--json", "--socket",
                                               sock, "--root", str(host.root))
                assert (code, err) == (0, ""), err
                assert json.loads(out)["to_mode"] == "vfio"

    anyio.run(go)
    assert ((nsenter, *NSENTER_ARGS, "systemctl", "stop", "nvidia-persistenced")
            in kernel.commands)
    assert all(argv[0] == nsenter for argv in kernel.commands)


def test_off_by_default(host: SysRoot, nsenter: str, monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv(ENV, raising=False)
    kernel = round_trip(host, monkeypatch, capsys)
    assert kernel.commands and not any(nsenter in argv for argv in kernel.commands)


# --------------------------------------------------------------------------- no nsenter


def test_no_nsenter_is_one_line_and_exit_2_before_anything_is_written(
        host: SysRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setenv(ENV, "on")
    run, kernel = simulated_cli(host, monkeypatch, capsys, sim=persistenced_host(host))
    code, out, err = run("mode", "vfio")
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        "gpuwatch: environment GPUWATCH_HOST_NAMESPACES is on, but nsenter is not on PATH "
        "(util-linux): host commands cannot run in the host's namespaces"], err
    assert kernel.record == []


def test_the_daemon_with_no_nsenter_stops_before_its_log(
        host: SysRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    log = tmp_path / "events.jsonl"
    config = tmp_path / "config.yaml"
    config.write_text("host_namespaces: yes\n")
    argv = ["watch", "--root", str(host.root), "--source", "file:/dev/null", "--log", str(log)]
    code = main([*argv, "--config", str(config)])
    _, err = capsys.readouterr()
    assert code == 2 and err.splitlines() == [
        f"gpuwatch: {config}: host_namespaces is on, but nsenter is not on PATH (util-linux): "
        "host commands cannot run in the host's namespaces"], err
    config.write_text("")
    code = main([*argv, "--config", str(config), "--host-namespaces"])
    _, err = capsys.readouterr()
    assert code == 2 and err.splitlines() == [
        "gpuwatch: --host-namespaces is on, but nsenter is not on PATH (util-linux): host "
        "commands cannot run in the host's namespaces"], err
    assert not log.exists()


# --------------------------------------------------------------------------- the pieces


def test_the_allow_list_takes_exactly_one_prefix() -> None:
    ok = ("/usr/bin/nsenter", *NSENTER_ARGS, "modprobe", "vfio-pci")
    check_command(ok)
    for bad in (("nsenter", *NSENTER_ARGS, "modprobe", "vfio-pci"),  # not a path
                ("/usr/bin/nsenter", "--target", "1", "--mount", "--", "modprobe", "x"),
                ("/usr/bin/nsenter", *NSENTER_ARGS, "sh", "-c", "true"),
                ("/usr/bin/nsenter", *NSENTER_ARGS, *ok),
                ("/usr/bin/nsenter", *NSENTER_ARGS)):
        with pytest.raises(UnsafeStep):
            check_command(bad)


def test_the_real_ops_run_nsenter_with_the_exact_argv_and_the_hosts_path(
        tmp_path: Path) -> None:
    """`RealHostOps` runs the prefixed argument list as it is, PATH the host's: a fake
    nsenter records what it was given and runs nothing."""
    said = tmp_path / "said.json"
    fake = executable(tmp_path / "bin/nsenter", f"#!{sys.executable}\n"
                      "import json, os, sys\n"
                      f"open({str(said)!r}, 'w').write(json.dumps("
                      "[sys.argv, os.environ.get('PATH')]))\n")
    root = SysRoot(tmp_path / "host").root
    ops = InHostNamespaces(RealHostOps(root, allow_commands=True), str(fake), str(root))
    result = anyio.run(ops.run, ("nvidia-ctk", "cdi", "generate",
                                 f"--output={root}/etc/cdi/nvidia.yaml"), 10.0)
    assert result.ok, result
    argv, path = json.loads(said.read_text())
    assert argv == [str(fake), *NSENTER_ARGS, "nvidia-ctk", "cdi", "generate",
                    "--output=/etc/cdi/nvidia.yaml"]
    assert path == HOST_PATH
    with pytest.raises(UnsafeStep):  # a path the host's mount namespace cannot see
        anyio.run(ops.run, ("nvidia-ctk", "cdi", "generate", "--output=/tmp/nvidia.yaml"), 1.0)


def test_host_which_reads_the_hosts_links_in_its_own_root(tmp_path: Path) -> None:
    """A tool linked absolutely (``/usr/bin/nvidia-ctk`` → ``/usr/local/nvidia/…``, as the
    GPU operator's toolkit installs it) is followed in the host's root, never ours."""
    s = SysRoot(tmp_path / "host")
    view = s.root / "proc/1/root"
    executable(view / "usr/local/nvidia/toolkit/nvidia-ctk")
    (view / "usr/bin").mkdir(parents=True)
    os.symlink("/usr/local/nvidia/toolkit/nvidia-ctk", view / "usr/bin/nvidia-ctk")
    os.symlink("/bin/sh", view / "usr/bin/systemctl")  # ours has one; the host's has not
    (view / "usr/sbin").mkdir()
    (view / "usr/sbin/modprobe").write_text("")  # not executable
    assert host_which(str(s.root), "nvidia-ctk") == "/usr/bin/nvidia-ctk"
    assert host_which(str(s.root), "systemctl") is None
    assert host_which(str(s.root), "modprobe") is None
    assert host_which(str(s.root), "../nvidia-ctk") is None


def test_the_setting_is_read_as_every_boolean() -> None:
    assert load_settings({}, env={ENV: "1"}, default_config="/nonexistent").host_namespaces
    assert not load_settings({}, env={}, default_config="/nonexistent").host_namespaces
    assert hostops.NSENTER_ARGS == ("--target", "1", "--mount", "--uts", "--ipc", "--pid", "--")


@pytest.mark.parametrize("pid1", ["the host's init", "the pod's own"])
def test_a_pod_whose_pid_1_is_not_the_hosts_init_is_warned_of(
        host: SysRoot, nsenter: str, caplog: pytest.LogCaptureFixture, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, pid1: str) -> None:
    """Without ``hostPID: true`` nsenter's PID 1 is the pod's own first process: the commands
    would run in the container, with the image's tools, which is what the setting exists to
    avoid. The host's ``/proc`` under the root names the host's init; where PID 1 here is
    not it, the backend says so."""
    own_proc = tmp_path / "own-proc"  # this process's /proc, as the pod sees it
    (own_proc / "1/ns").mkdir(parents=True)
    (own_proc / "1/ns/mnt").symlink_to("mnt:[4026531841]")
    monkeypatch.setattr(hostops, "OWN_PROC", str(own_proc))
    ns = host.root / "proc/1/ns"
    ns.mkdir(parents=True)
    (ns / "mnt").symlink_to("mnt:[4026531841]" if pid1 == "the host's init"
                            else "mnt:[4026531840]")
    assert hostops.nsenter_target_is_hosts(str(host.root)) is (pid1 == "the host's init")
    with caplog.at_level("WARNING", logger="gpuwatch.switch.hostops"):
        hostops.make_backend(str(host.root), host_namespaces=True)
    warned = [r.getMessage() for r in caplog.records if "hostPID: true" in r.getMessage()]
    assert bool(warned) is (pid1 == "the pod's own")
    assert hostops.nsenter_target_is_hosts("/") is None  # a bare host: nothing to tell


# --------------------------------------------------------------------------- the library


@pytest.mark.parametrize("given", ["the file's path", "the file read (config_in_force)"])
def test_open_host_takes_the_setting_from_the_config_it_is_given(
        host: SysRoot, nsenter: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        given: str) -> None:
    """``open_host(config=FILE)`` is the embedder's daemon: its switch runs its commands where
    FILE says, not where the default file or ``$GPUWATCH_CONFIG`` (another file) would."""
    monkeypatch.delenv(ENV, raising=False)
    kernel = persistenced_host(host)
    monkeypatch.setattr(hostops, "backend_factory",
                        lambda root: hostops.Backend(kernel, kernel.new_source(), lambda: 0))
    on, off = tmp_path / "on.yaml", tmp_path / "off.yaml"
    on.write_text("host_namespaces: true\n")
    off.write_text("host_namespaces: false\n")

    async def switches_with(config: Path, elsewhere: Path) -> list[tuple[str, ...]]:
        monkeypatch.setenv("GPUWATCH_CONFIG", str(elsewhere))  # the file in force otherwise
        kernel.record.clear()
        arg = config if given == "the file's path" else config_in_force(config)
        async with open_host(host.root, kernel.new_source(), config=arg) as h:
            with anyio.fail_after(30):
                await h.switch("0000:01:00.0", "vfio")
                await h.switch("0000:01:00.0", "nvidia")
        return list(kernel.commands)

    async def go() -> None:
        commands = await switches_with(on, off)
        assert commands and all(argv[0] == nsenter for argv in commands), commands
        commands = await switches_with(off, on)
        assert commands and not any(nsenter in argv for argv in commands), commands

    anyio.run(go)


def test_open_host_with_the_setting_and_no_nsenter_is_refused_before_its_scan(
        host: SysRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The library refuses as the daemon does (`NsenterMissing`, naming the file), and the
    source it was handed is closed: nothing is left open."""
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv(ENV, raising=False)
    config = tmp_path / "config.yaml"
    config.write_text("host_namespaces: true\n")
    source = MemorySource()

    async def go() -> None:
        with pytest.raises(NsenterMissing, match=f"^{config}: host_namespaces is on"):
            async with open_host(host.root, source, config=config):
                pytest.fail("the body ran")

    anyio.run(go)
    with pytest.raises(anyio.ClosedResourceError):
        source.push({"ACTION": "add", "DEVPATH": "/devices/x", "SUBSYSTEM": "pci"})
