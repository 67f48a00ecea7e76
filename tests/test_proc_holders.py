"""The holder scan against odd /proc trees: a maps file longer than one read, fds on device
nodes that were deleted and made again, a process whose main thread has exited while its other
threads keep the card open. Fixture trees laid out as /proc lays them out, and this machine's
own /proc (read only) where the kernel's behaviour is the point."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.core.plan import NodeScope
from gpuwatch.errors import SwitchRefused
from gpuwatch.hostfs.facts import mapped_files, scan_holders
from gpuwatch.hostfs.procfs import held_node, nvidia_holders
from gpuwatch.model import holders_report, scan
from gpuwatch.testing import SysRoot
from gpuwatch.testing.simkernel import SimKernel, simulated_switch

NV = "0000:01:00.0"
NV2, AUDIO2 = "0000:03:00.0", "0000:03:00.1"
NVIDIA_UNBIND = "/sys/bus/pci/drivers/nvidia/unbind"

real_proc = pytest.mark.skipif(not os.path.isfile(f"/proc/{os.getpid()}/maps"),
                               reason="needs Linux /proc")


def add_second_card(host: SysRoot) -> None:
    """Another NVIDIA card in group 15: only the group's own /dev/nvidiaN is then in scope."""
    host.add_bridge("0000:00:03.0", iommu_group=3)
    host.add_function(NV2, parent="0000:00:03.0", device="0x2684", driver="nvidia",
                      iommu_group=15)
    host.add_function(AUDIO2, parent="0000:00:03.0", device="0x22ba", klass="0x040300",
                      driver="snd_hda_intel", iommu_group=15)
    host.add_dev_node("/dev/nvidia1")
    for addr, minor in ((NV, 0), (NV2, 1)):
        folder = host.root / "proc/driver/nvidia/gpus" / addr
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "information").write_text(f"Model: \t\t NVIDIA GeForce RTX\n"
                                             f"Device Minor: \t {minor}\nBus Type: \t PCIe\n")


def report_of(host: SysRoot) -> list[tuple[int, str]]:
    report = holders_report(scan(host.root), vendor="0x10de", euid=0)
    return [(h["pid"], h.get("node", "")) for h in report["holders"]]


# --------------------------------------------------------------------------- maps read whole


def test_a_mapping_past_the_first_64_kib_of_maps_is_a_holder(host: SysRoot) -> None:
    # A CUDA process maps hundreds of libraries; /dev/nvidia0 comes late in address order.
    libs = [f"/usr/lib/x86_64-linux-gnu/libcuda-part{i}.so" for i in range(1200)]
    host.add_process(4242, "python3", fds={0: "/dev/null"}, maps=[*libs, "/dev/nvidia0"])
    assert os.path.getsize(host.root / "proc/4242/maps") > 65536
    assert report_of(host) == [(4242, "/dev/nvidia0")]


@real_proc
def test_mapped_files_reads_this_processs_whole_maps() -> None:
    # The kernel hands out /proc/<pid>/maps about a page per read: one read saw ~30 lines.
    with open(f"/proc/{os.getpid()}/maps", encoding="utf-8", errors="replace") as fh:
        lines = fh.read().splitlines()
    everything = {p[5].removesuffix(" (deleted)") for line in lines
                  if len(p := line.split(None, 5)) == 6 and p[5].startswith("/")}
    assert len("\n".join(lines)) > 8192  # more than a page or two: the point of the test
    assert {p for _, p in mapped_files("/proc", os.getpid())} >= everything - {""}


def test_mapped_files_picks_only_the_paths_wanted(host: SysRoot) -> None:
    # The scan parses only lines under its scope's paths; a path that merely holds " /dev/"
    # further on is no mapping of a node.
    nv0 = "7f0000000000-7f0000001000 rw-s 00000000 00:06 4 /dev/nvidia0"
    host.add_process(4242, "python3", maps=[
        "/usr/lib/libc.so.6", "[heap]", "/tmp/a /dev/nvidia0", nv0, "/dev/dri/card1",
        nv0.replace("7f00", "7f01"), "/dev/nvidiactl"])
    proc = str(host.root / "proc")
    assert [p for _, p in mapped_files(proc, 4242, ("/dev/nvidia0",))] == ["/dev/nvidia0"]
    assert [p for _, p in mapped_files(proc, 4242, ("/dev/nvidia", "/dev/nvidia0"))] == [
        "/dev/nvidia0", "/dev/nvidiactl"]  # each file once (dev inode path), a prefix's once
    assert [p for _, p in mapped_files(proc, 4242, ("/dev/", "/tmp/a"))] == [
        "/tmp/a /dev/nvidia0", "/dev/nvidia0", "/dev/dri/card1", "/dev/nvidiactl"]
    assert [p for _, p in mapped_files(proc, 4242, ())] == []
    assert len(list(mapped_files(proc, 4242))) == 5  # every file: [heap] is none


@pytest.mark.parametrize("shift", [-40, -12, -5, -1, 0, 1, 5])
def test_a_mapping_across_a_read_boundary_is_found(host: SysRoot, shift: int) -> None:
    # maps is read 64 KiB at a time: the node's line, or its path, cut in two by a read.
    line = "7f0000000000-7f0000001000 rw-s 00000000 00:05 99 /dev/nvidia0"
    pad = "7f1000000000-7f1000001000 r--p 00000000 08:01 5 /usr/lib/libpad.so"
    lines = [pad] * (65536 // (len(pad) + 1) - 3)
    used = sum(len(x) + 1 for x in lines)
    filler = "7f2000000000-7f2000001000 r--p 00000000 08:01 6 /usr/lib/"
    start = 65536 - len(line) // 2 + shift  # where the node's line begins
    lines.append(filler + "x" * (start - used - len(filler) - 1))
    lines.append(line)
    host.add_process(4242, "python3", maps=lines)
    data = (host.root / "proc/4242/maps").read_bytes()
    at = data.index(b"/dev/nvidia0")
    assert at - 70 < 65536 < at + 70  # the line is near the boundary, on one side or across
    assert report_of(host) == [(4242, "/dev/nvidia0")]


def test_an_overlong_maps_line_is_skipped_not_fatal(host: SysRoot) -> None:
    host.add_process(4242, "odd", maps=["x" * 200_000, "/dev/nvidia0"])
    assert report_of(host) == [(4242, "/dev/nvidia0")]


# --------------------------------------------------------------------------- deleted nodes


def test_an_fd_on_a_deleted_node_holds_the_node(host: SysRoot) -> None:
    # udev (or nvidia-modprobe) made the node again after the process opened it: the kernel
    # shows the open file as "<path> (deleted)", and it still holds the device.
    host.add_process(4243, "Xorg", fds={3: "/dev/dri/card1 (deleted)"})
    assert report_of(host) == [(4243, "/dev/dri/card1")]


async def test_multi_gpu_a_deleted_node_of_this_card_refuses_the_unbind(host: SysRoot) -> None:
    add_second_card(host)
    sim = SimKernel(host)
    host.add_process(7100, "python3", fds={3: "/dev/nvidia0 (deleted)"})
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, _ev):
        with pytest.raises(SwitchRefused, match="/dev/nvidia0"):
            await w.switch(NV, "vfio", timeout=5)
    assert NVIDIA_UNBIND not in [p for p, _ in sim.writes]


# --------------------------------------------------------------------------- exited main thread


def zombie_leader(host: SysRoot, pid: int, tid: int, node: str) -> None:
    """A process whose main thread has exited (``pthread_exit``) while thread ``tid`` runs:
    the kernel shows the leader's ``fd`` and ``maps`` empty, the thread's full."""
    host.add_process(pid, "cuda-worker", state="Z")
    task = host.root / f"proc/{pid}/task"
    (task / str(pid) / "fd").mkdir(parents=True)
    (task / str(pid) / "maps").write_bytes(b"")
    (task / str(tid) / "fd").mkdir(parents=True)
    os.symlink(node, task / str(tid) / "fd/3")
    (task / str(tid) / "maps").write_text(
        f"7f0000000000-7f0000001000 rw-s 00000000 00:05 99 {node}\n")


def test_a_process_whose_main_thread_exited_holds_through_its_threads(host: SysRoot) -> None:
    zombie_leader(host, 5000, 5001, "/dev/nvidia0")
    assert report_of(host) == [(5000, "/dev/nvidia0")]
    assert [h.pid for h in nvidia_holders(str(host.root))] == [5000]
    # ... by its mappings alone too (a CUDA context keeps them after closing the fd)
    os.unlink(host.root / "proc/5000/task/5001/fd/3")
    assert report_of(host) == [(5000, "/dev/nvidia0")]


def test_kernel_threads_and_zombies_hold_nothing(host: SysRoot) -> None:
    host.add_process(2, "kthreadd")
    (host.root / "proc/2/task/2/fd").mkdir(parents=True)
    host.add_process(6000, "defunct", state="Z")
    (host.root / "proc/6000/task/6000").mkdir(parents=True)
    assert report_of(host) == []


@real_proc
@pytest.mark.timeout(60)
def test_this_kernel_shows_the_threads_of_an_exited_main_thread(tmp_path: Path) -> None:
    target = os.path.realpath(tmp_path / "node")
    Path(target).write_bytes(b"\0" * 4096)
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import ctypes, mmap, sys, threading, time\n"
         "f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 4096)\n"
         "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
         "ctypes.CDLL(None).pthread_exit(None)\n", target])
    try:
        end = time.monotonic() + 20
        while time.monotonic() < end:
            with open(f"/proc/{child.pid}/stat", "rb") as fh:
                if fh.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    break
            time.sleep(0.05)
        else:
            pytest.fail("the child's main thread did not exit")
        assert os.listdir(f"/proc/{child.pid}/fd") == []  # the kernel's own behaviour
        found = scan_holders("/", NodeScope(exact=frozenset({target})), deadline=10)
        assert (child.pid, target) in [(h.pid, h.node) for h in found]
        assert target in [p for _, p in mapped_files("/proc", child.pid)]
    finally:
        child.kill()
        child.wait(timeout=10)


# --------------------------------------------------------------------------- renamed nodes

# A container started with ``--device /dev/nvidia3:/dev/nvidia0`` (or one that names a node of
# its own /dev anything it likes) shows its fd as ``/dev/nvidia0``: the same device, another
# name. These tests stand a real node of the root's dev/ with /dev/zero's numbers (1:5) for
# the card's node, and a real child process holding /dev/zero under its own name for the
# container's client; the fixture's proc/<pid> leads to the child's real /proc/<pid>.

as_root = pytest.mark.skipif(os.geteuid() != 0 or not os.path.isfile(f"/proc/{os.getpid()}/maps"),
                             reason="needs root (mknod, map_files) and Linux /proc")

ZERO, FULL = os.makedev(1, 5), os.makedev(1, 7)  # /dev/zero's numbers, /dev/full's

_HOLD_ZERO = (
    "import mmap, sys\n"
    "f = open('/dev/zero', 'r+b')\n"
    "if sys.argv[1] == 'map':\n"
    "    m = mmap.mmap(f.fileno(), 4096, mmap.MAP_PRIVATE)\n"
    "    f.close()\n"  # a CUDA context keeps its mappings after closing the fd
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n")


def char_node(root: Path, node: str, dev: int) -> None:
    """A real character device node at ``root/node`` (not the fixture's empty file)."""
    path = root / node.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    os.mknod(path, 0o600 | stat.S_IFCHR, dev)


@contextlib.contextmanager
def ready_child(argv: list[str]) -> Iterator[int]:
    """A live child that says ``ready`` once it holds what it holds: its pid, killed after."""
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == b"ready\n"
            yield child.pid
        finally:
            child.kill()
            child.wait(timeout=10)


@contextlib.contextmanager
def holding_zero(how: str) -> Iterator[int]:
    """A live child holding /dev/zero open (``fd``) or only mapped (``map``)."""
    with ready_child([sys.executable, "-c", _HOLD_ZERO, how]) as pid:
        yield pid


@pytest.fixture(params=["fd", "map"])
def zero_holder(request: pytest.FixtureRequest) -> Iterator[int]:
    with holding_zero(request.param) as pid:
        yield pid


def link_process(root: Path, pid: int) -> None:
    """The fixture's ``proc/<pid>`` is the live process's ``/proc/<pid>``."""
    (root / "proc").mkdir(parents=True, exist_ok=True)
    os.symlink(f"/proc/{pid}", root / "proc" / str(pid))


@as_root
@pytest.mark.timeout(60)
def test_a_renamed_node_holds_the_card_by_its_numbers(tmp_path: Path, zero_holder: int) -> None:
    root = tmp_path / "root"
    char_node(root, "/dev/nvidia3", ZERO)  # the child's /dev/zero, under the host's name
    char_node(root, "/dev/nvidia2", FULL)  # held by no one
    link_process(root, zero_holder)
    scope = NodeScope(exact=frozenset({"/dev/nvidia2", "/dev/nvidia3"}))
    found = scan_holders(str(root), scope, deadline=10)
    assert [(h.pid, h.node) for h in found] == [(zero_holder, "/dev/nvidia3")]
    # A prefix scope counts any minor of the majors the root's nodes have.
    found = scan_holders(str(root), NodeScope(prefixes=("/dev/nvidia",)), deadline=10)
    assert [(h.pid, h.node) for h in found] == [(zero_holder, "/dev/nvidia3")]


@as_root
@pytest.mark.timeout(60)
def test_nvidia_holders_counts_a_renamed_node_of_nvidias_major(tmp_path: Path) -> None:
    root = tmp_path / "root"
    char_node(root, "/dev/nvidia0", FULL)  # "nvidia's" major is 1 here; the minor differs
    with holding_zero("fd") as pid:
        link_process(root, pid)
        assert [h.pid for h in nvidia_holders(str(root), deadline=10)] == [pid]


@as_root
@pytest.mark.timeout(60)
def test_a_link_named_nvidia_lends_no_major(tmp_path: Path) -> None:
    # dev/nvidia-odd is a link to a node of another driver: its major is not nvidia's.
    root = tmp_path / "root"
    char_node(root, "/dev/nvidia0", os.makedev(10, 229))
    char_node(root, "/dev/zero", ZERO)
    os.symlink("zero", root / "dev/nvidia-odd")
    with holding_zero("fd") as pid:
        link_process(root, pid)
        assert nvidia_holders(str(root), deadline=10) == ()


@as_root
@pytest.mark.timeout(60)
async def test_multi_gpu_a_renamed_node_of_this_card_refuses_the_unbind(
        host: SysRoot, zero_holder: int) -> None:
    add_second_card(host)  # NV2 is /dev/nvidia1
    char_node(host.root, "/dev/nvidia1", ZERO)
    link_process(host.root, zero_holder)
    report = holders_report(scan(host.root), addr=NV2, euid=0)
    assert [(h["pid"], h.get("node")) for h in report["holders"]] == [(zero_holder,
                                                                       "/dev/nvidia1")]
    sim = SimKernel(host)
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, _ev):
        with pytest.raises(SwitchRefused, match="/dev/nvidia1"):
            await w.switch(NV2, "vfio", timeout=5)
    assert NVIDIA_UNBIND not in [p for p, _ in sim.writes]


@as_root
def test_the_dev_column_of_maps_is_not_the_nodes_number(tmp_path: Path) -> None:
    # maps's 4th column is the device of the filesystem the node lies on (devtmpfs: 00:06),
    # not the node's own numbers: a line saying 01:05 is no mapping of /dev/zero's 1:5.
    root = tmp_path / "root"
    char_node(root, "/dev/nvidia3", ZERO)
    host = SysRoot(root)
    host.add_process(4300, "odd", maps=["7f0000000000-7f0000001000 rw-s 00000000 01:05 4 /dev/x"])
    assert scan_holders(str(root), NodeScope(exact=frozenset({"/dev/nvidia3"}))) == []


def test_node_scope_finds_a_device_by_its_numbers() -> None:
    scope = NodeScope(exact=frozenset({"/dev/nvidia3"}),
                      numbers=frozenset({(195, 3, "/dev/nvidia3")}))
    assert scope.numbered
    assert scope.device_node(195, 3, "/dev/nvidia0") == "/dev/nvidia3"  # the root's name
    assert scope.device_node(195, 0, "/dev/nvidia0") is None  # another card of the driver
    assert not NodeScope(exact=frozenset({"/dev/nvidia3"})).numbered  # a fixture's plain file
    prefix = NodeScope(prefixes=("/dev/nvidia",), numbers=frozenset({(195, 255, "/dev/nvidiactl")}),
                       majors=frozenset({195}))
    assert prefix.device_node(195, 255, "/dev/ctl") == "/dev/nvidiactl"
    assert prefix.device_node(195, 7, "/dev/mygpu") == "/dev/mygpu"  # any minor of the major
    assert prefix.device_node(226, 0, "/dev/dri/card0") is None
    both = scope | prefix
    assert both.device_node(195, 3, "/dev/x") == "/dev/nvidia3" and both.majors == {195}



_HOLD_NODE = (
    "import mmap, sys\n"
    "f = open(sys.argv[1], 'r+b')\n"
    "if sys.argv[2] == 'map':\n"
    "    m = mmap.mmap(f.fileno(), 4096, mmap.MAP_PRIVATE)\n"
    "    f.close()\n"  # held through its mapping alone
    "print('ready', flush=True)\n"
    "sys.stdin.read()\n")

can_unshare = pytest.mark.skipif(
    os.geteuid() != 0 or subprocess.run(["unshare", "--mount", "true"],
                                        capture_output=True).returncode != 0,
    reason="needs root and mount namespaces")


@contextlib.contextmanager
def holding_in_own_dev(node: str, dev: int, how: str = "fd") -> Iterator[int]:
    """A live child in a mount namespace of its own whose ``/dev`` (a fresh tmpfs no one else
    sees) has ``node`` with the numbers ``dev``, holding it open (``fd``) or only mapped
    (``map``): a container's ``/dev``, as ``--device`` makes it. ``unshare`` and ``sh`` exec:
    the child's pid is the holder's."""
    script = (f"mount -t tmpfs none /dev && mkdir -p {os.path.dirname(node)}"
              f" && mknod {node} c {os.major(dev)} {os.minor(dev)}"
              f' && exec {sys.executable} -c "$0" {node} {how}')
    with ready_child(["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                      _HOLD_NODE]) as pid:
        yield pid


def holders_in(root: Path, *nodes: str) -> list[tuple[int, str]]:
    scope = NodeScope(exact=frozenset(nodes))
    return [(h.pid, h.node) for h in scan_holders(str(root), scope, deadline=10)]


@as_root
@can_unshare
@pytest.mark.timeout(60)
def test_a_container_node_is_found_by_its_numbers_in_its_own_namespace(
        tmp_path: Path) -> None:
    # docker run --device /dev/dri/renderD129:/dev/dri/renderD128: the container's client
    # reads /dev/dri/renderD128 (in a /dev no one else sees) but holds the host's renderD129.
    root = tmp_path / "root"
    char_node(root, "/dev/dri/renderD128", FULL)
    char_node(root, "/dev/dri/renderD129", ZERO)
    with holding_in_own_dev("/dev/dri/renderD128", ZERO) as pid:
        assert "/dev/dri/renderD128" in [os.readlink(f"/proc/{pid}/fd/{fd}")
                                         for fd in os.listdir(f"/proc/{pid}/fd")]
        link_process(root, pid)
        assert holders_in(root, "/dev/dri/renderD129") == [(pid, "/dev/dri/renderD129")]
        # Its name is another card's: the numbers say it is not that card's holder.
        assert holders_in(root, "/dev/dri/renderD128") == []


@as_root
@can_unshare
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["fd", "map"])
def test_a_renamed_gpu_is_held_only_by_its_numbers_not_by_the_name_of_another(
        tmp_path: Path, how: str) -> None:
    # --device /dev/nvidia3:/dev/nvidia0 on a multi-GPU host: the client holds GPU 3 under
    # GPU 0's name. GPU 0's switch (its scope: /dev/nvidia0) has no holder; GPU 3's has it.
    root = tmp_path / "root"
    char_node(root, "/dev/nvidia0", FULL)
    char_node(root, "/dev/nvidia3", ZERO)
    with holding_in_own_dev("/dev/nvidia0", ZERO, how) as pid:
        link_process(root, pid)
        assert holders_in(root, "/dev/nvidia0") == []
        assert holders_in(root, "/dev/nvidia3") == [(pid, "/dev/nvidia3")]
        assert holders_in(root, "/dev/nvidia0", "/dev/nvidia3") == [(pid, "/dev/nvidia3")]


@as_root
@can_unshare
@pytest.mark.timeout(60)
async def test_multi_gpu_a_container_holding_another_gpu_under_this_ones_name_refuses_nothing(
        host: SysRoot) -> None:
    # The whole path of a switch: GPU 0 (NV, /dev/nvidia0) is free, though a container holds
    # GPU 1 (NV2) under the name /dev/nvidia0; GPU 1's switch is refused.
    add_second_card(host)
    char_node(host.root, "/dev/nvidia0", FULL)
    char_node(host.root, "/dev/nvidia1", ZERO)
    with holding_in_own_dev("/dev/nvidia0", ZERO) as pid:
        link_process(host.root, pid)
        assert holders_report(scan(host.root), addr=NV, euid=0)["holders"] == []
        report = holders_report(scan(host.root), addr=NV2, euid=0)
        assert [(h["pid"], h.get("node")) for h in report["holders"]] == [(pid, "/dev/nvidia1")]
        sim = SimKernel(host)
        sim.unbind_waits_for_holders = False  # the simulation knows holders by name alone
        async with simulated_switch(host, sim=sim) as (w, _sim, _e, _ev):
            await w.switch(NV, "vfio", timeout=5)
        assert NVIDIA_UNBIND in [p for p, _ in sim.writes]


@as_root
@can_unshare
@pytest.mark.timeout(60)
def test_a_name_whose_numbers_the_root_lacks_still_counts(tmp_path: Path) -> None:
    # The root has /dev/nvidia3 as a device but /dev/nvidia0 only as a captured plain file:
    # nothing says which device /dev/nvidia0 is, so a file of that name counts by its name.
    root = tmp_path / "root"
    char_node(root, "/dev/nvidia3", FULL)
    (root / "dev/nvidia0").write_bytes(b"")
    with holding_in_own_dev("/dev/nvidia0", ZERO) as pid:
        link_process(root, pid)
        assert holders_in(root, "/dev/nvidia0", "/dev/nvidia3") == [(pid, "/dev/nvidia0")]


def test_a_captured_tree_without_numbers_counts_by_name(host: SysRoot) -> None:
    # Plain files in dev/: no numbers, the names decide (no stat is made at all).
    host.add_dev_node("/dev/nvidia0")
    host.add_process(4100, "client", fds={3: "/dev/nvidia0"})
    host.add_process(4101, "mapper", maps=["/dev/nvidia0"])
    assert holders_in(host.root, "/dev/nvidia0") == [(4100, "/dev/nvidia0"),
                                                     (4101, "/dev/nvidia0")]


# A path no machine has: the stat through a fixture's fd link (which leads to the host path
# itself) fails, as a stat of a process that is gone, or of map_files without CAP_SYS_ADMIN.
ABSENT = "/dev/gpuwatch-test-absent/nvidia0"


def test_a_failed_stat_leaves_the_name_to_decide(tmp_path: Path) -> None:
    host = SysRoot(tmp_path / "root")
    host.add_process(4200, "client", fds={3: ABSENT})
    host.add_process(4201, "mapper", maps=[ABSENT])
    known = NodeScope(exact=frozenset({ABSENT}), numbers=frozenset({(1, 7, ABSENT)}))
    proc = str(host.root / "proc")
    assert held_node(known, f"{proc}/4200/fd/3", ABSENT) == ABSENT
    assert held_node(known, f"{proc}/4201/map_files/7f0000000000-7f0000001000", ABSENT) == ABSENT


def test_a_file_replaced_under_its_fd_is_looked_at_again(tmp_path: Path) -> None:
    # fd 3 read /dev/nvidia0 (a node whose numbers are known, 1:7) and was closed; its
    # number now holds /dev/zero (1:5), in scope by its name only (its numbers unknown).
    # The stat is /dev/zero's: it must not be taken for what /dev/nvidia0 holds, and
    # /dev/zero, read again from the link, counts by its name.
    handle = tmp_path / "3"
    os.symlink("/dev/zero", handle)
    scope = NodeScope(exact=frozenset({"/dev/nvidia0", "/dev/zero"}),
                      numbers=frozenset({(1, 7, "/dev/nvidia0")}))
    assert held_node(scope, str(handle), "/dev/nvidia0") == "/dev/zero"
    # Now another file out of scope: no holder.
    os.unlink(handle)
    os.symlink("/dev/null", handle)
    assert held_node(scope, str(handle), "/dev/nvidia0") is None
    # Closed since, and nothing there: the name decides (nothing says otherwise).
    os.unlink(handle)
    assert held_node(scope, str(handle), "/dev/nvidia0") == "/dev/nvidia0"


def test_node_scope_held_lets_known_numbers_decide() -> None:
    scope = NodeScope(exact=frozenset({"/dev/nvidia0", "/dev/nvidia1"}),
                      numbers=frozenset({(195, 0, "/dev/nvidia0")}))
    assert scope.held("/dev/nvidia0", (195, 0)) == "/dev/nvidia0"
    assert scope.held("/dev/nvidia0", (195, 3)) is None  # GPU 3 under GPU 0's name
    assert scope.held("/dev/nvidia0", None) is None  # not a device at all
    assert scope.held("/dev/mygpu", (195, 0)) == "/dev/nvidia0"  # renamed: the root's name
    assert scope.held("/dev/nvidia1", (195, 3)) == "/dev/nvidia1"  # its numbers unknown
    assert scope.held("/dev/nvidia1", None) == "/dev/nvidia1"
    assert scope.held("/dev/null", (1, 3)) is None
    prefix = NodeScope(prefixes=("/dev/nvidia",), numbers=frozenset({(195, 0, "/dev/nvidia0")}),
                       majors=frozenset({195}))
    assert prefix.held("/dev/nvidia0", (195, 7)) == "/dev/nvidia0"  # any minor of the major
    assert prefix.held("/dev/nvidia0", (1, 5)) is None
    assert prefix.held("/dev/nvidia-uvm", (510, 0)) == "/dev/nvidia-uvm"  # numbers unknown
