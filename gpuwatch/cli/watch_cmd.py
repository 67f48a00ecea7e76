"""``gpuwatch watch``: keep the model current, log every change event as a JSONL line, and
(as the host's service) serve the socket, metrics and the NFD features file.

Every option can also come from the environment (``GPUWATCH_<OPTION>``) or the config file;
a flag wins over both (gpuwatch/settings.py, docs/service.md).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any

import anyio

from gpuwatch.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    check_root,
    fail,
    non_negative_seconds,
    positive_int,
    positive_seconds,
)
from gpuwatch.host import open_host
from gpuwatch.service.protocol import DEFAULT_SOCKET_PATH
from gpuwatch.settings import SETTINGS, WatchSettings, load_settings
from gpuwatch.sources import SourceUnavailable


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "watch", help="watch the host and log change events as JSON lines",
        description="Follow kernel uevents, keep the host model current and write every change "
                    "event as one JSON line; optionally serve it on a Unix socket, as Prometheus "
                    "metrics and as a node-feature-discovery file. Options also come from "
                    "GPUWATCH_<OPTION> environment variables and the config file "
                    "(/etc/gpuwatch/config.yaml); a flag wins over both.")
    # Defaults are None so that "not given" can be told apart: the settings loader fills in
    # environment, file and default values below a flag.
    p.add_argument("--root", default=None, metavar="DIR",
                   help="host root holding sys/, proc/, dev/ (default /; a fixture for tests)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="YAML file with watch options and data tables "
                        "(default $GPUWATCH_CONFIG, else /etc/gpuwatch/config.yaml if present)")
    p.add_argument("--source", default=None, metavar="auto|udev|kernel|file:PATH",
                   help="where uevents come from (default auto = kernel; udev needs udevd)")
    p.add_argument("--log", default=None, metavar="PATH|-",
                   help="event log file, - for stdout (default)")
    p.add_argument("--log-max-bytes", type=positive_int, default=None, metavar="N",
                   help="rotate the log before it grows past N bytes")
    p.add_argument("--log-keep", type=positive_int, default=None, metavar="K",
                   help="rotated files to keep, PATH.1 … PATH.K (default 5)")
    p.add_argument("--reconcile-interval", type=non_negative_seconds, default=None, metavar="S",
                   help="full rescan every S seconds to catch drift (default 300, 0 = off)")
    p.add_argument("--socket", nargs="?", const=DEFAULT_SOCKET_PATH, default=None, metavar="PATH",
                   help="serve the socket API (docs/socket.md) at PATH "
                        f"(default {DEFAULT_SOCKET_PATH} when given without PATH)")
    p.add_argument("--socket-group", default=None, metavar="GROUP",
                   help="group that may read through the socket (default gpuwatch if it exists, "
                        "else root only)")
    p.add_argument("--switch-group", default=None, metavar="GROUP",
                   help="group that may also switch and recover through the socket "
                        "(default: root only)")
    p.add_argument("--metrics", default=None, metavar="ADDR",
                   help="serve Prometheus metrics at http://ADDR/metrics (HOST:PORT, :PORT)")
    p.add_argument("--nfd-features", default=None, metavar="PATH",
                   help="keep a node-feature-discovery features file current (a features.d/ "
                        "directory gets the file 'gpuwatch')")
    p.add_argument("--nfd-expiry", type=non_negative_seconds, default=None, metavar="S",
                   help="NFD labels expire S seconds after the last write "
                        "(default 3600, 0 = never)")
    p.add_argument("--proc-read-timeout", type=positive_seconds, default=None, metavar="S",
                   help="budget of one /proc scan for holders and stuck tasks, in seconds "
                        "(default 2); a process not read in time counts as a holder")
    p.add_argument("-v", "--verbose", action="store_true", default=None,
                   help="log source details to stderr")
    p.set_defaults(func=run)


def add_source_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", default="auto", metavar="auto|udev|kernel|file:PATH",
                   help="where uevents come from (default auto = kernel; udev needs udevd)")


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO if verbose else logging.WARNING,
                        format="gpuwatch: %(message)s")


def settings_from_args(args: argparse.Namespace) -> WatchSettings:
    """Flags given on the command line over environment, file and defaults."""
    flags: dict[str, Any] = {s.key: getattr(args, s.key, None) for s in SETTINGS}
    return load_settings(flags, config=args.config)


async def watch(settings: WatchSettings) -> None:
    """Run until SIGINT/SIGTERM or the end of a file source; the event in hand is finished first
    (publishing never awaits, so cancellation can only land between events)."""
    from gpuwatch.service.daemon import run_services

    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_host(
            settings.root, source=settings.source, config=settings.tables(), log=settings.log,
            log_max_bytes=settings.log_max_bytes, log_keep=settings.log_keep,
            reconcile_interval=settings.reconcile_interval,
        ) as host, run_services(host, settings), anyio.create_task_group() as tg:
            host.watcher.model.proc_deadline = settings.proc_read_timeout

            async def stop_on_signal() -> None:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

            tg.start_soon(stop_on_signal)
            await host.source_ended.wait()
            tg.cancel_scope.cancel()


def _first_leaf(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups: the CLI reports one line."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    check_root(settings.root)
    setup_logging(settings.verbose)
    try:
        anyio.run(watch, settings)
    except SourceUnavailable as exc:
        return fail(str(exc), EXIT_USAGE)
    except BaseExceptionGroup as group:
        leaf = _first_leaf(group)
        if isinstance(leaf, SourceUnavailable):
            return fail(str(leaf), EXIT_USAGE)
        if isinstance(leaf, Exception):
            raise leaf from None  # main() maps it to its exit code, in one line
        raise
    return EXIT_OK
