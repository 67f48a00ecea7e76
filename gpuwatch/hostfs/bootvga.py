"""Which displays the firmware booted on, read without the scan's machinery.

`gpuwatch status` and `list` answered by a daemon hold no scan, yet must keep the boot display
for the host: they read ``boot_vga`` themselves. Importing the scan for that alone cost the
stdlib fast path more than the rest of the command, so the common case (every function has
its bus entry) lives here, and only a tree without the listing needs the scan's walk.
"""

from __future__ import annotations

import os
from collections.abc import Collection

from gpuwatch.hostfs.files import in_root, read_attr, tree_dir


def listed_boot_vga(root: str, addrs: Collection[str]) -> frozenset[str] | None:
    """Those of ``addrs`` whose ``boot_vga`` is 1, each read through its bus entry; None
    when one has no entry (a capture without the listing: the scan walks ``sys/devices``)."""
    bus = os.path.join(tree_dir(root, "sys"), "bus/pci/devices")
    entries = [(a, in_root(root, f"{bus}/{a}")) for a in addrs]
    if not all(os.path.lexists(entry) for _, entry in entries):
        return None
    return frozenset(a for a, entry in entries if read_attr(entry + "/boot_vga") == "1")
