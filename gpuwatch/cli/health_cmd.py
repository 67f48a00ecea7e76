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
                   help="seconds the whole check may take, connect and answer "
                        "(default 5)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing when healthy")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """One deadline for the whole check: the connect (a full listen backlog waits for room)
    and the answer together take at most ``--timeout``, so a probe whose own limit is a
    little longer always gets this line, never kubelet's silent kill."""
    from gpuwatch.service.client import (
        Client,
        DaemonError,
        DaemonUnavailable,
        default_socket_path,
    )

    start = time.monotonic()
    deadline = start + args.timeout
    path = args.socket or default_socket_path()
    try:
        with Client(args.socket, timeout=args.timeout) as client:
            path = client.path
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            client.call("probe", {"action": HEALTH_ACTION}, timeout=left)
    except TimeoutError:
        return fail(f"health: the daemon at {path} did not answer within "
                    f"{args.timeout:g} s", EXIT_FAILURE)
    except (DaemonUnavailable, DaemonError, OSError) as exc:
        return fail(f"health: {exc}", EXIT_FAILURE)
    if not args.quiet:
        print(f"ok: the daemon at {path} answered in "
              f"{(time.monotonic() - start) * 1000:.1f} ms")
    return EXIT_OK
