"""`Host`: one GPU host, composed. The model kept current by a watcher, and the switch over it.

This is the composition layer: it builds the watcher (source pump, event log, reconcile
loop, subscriptions) and a `SwitchEngine` handed only what it needs (the model, the
`HostOps` seam, and the watcher's publish, subscribe and refresh callables), so neither
half knows the other. The service and the CLI stand on it; nothing below imports it.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal, Unpack, overload

from gpuwatch.settings import read_once, root_in_force
from gpuwatch.switch.engine import (
    DEFAULT_SCAN_TIMEOUT,
    DEFAULT_STEP_TIMEOUT,
    DEFAULT_TIMEOUT,
    DEFAULT_TREE_CHECK_AFTER,
    EventStream,
    SwitchEngine,
    SwitchResult,
)
from gpuwatch.switch.hostops import make_backend
from gpuwatch.watch import watcher as _watch
from gpuwatch.watch.watcher import (
    HostSnapshot,
    Watcher,
    WatcherOptions,
    entered_once,
)

if TYPE_CHECKING:
    import anyio

    from gpuwatch.core.observations import Observation
    from gpuwatch.core.probes import BoolAction, TextAction
    from gpuwatch.core.results import (
        DetectVfioResult,
        Holder,
        HostDevicesResult,
        MemlockResult,
        VfioBackend,
    )
    from gpuwatch.core.tables import Tables
    from gpuwatch.hostfs.scan import HostPaths
    from gpuwatch.model import HostModel
    from gpuwatch.settings import ConfigInForce
    from gpuwatch.sources import EventSource
    from gpuwatch.switch.hostops import HostOps
    from gpuwatch.watch.eventlog import EventLog
    from gpuwatch.watch.subscription import Subscription


class Host:
    """A running host: probes and snapshots from memory, events, and driver switches.

    Get one from `open_host`. Reads answer from the model; ``switch``/``recover`` write
    through the `HostOps` seam (root only) and return once the model sees the new drivers.
    """

    def __init__(self, watcher: Watcher, engine: SwitchEngine) -> None:
        self.watcher = watcher
        self.engine = engine

    # ------------------------------------------------------------------ reading

    @property
    def model(self) -> HostModel:
        return self.watcher.model

    @property
    def paths(self) -> HostPaths:
        return self.watcher.paths

    @property
    def tables(self) -> Tables:
        return self.watcher.tables

    @property
    def source(self) -> EventSource:
        return self.watcher.source

    @property
    def seq(self) -> int:
        """The seq of the last event published."""
        return self.watcher.seq

    @property
    def source_ended(self) -> anyio.Event:
        return self.watcher.source_ended

    @property
    def listeners(self) -> list[Callable[[Any], None]]:
        """Observers called with every stamped event (metrics, NFD, the socket server)."""
        return self.watcher.listeners

    @property
    def batch_listeners(self) -> list[Callable[[Sequence[Any], Sequence[str]], None]]:
        """Observers called once per published batch with the events and their JSON lines."""
        return self.watcher.batch_listeners

    @overload
    def probe(self, action: Literal["detect-vfio"], *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> DetectVfioResult: ...
    @overload
    def probe(self, action: BoolAction, *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> bool: ...
    @overload
    def probe(self, action: TextAction, *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> str: ...
    @overload
    def probe(self, action: Literal["detect-host-devices"], *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> HostDevicesResult: ...
    @overload
    def probe(self, action: Literal["memlock"], *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> MemlockResult: ...
    @overload
    def probe(self, action: Literal["nvidia-holders"], *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> tuple[Holder, ...]: ...
    @overload
    def probe(self, action: Literal["vfio-backend"], *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> VfioBackend: ...
    @overload
    def probe(self, action: Literal["plan"], *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> list[dict[str, Any]]: ...
    @overload
    def probe(self, action: str, *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> Any: ...
    def probe(self, action: str, *, group: int | None = None, addr: str | None = None,
              mode: str | None = None, vendor: str | None = None) -> Any:
        """Answer a probe action (docs/probes.md) from memory, typed per action
        (`HostModel.probe`)."""
        return self.model.probe(action, group=group, addr=addr, mode=mode, vendor=vendor)

    def snapshot(self) -> HostSnapshot:
        return self.watcher.snapshot()

    # ------------------------------------------------------------------ events

    def subscribe(self, types: Iterable[str] | None = None, addrs: Iterable[str] | None = None,
                  *, since_seq: int | None = None,
                  buffer: int | None = None) -> AbstractAsyncContextManager[Subscription]:
        """Events from now on, filtered; with ``since_seq`` the logged ones after it first,
        handed over to live events with no gap and no duplicate (`Watcher.subscribe`)."""
        return self.watcher.subscribe(types, addrs, since_seq=since_seq, buffer=buffer)

    async def wait_for(self, predicate: Callable[[Any], bool], timeout: float | None = None,
                       *, types: Iterable[str] | None = None) -> Any:
        return await self.watcher.wait_for(predicate, timeout, types=types)

    def publish(self, events: Sequence[Any]) -> None:
        self.watcher.publish(events)

    def apply(self, observations: Sequence[Observation]) -> list[Any]:
        return self.watcher.apply(observations)

    async def resync(self, reason: str) -> int:
        return await self.watcher.resync(reason)

    # ------------------------------------------------------------------ switching

    async def switch(self, addr_or_vendor: str, mode: str, *, timeout: float = DEFAULT_TIMEOUT,
                     tolerant: bool = False, force: bool = False,
                     vfio_driver: str | None = None) -> SwitchResult:
        """Switch a GPU's whole IOMMU group to ``mode`` (docs/switch.md); raises
        `SwitchRefused`, `SwitchWedged`, `SwitchFailed`, `GroupBusy`, `NotPrivileged`.
        ``force`` passes a group kept for the host (BMC/console, VMD) to vfio anyway;
        ``vfio_driver`` names the VFIO driver (else modules.alias chooses)."""
        self.watcher.check_open()
        return await self.engine.switch(addr_or_vendor, mode, timeout=timeout, tolerant=tolerant,
                                        force=force, vfio_driver=vfio_driver)

    async def plan(self, addr_or_vendor: str, mode: str, *, force: bool = False,
                   vfio_driver: str | None = None) -> dict[str, Any]:
        """The plan a switch would follow now, as JSON."""
        self.watcher.check_thread()
        return await self.engine.plan(addr_or_vendor, mode, force=force, vfio_driver=vfio_driver)

    async def recover(self, addr_or_vendor: str, *,
                      timeout: float = DEFAULT_TIMEOUT) -> SwitchResult:
        """Rebind a wedged group to vfio-pci and clear its poison (`RebootRequired` if stuck)."""
        self.watcher.check_open()
        return await self.engine.recover(addr_or_vendor, timeout=timeout)

    async def holders(self, addr_or_vendor: str) -> dict[str, Any]:
        """Who holds the card's nodes."""
        self.watcher.check_thread()
        return await self.engine.holders(addr_or_vendor)


@entered_once
@asynccontextmanager
async def open_host(
    root: str | os.PathLike[str] | None = None,
    source: str | EventSource = "auto",
    *,
    config: str | os.PathLike[str] | Tables | ConfigInForce | None = None,
    log: str | os.PathLike[str] | EventLog | None = None,
    ops: HostOps | None = None,
    geteuid: Callable[[], int] | None = None,
    poison_path: str | os.PathLike[str] | None = None,
    step_timeout: float = DEFAULT_STEP_TIMEOUT,
    scan_timeout: float = DEFAULT_SCAN_TIMEOUT,
    tree_check_after: float = DEFAULT_TREE_CHECK_AFTER,
    **watcher_options: Unpack[WatcherOptions],
) -> AsyncIterator[Host]:
    """Watch ``root`` and be ready to switch it; the body runs once the initial scan is done.

    ``root``, ``source``, ``config``, ``log`` and every other keyword of
    `gpuwatch.watch.watcher.open_watcher` (``log_max_bytes``, ``reconcile_interval``,
    ``announce``, …: `WatcherOptions`, so a type checker catches a misspelt one) configure
    the watcher. ``ops``/``geteuid`` default to the real host's seam (or a refusing one off
    the real ``/sys``), its commands in the host's namespaces where ``host_namespaces`` is on
    as the daemon reads it (``$GPUWATCH_HOST_NAMESPACES``, else ``config``'s); tests pass
    `gpuwatch.testing.simkernel.SimKernel`.
    ``announce=False``: the body runs before ``ready``, and calls
    ``host.watcher.announce_ready()`` (a daemon, once its listeners are bound).

    Leaving the context waits (shielded) for a switch or recover still under way in a task
    outside it, so that its end is read, published and logged with the watcher open.
    """
    try:
        # The file read once, for the watcher and the switch alike: ``host_namespaces`` is
        # the config's given here (as the daemon's is its own), not the default file's.
        config = read_once(config)
        if ops is None or geteuid is None:
            backend = make_backend(root_in_force(root, config), config=config,
                                   host_namespaces=watcher_options.get("host_namespaces"))
            ops = ops if ops is not None else backend.ops
            geteuid = geteuid if geteuid is not None else backend.geteuid
    except BaseException:
        if not isinstance(source, str):
            source.close()  # handed in, it is ours on every way out (`open_watcher`)
        raise
    async with _watch.open_watcher(root, source, config=config, log=log,
                                   **watcher_options) as watcher:

        def subscribe(types: Iterable[str]) -> AbstractAsyncContextManager[EventStream]:
            return watcher.subscribe(types=types)

        engine = SwitchEngine(
            watcher.model, ops, publish=watcher.publish, subscribe=subscribe,
            refresh=watcher.refresh, geteuid=geteuid, poison_path=poison_path,
            step_timeout=step_timeout, scan_timeout=scan_timeout,
            tree_check_after=tree_check_after, on_idle=watcher.finish_stop,
        )
        # A stop while a switch is under way (SIGTERM to a daemon mid-switch) writes
        # ``stopped`` after the switch's end, so ``stopped`` stays the log's last record.
        watcher.stop_waits_for = lambda: engine.busy
        # A switch whose process was killed half-way (SIGKILL) left its record: its end goes
        # in this run's log, after ``ready``.
        if watcher.announced:
            engine.report_abandoned()
        else:
            watcher.after_ready = engine.report_abandoned
        try:
            yield Host(watcher, engine)
        finally:
            # A switch the caller runs in a task outside this context (a task group around
            # it, cancelled or not) needs the watcher to its end: its re-reads, its events,
            # its log. Shielded: a cancelled body still leaves the switch its roll-back.
            if engine.busy:
                import anyio  # loaded already, with the engine

                with anyio.CancelScope(shield=True):
                    await engine.idle()


#: The first name of `open_host`, from when the watcher also switched: code written against
#: ``gpuwatch.open_watcher`` (probes, subscriptions and switches) runs unchanged.
open_watcher = open_host

__all__ = ["Host", "open_host", "open_watcher"]
