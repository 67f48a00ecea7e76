"""The holder scan against odd /proc trees: a maps file longer than one read, fds on device
nodes that were deleted and made again, a process whose main thread has exited while its other
threads keep the card open. Fixture trees laid out as /proc lays them out, and this machine's
own /proc (read only) where the kernel's behaviour is the point."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwatch.core.plan import NodeScope
from gpuwatch.errors import SwitchRefused
from gpuwatch.hostfs.facts import map_paths, scan_holders
from gpuwatch.hostfs.procfs import nvidia_holders
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
def test_map_paths_reads_this_processs_whole_maps() -> None:
    # The kernel hands out /proc/<pid>/maps about a page per read: one read saw ~30 lines.
    with open(f"/proc/{os.getpid()}/maps", encoding="utf-8", errors="replace") as fh:
        lines = fh.read().splitlines()
    everything = {p[5].removesuffix(" (deleted)") for line in lines
                  if len(p := line.split(None, 5)) == 6 and p[5].startswith("/")}
    assert len("\n".join(lines)) > 8192  # more than a page or two: the point of the test
    assert set(map_paths("/proc", os.getpid())) >= everything - {""}


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
        assert target in list(map_paths("/proc", child.pid))
    finally:
        child.kill()
        child.wait(timeout=10)
