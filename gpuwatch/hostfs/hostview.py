"""The host's own tools as a container sees them: ``<root>/proc/1/root`` is the host's root
as its init sees it, and `HOST_PATH` the PATH a command run there (``nsenter --target 1``)
is looked for on. Read here, not in the switch, because a fact the model keeps (whether
``nvidia-ctk`` can make a CDI spec, `gpuwatch.hostfs.scan.read_cdi`) asks it too."""

from __future__ import annotations

import os

from gpuwatch.hostfs.files import resolve_in_root

#: Where a command in the host's namespaces is looked for (its PATH there, and where
#: `host_which` looks): the image's own PATH says nothing of the host's.
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: The host's root as PID 1 sees it, under the root (its ``proc`` is the host's).
HOST_ROOT_VIEW = "proc/1/root"


def host_which(root: str, name: str) -> str | None:
    """Where ``name`` is on the host's PATH (`HOST_PATH`), read under ``<root>/proc/1/root``
    (the host's root as its init sees it) with every link read as in a chroot there: the
    tool nsenter will run, not one of the image's."""
    if "/" in name or name in ("", ".", ".."):
        return None
    view = os.path.join(os.path.abspath(root), HOST_ROOT_VIEW)
    for folder in HOST_PATH.split(":"):
        host_path = f"{folder}/{name}"
        try:
            found = resolve_in_root(view, view + host_path, follow_last=True)
        except (OSError, ValueError):
            continue
        if os.path.isfile(found) and os.access(found, os.X_OK):
            return host_path
    return None


__all__ = ["HOST_PATH", "HOST_ROOT_VIEW", "host_which"]
