"""Live process facts: who holds GPU device nodes open, this process's memlock limit, and a
process's effective capabilities.

These are live by nature (a process opens /dev/nvidia0 without any uevent), so they are
read on every call rather than cached; how long a capability set is kept is the caller's
choice (the model reads its own once, the daemon a peer's once per connection).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, TypeVar

from gpuwatch.hostfs.files import list_dir, open_regular, read_bytes, tree_dir

if TYPE_CHECKING:  # the records (and the planner's scope) load pydantic: imported where
    # one is made, so the cold direct probe (`gpuwatch.cli.direct`) can read capabilities
    # without it
    from gpuwatch.core.plan import NodeScope
    from gpuwatch.core.results import Holder, MemlockResult

T = TypeVar("T")

#: The whole budget of one scan of /proc (``proc_read_timeout``): reading ``fd``, ``maps`` or
#: ``stack`` of a process stuck in the kernel can block for ever.
DEFAULT_PROC_DEADLINE = 2.0
#: One process may take this share of the budget before it is given up as unreadable, so
#: that one stuck process does not make every other one unreadable too.
_PER_PROCESS_SHARE = 0.25

# Pids whose read was given up on and is still blocked in the kernel, with how many such
# abandoned threads each has. A later scan counts them unreadable at once instead of
# starting one more thread to block beside the others: a daemon asked for holders again
# and again (a client can ask as often as it likes) keeps one thread per stuck process,
# not one per question.
# Keyed by (scope, pid): the same pid in another /proc (another root) is another process.
_abandoned: dict[tuple[str, int], int] = {}
_abandoned_lock = threading.Lock()


def _abandon(key: tuple[str, int]) -> None:
    with _abandoned_lock:
        _abandoned[key] = _abandoned.get(key, 0) + 1


def _returned(key: tuple[str, int]) -> None:
    """An abandoned read came back: the process may be read again."""
    with _abandoned_lock:
        left = _abandoned.get(key, 0) - 1
        if left > 0:
            _abandoned[key] = left
        else:
            _abandoned.pop(key, None)


def read_each(pids: Sequence[int], read: Callable[[int], T], *,
              deadline: float = DEFAULT_PROC_DEADLINE,
              scope: str = "") -> tuple[dict[int, T], list[int]]:
    """``read(pid)`` for every pid, all of it within ``deadline`` seconds: ``(results,
    unreadable)``, the second the pids whose read did not finish in time (stuck in the
    kernel, or never reached). Returns within the deadline plus a scheduling moment.

    The reads run in a daemon thread. A thread blocked in the kernel cannot be interrupted
    or joined, so when one process takes more than its share it is left behind, abandoned,
    and a fresh thread goes on with the next pid. While an abandoned read is still blocked,
    its pid is unreadable at once: no second thread is sent to block on it. ``scope`` (the
    /proc directory read) tells apart the same pid of two trees.
    """
    end = time.monotonic() + max(deadline, 0.0)
    per_pid = max(deadline * _PER_PROCESS_SHARE, 0.01)
    cond = threading.Condition()
    results: dict[int, T] = {}
    unreadable: list[int] = []
    state: dict[str, object] = {"gen": 0, "pid": None, "since": 0.0, "done": False}
    given_up: set[tuple[int, int]] = set()  # (generation, pid) of each abandoned read

    def worker(items: Sequence[int], gen: int) -> None:
        for pid in items:
            with cond:
                if state["gen"] != gen:
                    return
                state["pid"], state["since"] = pid, time.monotonic()
            try:
                value = read(pid)
            except Exception:  # a reader is fault-tolerant; a surprise still must not hang us
                value = None
            with cond:
                if state["gen"] != gen:
                    if (gen, pid) in given_up:
                        _returned((scope, pid))
                    return  # given up on while it read: the caller has moved on
                if value is not None:
                    results[pid] = value
                state["pid"] = None
                cond.notify_all()
        with cond:
            if state["gen"] == gen:
                state["done"] = True
                cond.notify_all()

    def start(items: Sequence[int]) -> None:
        gen = int(state["gen"])  # type: ignore[call-overload]
        threading.Thread(target=worker, args=(items, gen), name="gpuwatch /proc read",
                         daemon=True).start()

    with _abandoned_lock:
        blocked = {pid for where, pid in _abandoned if where == scope}
    todo = [pid for pid in pids if pid not in blocked]
    unreadable.extend(pid for pid in pids if pid in blocked)
    if not todo:
        return results, sorted(set(unreadable))
    start(todo)
    with cond:
        while not state["done"]:
            now = time.monotonic()
            pid = state["pid"]
            since = float(state["since"])  # type: ignore[arg-type]
            if now >= end or (pid is not None and now - since >= per_pid):
                # Give up on the process being read; go on with the rest while time is left.
                if isinstance(pid, int):
                    given_up.add((int(state["gen"]), pid))  # type: ignore[call-overload]
                    _abandon((scope, pid))  # until its thread says it returned
                state["gen"] = int(state["gen"]) + 1  # type: ignore[call-overload]
                state["pid"] = None
                stuck = [pid] if isinstance(pid, int) else []
                unreadable.extend(stuck)
                index = todo.index(stuck[0]) + 1 if stuck else 0
                rest = [p for p in todo[index:] if p not in results]
                if now >= end or not rest:
                    unreadable.extend(p for p in rest if p not in unreadable)
                    break
                todo = rest
                start(todo)
                continue
            limit = end - now if pid is None else min(end - now, per_pid - (now - since))
            cond.wait(timeout=max(limit, 0.001))
    return results, sorted(set(unreadable))


def memlock() -> MemlockResult:
    """RLIMIT_MEMLOCK now (prlimit can change it from outside); None means unlimited."""
    from gpuwatch.core.results import MemlockResult

    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def clean(value: int) -> int | None:
        return None if value == resource.RLIM_INFINITY else value

    return MemlockResult(soft=clean(soft), hard=clean(hard))


def read_comm(proc: str, pid: int) -> str:
    """A process's comm; bytes that are not UTF-8 are replaced, never fatal. The kernel ends
    the name with one newline: only that one goes, a newline the process put at the end of
    its own name (``prctl(PR_SET_NAME)`` takes any byte but NUL) stays part of it."""
    try:
        raw = read_bytes(f"{proc}/{pid}/comm", 256)
    except OSError:
        return ""
    return raw.decode("utf-8", "replace").removesuffix("\n")


def pids(proc: str) -> list[int]:
    return sorted(int(n) for n in list_dir(proc) if n.isascii() and n.isdigit())


#: What the kernel appends to the path of an open file whose name was unlinked (udev or
#: nvidia-modprobe made the node again): the file, and the device it holds, is still open.
DELETED = " (deleted)"


def task_dirs(proc: str, pid: int) -> list[str]:
    """The ``/proc/<pid>/task/<tid>`` of a process's threads other than its main one. Where
    the main thread has exited (``pthread_exit``) while the others run on, the kernel shows
    the process's own ``fd`` and ``maps`` empty (a zombie leader has no files or memory of
    its own) though its threads keep the card open and mapped: these are read instead."""
    task = f"{proc}/{pid}/task"
    return [f"{task}/{tid}" for tid in list_dir(task)
            if tid.isascii() and tid.isdigit() and int(tid) != pid]


def _read_links(fd_dir: str, names: list[str]) -> Iterator[tuple[str, str]]:
    for fd in names:
        link = f"{fd_dir}/{fd}"
        try:
            yield link, os.readlink(link).removesuffix(DELETED)
        except OSError:
            continue


def open_files(proc: str, pid: int) -> Iterator[tuple[str, str]]:
    """``(link, target)`` of a process's open fds: the ``fd/N`` link (a stat of it reaches
    the open file itself) and its target, the path as it was opened (a node deleted since
    still counts: ``/dev/nvidia0 (deleted)`` is ``/dev/nvidia0``); an unreadable or vanished
    process yields nothing. A process that lists no fd at all (its main thread exited, or a
    kernel thread) is read through its other threads (`task_dirs`)."""
    fd_dir = f"{proc}/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except (OSError, ValueError):  # gone, or another user's and we are not root
        return
    if names:
        yield from _read_links(fd_dir, names)
        return
    for task in task_dirs(proc, pid):
        yield from _read_links(f"{task}/fd", list_dir(f"{task}/fd"))


# --------------------------------------------------------------------------- device numbers


def char_device(path: str, *, follow: bool = True) -> tuple[int, int] | None:
    """``(major, minor)`` of the character device at ``path`` (followed: a ``/proc/<pid>/fd/N``
    link leads to the open file itself, in whatever mount namespace it was opened); None
    for anything else, and for device number 0 (no device: a fixture's regular file)."""
    try:
        st = os.stat(path, follow_symlinks=follow)
    except (OSError, ValueError):
        return None
    return _char_numbers(st)


def _char_numbers(st: os.stat_result) -> tuple[int, int] | None:
    if not stat.S_ISCHR(st.st_mode) or st.st_rdev == 0:
        return None
    return os.major(st.st_rdev), os.minor(st.st_rdev)


def _nodes_with_prefix(root: str, prefix: str) -> Iterator[tuple[str, str]]:
    """``(node, place)`` of the root's nodes whose path starts with ``prefix``
    (``/dev/nvidia``: ``nvidia0``, ``nvidiactl``, ``nvidia-uvm``, and those one folder down,
    ``nvidia-caps/nvidia-cap1``), ``place`` where the node lies in the tree."""
    folder, _, start = prefix.rpartition("/")
    where = tree_dir(root, folder or "/")
    for name in sorted(list_dir(where)):
        if not name.startswith(start):
            continue
        node, place = f"{folder}/{name}", f"{where}/{name}"
        yield node, place
        if os.path.isdir(place) and not os.path.islink(place):
            yield from ((f"{node}/{child}", f"{place}/{child}")
                        for child in sorted(list_dir(place)))


def numbered_scope(root: str, scope: NodeScope) -> NodeScope:
    """``scope`` with the device numbers of its nodes as the root's ``/dev`` has them: each
    exact node that is a character device, and every node under a prefix (their majors too:
    any minor of nvidia's majors is nvidia's; a link there, which may lead anywhere, is
    not followed). A container shows its nodes under its own names
    (``--device /dev/nvidia3:/dev/nvidia0``); the numbers are the same device's."""
    numbers: set[tuple[int, int, str]] = set()
    majors: set[int] = set()
    for node in scope.exact:
        if node.startswith("/") and (dev := char_device(tree_dir(root, node))) is not None:
            numbers.add((*dev, node))
    for prefix in scope.prefixes:
        for node, place in _nodes_with_prefix(root, prefix):
            if (dev := char_device(place, follow=False)) is not None:
                numbers.add((*dev, node))
                majors.add(dev[0])
    return dataclasses.replace(scope, numbers=scope.numbers | frozenset(numbers),
                               majors=scope.majors | frozenset(majors))


#: How often `held_node` reads a handle again when its file changed under it (an fd closed
#: and its number reused) before it lets the name decide.
_RECHECKS = 3


def _link_target(handle: str) -> str | None:
    try:
        return os.readlink(handle).removesuffix(DELETED)
    except (OSError, ValueError):
        return None


def held_node(scope: NodeScope, handle: str, path: str) -> str | None:
    """The node in ``scope`` that an open file or mapping holds, ``path`` its name as read
    (the target of ``handle``, its ``fd/N`` or ``map_files`` link, or its ``maps`` line).

    Where the scope has device numbers (the root's ``/dev`` has character devices), a file
    under ``/dev/`` is stat-ed through ``handle`` (the kernel resolves it to the open file
    itself, in whatever mount namespace it was opened) and its numbers decide
    (`NodeScope.held`): a container's ``/dev/nvidia0`` that is the host's GPU 3 holds
    ``/dev/nvidia3``, not ``/dev/nvidia0``. The name decides where no numbers are known, and
    where the stat fails (no ``CAP_SYS_ADMIN`` for ``map_files``, a process gone while read):
    a needless refusal rather than a missed holder. The stat says what ``handle`` holds when
    it is made; where that drops a name in scope, the link is read again: if it names
    another file now (the fd was closed and its number reused), that file is looked at."""
    by_name = scope.matches(path)
    if not scope.numbered or not path.startswith("/dev/"):
        return path if by_name else None
    for _ in range(_RECHECKS):
        try:
            st = os.stat(handle)
        except (OSError, ValueError):
            return path if by_name else None
        node = scope.held(path, _char_numbers(st))
        if node is not None or not by_name:
            return node
        again = _link_target(handle)
        if again == path:
            return None  # the file named path when stat-ed: its numbers are another node's
        if again is None:
            return path  # gone since: the stat cannot be told apart from the name's file
        path, by_name = again, scope.matches(again)
        if not path.startswith("/dev/"):
            return path if by_name else None
    return path if by_name else None


def holders(root: str, scope: NodeScope, *,
            deadline: float = DEFAULT_PROC_DEADLINE) -> tuple[list[tuple[int, str, str]],
                                                               list[tuple[int, str]]]:
    """``(pid, comm, node)`` for every fd on a node in ``scope`` (`held_node`), sorted by pid
    then node, and ``(pid, comm)`` of every process whose fds could not be read within
    ``deadline``."""
    proc = tree_dir(root, "proc")
    scope = numbered_scope(root, scope)

    def read(pid: int) -> list[str]:
        return sorted({node for link, target in open_files(proc, pid)
                       if (node := held_node(scope, link, target)) is not None})

    nodes_of, stuck = read_each(pids(proc), read, deadline=deadline, scope=proc)
    found: list[tuple[int, str, str]] = []
    for pid, nodes in sorted(nodes_of.items()):
        if nodes:
            comm = read_comm(proc, pid)
            found.extend((pid, comm, node) for node in nodes)
    return found, [(pid, read_comm(proc, pid)) for pid in stuck]


def nvidia_holders(root: str, *, deadline: float = DEFAULT_PROC_DEADLINE) -> tuple[Holder, ...]:
    """Processes with an fd on any character device of the majors the root's ``/dev/nvidia*``
    have (a container's renamed node too), or on a ``/dev/nvidia*`` whose numbers the root
    does not give (`held_node`), one entry per process, sorted by pid; a process whose fds
    could not be read in time is listed ``unreadable`` (it may hold one)."""
    from gpuwatch.core.plan import NodeScope
    from gpuwatch.core.results import Holder

    seen: dict[int, Holder] = {}
    found, stuck = holders(root, NodeScope(prefixes=("/dev/nvidia",)), deadline=deadline)
    for pid, comm, _node in found:
        seen.setdefault(pid, Holder(pid=pid, comm=comm))
    for pid, comm in stuck:
        seen[pid] = Holder(pid=pid, comm=comm, unreadable=True)
    return tuple(seen[pid] for pid in sorted(seen))


#: CAP_DAC_OVERRIDE's bit in a capability set (linux/capability.h): it lets a process open
#: a file whatever its owner, mode and ACL say.
CAP_DAC_OVERRIDE = 1
#: How much of ``/proc/<pid>/status`` is read to find ``CapEff:`` (its ``Groups:`` line,
#: before it, lists every supplementary group: up to 65536 of them).
_STATUS_CAP = 1 << 20
_HEX = frozenset(b"0123456789abcdefABCDEF")


def parse_cap_eff(raw: bytes) -> int | None:
    """The effective capability set of a ``/proc/<pid>/status`` text (its ``CapEff:`` line,
    hex digits); None where there is no such line or its value is not plain hex (``int``
    alone would take a sign, ``0x`` or underscores the kernel never writes)."""
    for line in raw.split(b"\n"):
        if line.startswith(b"CapEff:"):
            value = line[len(b"CapEff:"):].strip(b" \t")
            if not value or not _HEX.issuperset(value):
                return None
            return int(value, 16)
    return None


def effective_capabilities(pid: int | str = "self", proc: str = "/proc") -> int | None:
    """``CapEff`` of process ``pid`` (world-readable, no privilege needed); None when it
    cannot be read (gone, another pid namespace) or is garbage. Read only up to that line."""
    path = f"{proc}/{pid}/status"
    try:
        fd = open_regular(path)
    except OSError:
        return None
    raw = b""
    try:
        while len(raw) < _STATUS_CAP:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            raw += chunk
            start = raw.find(b"CapEff:")
            if start >= 0 and b"\n" in raw[start:]:
                break
    except OSError:
        return None
    finally:
        os.close(fd)
    return parse_cap_eff(raw)


def dac_override(caps: int | None) -> bool | None:
    """Whether a capability set holds CAP_DAC_OVERRIDE; None for a set not known."""
    return None if caps is None else bool(caps >> CAP_DAC_OVERRIDE & 1)


def own_dac_override() -> bool | None:
    """Whether this process holds CAP_DAC_OVERRIDE now: root in a container that dropped it
    is refused nodes of other users, an unprivileged process granted it is not (None: its
    ``/proc/self/status`` could not be read)."""
    return dac_override(effective_capabilities("self"))


def in_our_user_namespace(pid: int, proc: str = "/proc") -> bool:
    """Whether process ``pid`` is in this process's user namespace (its capabilities then
    count over our files); False when either cannot be read (reading another user's takes
    ptrace access)."""
    try:
        return os.readlink(f"{proc}/{pid}/ns/user") == os.readlink(f"{proc}/self/ns/user")
    except OSError:
        return False
