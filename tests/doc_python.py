"""Run one Python example of the docs against a fixture host (tests/doc_examples.py).

``root="/"`` (the default) means the fixture workstation built here; watchers get their
uevents from a simulated kernel, which also switches drivers, and the NVIDIA GPU and the NIC
keep changing driver so that event loops in the example have events to print. The example
runs as ``__main__``, unchanged.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio

import gpuwatch
from gpuwatch.testing import example_gpu_host
from gpuwatch.testing.simkernel import SimKernel

ROOT = os.path.join(os.environ["GPUWATCH_DOC_ROOT"] + "-py")
HOST = example_gpu_host(ROOT)
CHURN = (("0000:01:00.0", "nvidia"), ("0000:02:00.0", "igb"))

_open_host = gpuwatch.open_host
_scan = gpuwatch.scan
_probe = gpuwatch.probe


def fixture(root: Any) -> Any:
    if root is None or os.path.normpath(os.fspath(root)) == "/":
        return ROOT
    return root


async def churn(sim: SimKernel) -> None:
    while True:
        for addr, driver in CHURN:
            await anyio.sleep(0.2)
            HOST.unbind(addr)
            sim.source.push(HOST.uevent_props("unbind", addr))
            await anyio.sleep(0.2)
            HOST.bind(addr, driver)
            sim.source.push(HOST.uevent_props("bind", addr))


@asynccontextmanager
async def open_host(root: Any = "/", source: Any = "auto", **options: Any) -> AsyncIterator[Any]:
    sim = SimKernel(HOST)
    options.setdefault("reconcile_interval", 0)
    options.setdefault("cdi_poll_interval", 0)
    options.setdefault("ops", sim)
    options.setdefault("geteuid", lambda: 0)
    async with _open_host(fixture(root), sim.source, **options) as host, \
            anyio.create_task_group() as tg:
        tg.start_soon(churn, sim)
        yield host
        tg.cancel_scope.cancel()


def scan(root: Any = "/", *args: Any, **kwargs: Any) -> Any:
    return _scan(fixture(root), *args, **kwargs)


def probe(action: str, root: Any = "/", *args: Any, **kwargs: Any) -> Any:
    return _probe(action, fixture(root), *args, **kwargs)


gpuwatch.open_host = open_host  # type: ignore[assignment]
gpuwatch.open_watcher = open_host  # type: ignore[attr-defined]
gpuwatch.scan = scan  # type: ignore[assignment]
gpuwatch.probe = probe  # type: ignore[assignment]

if __name__ == "__main__":
    path = sys.argv[1]
    sys.argv = [path]
    runpy.run_path(path, run_name="__main__")
