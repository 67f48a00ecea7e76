"""``device_patterns`` match as the shell's glob does, one path component per ``*``, in the
scan and in the watcher alike: a uevent's node in a folder below the one a pattern names
(``/dev/bus/usb/*`` and a USB device's ``bus/usb/001/005``) is no match, as the scan's
glob never lists it, and a wildcard does not match a name that starts with a dot."""

from __future__ import annotations

import fnmatch
import glob
import os
import re
from pathlib import Path

import anyio
import pytest

import gpuwatch
from gpuwatch.core.probes import compiled_patterns, glob_regex, is_watched_node
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot
from gpuwatch.watch.watcher import open_watcher

pytestmark = pytest.mark.timeout(60)

PATTERNS = ("/dev/dri/renderD*", "/dev/bus/usb/*", "/dev/nvidia*")


def _host(root: Path) -> tuple[SysRoot, Path]:
    """A GPU host with USB buses and NVIDIA's nodes, and a config naming folders' nodes."""
    s = SysRoot(root)
    s.add_function("0000:01:00.0", driver="nvidia", iommu_group=1)
    s.add_drm("renderD128", "0000:01:00.0")
    for node in ("/dev/bus/usb/001/001", "/dev/nvidia0", "/dev/nvidiactl",
                 "/dev/nvidia-caps/nvidia-cap1"):
        s.add_dev_node(node)
    config = root.parent / f"{root.name}.yaml"
    config.write_text("device_patterns:\n" + "".join(f"  - {p}\n" for p in PATTERNS))
    return s, config


@pytest.mark.parametrize(("path", "watched"), [
    ("/dev/bus/usb/001", True),
    ("/dev/bus/usb/001/005", False),  # a folder further down: glob's * stops at the slash
    ("/dev/nvidia-caps", True),
    ("/dev/nvidia-caps/nvidia-cap1", False),
    ("/dev/dri/renderD128", True),
    ("/dev/bus/usb/.hidden", False),  # a wildcard never matches a leading dot
    ("/dev/nvidia0", True),
])
def test_a_pattern_matches_as_glob_does(path: str, watched: bool) -> None:
    assert is_watched_node(path, compiled_patterns(PATTERNS)) is watched


@pytest.mark.parametrize("pattern", ["/dev/[!x]*", "/dev/[]]x", "/dev/[a-c]?", "/dev/[",
                                     "/dev/x[^]", "/dev/*"])
def test_classes_match_as_fnmatch_does_within_one_component(pattern: str, tmp_path: Path) -> None:
    """The classes glob takes (``[!…]``, a leading ``]``, ranges, an unclosed ``[``)."""
    names = ["a1", "b2", "x", "]x", "[", "x^", "c", "ab", "bb"]
    for name in names:
        (tmp_path / name).touch()
    want = sorted("/dev/" + os.path.basename(p) for p in glob.glob(str(tmp_path) + pattern[4:]))
    (regex,) = compiled_patterns((pattern,))
    assert sorted("/dev/" + n for n in names if regex.match("/dev/" + n)) == want


async def test_the_watcher_lists_what_a_scan_lists(tmp_path: Path) -> None:
    s, config = _host(tmp_path / "h")
    source = MemorySource()
    async with open_watcher(s.root, source, config=config, reconcile_interval=0,
                            cdi_poll_interval=0) as w:
        s.add_dev_node("/dev/bus/usb/001/005")  # a USB device plugged in
        source.push({"ACTION": "add", "SUBSYSTEM": "usb", "DEVTYPE": "usb_device",
                     "DEVPATH": "/devices/pci0000:00/0000:00:14.0/usb1/1-2",
                     "DEVNAME": "bus/usb/001/005", "MAJOR": "189", "MINOR": "4",
                     "SEQNUM": "900"})
        s.add_drm("renderD129", "0000:01:00.0")  # and a node that does match, after it
        source.push(s.uevent_props("add", s.devpath("0000:01:00.0") + "/drm/renderD129"))
        with anyio.fail_after(10):
            while "/dev/dri/renderD129" not in w.probe("detect-host-devices").devices:
                await anyio.sleep(0.01)
        fresh = gpuwatch.scan(s.root, config=config).probe("detect-host-devices")
        assert w.probe("detect-host-devices").devices == fresh.devices
        assert fresh.devices == ("/dev/dri/renderD128", "/dev/dri/renderD129",
                                 "/dev/bus/usb/001", "/dev/nvidia-caps", "/dev/nvidia0",
                                 "/dev/nvidiactl")


@pytest.mark.parametrize(("path", "watched"), [
    ("/dev/ax", True), ("/dev/bx", True), ("/dev/a", False), ("/dev/cx", False),
    ("/dev/a/x", False),
])
def test_classes_of_python_3_14s_fnmatch(monkeypatch: pytest.MonkeyPatch, path: str,
                                         watched: bool) -> None:
    """From Python 3.14 ``fnmatch.translate`` ends its expression with ``\\z``, not
    ``\\Z``: a class must still match within the path, not only at its end (nor make a
    pattern ``re`` refuses, as ``\\z`` is before 3.14)."""
    translate = fnmatch.translate
    monkeypatch.setattr(fnmatch, "translate",
                        lambda pat: translate(pat).removesuffix(r"\Z") + r"\z")
    regex = re.compile(glob_regex("/dev/[ab]x"))
    assert bool(regex.match(path)) is watched
