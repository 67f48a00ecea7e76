"""``gpuwatch recover``: after a wedge, rebind the whole group to vfio-pci and clear the poison.

Unless a task is still stuck in the nvidia driver: then a bind would only add a second stuck
task, so recover reports that a reboot is required and touches nothing.
"""

from __future__ import annotations

import argparse

from gpuwatch.cli.common import (
    EXIT_OK,
    add_root_args,
    check_root,
    config_of,
    positive_seconds,
)
from gpuwatch.cli.daemon import add_daemon_args, ask_daemon
from gpuwatch.cli.mode_cmd import (
    add_target_args,
    print_result,
    run_switch,
    stopped_before_switch,
    target_of,
)
from gpuwatch.core.plan import NVIDIA_VENDOR, find_card, switch_guard
from gpuwatch.errors import NotPrivileged, RebootRequired, SwitchRefused
from gpuwatch.hostfs.wedge import scan_wedge
from gpuwatch.model import scan
from gpuwatch.switch.engine import DEFAULT_TIMEOUT, SwitchResult
from gpuwatch.switch.hostops import make_backend


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "recover",
        description="If a task is stuck in the nvidia driver, say a reboot is required and "
                    "touch nothing; otherwise rebind every function of the group to vfio-pci "
                    "and clear its poison. Root only.")
    add_target_args(p)
    p.add_argument("--timeout", type=positive_seconds, default=DEFAULT_TIMEOUT, metavar="S",
                   help=f"bound of the rebind in seconds (default {DEFAULT_TIMEOUT:g})")
    add_root_args(p)
    add_daemon_args(p)
    p.add_argument("--log", default=None, metavar="PATH|-", help="append the events to this log")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """A signal before the rebind begins (the scan, the wedge check) stops it with nothing
    touched, exit 128 + the signal, as `gpuwatch mode` does (`stopped_before_switch`)."""
    return stopped_before_switch(lambda _switch_over: _run(args))


def _run(args: argparse.Namespace) -> int:
    addr, vendor = target_of(args)
    check_root(args.root)
    if args.log is None:
        # A running daemon owns the switch lock and the log: let it do the work.
        answer = ask_daemon(args, lambda c: c.recover(addr=addr, vendor=vendor), mutating=True)
        if answer is not None:
            print_result(SwitchResult.model_validate(answer.value), args.json)
            return EXIT_OK
    model = scan(args.root, config_of(args))
    card, _members = find_card(model.state, addr=addr, vendor=vendor)
    guard = switch_guard(card, "vfio", action="recover")
    if guard is not None:  # not an NVIDIA card: refused before anything, root or not
        raise SwitchRefused(guard.reason)
    backend = make_backend(args.root, config=config_of(args))
    if backend.geteuid() != 0:
        raise NotPrivileged("recover needs root (it writes to sysfs and loads modules)")
    wedge = scan_wedge(model.root, deadline=model.proc_deadline)
    if wedge.wedged:
        raise RebootRequired(f"{wedge.describe()}: a reboot is required; nothing was touched")
    if not wedge.complete:
        raise SwitchRefused(f"{wedge.describe()}; not touching the device")
    result = run_switch(args, backend, "recover", addr or vendor or NVIDIA_VENDOR, None)
    if isinstance(result, int):
        return result
    print_result(result, args.json)
    return EXIT_OK
