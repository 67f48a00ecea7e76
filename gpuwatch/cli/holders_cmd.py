"""``gpuwatch holders``: the processes keeping the card's device nodes open, which a switch
away from the card's driver would wait on forever. gpuwatch names them; it never kills them."""

from __future__ import annotations

import argparse

from gpuwatch.cli.common import EXIT_OK, add_root_args, check_root, config_of
from gpuwatch.cli.daemon import add_daemon_args, ask_daemon, expect_shape
from gpuwatch.cli.fast import is_holders_report, print_holders
from gpuwatch.cli.mode_cmd import add_target_args, target_of
from gpuwatch.jsonout import dumps
from gpuwatch.model import holders_report, scan
from gpuwatch.switch.hostops import make_backend


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "holders",
        description="Every process with an open file on, or a mapping of, a node of the card: "
                    "/dev/nvidia*, its /dev/dri card and render nodes, its audio function's "
                    "/dev/snd nodes and /dev/vfio/N (under another name too, such as a "
                    "container's renamed node: matched by its device number).")
    add_target_args(p)
    add_root_args(p)
    add_daemon_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    addr, vendor = target_of(args)
    check_root(args.root)
    # The daemon runs as root: it can read every process's fds, which we may not.
    answer = ask_daemon(args, lambda c: expect_shape(c.holders(addr=addr, vendor=vendor),
                                                     is_holders_report, c))
    if answer is not None:
        report = answer.value
    else:
        report = holders_report(scan(args.root, config_of(args)), addr=addr, vendor=vendor,
                                euid=make_backend(args.root, host_namespaces=False).geteuid())
    print_holders(report, args.json, dumps)
    return EXIT_OK
