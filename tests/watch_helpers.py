"""A watcher over a fixture tree fed by hand, and the events its subscriber got: for tests
that change the tree as the kernel would, push the uevent, and look at one batch's outcome;
and counters of calls and reads, for tests that pin what something costs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, cast

import anyio
import pytest

from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot
from gpuwatch.watch import eventlog
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


def count_calls(monkeypatch: pytest.MonkeyPatch, owner: object, name: str,
                key: Callable[[Any], Any] = lambda arg: arg) -> list[Any]:
    """Every call to ``owner.name`` from now on, as ``key`` of its first argument; the real
    one still answers. What a test counts to pin how often something is done, not only
    what comes out."""
    real = getattr(owner, name)
    calls: list[Any] = []

    def counting(first: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(key(first))
        return real(first, *args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


def count_reads(monkeypatch: pytest.MonkeyPatch, reader: str) -> list[str]:
    """Every call the watcher makes to the tree reader ``reader`` (``read_kfd``…) from now
    on, as the root it read under."""
    return count_calls(monkeypatch, watcher_mod, reader, lambda paths: paths.root)


class CountingFile:
    """A file whose reads are counted (``reads``, ``read_bytes``, the ``largest`` one): what
    a search through a log costs, measured in what it reads rather than in time."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.reads = 0
        self.read_bytes = 0
        self.largest = 0

    def read(self, n: int = -1) -> bytes:
        data = cast(bytes, self._f.read(n))
        self.reads += 1
        self.read_bytes += len(data)
        self.largest = max(self.largest, len(data))
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def count_log_reads(monkeypatch: pytest.MonkeyPatch) -> list[CountingFile]:
    """Every event log file a reader opens from now on, its reads counted."""
    opened: list[CountingFile] = []
    real_init = eventlog._Source.__init__

    def counting_init(self: Any, file: Any, ident: Any) -> None:
        opened.append(CountingFile(file))
        real_init(self, opened[-1], ident)

    monkeypatch.setattr(eventlog._Source, "__init__", counting_init)
    return opened
