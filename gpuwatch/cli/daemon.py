"""CLI commands that ask the running daemon when one answers, and scan directly otherwise.

``--socket PATH`` names the daemon; without it the default socket is tried only for the host
root (``--root /``): a fixture root must never be answered by the host's daemon. ``--config``
and ``--no-daemon`` force a direct scan (the daemon answers with its own tables).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from gpuwatch.cli.fast import UNANSWERED, socket_path
from gpuwatch.errors import SERVICE, GpuwatchError, HostError

if TYPE_CHECKING:
    from gpuwatch.service.client import Client

T = TypeVar("T")

#: A daemon answers from memory in microseconds; one that takes this long is stuck.
CLI_TIMEOUT = 10.0


def add_daemon_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", default=None, metavar="PATH",
                        help="ask the gpuwatch daemon at PATH (default: /run/gpuwatch/"
                             "gpuwatch.sock when --root is /)")
    parser.add_argument("--no-daemon", action="store_true",
                        help="scan directly even when a daemon answers")


def daemon_from_args(args: argparse.Namespace) -> Client | None:
    if getattr(args, "config", None) or getattr(args, "fresh", False):
        return None
    if getattr(args, "no_daemon", False):
        return None
    # No socket file, no daemon: decided with the stdlib, so a direct scan never pays for
    # importing the client and its protocol (a cold ``gpuwatch probe`` without a daemon).
    path = socket_path(getattr(args, "root", "/"), getattr(args, "socket", None))
    if path is None or not os.path.exists(path) or path in UNANSWERED:
        return None  # (one that did not answer the fast path in time is not waited on twice)
    from gpuwatch.service.client import try_daemon

    return try_daemon(getattr(args, "socket", None), bool(getattr(args, "no_daemon", False)),
                      root=getattr(args, "root", "/"), timeout=CLI_TIMEOUT)


@dataclass(frozen=True)
class DaemonAnswer(Generic[T]):
    value: T


class DaemonLost(HostError):
    """The daemon stopped answering while it was changing the host: doing it again here
    could race its switch, so the command stops and says so (exit 1)."""

    code = SERVICE


def ask_daemon(args: argparse.Namespace, call: Callable[[Client], T], *,
               mutating: bool = False) -> DaemonAnswer[T] | None:
    """``call(client)`` on the daemon, or None when the command should do the work itself:
    no daemon, a refusal (not in the socket group, or no connection to spare), and, for
    reads, a broken connection, a timeout or an answer in no shape gpuwatch answers (the
    ``call`` fails on it, or `expect_shape` refuses it). Other error replies are raised
    (`DaemonUsageError` is a `UsageError`, `DaemonDeviceNotFound` a `DeviceNotFound`, the
    rest `GpuwatchError`s: exit 1).

    ``mutating`` (switch, recover): once the request may have reached the daemon, a lost
    connection is `DaemonLost`, never a second attempt of our own.
    """
    client = daemon_from_args(args)
    if client is None:
        return None
    from gpuwatch.service.client import DaemonError, DaemonUnavailable
    from gpuwatch.service.protocol import PERMISSION_DENIED, TOO_MANY_CLIENTS, UNAVAILABLE

    with client:
        try:
            return DaemonAnswer(call(client))
        except (DaemonUnavailable, TimeoutError) as exc:
            if mutating:
                raise DaemonLost(f"the daemon at {client.path} stopped answering during the "
                                 f"request ({exc}); see `gpuwatch status` and its log") from None
            return None
        except DaemonError as exc:
            if mutating and exc.code == TOO_MANY_CLIENTS:
                # A daemon is running: a switch done here would race its own, and a wedge
                # here would never reach its memory. It is busy, not gone: retry.
                raise DaemonLost(f"the daemon at {client.path} is serving as many clients as "
                                 f"it may ({exc.message or exc.code}); retry") from None
            if exc.code in (PERMISSION_DENIED, TOO_MANY_CLIENTS, UNAVAILABLE):  # cannot help
                return None
            raise
        except GpuwatchError:
            raise
        except (TypeError, KeyError, IndexError, AttributeError, ValueError):
            # A reply in no shape gpuwatch answers (a hostile or foreign socket): as one
            # that does not speak the protocol, a read scans directly.
            if mutating:
                raise
            return None


def expect_shape(value: T, ok: Callable[[Any], bool], client: Client) -> T:
    """``value`` when ``ok(value)``; else the daemon does not speak the protocol, so a read
    goes on without it (`ask_daemon`) instead of failing half-way through printing it."""
    if not ok(value):
        from gpuwatch.service.client import DaemonUnavailable

        raise DaemonUnavailable(f"{client.path} does not speak the gpuwatch protocol")
    return value


__all__ = [
    "CLI_TIMEOUT",
    "DaemonAnswer",
    "DaemonLost",
    "add_daemon_args",
    "ask_daemon",
    "daemon_from_args",
    "expect_shape",
]
