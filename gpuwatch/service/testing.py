"""A socket daemon over a fixture root, in-process: for gpuwatch's tests and for anyone testing
a client of the socket API without a real host.

>>> async with served_watcher(host.root, "/tmp/gw/gw.sock") as served:
...     served.source.push(host.uevent_props("bind", "0000:01:00.0"))
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import anyio

from gpuwatch.host import Host, open_host
from gpuwatch.service.server import SocketServer
from gpuwatch.sources import EventSource
from gpuwatch.sources.memory import MemorySource
from gpuwatch.watch.eventlog import EventLog
from gpuwatch.watch.watcher import Watcher


@dataclass
class ServedWatcher:
    #: The watcher under the served host (its pump, subscriptions and publish).
    watcher: Watcher
    source: MemorySource | EventSource
    server: SocketServer
    path: str
    #: The host the socket serves (the watcher plus its switch engine).
    host: Host


@asynccontextmanager
async def served_watcher(
    root: str | os.PathLike[str],
    socket_path: str,
    *,
    source: EventSource | None = None,
    log: str | EventLog | None = None,
    **server_options: Any,
) -> AsyncIterator[ServedWatcher]:
    """A watcher on ``root`` (a `MemorySource` unless given) served at ``socket_path``.

    ``log`` is the event log (a path or an `EventLog`), which ``since_seq`` replays from.
    No reconcile and no CDI polling: only what the test pushes happens.
    """
    src = source if source is not None else MemorySource()
    log_path = log.path if isinstance(log, EventLog) else log
    async with open_host(root, source=src, log=log, reconcile_interval=0,
                         cdi_poll_interval=0) as w, \
            anyio.create_task_group() as tg:
        server = SocketServer(w, socket_path, log_path=log_path, **server_options)
        await tg.start(server.serve)
        try:
            yield ServedWatcher(w.watcher, src, server, socket_path, w)
        finally:
            tg.cancel_scope.cancel()


@contextmanager
def short_socket_dir(prefix: str = "gw-") -> Iterator[str]:
    """A fresh directory in /tmp, mode 0755: socket paths stay under the 107-byte limit
    (pytest's tmp_path often does not) and another uid can reach a socket inside it."""
    path = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


__all__ = ["ServedWatcher", "served_watcher", "short_socket_dir"]
