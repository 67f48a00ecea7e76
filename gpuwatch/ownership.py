"""Who else could change what a path names: the check behind every file gpuwatch, often run
by root, makes, writes or trusts at a path it was given (the socket, the event log, the
config file).

Root writing through a path that passes through another user's directory writes wherever
that user points it: a link planted at the name (``/etc/passwd`` appended to), a directory
renamed aside and made anew (a socket of theirs in place of the daemon's), a config file of
their own text. So such a path is refused, as sshd refuses a ``~/.ssh`` others may write.
"""

from __future__ import annotations

import errno
import os
import stat

#: Links followed at most while walking a path, as the kernel's own bound.
MAX_LINKS = 40


def trusted_uids() -> frozenset[int]:
    """Root, the user we run as and, run as root by ``sudo``, the user who ran it
    (``SUDO_UID``): whoever else owns a directory on the way controls it. The sudo user
    names the paths on the command line anyway (``--out /etc/passwd`` is theirs to give),
    so trusting their directories gives them nothing new, and ``sudo gpuwatch record --out
    capture.jsonl`` in their own home works; a third user's link is refused all the same."""
    uids = {0, os.geteuid()}
    sudo_uid = os.environ.get("SUDO_UID", "")
    if uids == {0} and sudo_uid.isascii() and sudo_uid.isdigit():
        uids.add(int(sudo_uid))
    return frozenset(uids)


def shared_sticky(st: os.stat_result) -> bool:
    """A directory others may add names to, though not rename ours (sticky, like /tmp): a
    name there may be theirs, and is to be looked at before it is used."""
    return bool(st.st_mode & stat.S_ISVTX and st.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _why_dir(path: str, st: os.stat_result) -> str | None:
    """Why others control the directory ``path``: another owner, or write permission
    without the sticky bit for everyone, or for a group of someone else's directory. A
    directory of root's that a group of root's choosing may write (Ubuntu's ``/var/log``,
    ``root:syslog`` 0775) is an administrator's arrangement, not another user's say."""
    if st.st_uid not in trusted_uids():
        return f"{path} belongs to uid {st.st_uid}"
    if st.st_mode & stat.S_ISVTX:
        return None
    if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP and st.st_uid != 0
                                     and st.st_gid not in (0, os.getegid())):
        return f"{path} is writable by other users"
    return None


def foreign_entry(path: str, st: os.stat_result, folder: os.stat_result) -> str | None:
    """Why the entry ``path`` (its lstat ``st``) in ``folder`` (stat) is not to be used: in a
    sticky directory others write, a name that is not ours nor the directory owner's (a link,
    file or FIFO planted there, as the kernel's ``protected_symlinks``/``protected_regular``
    would refuse it, whether or not those are on)."""
    if shared_sticky(folder) and st.st_uid not in trusted_uids() | {folder.st_uid}:
        what = "a link" if stat.S_ISLNK(st.st_mode) else "a file"
        return f"{path} is {what} of uid {st.st_uid} in a directory other users may write"
    return None


def others_control(path: str) -> str | None:
    """Why another user could change what ``path`` names (None: no one but root and us):
    a directory the lookup of its parent passes through (every link on the way read as the
    kernel reads it, the directories holding the links included) belongs to another user,
    or others may write it without the sticky bit, or a link on the way was planted in a
    sticky one by another user. The name itself is not looked at: see `foreign_entry`.

    Raises `OSError` when a directory on the way cannot be read (ENOENT, EACCES, ELOOP).
    """
    folder = os.path.dirname(os.path.join(os.getcwd(), path))
    pending = [part for part in reversed(folder.split("/")) if part not in ("", ".")]
    current = "/"
    here = os.stat(current)
    why = _why_dir(current, here)
    links = 0
    while why is None and pending:
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            # ``current`` holds no link: its parent is the one the kernel goes up to.
            current = os.path.dirname(current)
            here = os.stat(current)
            continue
        name = os.path.join(current, part)
        st = os.lstat(name)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > MAX_LINKS:
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), name)
            why = foreign_entry(name, st, here)
            target = os.readlink(name)
            if target.startswith("/"):
                current = "/"
                here = os.stat(current)
            pending.extend(p for p in reversed(target.split("/")) if p not in ("", "."))
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), name)
        current, here = name, st
        why = _why_dir(current, here)
    return why


def others_choose(path: str) -> str | None:
    """Why another user could choose the file ``path`` names (None: no one but root and
    us): `others_control` of it, the name itself when it sits in a sticky directory others
    write (`foreign_entry`), and, when it is a link, `others_control` of where it leads.
    Raises `OSError` as `others_control` does."""
    why = others_control(path)
    if why is None:
        folder = os.stat(os.path.dirname(os.path.join(os.getcwd(), path)))
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        why = foreign_entry(path, st, folder)
        if why is None and stat.S_ISLNK(st.st_mode):
            why = others_control(os.path.realpath(path))
    return why


def not_ours(st: os.stat_result) -> str | None:
    """Why the file just opened (its fstat ``st``) is not one of ours to write: another
    user's, or a regular file with more than one link (a hard link planted to a file of
    root's, which writing would overwrite); None when it is ours."""
    if st.st_uid not in trusted_uids():
        return f"belongs to uid {st.st_uid}"
    if stat.S_ISREG(st.st_mode) and st.st_nlink != 1:
        return f"has {st.st_nlink} links"
    return None


def open_owned(path: str, flags: int, mode: int) -> int:
    """``os.open`` of a file root writes at a path an administrator named: in a sticky
    directory others write (/tmp) following no link but one of ours and keeping nothing that
    is not ours, since a name can be planted there at any moment (after the file was
    removed, say), and root must not write through it. Raises `OSError` (EPERM) for a name
    of another user's there. ``O_TRUNC`` is for the caller to do after it (`ftruncate`): an
    open that truncates would do so before anything could be checked."""
    folder = os.stat(os.path.dirname(path) or ".")
    if not shared_sticky(folder):
        return os.open(path, flags, mode)
    target = path
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        pass  # made below, O_NOFOLLOW: a link planted since is not followed
    else:
        why = foreign_entry(path, st, folder)
        if why is not None:
            raise OSError(errno.EPERM, f"{why}: not written")
        if stat.S_ISLNK(st.st_mode):
            # Ours, so no one else may change or remove it: where it leads, taken once and
            # opened without following a link put there since.
            target = os.path.realpath(path)
    fd = os.open(target, flags | os.O_NOFOLLOW, mode)
    whose = not_ours(os.fstat(fd))
    if whose is not None:
        os.close(fd)
        raise OSError(errno.EPERM, f"{path} {whose}: not written")
    return fd


def others_may_write(st: os.stat_result) -> str | None:
    """Why a file (its stat ``st``) may be written by someone but root and us: another
    owner, or write permission for others, or for a group that is not root's nor ours."""
    if st.st_uid not in trusted_uids():
        return f"belongs to uid {st.st_uid}"
    if st.st_mode & stat.S_IWOTH or (st.st_mode & stat.S_IWGRP
                                     and st.st_gid not in (0, os.getegid())):
        return "is writable by other users"
    return None


__all__ = ["MAX_LINKS", "foreign_entry", "not_ours", "open_owned", "others_choose",
           "others_control", "others_may_write", "shared_sticky", "trusted_uids"]
