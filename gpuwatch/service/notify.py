"""systemd's notify protocol, spoken directly: one datagram per state to ``$NOTIFY_SOCKET``.

No libsystemd or python-systemd dependency: the protocol is a single AF_UNIX datagram of
``KEY=VALUE`` lines (``READY=1``, ``WATCHDOG=1``, ``STOPPING=1``, ``STATUS=…``). Without
``NOTIFY_SOCKET`` (not started by systemd) every call is a no-op, so the same code runs
under systemd, in a container and in a terminal.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

import anyio

_log = logging.getLogger("gpuwatch.service")


def _address(env: Mapping[str, str]) -> str | None:
    path = env.get("NOTIFY_SOCKET", "")
    if not path:
        return None
    if path.startswith("@"):  # abstract namespace
        return "\0" + path[1:]
    if not path.startswith("/"):
        return None  # vsock: and other schemes are not for a host daemon
    return path


def sd_notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (newline-separated ``KEY=VALUE``); True when a datagram went out.

    A failure is logged, never raised: a broken notify socket must not kill the daemon
    (systemd then restarts it for not being ready, which is the right outcome).
    """
    address = _address(os.environ if env is None else env)
    if address is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode("utf-8"))
    except OSError as exc:
        _log.warning("sd_notify(%s) failed: %s", state.split("\n", 1)[0], exc)
        return False
    return True


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between pings (half of ``WatchdogSec``), or None when no watchdog is armed.

    ``WATCHDOG_PID`` names the process systemd watches; another process must not ping.
    """
    e = os.environ if env is None else env
    usec = e.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    pid = e.get("WATCHDOG_PID", "")
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 1e6 / 2


class Notifier:
    """READY/STATUS/STOPPING and the watchdog for one daemon run."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self._env = dict(os.environ if env is None else env)
        self.enabled = _address(self._env) is not None
        self.pings = 0

    def ready(self, status: str = "") -> bool:
        return sd_notify("READY=1" + (f"\nSTATUS={status}" if status else ""), self._env)

    def status(self, status: str) -> bool:
        return sd_notify(f"STATUS={status}", self._env)

    def stopping(self) -> bool:
        return sd_notify("STOPPING=1", self._env)

    async def run_watchdog(self) -> None:
        """Ping from the event loop itself: a loop stuck in a blocking call stops pinging,
        and systemd restarts the daemon (which is the point of ``WatchdogSec``)."""
        interval = watchdog_interval(self._env)
        if interval is None or not self.enabled:
            return
        while True:
            if sd_notify("WATCHDOG=1", self._env):
                self.pings += 1
            await anyio.sleep(interval)


__all__ = ["Notifier", "sd_notify", "watchdog_interval"]
