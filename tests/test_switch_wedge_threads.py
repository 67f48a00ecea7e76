"""The wedge scan judges each thread by its own state: the task stuck in an unbind is often
not a process's main thread (libvirtd detaches a device from a worker thread while its main
thread sleeps in poll), and ``/proc/<pid>/stat`` shows the main thread's state alone.
`recover` must see such a wedge and touch nothing, as it does for a single-threaded one.
"""

from __future__ import annotations

import pytest

from gpuwatch.errors import RebootRequired, SwitchRefused
from gpuwatch.hostfs.wedge import scan_wedge
from gpuwatch.testing import SysRoot
from gpuwatch.testing.simkernel import SimKernel, simulated_switch

NV = "0000:01:00.0"
#: What a real kernel shows for a thread stuck in nvidia's remove: msleep on top of os_delay
#: (it sleeps uninterruptibly between polls of its clients), under the PCI core's remove.
NVIDIA_REMOVE = ("[<0>] msleep+0x2d/0x40\n"
                 "[<0>] os_delay+0x3c/0x60 [nvidia]\n"
                 "[<0>] nv_pci_remove+0x1b4/0x380 [nvidia]\n"
                 "[<0>] pci_device_remove+0x3e/0xb0\n"
                 "[<0>] device_release_driver_internal+0x1b/0x30\n"
                 "[<0>] unbind_store+0xd9/0x100\n"
                 "[<0>] kernfs_fop_write_iter+0x13c/0x1d0\n"
                 "[<0>] vfs_write+0x2b7/0x480\n")
#: snd_hda_intel's remove waiting for an open sound file: no nvidia frame, the PCI core's.
SND_REMOVE = ("[<0>] snd_card_disconnect_sync+0x9b/0xe0 [snd]\n"
              "[<0>] azx_remove+0x5f/0x80 [snd_hda_intel]\n"
              "[<0>] pci_device_remove+0x3e/0xb0\n"
              "[<0>] device_release_driver_internal+0x1b/0x30\n"
              "[<0>] unbind_store+0xd9/0x100\n")
#: A main thread at rest in poll: what libvirtd's shows.
POLL = ("[<0>] do_sys_poll+0x3f6/0x5c0\n"
        "[<0>] __x64_sys_poll+0xb8/0x170\n")


def libvirtd(host: SysRoot, *, state: str, stack: str) -> None:
    """libvirtd (pid 1320) with its main thread asleep in poll and worker 1377 in ``state``
    with ``stack``, as `virsh nodedev-detach` leaves it while the unbind has not returned."""
    host.add_process(1320, "libvirtd", state="S", stack=POLL)
    host.add_thread(1320, 1376, "rpc-worker", state="S", stack=POLL)
    host.add_thread(1320, 1377, "rpc-worker", state=state, stack=stack)


def test_a_worker_thread_stuck_in_nvidias_remove_is_a_wedge(host: SysRoot) -> None:
    libvirtd(host, state="D", stack=NVIDIA_REMOVE)
    scan = scan_wedge(str(host.root))
    assert scan.wedged and scan.stuck[0][0] == 1320, scan
    assert "libvirtd (pid 1320) is stuck in" in scan.describe()


def test_a_worker_thread_stuck_in_another_drivers_remove_is_removing(host: SysRoot) -> None:
    libvirtd(host, state="D", stack=SND_REMOVE)
    scan = scan_wedge(str(host.root))
    assert not scan.wedged and scan.removing == ((1320, "libvirtd", "pci_device_remove"),)
    assert scan.any_stuck


def test_a_sleeping_thread_or_another_wait_is_no_wedge(host: SysRoot) -> None:
    """Frames alone do not make a wedge: the thread must be in D state, and in a remove."""
    libvirtd(host, state="S", stack=NVIDIA_REMOVE)
    host.add_process(2000, "nvidia-smi", state="D", stack=(
        "[<0>] nvidia_dev_put+0x2a/0x90 [nvidia]\n"
        "[<0>] nvidia_close+0x1c5/0x300 [nvidia]\n"
        "[<0>] __fput+0xff/0x290\n"))
    scan = scan_wedge(str(host.root))
    assert (scan.stuck, scan.removing, scan.unreadable) == ((), (), ())


def test_a_stuck_thread_whose_stack_cannot_be_read_makes_the_scan_incomplete(
        host: SysRoot) -> None:
    """A kernel built without CONFIG_STACKTRACE has no ``stack`` file at all: a D-state
    thread there may be stuck anywhere, so the scan cannot say "not wedged"."""
    libvirtd(host, state="D", stack="")
    (host.root / "proc/1320/task/1377/stack").unlink()
    scan = scan_wedge(str(host.root))
    assert scan.unreadable == (1320,) and not scan.complete


@pytest.mark.parametrize(("stack", "refusal"), [(NVIDIA_REMOVE, RebootRequired),
                                                 (SND_REMOVE, SwitchRefused)],
                         ids=["nvidia", "snd_hda_intel"])
async def test_recover_touches_nothing_while_a_worker_thread_is_stuck(
        host: SysRoot, stack: str, refusal: type[Exception]) -> None:
    """The group half switched by a tool whose worker thread is still in the unbind: a bind
    now would add a second stuck task, so `recover` refuses and writes nothing."""
    sim = SimKernel(host)
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, events):
        libvirtd(host, state="D", stack=stack)
        with pytest.raises(refusal):
            await w.recover(NV, timeout=5)
        assert sim.record == []
        assert [getattr(e, "type", "") for e in events
                if getattr(e, "type", "").startswith("switch-")] == ["switch-refused"]
        host.add_thread(1320, 1377, "rpc-worker", state="S", stack=POLL)  # it returned
        result = await w.recover(NV, timeout=5)
        assert result.changed and sim.record
