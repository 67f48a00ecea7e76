"""The real host seam: writes from a child process under a timeout, commands as argument lists.

Only regular files and FIFOs in tmp dirs are written, and the only processes started are
this Python itself: nothing here touches the real /sys or runs a host command.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest

from gpuwatch.errors import HostStepError, StepTimedOut, UnsafeStep
from gpuwatch.hostfs.facts import call_bounded
from gpuwatch.hostfs.files import resolve_in_root
from gpuwatch.switch import hostops
from gpuwatch.switch.hostops import (
    RealHostOps,
    check_command,
    check_write,
    is_real_sysfs,
    run_bounded,
    write_in_child,
)
from gpuwatch.testing import SysRoot


def test_a_write_lands_in_the_file_exactly(tmp_path: Path) -> None:
    target = tmp_path / "driver_override"
    target.write_text("(null)\n")
    write_in_child(str(target), "vfio-pci", 5.0)
    assert target.read_text() == "vfio-pci"
    write_in_child(str(target), "\n", 5.0)
    assert target.read_text() == "\n"


def test_a_failed_write_reports_the_errno(tmp_path: Path) -> None:
    with pytest.raises(HostStepError) as info:
        write_in_child(str(tmp_path / "missing"), "x", 5.0)
    assert info.value.errno == errno.ENOENT
    assert "No such file" in str(info.value)
    assert not (tmp_path / "missing").exists()  # never created


def test_a_write_does_not_follow_a_planted_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    (tmp_path / "unbind").symlink_to(victim)
    with pytest.raises(HostStepError) as info:
        write_in_child(str(tmp_path / "unbind"), "0000:01:00.0", 5.0)
    assert info.value.errno == errno.ELOOP
    assert victim.read_text() == "keep\n"


def test_a_write_that_never_returns_is_killed_and_the_caller_goes_on(tmp_path: Path) -> None:
    fifo = tmp_path / "unbind"
    os.mkfifo(fifo)  # opening it for writing blocks until a reader comes: never
    start = time.monotonic()
    with pytest.raises(StepTimedOut, match=r"did not return within 0\.5s"):
        write_in_child(str(fifo), "0000:01:00.0", 0.5)
    assert time.monotonic() - start < 3.0
    # Had the child survived, it would now finish its open and write to this reader.
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        time.sleep(0.3)
        assert os.read(reader, 64) == b""
    finally:
        os.close(reader)
    assert hostops._ABANDONED == []  # it died of the kill: nothing left behind


async def test_real_ops_write_under_the_root_only_what_is_allowed(tmp_path: Path) -> None:
    host = SysRoot(tmp_path / "host")
    host.add_function("0000:01:00.0", driver="nvidia", iommu_group=13)
    ops = RealHostOps(host.root)
    await ops.write("/sys/bus/pci/devices/0000:01:00.0/driver_override", "vfio-pci", 5.0)
    assert (host.device_dir("0000:01:00.0") / "driver_override").read_text() == "vfio-pci"
    await ops.write("/sys/bus/pci/drivers_probe", "0000:01:00.0", 5.0)
    assert (host.root / "sys/bus/pci/drivers_probe").read_text() == "0000:01:00.0"
    for path, value in (("/sys/bus/pci/devices/0000:01:00.0/remove", "1"),
                        ("/sys/bus/pci/drivers_probe", "0000:01:00.0;x"),
                        ("/sys/bus/pci/devices/0000:01:00.0/driver_override", "a b")):
        with pytest.raises(UnsafeStep):
            await ops.write(path, value, 5.0)
    # ``remove`` is write-only (0200), so only its size says nothing was written to it.
    assert (host.device_dir("0000:01:00.0") / "remove").stat().st_size == 0


#: An address no host here has, so that a write led astray could only fail, never land.
_STRAY = "0000:7e:1f.7"


@pytest.mark.parametrize("spelling", ["absolute", "climbing"])
async def test_a_write_follows_the_trees_links_as_in_a_chroot(tmp_path: Path,
                                                              spelling: str) -> None:
    """A captured tree may spell the bus entry's link absolute (``/sys/devices/…``), or with
    more ``..`` than it has levels: followed by the kernel, either leads out of the tree and
    into the host's sysfs. The write must land in the tree's own device."""
    host = SysRoot(tmp_path / "host")
    host.add_function(_STRAY, driver="nvidia", iommu_group=13)
    device = host.device_dir(_STRAY)
    inside = "/" + str(device.relative_to(host.root))
    assert not os.path.lexists(inside), "the host has this device: the test would not be safe"
    entry = host.root / "sys/bus/pci/devices" / _STRAY
    entry.unlink()
    entry.symlink_to(inside if spelling == "absolute" else "../" * 40 + inside.lstrip("/"))
    ops = RealHostOps(host.root)
    await ops.write(f"/sys/bus/pci/devices/{_STRAY}/driver_override", "vfio-pci", 5.0)
    assert (device / "driver_override").read_text() == "vfio-pci"


async def test_a_folder_made_through_the_trees_link_is_made_in_the_tree(tmp_path: Path) -> None:
    """``etc/cdi`` a link spelled absolute (``/run/cdi``-like): the folder made for the CDI
    spec is the tree's, never the one that path names on the host running gpuwatch (which
    may not exist: then the link itself made ``mkdir -p`` fail with EEXIST)."""
    root = tmp_path / "host"
    (root / "etc").mkdir(parents=True)
    away = "/gpuwatch-test-absent/cdi"
    assert not os.path.lexists(away), "the host has this folder: the test would not be safe"
    os.symlink(away, root / "etc/cdi")
    await RealHostOps(root).makedirs("/etc/cdi")
    assert (root / away.lstrip("/")).is_dir()
    assert not os.path.lexists(away)


async def test_a_write_through_a_link_loop_is_refused(tmp_path: Path) -> None:
    host = SysRoot(tmp_path / "host")
    host.add_function(_STRAY, driver="nvidia", iommu_group=13)
    entry = host.root / "sys/bus/pci/devices" / _STRAY
    entry.unlink()
    entry.symlink_to(_STRAY)  # itself
    with pytest.raises(UnsafeStep, match="refusing to write"):
        await RealHostOps(host.root).write(
            f"/sys/bus/pci/devices/{_STRAY}/driver_override", "vfio-pci", 5.0)


def test_resolve_in_root_reads_links_as_a_chroot_would(tmp_path: Path) -> None:
    (tmp_path / "a/b").mkdir(parents=True)
    (tmp_path / "abs").symlink_to("/a/b")
    (tmp_path / "a/up").symlink_to("../../../../a")
    (tmp_path / "a/b/file").symlink_to("/elsewhere")
    assert resolve_in_root(str(tmp_path), f"{tmp_path}/abs/x") == f"{tmp_path}/a/b/x"
    assert resolve_in_root(str(tmp_path), f"{tmp_path}/a/up/b/x") == f"{tmp_path}/a/b/x"
    assert resolve_in_root(str(tmp_path), f"{tmp_path}/abs/../../../y") == f"{tmp_path}/y"
    # The last component is not followed: the write refuses a link there (O_NOFOLLOW).
    assert resolve_in_root(str(tmp_path), f"{tmp_path}/a/b/file") == f"{tmp_path}/a/b/file"
    with pytest.raises(ValueError):
        resolve_in_root(str(tmp_path / "a"), f"{tmp_path}/abs")


def test_resolve_in_root_at_slash_is_the_kernels_resolution() -> None:
    """Read-only, on this machine's real sysfs: with root ``/`` it finds what the kernel finds."""
    entries = sorted(os.listdir("/sys/bus/pci/devices")) if os.path.isdir(
        "/sys/bus/pci/devices") else []
    if not entries:
        pytest.skip("no PCI devices in /sys here")
    for addr in entries:
        path = f"/sys/bus/pci/devices/{addr}/driver_override"
        assert resolve_in_root("/", path) == os.path.join(
            os.path.realpath(f"/sys/bus/pci/devices/{addr}"), "driver_override")


async def test_real_ops_refuse_host_commands_on_a_fixture_root(tmp_path: Path) -> None:
    ops = RealHostOps(SysRoot(tmp_path / "host").root)
    assert ops.allow_commands is False
    with pytest.raises(UnsafeStep, match="not a mounted sysfs"):
        await ops.run(["modprobe", "-r", "nvidia"], 5.0)
    with pytest.raises(UnsafeStep):
        await ops.run(["sh", "-c", "true"], 5.0)


def test_commands_outside_the_allow_list_are_refused() -> None:
    check_command(["modprobe", "-r", "nvidia_drm", "nvidia_modeset"])
    check_command(["systemctl", "stop", "nvidia-persistenced"])
    check_command(["nvidia-modprobe", "-c", "0", "-u"])
    check_command(["nvidia-ctk", "cdi", "generate", "--output=/etc/cdi/nvidia.yaml"])
    for argv in (["rmmod", "nvidia"], ["modprobe", "nvidia;reboot"], ["modprobe", "-r"],
                 ["systemctl", "stop", "sshd"], ["nvidia-ctk", "runtime", "configure"],
                 ["nvidia-modprobe", "-f"], [], ["modprobe", "nvidia\n"]):
        with pytest.raises(UnsafeStep):
            check_command(argv)


def test_write_checks_use_full_matches() -> None:
    check_write("/sys/bus/pci/drivers/vfio-pci/unbind", "0000:01:00.0")
    check_write("/sys/bus/pci/devices/0000:01:00.0/driver_override", "\n")
    for path, value in (("/sys/bus/pci/drivers/vfio-pci/unbind", "0000:01:00.0\n"),
                        ("/sys/bus/pci/devices/0000:01:00.0\n/driver_override", "nvidia"),
                        ("/sys/bus/pci/drivers/../unbind", "0000:01:00.0")):
        with pytest.raises(UnsafeStep):
            check_write(path, value)


def test_a_command_that_hangs_is_killed_at_its_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(StepTimedOut):
        run_bounded([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    assert time.monotonic() - start < 3.0
    ok = run_bounded([sys.executable, "-c", "import sys; print('hi'); sys.exit(3)"], 10.0)
    assert (ok.returncode, ok.stdout.strip()) == (3, "hi")
    missing = run_bounded(["/nonexistent/gpuwatch-tool"], 1.0)
    assert missing.returncode == 127 and "not found" in missing.message()


def test_a_hung_command_is_killed_with_what_it_started(tmp_path: Path) -> None:
    """A wrapper (a shell script around nvidia-ctk) that hangs in a child of its own: the
    child goes too at the timeout, not only the wrapper (it ran on, holding our pipes, and
    the step waited out the grace for nothing)."""
    pid_file = tmp_path / "grandchild.pid"
    wrapper = ("import subprocess, sys, time; "
               "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
               f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    with pytest.raises(StepTimedOut):
        run_bounded([sys.executable, "-c", wrapper], 1.0)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:  # killed, and reaped by init once its parent is gone
            state = Path(f"/proc/{grandchild}/stat").read_text().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        os.kill(grandchild, 9)
        pytest.fail("the hung command's own child outlived its timeout")


def test_is_real_sysfs_reads_mountinfo(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    (tmp_path / "host/sys").mkdir(parents=True)
    info.write_text(
        "22 1 0:21 / /proc rw,nosuid - proc proc rw\n"
        f"23 1 0:22 / {tmp_path}/host/sys rw,nosuid shared:7 - sysfs sysfs rw\n")
    assert is_real_sysfs(str(tmp_path / "host"), str(info)) is True
    assert is_real_sysfs(str(tmp_path / "other"), str(info)) is False
    assert is_real_sysfs(str(tmp_path / "host"), str(tmp_path / "absent")) is False


# --------------------------------------------------------------------------- bounded reads

_BACKENDS = ["asyncio", pytest.param("trio", marks=pytest.mark.skipif(
    importlib.util.find_spec("trio") is None, reason="trio is not installed"))]


@pytest.mark.parametrize("backend", _BACKENDS)
def test_a_bounded_read_hands_back_its_value_as_soon_as_it_has_it(backend: str) -> None:
    """The thread wakes the loop when its read is done: the caller never sits out the rest
    of the timeout (with an anyio that could not be entered from a foreign thread, the
    wake-up failed silently and every read took its whole timeout)."""
    async def main() -> tuple[object, float]:
        started = time.monotonic()
        value = await call_bounded(lambda: threading.current_thread().name, 30.0, "a read")
        return value, time.monotonic() - started

    value, took = anyio.run(main, backend=backend)
    assert value == "gpuwatch a read"  # read in a thread of its own, named for the read
    assert took < 10.0, f"the read's value waited {took:.1f} s for a 30 s timeout"


@pytest.mark.parametrize("backend", _BACKENDS)
def test_a_bounded_read_that_fails_or_hangs_is_reported_as_such(backend: str) -> None:
    release = threading.Event()

    def fail() -> None:
        raise PermissionError(errno.EACCES, "no")

    async def main() -> None:
        with pytest.raises(PermissionError):
            await call_bounded(fail, 30.0, "a read")
        with pytest.raises(StepTimedOut, match="a stuck read"):
            await call_bounded(lambda: release.wait(30), 0.2, "a stuck read")

    try:
        anyio.run(main, backend=backend)
    finally:
        release.set()


@pytest.mark.parametrize("backend", _BACKENDS)
def test_a_bounded_read_that_ends_after_its_loop_is_gone_ends_quietly(backend: str) -> None:
    """The caller gave up and its loop has finished when the read returns: the thread's
    wake-up finds no loop (anyio's RunFinishedError) and ends without a word."""
    release = threading.Event()
    ended = threading.Event()
    hooked: list[BaseException | None] = []
    previous = threading.excepthook

    def read() -> int:
        release.wait(30)
        return 1

    async def main() -> None:
        with pytest.raises(StepTimedOut):
            await call_bounded(read, 0.1, "a late read")

    threading.excepthook = lambda args: hooked.append(args.exc_value)
    try:
        anyio.run(main, backend=backend)
        [thread] = [t for t in threading.enumerate() if t.name == "gpuwatch a late read"]
        release.set()
        thread.join(10)
        ended.set()
        assert not thread.is_alive()
    finally:
        release.set()
        threading.excepthook = previous
    assert ended.is_set() and hooked == []
