"""gpuwatch: a uevent-driven, in-memory model of a Linux GPU host.

Scan once (`scan`), answer every probe from memory (`HostModel.probe`), and keep the model
current from kernel uevents (`open_watcher`). See docs/ for the contracts.
"""

from __future__ import annotations

from gpuwatch.config import ConfigError, Tables, load_tables
from gpuwatch.core.results import (
    DetectVfioResult,
    GpuInfo,
    Holder,
    HostDevicesResult,
    MemlockResult,
    PciFunction,
)
from gpuwatch.errors import DeviceNotFound, GpuwatchError, UsageError
from gpuwatch.model import ACTIONS, HostModel, probe, scan
from gpuwatch.service.client import AsyncClient, Client, DaemonError
from gpuwatch.switch.errors import (
    GroupBusy,
    NotPrivileged,
    SwitchFailed,
    SwitchRefused,
    SwitchWedged,
)
from gpuwatch.watch.subscription import SubscriberLagged
from gpuwatch.watch.watcher import HostSnapshot, Watcher, open_watcher

__version__ = "0.1.0"

__all__ = [
    "ACTIONS",
    "AsyncClient",
    "Client",
    "ConfigError",
    "DaemonError",
    "DetectVfioResult",
    "DeviceNotFound",
    "GpuInfo",
    "GpuwatchError",
    "GroupBusy",
    "Holder",
    "HostDevicesResult",
    "HostModel",
    "HostSnapshot",
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
    "load_tables",
    "open_watcher",
    "probe",
    "scan",
]
