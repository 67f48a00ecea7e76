"""gpuwatch as a host service: the socket API, its client, systemd notify, metrics, NFD, udev.

Only the light client is imported here; the server side (and prometheus_client) load when
``gpuwatch watch`` turns them on.
"""

from gpuwatch.service.client import (
    AsyncClient,
    Client,
    DaemonDeviceNotFound,
    DaemonError,
    DaemonUnavailable,
    DaemonUsageError,
    try_daemon,
)
from gpuwatch.service.protocol import DEFAULT_SOCKET_PATH, RpcError

__all__ = [
    "DEFAULT_SOCKET_PATH",
    "AsyncClient",
    "Client",
    "DaemonDeviceNotFound",
    "DaemonError",
    "DaemonUnavailable",
    "DaemonUsageError",
    "RpcError",
    "try_daemon",
]
