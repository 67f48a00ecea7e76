"""vfio-group-accessible against the kernel itself: real processes of other users open the
nodes the probe judges, with owners, modes and POSIX ACLs (udev's ``uaccess``, ``setfacl``)
of every kind. The fixture's nodes are regular files: the kernel's permission check is the
same for them as for a char device."""

from __future__ import annotations

import itertools
import os
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.core.observations import (
    ACL_GROUP,
    ACL_GROUP_OBJ,
    ACL_MASK,
    ACL_OTHER,
    ACL_USER,
    ACL_USER_OBJ,
    NodeStat,
)
from gpuwatch.core.probes import FreshHost, may_read_write
from gpuwatch.hostfs.scan import HostPaths, node_stat, parse_posix_acl, scan
from gpuwatch.settings import default_tables
from gpuwatch.testing import SysRoot

#: The callers: (uid, primary gid, supplementary groups).
CALLERS = [(1000, 1000, ()), (1000, 1000, (36,)), (1001, 36, ()), (1002, 1002, (37, 36)),
           (1003, 1003, (37,))]


def _acl_bytes(entries: list[tuple[int, int, int]]) -> bytes:
    """A ``system.posix_acl_access`` value, as setfacl writes it (entries sorted)."""
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in sorted(entries))


def _with_acl(user_obj: int, named: list[tuple[int, int, int]], group_obj: int,
              other: int) -> bytes:
    """An ACL with named entries and the mask setfacl computes (their union with the
    owning group's)."""
    mask = group_obj
    for _tag, perm, _ident in named:
        mask |= perm
    none = 0xFFFFFFFF
    return _acl_bytes([(ACL_USER_OBJ, user_obj, none), *named, (ACL_GROUP_OBJ, group_obj, none),
                       (ACL_MASK, mask, none), (ACL_OTHER, other, none)])


#: Nodes: (owner uid, owner gid, mode, ACL value or None). Modes cover each class's bits;
#: ACLs grant a named user, a named group, refuse the owning group while the mask says rw,
#: and a mask that takes back what a named entry grants.
NODES: list[tuple[int, int, int, bytes | None]] = [
    *((uid, gid, mode, None) for uid, gid, mode in itertools.product(
        (0, 1000), (0, 36), (0o600, 0o660, 0o640, 0o606, 0o666, 0o066, 0o000))),
    (0, 0, 0, _with_acl(6, [(ACL_USER, 6, 1000)], 0, 0)),
    (0, 0, 0, _with_acl(6, [(ACL_GROUP, 6, 37)], 0, 0)),
    (0, 36, 0, _with_acl(6, [(ACL_USER, 6, 1003)], 0, 0)),       # group 36 refused, mask rw
    (0, 36, 0, _with_acl(6, [(ACL_GROUP, 6, 37)], 4, 6)),        # 36 matched: not "other"
    (0, 0, 0, _with_acl(6, [(ACL_USER, 4, 1000), (ACL_GROUP, 6, 36)], 0, 0)),
    (1000, 0, 0, _with_acl(0, [(ACL_USER, 6, 1000)], 6, 6)),     # the owner's entry wins
]


def _mode_of(mode: int, acl: bytes | None) -> int:
    """The mode the kernel shows for the node: with an ACL, its mask as the group bits."""
    if acl is None:
        return mode
    entries = dict((tag, perm) for tag, perm, _ in parse_posix_acl(acl)
                   if tag in (ACL_USER_OBJ, ACL_MASK, ACL_OTHER))
    return entries[ACL_USER_OBJ] << 6 | entries[ACL_MASK] << 3 | entries[ACL_OTHER]


@pytest.fixture
def nodes_root() -> Iterator[SysRoot]:
    """A fixture tree other users can walk to its nodes (pytest's own folders are 0700)."""
    base = tempfile.mkdtemp(prefix="gw-vfio-access-")
    try:
        os.chmod(base, 0o755)
        host = SysRoot(Path(base) / "root")
        for path in (base, host.root):
            os.chmod(path, 0o755)
        for n, (uid, gid, mode, acl) in enumerate(NODES):
            host.add_vfio_group(n)
            node = host.root / f"dev/vfio/{n}"
            os.chown(node, uid, gid)
            os.chmod(node, mode)
            if acl is not None:
                os.setxattr(node, "system.posix_acl_access", acl)
        for folder in ("dev", "dev/vfio"):
            os.chmod(host.root / folder, 0o755)
        yield host
    finally:
        subprocess.run(["rm", "-rf", base], check=False)


#: Opens each path read/write (the shell's ``<>``) and says 1 or 0 for it, a line each: the
#: shell, not this interpreter, which may live where other users cannot run it.
_OPEN_ALL = 'for p; do if (: <>"$p") 2>/dev/null; then echo 1; else echo 0; fi; done'


def _opens(host: SysRoot, uid: int, gid: int, groups: tuple[int, ...]) -> dict[int, bool]:
    """Which group nodes a process with these credentials may open read/write: asked of the
    kernel by such a process."""
    paths = [str(host.root / f"dev/vfio/{n}") for n in range(len(NODES))]
    done = subprocess.run(["/bin/sh", "-c", _OPEN_ALL, "sh", *paths], user=uid, group=gid,
                          extra_groups=list(groups), capture_output=True, check=True,
                          timeout=60, cwd="/")
    said = done.stdout.decode().split()
    assert len(said) == len(paths)
    return {n: word == "1" for n, word in enumerate(said)}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make nodes of other users and "
                                               "run processes as them")
def test_vfio_group_accessible_says_what_the_kernel_decides(nodes_root: SysRoot) -> None:
    """The answer for each caller is what its open(O_RDWR) gets from the kernel: with a
    POSIX ACL the mode's group bits are only the mask, and a user granted the node by an
    ACL entry (udev's ``uaccess``, ``setfacl -m u:qemu:rw``) was told false, a member of an
    owning group the ACL refuses was told true."""
    host = nodes_root
    for n, (_uid, _gid, mode, acl) in enumerate(NODES):  # the kernel keeps them in step
        assert os.stat(host.root / f"dev/vfio/{n}").st_mode & 0o777 == _mode_of(mode, acl)
    tables = default_tables()
    snapshot = scan(HostPaths(str(host.root)), tables)
    for uid, gid, groups in CALLERS:
        gids = frozenset((gid, *groups))
        fresh = FreshHost(snapshot, tables, uid, gids)
        kernel = _opens(host, uid, gid, groups)
        answers = {n: fresh.answer("vfio-group-accessible", group=n) for n in kernel}
        wrong = {n: (NODES[n], answers[n]) for n in kernel if answers[n] != kernel[n]}
        assert not wrong, f"caller {(uid, gid, groups)}: answers that are not the kernel's"
    assert sum(kernel.values()) and not all(kernel.values())  # both kinds of answer seen


def test_an_acl_is_read_with_the_node_and_garbage_is_none(tmp_path: Path) -> None:
    """The ACL comes with the node's stat (so a setfacl alone is a change of the node), and
    a value the kernel would not have written is no ACL."""
    host = SysRoot(tmp_path)
    host.add_vfio_group(5)
    node = host.root / "dev/vfio/5"
    paths = HostPaths(str(host.root))
    before = node_stat(paths, "/dev/vfio/5")
    assert before is not None and before.acl == ()
    os.setxattr(node, "system.posix_acl_access", _with_acl(6, [(ACL_USER, 6, 107)], 0, 0))
    after = node_stat(paths, "/dev/vfio/5")
    assert after is not None and after != before
    assert (ACL_USER, 6, 107) in after.acl
    assert may_read_write(after, 107, frozenset({107}))
    assert not may_read_write(before, 107, frozenset({107}))
    assert parse_posix_acl(b"") == ()
    assert parse_posix_acl(struct.pack("<I", 1) + struct.pack("<HHI", 2, 6, 1)) == ()
    assert parse_posix_acl(struct.pack("<I", 2) + b"\x02\x00\x06") == ()


@pytest.mark.parametrize(
    ("acl", "uid", "gids", "expected"),
    [
        # a named user: its entry and the mask (the mode's group bits, here rw)
        (((ACL_USER, 6, 107),), 107, {107}, True),
        (((ACL_USER, 4, 107),), 107, {107}, False),
        # the owning group refused by its entry although the mask says rw
        (((ACL_GROUP_OBJ, 0, 0), (ACL_USER, 6, 107)), 1000, {36}, False),
        (((ACL_GROUP_OBJ, 6, 0), (ACL_USER, 6, 107)), 1000, {36}, True),
        # a named group; a caller matched by a group entry that refuses is not "other"
        (((ACL_GROUP_OBJ, 0, 0), (ACL_GROUP, 6, 37)), 1000, {37}, True),
        (((ACL_GROUP_OBJ, 4, 0), (ACL_GROUP, 4, 37)), 1000, {37}, False),
        (((ACL_GROUP_OBJ, 0, 0),), 1000, {99}, True),  # no match: the other bits (rw)
    ],
)
def test_acl_rule(acl: tuple[tuple[int, int, int], ...], uid: int, gids: set[int],
                  expected: bool) -> None:
    """The kernel's ``posix_acl_permission`` for an O_RDWR open, node 0:36 mode 0666."""
    stat = NodeStat(mode=0o666, uid=0, gid=36, acl=acl)
    assert may_read_write(stat, uid, frozenset(gids)) is expected
