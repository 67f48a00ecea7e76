"""Live process facts: who holds GPU device nodes open, and this process's memlock limit.

These are live by nature (a process opens /dev/nvidia0 without any uevent), so they are
read on every call rather than cached.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Iterator

from gpuwatch.core.results import Holder, MemlockResult
from gpuwatch.hostfs.files import list_dir, read_bytes


def memlock() -> MemlockResult:
    """RLIMIT_MEMLOCK now (prlimit can change it from outside); None means unlimited."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def clean(value: int) -> int | None:
        return None if value == resource.RLIM_INFINITY else value

    return MemlockResult(soft=clean(soft), hard=clean(hard))


def read_comm(proc: str, pid: int) -> str:
    """A process's comm; bytes that are not UTF-8 are replaced, never fatal."""
    try:
        raw = read_bytes(f"{proc}/{pid}/comm", 256)
    except OSError:
        return ""
    return raw.decode("utf-8", "replace").rstrip("\n")


def pids(proc: str) -> list[int]:
    return sorted(int(n) for n in list_dir(proc) if n.isascii() and n.isdigit())


def fd_targets(proc: str, pid: int) -> Iterator[str]:
    """Targets of a process's open fds; an unreadable or vanished process yields nothing."""
    fd_dir = f"{proc}/{pid}/fd"
    for fd in list_dir(fd_dir):
        try:
            yield os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue


def holders(root: str, matches: Callable[[str], bool]) -> list[tuple[int, str, str]]:
    """``(pid, comm, node)`` for every fd whose target ``matches``, sorted by pid then node."""
    proc = os.path.join(root, "proc")
    found: list[tuple[int, str, str]] = []
    for pid in pids(proc):
        nodes = sorted({t for t in fd_targets(proc, pid) if matches(t)})
        if nodes:
            comm = read_comm(proc, pid)
            found.extend((pid, comm, node) for node in nodes)
    return found


def nvidia_holders(root: str) -> tuple[Holder, ...]:
    """Processes with an fd on ``/dev/nvidia*``, one entry per process, sorted by pid."""
    seen: dict[int, str] = {}
    for pid, comm, _node in holders(root, lambda t: t.startswith("/dev/nvidia")):
        seen.setdefault(pid, comm)
    return tuple(Holder(pid=pid, comm=comm) for pid, comm in sorted(seen.items()))
