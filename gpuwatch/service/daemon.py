"""What ``gpuwatch watch`` runs beside the watcher when it is the host's service.

The socket server, Prometheus metrics, the NFD features file and systemd's notify protocol,
each started from the settings and all attached to the watcher through its listeners. Ready
is signalled only once the initial scan is done *and* the socket listens, so a unit ordered
``After=gpuwatch.service`` can connect at once.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from gpuwatch.core.tabledata import tables_json
from gpuwatch.errors import SERVICE, HostError
from gpuwatch.service.notify import Notifier
from gpuwatch.settings import WatchSettings

if TYPE_CHECKING:
    from gpuwatch.host import Host

if TYPE_CHECKING:
    from gpuwatch.service.metrics import Metrics
    from gpuwatch.service.nfd import NfdFeatureFile
    from gpuwatch.service.server import SocketServer

_log = logging.getLogger("gpuwatch.service")


class ServiceSetupError(HostError):
    """A service part cannot start (metrics port taken, socket path unusable, …)."""

    code = SERVICE


@dataclass
class Services:
    """The parts running for one watcher; None where the settings turned a part off."""

    notifier: Notifier
    server: SocketServer | None = None
    metrics: Metrics | None = None
    nfd: NfdFeatureFile | None = None


@asynccontextmanager
async def run_services(watcher: Host, settings: WatchSettings, *,
                       notifier: Notifier | None = None) -> AsyncIterator[Services]:
    """Start every configured part, signal READY, run the watchdog; stop all on exit."""
    services = Services(notifier=notifier or Notifier())
    metrics: Metrics | None = None
    nfd: NfdFeatureFile | None = None
    async with anyio.create_task_group() as tg:
        try:
            if settings.metrics:
                from gpuwatch.service.metrics import Metrics

                metrics = Metrics()
                metrics.attach(watcher.watcher)
                services.metrics = metrics
                try:
                    metrics.serve(settings.metrics)
                except OSError as exc:
                    from gpuwatch.service.server import NOT_YET_ERRNOS, ListenerNotYet

                    # A port still taken (the old daemon, another service) may be free on
                    # the next start: systemd retries that one, not a bad address.
                    error = (ListenerNotYet if exc.errno in NOT_YET_ERRNOS
                             else ServiceSetupError)
                    raise error(
                        f"--metrics {settings.metrics}: {exc.strerror or exc}") from None
            if settings.nfd_features:
                from gpuwatch.service.nfd import NfdFeatureFile

                nfd = NfdFeatureFile(settings.nfd_features, expiry=settings.nfd_expiry)
                # Before anything is written: a second writer of the directory (the unit and
                # the DaemonSet on one node) refuses to start, naming the holder.
                nfd.lock()
                nfd.attach(watcher.watcher)
                if metrics is not None:
                    metrics.track_nfd(nfd)
                services.nfd = nfd
                tg.start_soon(nfd.run, name="gpuwatch-nfd")
            if settings.socket:
                from gpuwatch.service.server import SocketServer

                read_gid = settings.socket_gid
                if os.geteuid() != 0 and settings.origins.get("socket_group") == "default":
                    read_gid = None  # not root: cannot give the file to the gpuwatch group
                server = SocketServer(
                    watcher, settings.socket, read_gid=read_gid,
                    switch_gid=settings.switch_gid, metrics=metrics,
                    # Replays read the log's files: none for stdout, a FIFO or a device.
                    log_path=watcher.watcher.replay_log_path,
                    max_line=settings.socket_max_request_bytes,
                    max_clients=settings.socket_max_clients,
                    max_per_uid=settings.socket_max_per_uid,
                    root_reserve=settings.socket_root_reserve, log_keep=settings.log_keep,
                    stall_timeout=settings.socket_stall_timeout,
                    outbox_limit=settings.socket_max_output_bytes,
                    config=served_config(settings),
                )
                services.server = server
                await tg.start(server.serve, name="gpuwatch-socket")
            # Every listener is bound: only now is `ready` a promise the daemon can keep. A
            # stop that came while they were binding (a signal) wins: nothing is announced.
            await anyio.lowlevel.checkpoint()
            freeze_startup_heap()
            watcher.watcher.announce_ready()
            services.notifier.ready(_status(watcher, settings))
            tg.start_soon(services.notifier.run_watchdog, name="gpuwatch-watchdog")
            yield services
        finally:
            gc.unfreeze()  # (a no-op unless frozen above) the process's own again
            services.notifier.stopping()
            tg.cancel_scope.cancel()
            if metrics is not None:
                metrics.close()
            if nfd is not None:
                nfd.detach()
                nfd.close()


def served_config(settings: WatchSettings) -> dict[str, Any]:
    """What the socket's ``config`` method answers (docs/socket.md): the config file this
    daemon read and checked at start, by path and `gpuwatch.settings.file_identity` (None
    for none), its root with where that came from, and the tables built from it. A command
    whose config file in force shows the same identity knows, without reading it, that the
    file is valid, what its ``root`` says (``root_from`` ``file`` or ``default``) and what
    its tables are (what `status` and `list` name vendors and keep for the host by): the
    stdlib fast paths' proof (`gpuwatch.cli.fast`, `gpuwatch.cli.fast_report`)."""
    identity = settings.config_identity
    return {"path": settings.config_path,
            "identity": list(identity) if identity is not None else None,
            "root": settings.root, "root_from": settings.origins.get("root", "default"),
            "tables": tables_json(settings.tables())}


def freeze_startup_heap() -> None:
    """Move what start-up built (modules, schemas, the initial model) out of the collector's
    sight: a daemon keeps nearly all of it for life, and every full collection during a uevent
    storm would otherwise walk all of it again (a sixth to a quarter of a storm's CPU in a
    process with a large heap). Only the daemon, which owns its process, does this; a library
    caller's collector is left alone."""
    gc.collect()
    gc.freeze()


def _status(watcher: Host, settings: WatchSettings) -> str:
    gpus = len(watcher.probe("detect-vfio").gpus)
    parts = [f"watching {len(watcher.model.state.functions)} PCI functions, {gpus} GPU(s)"]
    if settings.socket:
        parts.append(f"socket {settings.socket}")
    if settings.metrics:
        parts.append(f"metrics {settings.metrics}")
    return "; ".join(parts)


__all__ = ["ServiceSetupError", "Services", "freeze_startup_heap", "run_services",
           "served_config"]
