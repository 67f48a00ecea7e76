"""A watcher over a fixture tree fed by hand, and the events its subscriber got: for tests
that change the tree as the kernel would, push the uevent, and look at one batch's outcome."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from gpuwatch.hostfs.scan import HostPaths
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot
from gpuwatch.watch import watcher as watcher_mod
from gpuwatch.watch.watcher import Watcher, open_watcher


@asynccontextmanager
async def watching(host: SysRoot) -> AsyncIterator[tuple[Watcher, MemorySource, list[Any]]]:
    """The watcher, its source, and the list a subscriber appends every event to."""
    source = MemorySource()
    async with open_watcher(host.root, source, reconcile_interval=0,
                            cdi_poll_interval=0) as w:
        got: list[Any] = []
        async with w.subscribe() as sub:
            async def collect() -> None:
                async for event in sub:
                    got.append(event)

            async with anyio.create_task_group() as tg:
                tg.start_soon(collect)
                yield w, source, got
                tg.cancel_scope.cancel()


async def until_driver(got: list[Any], addr: str, driver: str) -> list[Any]:
    """The events so far once ``addr``'s driver-changed to ``driver`` is among them, with the
    rest of its batch (a batch's probe-changed comes last)."""
    with anyio.fail_after(10):
        while not any(e.type == "driver-changed" and e.addr == addr and e.new == driver
                      for e in got):
            await anyio.sleep(0.005)
    await anyio.sleep(0.05)
    return list(got)


def count_reads(monkeypatch: pytest.MonkeyPatch, reader: str) -> list[str]:
    """Every call the watcher makes to the tree reader ``reader`` (``read_kfd``…) from now
    on, as the root it read under."""
    real = getattr(watcher_mod, reader)
    calls: list[str] = []

    def counting(paths: HostPaths) -> Any:
        calls.append(paths.root)
        return real(paths)

    monkeypatch.setattr(watcher_mod, reader, counting)
    return calls
