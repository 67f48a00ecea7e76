"""``python fd_eater.py ARGS`` is ``gpuwatch ARGS`` with something else in the process eating
its descriptors on demand: SIGUSR1 opens /dev/null until the open-file limit refuses (the
count goes to stderr as ``ate N``), SIGUSR2 closes them all again (``freed``). A leak in a
library, a burst of /proc reads, an NSS module: the accept loop must survive it."""

from __future__ import annotations

import os
import runpy
import signal
import sys
from types import FrameType

_eaten: list[int] = []


def _eat(signum: int, frame: FrameType | None) -> None:
    while True:
        try:
            _eaten.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        except OSError:
            break
    os.write(2, b"ate %d\n" % len(_eaten))


def _free(signum: int, frame: FrameType | None) -> None:
    while _eaten:
        os.close(_eaten.pop())
    os.write(2, b"freed\n")


signal.signal(signal.SIGUSR1, _eat)
signal.signal(signal.SIGUSR2, _free)
sys.argv = ["gpuwatch", *sys.argv[1:]]
runpy.run_module("gpuwatch", run_name="__main__", alter_sys=True)
