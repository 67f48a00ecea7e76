"""``wedge-detected``: is a task stuck in the nvidia driver's remove path right now?

A write to nvidia's ``unbind`` while a client holds the card blocks in ``nv_pci_remove``
(looping in ``os_delay``) in uninterruptible sleep, holding the PCI device lock; only a
reboot frees it, and any further bind or unbind of the device adds another stuck task.
Kernel stacks (``/proc/<pid>/stack``) are readable by root only: when they cannot be read
the answer is incomplete, and the scan says so instead of claiming "not wedged".

The probe's answer is about nvidia alone (its contract), but any driver's remove can hang
the same way: vfio-pci's (and its variants') waits for the VM holding the device to let go,
snd_hda_intel's for open sound files. Such a task is reported apart (`WedgeScan.removing`):
``recover`` and an interrupted switch's roll-back touch nothing while one is there.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

from gpuwatch.hostfs.files import read_bytes, tree_dir
from gpuwatch.hostfs.procfs import DEFAULT_PROC_DEADLINE, pids, read_comm, read_each

_log = logging.getLogger("gpuwatch.switch")

#: Kernel functions in a stuck task's stack that mean "the nvidia remove path hangs".
WEDGE_SYMBOLS = ("nv_pci_remove", "os_delay")
#: The "cannot read the stacks" warning is said at most this often (seconds).
UNREADABLE_WARNING_EVERY = 60.0
#: A D-state task in any PCI driver's remove (an unbind that has not returned): the PCI core's
#: remove callback, and vfio's wait for its user to release the device.
REMOVE_SYMBOLS = ("vfio_unregister_group_dev", "pci_device_remove")


@dataclass(frozen=True, slots=True)
class WedgeScan:
    """The tasks found stuck, and the D-state tasks whose stacks could not be read."""

    stuck: tuple[tuple[int, str, str], ...]  # (pid, comm, symbol)
    unreadable: tuple[int, ...]
    #: D-state tasks in another driver's remove path (not the probe's wedge), same form.
    removing: tuple[tuple[int, str, str], ...] = ()

    @property
    def wedged(self) -> bool:
        return bool(self.stuck)

    @property
    def complete(self) -> bool:
        return not self.unreadable

    @property
    def any_stuck(self) -> bool:
        """A task is (or, unreadable, may be) stuck in some driver's remove: not the time
        to bind or unbind anything."""
        return bool(self.stuck or self.removing) or not self.complete

    def describe(self) -> str:
        if self.stuck:
            return "; ".join(f"{comm or '?'} (pid {pid}) is stuck in {sym}"
                             for pid, comm, sym in self.stuck)
        if self.removing:
            return "; ".join(f"{comm or '?'} (pid {pid}) is stuck in a driver's remove ({sym})"
                             for pid, comm, sym in self.removing)
        if self.unreadable:
            return (f"cannot read /proc/<pid>/stack of {len(self.unreadable)} task(s) in D state "
                    "(root only): a wedge may go unseen")
        return "no task is stuck in the nvidia driver"


def _state(stat: str) -> str:
    """The one-letter state from a ``stat`` file (after the comm's last ``)``); ``""`` when
    it cannot be read (the task is gone)."""
    try:
        raw = read_bytes(stat, 4096)
    except OSError:
        return ""
    tail = raw.rpartition(b")")[2].split()
    return tail[0].decode("ascii", "replace") if tail else ""


def _tasks(proc: str, pid: int) -> list[tuple[str, str]]:
    """``(stat, stack)`` of a process's main thread and of each of its other threads. Each
    thread has its own state: a multithreaded process (libvirtd detaching a device from a
    worker thread, a threaded tool) sleeps in its main thread while another one is stuck in
    an unbind, and ``/proc/<pid>/stat`` shows the main thread's state alone."""
    task_dir = f"{proc}/{pid}/task"
    try:
        tids = [t for t in os.listdir(task_dir) if t.isascii() and t.isdigit()]
    except OSError:
        tids = []
    others = [(f"{task_dir}/{t}/stat", f"{task_dir}/{t}/stack")
              for t in sorted(tids, key=int) if t != str(pid)]
    return [(f"{proc}/{pid}/stat", f"{proc}/{pid}/stack"), *others]


def _stack_hit(proc: str, pid: int) -> tuple[bool, str, str]:
    """``(readable, wedge symbol, remove symbol)`` for a process: whether the stack of each
    of its threads in D state could be read, the nvidia wedge symbol found in one, else
    another driver's remove symbol; ``(True, "", "")`` when no thread is in D state. Each
    thread is judged by its own state, not by the main thread's."""
    readable = True
    removing = ""
    for stat, stack in _tasks(proc, pid):
        if _state(stat) != "D":
            continue
        try:
            text = read_bytes(stack).decode("utf-8", "replace")
        except OSError:
            # EACCES for non-root; no such file on a kernel without CONFIG_STACKTRACE, or
            # not a /proc file at all. A thread that ended meanwhile (its stat gone too) is
            # stuck nowhere.
            readable = readable and not os.path.lexists(stat)
            continue
        hit = next((s for s in WEDGE_SYMBOLS if s in text), "")
        if hit:
            return True, hit, ""
        removing = removing or next((s for s in REMOVE_SYMBOLS if s in text), "")
    return readable, "", removing


def scan_wedge(root: str, *, deadline: float = DEFAULT_PROC_DEADLINE) -> WedgeScan:
    """Every task in D state whose kernel stack shows the nvidia remove path; all of it
    within ``deadline`` (a stack read can block too: that task is counted unreadable)."""
    proc = tree_dir(root, "proc")
    stuck: list[tuple[int, str, str]] = []
    removing: list[tuple[int, str, str]] = []
    seen, timed_out = read_each(pids(proc), lambda pid: _stack_hit(proc, pid),
                                deadline=deadline, scope=proc)
    unreadable = list(timed_out)
    for pid, (readable, hit, remove) in sorted(seen.items()):
        if hit:
            stuck.append((pid, read_comm(proc, pid), hit))
        elif remove:
            removing.append((pid, read_comm(proc, pid), remove))
        elif not readable:
            unreadable.append(pid)
    return WedgeScan(tuple(stuck), tuple(sorted(unreadable)), tuple(removing))


class _Once:
    """A warning said at most once per ``every`` seconds: a daemon answers this probe as
    often as its clients ask, and the journal must not get a line per question."""

    def __init__(self, every: float) -> None:
        self.every = every
        self._last: float | None = None
        self._lock = threading.Lock()

    def due(self) -> bool:
        now = time.monotonic()
        with self._lock:
            if self._last is not None and now - self._last < self.every:
                return False
            self._last = now
            return True


_unreadable_warning = _Once(UNREADABLE_WARNING_EVERY)


def wedge_detected(root: str, *, deadline: float = DEFAULT_PROC_DEADLINE) -> bool:
    """The probe answer; warns (at most once a minute) when stacks could not be read."""
    scan = scan_wedge(root, deadline=deadline)
    if not scan.wedged and not scan.complete and _unreadable_warning.due():
        _log.warning("wedge-detected: %s", scan.describe())
    return scan.wedged


__all__ = ["REMOVE_SYMBOLS", "WEDGE_SYMBOLS", "WedgeScan", "scan_wedge", "wedge_detected"]
