"""``gpuwatch probe ACTION``: one probe answer as ``{"action", "result"}`` JSON on stdout."""

from __future__ import annotations

import argparse

from gpuwatch.cli.common import EXIT_OK, add_root_args, check_root, config_of
from gpuwatch.cli.daemon import add_daemon_args, ask_daemon, expect_shape
from gpuwatch.cli.fast import is_probe_result
from gpuwatch.jsonout import dumps
from gpuwatch.model import ACTIONS, check_params, probe, scan


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("probe",
                              description="Answer one probe action as JSON (docs/probes.md).")
    p.add_argument("action", metavar="ACTION", help="one of: " + ", ".join(ACTIONS))
    add_root_args(p)
    p.add_argument("--group", type=int, metavar="N", help="IOMMU group (vfio-group-accessible)")
    p.add_argument("--addr", metavar="ADDR", help="PCI address DDDD:BB:DD.F")
    p.add_argument("--mode", metavar="MODE", help="vfio or nvidia (group-in-mode, plan)")
    p.add_argument("--vendor", metavar="VENDOR", help="PCI vendor id such as 0x10de (plan)")
    p.add_argument("--fresh", action="store_true",
                   help="scan anew for this answer instead of answering from the model")
    add_daemon_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Validate before touching the host: a bad request is exit 2 even on a broken root.
    check_params(args.action, args.group, args.addr, args.mode, args.vendor)
    check_root(args.root)
    kwargs = {"group": args.group, "addr": args.addr, "mode": args.mode}
    if args.fresh:
        result = probe(args.action, args.root, config_of(args), vendor=args.vendor, **kwargs)
    else:
        # memlock is this process's own limit: no daemon can answer it better than we can;
        # a plan is read live from the host (holders, modules), so it is made here too.
        # An answer in no shape the action has (docs/probes.md) is no answer: scan directly.
        answer = None if args.action in ("memlock", "plan") else ask_daemon(
            args, lambda c: expect_shape(c.probe(args.action, **kwargs),
                                         lambda r: is_probe_result(args.action, r), c))
        if answer is not None:
            result = answer.value
        else:
            result = scan(args.root, config_of(args)).probe(args.action, vendor=args.vendor,
                                                        **kwargs)
    print(dumps({"action": args.action, "result": result}))
    return EXIT_OK
