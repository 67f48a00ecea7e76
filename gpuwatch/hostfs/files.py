"""Fault-tolerant primitive reads. Every sysfs read in gpuwatch goes through here."""

from __future__ import annotations

import os

_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC


def read_text(path: str) -> str | None:
    """A small attribute file's text, stripped; None when it cannot be read for any reason.

    ENOENT/ENODEV (device gone), EACCES, EIO and odd bytes (replaced) are all normal on a
    live host and must not stop a scan.
    """
    # os.open/os.read, not open(): no buffered file object per attribute, which is a third of
    # the cost of a scan. One read suffices: sysfs hands out an attribute in a single read.
    try:
        fd = os.open(path, _READ_FLAGS)
    except (OSError, ValueError):
        return None
    try:
        data = os.read(fd, 65536)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace").strip()


def read_attr(path: str) -> str:
    """Like `read_text`, with ``""`` for unreadable."""
    text = read_text(path)
    return "" if text is None else text


def link_name(path: str) -> str:
    """The basename of a symlink's target (``driver`` → ``nvidia``); ``""`` when absent."""
    try:
        target = os.readlink(path)
    except (OSError, ValueError):
        return ""
    return target.rstrip("/").rpartition("/")[2]  # os.path.basename, minus its overhead


def list_dir(path: str) -> list[str]:
    """Directory entries; ``[]`` for a missing or unreadable directory."""
    try:
        return os.listdir(path)
    except (OSError, ValueError):
        return []
