"""Who is on the other end of a socket connection, and what they may ask.

The kernel vouches for the peer (SO_PEERCRED, taken at ``connect()``), so a client cannot
claim to be someone else; the supplementary groups come from SO_PEERGROUPS where the kernel
has it (Linux 4.13+), else from the group database for the peer's uid.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import grp
import os
import platform
import pwd
import signal
import socket
import struct
from dataclasses import dataclass

from gpuwatch.core.results import MemlockResult
from gpuwatch.hostfs import procfs
from gpuwatch.hostfs.files import read_bytes
from gpuwatch.service.protocol import SWITCH_METHODS

_UCRED = struct.Struct("3i")
# SO_PEERGROUPS is 59 in asm-generic; these architectures use their own numbering.
_OWN_SOCKOPT_NUMBERS = ("alpha", "mips", "parisc", "sparc")
# SO_PEERPIDFD (Linux 6.5+; not named by Python 3.11's socket module): a pidfd for the very
# process that connected, which a reused pid cannot stand in for.
_SO_PEERPIDFD = 77


@dataclass(frozen=True, slots=True)
class PeerCred:
    """The peer process as the kernel saw it at connect time."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int]
    #: When ``pid`` started (`process_start`), read at accept: with the pid it names one
    #: process for the whole boot, so a pid reused after the peer exited is told apart.
    start: int | None = None

    def describe(self) -> str:
        return f"uid {self.uid} pid {self.pid}"

    def still_there(self, proc: str = "/proc") -> bool:
        """Whether ``pid`` still names the process that connected (False when it exited,
        maybe handing its pid to another process, or its start time was never read)."""
        return self.start is not None and process_start(self.pid, proc) == self.start


def _peer_groups(sock: socket.socket) -> list[int] | None:
    option = getattr(socket, "SO_PEERGROUPS", None)
    if option is None:
        machine = platform.machine().lower()
        if machine.startswith(_OWN_SOCKOPT_NUMBERS):
            return None
        option = 59
    for count in (64, 65536):
        try:
            raw = sock.getsockopt(socket.SOL_SOCKET, option, 4 * count)
        except OSError:
            continue
        return list(struct.unpack(f"{len(raw) // 4}I", raw[: len(raw) // 4 * 4]))
    return None


def _db_groups(uid: int, gid: int) -> list[int]:
    try:
        name = pwd.getpwuid(uid).pw_name
        return os.getgrouplist(name, gid)
    except (KeyError, OSError):
        return []


def database_groups(uid: int, gid: int) -> list[int]:
    """The supplementary groups of ``uid`` from the group database (NSS: files, LDAP, sssd):
    where the kernel lacks SO_PEERGROUPS. It may block on the network: a daemon calls it
    off its event loop, with a bound (`gpuwatch.service.server`)."""
    return _db_groups(uid, gid)


def kernel_credentials(sock: socket.socket, *, vouch: bool = True) -> tuple[PeerCred, bool]:
    """SO_PEERCRED of a connected Unix socket, with SO_PEERGROUPS where the kernel has it:
    ``(peer, complete)``; ``complete`` is False when the supplementary groups are still to
    be looked up (`database_groups`), the peer then holding its primary group alone. Never
    blocks on anything but the kernel. With ``vouch`` False the start time is left for
    `vouched` (a peer refused on its credentials costs no read of ``/proc``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    groups = _peer_groups(sock)
    peer = PeerCred(pid=pid, uid=uid, gid=gid, groups=frozenset((gid, *(groups or ()))),
                    start=_connected_start(sock, pid) if vouch else None)
    return peer, groups is not None


def vouched(sock: socket.socket, peer: PeerCred) -> PeerCred:
    """``peer`` with the start time of the process that connected on ``sock`` (None when it
    has exited): read once a peer is admitted, still at accept."""
    return dataclasses.replace(peer, start=_connected_start(sock, peer.pid))


def _connected_start(sock: socket.socket, pid: int) -> int | None:
    """The start time of the process that connected, or None when it has exited: the peer
    may exit between its ``connect()`` and our accept, and its pid go to another process
    whose start time would then vouch for the wrong one. Read first, then the peer's pidfd
    is asked whether it still lives: if it does, the pid was its own when read."""
    start = process_start(pid)
    if start is not None and _peer_alive(sock) is False:
        return None
    return start


def _peer_alive(sock: socket.socket) -> bool | None:
    """Whether the process that connected still runs (its pidfd, SO_PEERPIDFD); None where
    the kernel cannot say (before Linux 6.5, or an architecture with its own numbering)."""
    if platform.machine().lower().startswith(_OWN_SOCKOPT_NUMBERS):
        return None
    try:
        pidfd = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
    except OSError as exc:
        # Until Linux 6.15 no pidfd is made for an exited peer (EINVAL, ESRCH); newer ones
        # make one that signal 0 finds gone. ENOPROTOOPT: before 6.5, nothing to ask.
        return False if exc.errno in (errno.EINVAL, errno.ESRCH) else None
    try:
        signal.pidfd_send_signal(pidfd, 0)  # signal 0: nothing is sent, existence is checked
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists; we may just not signal it
    except OSError:
        return None
    finally:
        os.close(pidfd)
    return True


def with_groups(peer: PeerCred, groups: list[int]) -> PeerCred:
    """``peer`` with the supplementary groups looked up for it."""
    return PeerCred(pid=peer.pid, uid=peer.uid, gid=peer.gid,
                    groups=frozenset((peer.gid, *groups)), start=peer.start)


def peer_credentials(sock: socket.socket) -> PeerCred:
    """SO_PEERCRED of a connected Unix socket, with the peer's groups (looked up in the
    group database, blocking, where the kernel lacks SO_PEERGROUPS)."""
    peer, complete = kernel_credentials(sock)
    if complete:
        return peer
    return with_groups(peer, _db_groups(peer.uid, peer.gid))


def process_start(pid: int, proc: str = "/proc") -> int | None:
    """When process ``pid`` started, in clock ticks after boot (``starttime``, field 22 of
    ``/proc/<pid>/stat``); None when there is no such process or the file is garbage."""
    if pid <= 0:
        return None
    try:
        raw = read_bytes(f"{proc}/{pid}/stat", 4096)
    except OSError:
        return None
    fields = raw.rpartition(b")")[2].split()  # after the comm, which may hold anything
    try:
        return int(fields[19])  # fields[0] is field 3 (the state)
    except (IndexError, ValueError):
        return None


@functools.lru_cache(maxsize=64)
def group_label(gid: int | None) -> str:
    """The name of group ``gid`` for messages. Cached: refusals name the daemon's two groups
    over and over, on the event loop, and the group database (NSS: LDAP, sssd) may block;
    the server looks them up once, at start (`gpuwatch.service.server`)."""
    if gid is None:
        return "root only"
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    """Reads for root and the socket group; switches for root and the switch group.

    A member of the switch group may read too: it can only connect at all if the socket's
    file mode lets it, and someone trusted to switch is trusted to look.
    """

    read_gid: int | None
    switch_gid: int | None
    #: The daemon's own user: a daemon run without root (a developer's) serves its user.
    owner_uid: int = 0

    def privileged(self, peer: PeerCred) -> bool:
        """Root or the daemon's own user: never refused, never counted against a share."""
        return peer.uid in (0, self.owner_uid)

    def may_connect(self, peer: PeerCred) -> bool:
        """Whether the peer may use the socket at all (checked at accept, before parsing)."""
        return any(self.allows(method, peer) for method in ("probe", "switch"))

    def allows(self, method: str, peer: PeerCred) -> bool:
        if self.privileged(peer):
            return True
        in_switch = self.switch_gid is not None and self.switch_gid in peer.groups
        if method in SWITCH_METHODS:
            return in_switch
        return in_switch or (self.read_gid is not None and self.read_gid in peer.groups)

    def refusal(self, method: str, peer: PeerCred) -> str:
        if method in SWITCH_METHODS:
            who = "root" if self.switch_gid is None else \
                f"root or members of group {group_label(self.switch_gid)!r} (--switch-group)"
        else:
            who = "root" if self.read_gid is None else \
                f"root or members of group {group_label(self.read_gid)!r} (--socket-group)"
        return f"{method} is allowed for {who} only; this peer is {peer.describe()}"


def peer_memlock(pid: int, proc: str = "/proc") -> MemlockResult | None:
    """The peer's RLIMIT_MEMLOCK from ``/proc/<pid>/limits`` (world-readable, no privilege):
    the probe contract answers for the asking process, so the daemon answers for its peer.
    Whether ``pid`` is still that process is the caller's to check, after this read
    (`PeerCred.still_there`)."""
    try:
        lines = read_bytes(f"{proc}/{pid}/limits", 16384).decode("ascii", "replace").splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("Max locked memory"):
            fields = line[len("Max locked memory"):].split()
            if len(fields) < 2:
                return None

            def value(text: str) -> int | None:
                return None if text == "unlimited" else int(text)

            try:
                return MemlockResult(soft=value(fields[0]), hard=value(fields[1]))
            except ValueError:
                return None
    return None


def peer_dac_override(peer: PeerCred, proc: str = "/proc") -> bool | None:
    """Whether the peer holds CAP_DAC_OVERRIDE over our files, from its ``CapEff`` (root in
    a container that dropped it is refused what its bits refuse; a user granted it may open
    anything). A peer whose uid we see is not 0 counts only in our user namespace: one
    that is root in a namespace of its own has no such power here (and one whose namespace
    cannot be read has none). None, not known: the status could not be read, or ``pid``
    no longer names the process that connected (checked after the reads)."""
    caps = procfs.effective_capabilities(peer.pid, proc)
    here = peer.uid == 0 or procfs.in_our_user_namespace(peer.pid, proc)
    if caps is None or not peer.still_there(proc):
        return None
    return here and bool(procfs.dac_override(caps))


__all__ = [
    "AccessPolicy",
    "PeerCred",
    "database_groups",
    "group_label",
    "kernel_credentials",
    "peer_credentials",
    "peer_dac_override",
    "peer_memlock",
    "process_start",
    "vouched",
    "with_groups",
]
