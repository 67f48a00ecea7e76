"""``gpuwatch plan [vfio|nvidia]``: the exact steps a switch would take on this host, run none.

Every write with its file and value and every command, in order: what ``gpuwatch mode``
would execute now. On a host without a matching card it plans for the documented example
card, and says so.
"""

from __future__ import annotations

import argparse
from typing import Any

from gpuwatch.cli.common import add_root_args, check_root, config_of
from gpuwatch.cli.daemon import add_daemon_args, ask_daemon, expect_shape
from gpuwatch.cli.fast import is_plan, print_plan
from gpuwatch.cli.mode_cmd import (
    add_force_arg,
    add_target_args,
    add_vfio_driver_arg,
    load_poison,
    target_of,
    vfio_driver_of,
)
from gpuwatch.core.modes import MODES, Mode
from gpuwatch.core.plan import default_mode, find_card, parse_mode
from gpuwatch.jsonout import dumps
from gpuwatch.model import plan_for_host, scan
from gpuwatch.switch.hostops import make_backend


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "plan",
        description="Print the ordered writes and commands `gpuwatch mode MODE` would run on "
                    "this host now. Needs no privilege and changes nothing.")
    p.add_argument("mode", nargs="?", choices=MODES,
                   help="vfio or nvidia (default: out of the group's current mode)")
    add_target_args(p)
    add_vfio_driver_arg(p)
    add_root_args(p)
    add_daemon_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_force_arg(p)
    p.add_argument("--example", action="store_true",
                   help="plan for the documented example card (display 0000:01:00.0, audio "
                        "0000:01:00.1, group 1) instead of this host's; the plan says "
                        "\"example\": true")
    p.set_defaults(func=run)


def _local_plan(args: argparse.Namespace, mode: Mode | None, addr: str | None,
                vendor: str | None, vfio_driver: str | None = None) -> dict[str, Any]:
    model = scan(args.root, config_of(args))
    if args.example:
        mode = mode or "vfio"
    elif mode is None:
        mode = default_mode(find_card(model.state, addr=addr, vendor=vendor)[1])
    load_poison(model)
    backend = make_backend(args.root, config=config_of(args))
    plan = plan_for_host(model, mode, addr=addr, vendor=vendor, euid=backend.geteuid(),
                         which=backend.ops.which, force=args.force, vfio_driver=vfio_driver,
                         example=args.example)
    return plan.to_json()


def run(args: argparse.Namespace) -> int:
    addr, vendor = target_of(args)
    mode: Mode | None = parse_mode(args.mode) if args.mode is not None else None
    if args.vfio_driver is not None and mode is None:
        mode = "vfio"  # naming a VFIO driver says where the card is going
    vfio_driver = vfio_driver_of(args, mode)
    check_root(args.root)
    # The daemon runs as root and sees every holder; a plan made here may not.
    answer = ask_daemon(args, lambda c: expect_shape(
        c.plan(mode, addr=addr, vendor=vendor, force=args.force or None,
               vfio_driver=vfio_driver), is_plan, c)) if mode and not args.example else None
    plan = (answer.value if answer is not None
            else _local_plan(args, mode, addr, vendor, vfio_driver))
    return print_plan(plan, args.json, dumps)
