"""gpuwatch: a uevent-driven, in-memory model of a Linux GPU host.

Scan once (`scan`), answer every probe from memory (`HostModel.probe`), keep the model current
from kernel uevents and switch drivers safely (`open_host`, also known by its first name
`open_watcher`). See docs/ for the contracts.

Every public name is loaded on first use (PEP 562): ``import gpuwatch`` imports neither
pydantic nor PyYAML nor anyio nor pyudev, so a program that only needs the client, or a
``gpuwatch --help``, starts in milliseconds.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "ACTIONS": "gpuwatch.model",
    "AsyncClient": "gpuwatch.service.client",
    "CallerError": "gpuwatch.errors",
    "Client": "gpuwatch.service.client",
    "ConfigError": "gpuwatch.errors",
    "DaemonError": "gpuwatch.service.client",
    "DetectVfioResult": "gpuwatch.core.results",
    "DeviceNotFound": "gpuwatch.errors",
    "GpuInfo": "gpuwatch.core.results",
    "GpuwatchError": "gpuwatch.errors",
    "GroupBusy": "gpuwatch.errors",
    "Holder": "gpuwatch.core.results",
    "Host": "gpuwatch.host",
    "HostDevicesResult": "gpuwatch.core.results",
    "HostError": "gpuwatch.errors",
    "HostModel": "gpuwatch.model",
    "HostSnapshot": "gpuwatch.watch.watcher",
    "InternalError": "gpuwatch.errors",
    "MemlockResult": "gpuwatch.core.results",
    "NotPrivileged": "gpuwatch.errors",
    "PciFunction": "gpuwatch.core.results",
    "SubscriberLagged": "gpuwatch.errors",
    "SwitchFailed": "gpuwatch.errors",
    "SwitchRefused": "gpuwatch.errors",
    "SwitchWedged": "gpuwatch.errors",
    "Tables": "gpuwatch.core.tables",
    "UsageError": "gpuwatch.errors",
    "Watcher": "gpuwatch.watch.watcher",
    "WatcherClosed": "gpuwatch.watch.watcher",
    "load_tables": "gpuwatch.settings",
    "open_host": "gpuwatch.host",
    "open_watcher": "gpuwatch.host",
    "probe": "gpuwatch.model",
    "scan": "gpuwatch.model",
}

__all__ = [
    "ACTIONS",
    "AsyncClient",
    "CallerError",
    "Client",
    "ConfigError",
    "DaemonError",
    "DetectVfioResult",
    "DeviceNotFound",
    "GpuInfo",
    "GpuwatchError",
    "GroupBusy",
    "Holder",
    "Host",
    "HostDevicesResult",
    "HostError",
    "HostModel",
    "HostSnapshot",
    "InternalError",
    "MemlockResult",
    "NotPrivileged",
    "PciFunction",
    "SubscriberLagged",
    "SwitchFailed",
    "SwitchRefused",
    "SwitchWedged",
    "Tables",
    "UsageError",
    "Watcher",
    "WatcherClosed",
    "load_tables",
    "open_host",
    "open_watcher",
    "probe",
    "scan",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'gpuwatch' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


if TYPE_CHECKING:
    from gpuwatch.core.results import (
        DetectVfioResult,
        GpuInfo,
        Holder,
        HostDevicesResult,
        MemlockResult,
        PciFunction,
    )
    from gpuwatch.core.tables import Tables
    from gpuwatch.errors import (
        CallerError,
        ConfigError,
        DeviceNotFound,
        GpuwatchError,
        GroupBusy,
        HostError,
        InternalError,
        NotPrivileged,
        SubscriberLagged,
        SwitchFailed,
        SwitchRefused,
        SwitchWedged,
        UsageError,
    )
    from gpuwatch.host import Host, open_host, open_watcher
    from gpuwatch.model import ACTIONS, HostModel, probe, scan
    from gpuwatch.service.client import AsyncClient, Client, DaemonError
    from gpuwatch.settings import load_tables
    from gpuwatch.watch.watcher import HostSnapshot, Watcher, WatcherClosed
