"""``gpuwatch health``: does the daemon answer? For readiness and liveness probes.

A probe that asks the daemon a question, rather than checking that a process exists, fails
when the event loop is stuck: the daemon answers probes from that loop. Stdlib and the small
client only, so a probe run every few seconds stays cheap.
"""

from __future__ import annotations

import argparse
import time

from gpuwatch.cli.common import EXIT_FAILURE, EXIT_OK, fail, positive_seconds

#: Asked of the daemon: answered from memory, so it measures the loop, not the host.
HEALTH_ACTION = "detect-vfio"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "health",
        description="Ask the gpuwatch daemon one question over its socket; exit 0 when it "
                    "answers within the timeout, 1 when it does not (not running, not ready, "
                    "stuck, or this user may not ask it).")
    p.add_argument("--socket", default=None, metavar="PATH",
                   help="the daemon's socket (default $GPUWATCH_SOCKET, else "
                        "/run/gpuwatch/gpuwatch.sock)")
    p.add_argument("--timeout", type=positive_seconds, default=5.0, metavar="S",
                   help="seconds to wait for the answer (default 5)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing when healthy")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gpuwatch.service.client import Client, DaemonError, DaemonUnavailable

    start = time.monotonic()
    try:
        with Client(args.socket, timeout=args.timeout) as client:
            client.probe(HEALTH_ACTION)
            path = client.path
    except (DaemonUnavailable, DaemonError, TimeoutError, OSError) as exc:
        return fail(f"health: {exc}", EXIT_FAILURE)
    if not args.quiet:
        print(f"ok: the daemon at {path} answered in "
              f"{(time.monotonic() - start) * 1000:.1f} ms")
    return EXIT_OK
