"""``gpuwatch watch``: keep the model current and write every change event as a JSONL line."""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import anyio

from gpuwatch.cli.common import EXIT_OK, EXIT_USAGE, add_root_args, check_root, fail
from gpuwatch.sources import SourceUnavailable
from gpuwatch.watch.watcher import DEFAULT_RECONCILE_INTERVAL, open_watcher


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("watch", help="watch the host and log change events as JSON lines",
                              description="Follow kernel uevents, keep the host model current and "
                                          "write every change event as one JSON line.")
    add_root_args(p)
    add_source_arg(p)
    p.add_argument("--log", default="-", metavar="PATH|-", help="event log file, - for stdout (default)")
    p.add_argument("--log-max-bytes", type=_positive_int, default=None, metavar="N",
                   help="rotate the log before it grows past N bytes")
    p.add_argument("--log-keep", type=_positive_int, default=5, metavar="K",
                   help="rotated files to keep, PATH.1 … PATH.K (default 5)")
    p.add_argument("--reconcile-interval", type=_non_negative_float, default=DEFAULT_RECONCILE_INTERVAL,
                   metavar="S", help="full rescan every S seconds to catch drift (default 300, 0 = off)")
    p.add_argument("-v", "--verbose", action="store_true", help="log source details to stderr")
    p.set_defaults(func=run)


def add_source_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", default="auto", metavar="auto|udev|kernel|file:PATH",
                   help="where uevents come from (default auto: udev if udevd runs, else kernel)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must not be negative")
    return value


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(stream=sys.stderr, level=logging.INFO if verbose else logging.WARNING,
                        format="gpuwatch: %(message)s")


async def watch(args: argparse.Namespace) -> None:
    """Run until SIGINT/SIGTERM or the end of a file source; the event in hand is finished first
    (publishing never awaits, so cancellation can only land between events)."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with open_watcher(
            args.root, args.source, config=args.config, log=args.log,
            log_max_bytes=args.log_max_bytes, log_keep=args.log_keep,
            reconcile_interval=args.reconcile_interval,
        ) as watcher, anyio.create_task_group() as tg:

            async def stop_on_signal() -> None:
                async for _ in signals:
                    tg.cancel_scope.cancel()
                    return

            tg.start_soon(stop_on_signal)
            await watcher.source_ended.wait()
            tg.cancel_scope.cancel()


def run(args: argparse.Namespace) -> int:
    check_root(args.root)
    setup_logging(args.verbose)
    try:
        anyio.run(watch, args)
    except SourceUnavailable as exc:
        return fail(str(exc), EXIT_USAGE)
    return EXIT_OK
