"""Which displays the firmware booted on, and which carry a framebuffer, read without the
scan's machinery.

`gpuwatch status` and `list` answered by a daemon hold no scan, yet must keep the boot display
for the host: they read ``boot_vga`` (and a display's framebuffer devices) themselves.
Importing the scan for that alone cost the stdlib fast path more than the rest of the command,
so the common case (every function has its bus entry) lives here, and only a tree without the
listing needs the scan's walk.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from gpuwatch.core.hostkeep import is_3d_controller, own_displays
from gpuwatch.core.pci import is_pci_addr
from gpuwatch.hostfs.files import in_root, list_dir, present, read_attr, tree_dir


class HostConsole(NamedTuple):
    """What `gpuwatch.core.hostkeep.kept_for_host_reason` reads of the host's displays
    besides a group's members, for a report on a daemon's answers (which carry neither
    ``boot_vga`` nor framebuffers): its ``host_displays``, ``boot_vga`` and
    ``framebuffers``."""

    displays: tuple[str, ...]
    boot_vga: frozenset[str]
    framebuffers: frozenset[str]


def one_group(displays: Iterable[str], groups: Mapping[str, int]) -> bool:
    """Whether the host's own ``displays`` are all in one IOMMU group (``groups``: each
    address's), so that passing it through takes every one: one display or none always; two
    or more when they share a group (cards behind a port without ACS)."""
    own = set(displays)
    if len(own) < 2:
        return True
    found = {groups.get(a, -1) for a in own}
    return len(found) == 1 and -1 not in found


#: What the reports know of every display-class function before reading anything:
#: ``(addr, physfn, class)``, as `gpuwatch.core.hostkeep.own_displays` takes them.
Gpu = tuple[str, str, str]


def console_of(gpus: Iterable[Gpu], folder: Callable[[str], str],
               groups: Mapping[str, int] | None = None) -> HostConsole:
    """The `HostConsole` of ``gpus`` (``(addr, physfn, class)`` of every display-class
    function), each read in ``folder(addr)``: ``boot_vga`` of every one; the framebuffers of
    the 3D controllers, which make them screens of the host's (`own_displays`), while the
    screens found so far are in one group; and those of the other displays when every
    screen is in one group (`one_group`; ``groups``: each address's IOMMU group, none known:
    each its own): the rule counts them for no other host, so no other folder is listed.
    Once the screens span two groups no group holds them all, and the rule answers alike
    whatever more is found."""
    gpus = list(gpus)
    groups = groups or {}
    sure = tuple(own_displays(gpus))  # the screens with no framebuffer read
    found: set[str] = set()
    if one_group(sure, groups):
        for addr in (a for a, physfn, klass in gpus if not physfn and is_3d_controller(klass)):
            if framebuffer_names(folder(addr)):
                found.add(addr)  # a 3D controller with the console: a screen too
                if not one_group((*sure, *found), groups):
                    break
    displays = tuple(own_displays(gpus, found))
    if one_group(displays, groups):
        found.update(a for a in sure if framebuffer_names(folder(a)))
    return HostConsole(
        displays,
        frozenset(a for a, _, _ in gpus if read_attr(folder(a) + "/boot_vga") == "1"),
        frozenset(found))


def console_unread(gpus: Iterable[Gpu],
                   groups: Mapping[str, int] | None = None) -> HostConsole | None:
    """The `HostConsole` of ``gpus`` (``(addr, physfn, class)``) with nothing read, where
    nothing read could change a report: a host with two or more screens of its own in more
    than one IOMMU group (``groups``: each address's) before a framebuffer is read (the VGA,
    XGA and other display controllers; a 3D controller is one only with a framebuffer, and
    more screens keep no more). The rule names a function by its ``boot_vga`` or its
    framebuffer only when its group holds every screen of the host
    (`gpuwatch.core.hostkeep.kept_for_host_reason`), so neither set is consulted there, and
    a big host is spared a ``boot_vga`` read per GPU. None: the host has one such screen or
    none, or all in one group, so they must be read (`listed_console`)."""
    displays = tuple(own_displays(gpus))
    if one_group(displays, groups or {}):
        return None
    return HostConsole(displays, frozenset(), frozenset())


def listed_console(root: str, gpus: Iterable[Gpu],
                   groups: Mapping[str, int] | None = None) -> HostConsole | None:
    """`console_of` ``gpus``, each read through its bus entry; None when one has no entry (a
    capture without the listing: `gpuwatch.hostfs.scan.read_console` walks ``sys/devices``)."""
    gpus = list(gpus)
    bus = os.path.join(tree_dir(root, "sys"), "bus/pci/devices")
    entries = {a: in_root(root, f"{bus}/{a}") for a, _, _ in gpus}
    if not all(os.path.lexists(entry) for entry in entries.values()):
        return None
    return console_of(gpus, entries.__getitem__, groups)


def is_framebuffer(name: str) -> bool:
    """``fb0``, ``fb1``…: a framebuffer device of the ``graphics`` class (not ``fbcon``,
    the console's own device there)."""
    return name.startswith("fb") and name[2:].isascii() and name[2:].isdigit()


def framebuffer_names(directory: str) -> list[str]:
    """The framebuffer devices (``fbN``) beneath a PCI function's folder, sorted: in its own
    ``graphics/`` folder (the fbdev emulation of the DRM driver bound to it: i915, amdgpu,
    bochs, nouveau…) or in that of a device one level below it (virtio-gpu registers on
    ``virtioN``; from Linux 6.9 on the firmware's framebuffer, ``simple-framebuffer.0``, is
    a child of the function whose memory it shows). Only real folders are entered, never a
    link: ``physfn`` leads to another function, ``driver`` to a driver. A captured copy of
    the folder holds the same folders, so it answers the same."""
    own = directory + "/graphics"
    found = ([n for n in list_dir(own) if is_framebuffer(n)]
             if present(own, follow_symlinks=False) else [])
    try:
        with os.scandir(directory) as entries:
            children = [e.name for e in entries
                        if e.name != "graphics" and e.is_dir(follow_symlinks=False)]
    except (OSError, ValueError):
        return sorted(found)
    for child in children:
        graphics = f"{directory}/{child}/graphics"
        if present(graphics, follow_symlinks=False):
            found.extend(n for n in list_dir(graphics) if is_framebuffer(n))
    return sorted(found)


def framebuffer_owner(devpath: str) -> str:
    """The PCI function a framebuffer device at ``devpath`` hangs beneath as
    `framebuffer_names` looks for one (``…/ADDR/graphics/fbN``, ``…/ADDR/CHILD/graphics/
    fbN``), ``""`` for any other: a virtual one, the firmware's on a platform device, one
    further down (a USB display adapter's, behind its controller). A framebuffer's uevent is
    attributed by this rule, so the watcher's model holds what a fresh scan finds."""
    parts = devpath.split("/")
    if len(parts) < 4 or parts[-2] != "graphics":
        return ""
    if is_pci_addr(parts[-3]):
        return parts[-3]
    if len(parts) >= 5 and parts[-3] != "graphics" and is_pci_addr(parts[-4]):
        return parts[-4]
    return ""
