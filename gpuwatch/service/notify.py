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
import struct
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


#: How long ``READY=1`` and ``STOPPING=1`` may wait for room in a full notify queue (systemd
#: busy at boot, when every unit notifies at once): dropped, READY=1 would have systemd time
#: the start out and restart a daemon that was serving. Pings and status lines never wait.
ESSENTIAL_WAIT = 2.0


def _send(state: str, address: str, wait: float = 0.0) -> None:
    """One datagram. With no ``wait`` it never waits: the socket is non-blocking, so a notify
    socket whose queue is full (its reader busy or gone) refuses at once (``EAGAIN``) instead
    of stopping the event loop, and with it the socket API and the daemon's own stop, until
    it drains. With a ``wait``, the kernel holds the send that long at most
    (``SO_SNDTIMEO``) for room in the queue, then refuses."""
    data = state.encode("utf-8")
    kind = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
    if wait <= 0:
        kind |= socket.SOCK_NONBLOCK
    with socket.socket(socket.AF_UNIX, kind) as sock:
        if wait > 0:
            sec, usec = int(wait), int((wait % 1) * 1_000_000)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                            struct.pack("@ll", sec, usec))
        if sock.sendto(data, address) != len(data):
            raise OSError(f"sent {len(data)} bytes only in part")


def sd_notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (newline-separated ``KEY=VALUE``); True when a datagram went out.

    A failure is logged, never raised, and never waited out: a broken or full notify socket
    must not kill or stall the daemon (systemd then restarts it for not being ready, or for
    missed watchdog pings, which is the right outcome).
    """
    address = _address(os.environ if env is None else env)
    if address is None:
        return False
    try:
        _send(state, address)
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
        self._address = _address(self._env)
        self.enabled = self._address is not None
        self.pings = 0
        #: A notify socket that keeps failing (gone, full) is said once, not at every ping;
        #: the first success after it is said too.
        self._failing = False

    def _notify(self, state: str, wait: float = 0.0) -> bool:
        if self._address is None:
            return False
        try:
            _send(state, self._address, wait)
        except OSError as exc:
            if not self._failing:
                _log.warning("sd_notify(%s) failed: %s (not said again until it works)",
                             state.split("\n", 1)[0], exc)
            self._failing = True
            return False
        if self._failing:
            _log.warning("sd_notify(%s) works again", state.split("\n", 1)[0])
        self._failing = False
        return True

    def ready(self, status: str = "") -> bool:
        return self._notify("READY=1" + (f"\nSTATUS={status}" if status else ""), ESSENTIAL_WAIT)

    def status(self, status: str) -> bool:
        return self._notify(f"STATUS={status}")

    def stopping(self) -> bool:
        return self._notify("STOPPING=1", ESSENTIAL_WAIT)

    async def run_watchdog(self) -> None:
        """Ping from the event loop itself: a loop stuck in a blocking call stops pinging,
        and systemd restarts the daemon (which is the point of ``WatchdogSec``)."""
        interval = watchdog_interval(self._env)
        if interval is None or not self.enabled:
            return
        while True:
            if self._notify("WATCHDOG=1"):
                self.pings += 1
            await anyio.sleep(interval)


__all__ = ["Notifier", "sd_notify", "watchdog_interval"]
