"""``gpuwatch service install|uninstall``: run this gpuwatch as the host's systemd service.

The unit's ``ExecStart=`` names the gpuwatch running this command, wherever pip, pipx or a
venv put it, so the unit never points at a program that is not there (docs/service.md).
"""

from __future__ import annotations

import argparse
import os
import sys

from gpuwatch.cli.common import EXIT_OK, check_root


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "service",
        description="Install or remove gpuwatch as the host's systemd service: the unit (its "
                    "ExecStart= naming this gpuwatch), the udev rules for /dev/vfio, "
                    "/etc/gpuwatch/config.yaml when absent and the gpuwatch group when "
                    "missing. Every file written and command run is printed.")
    verbs = p.add_subparsers(dest="verb", metavar="install|uninstall")
    verbs.required = True
    install = verbs.add_parser(
        "install", help="write the unit, udev rules, config and group",
        description="Write the systemd unit, the udev rules, /etc/gpuwatch/config.yaml (only "
                    "when absent) and the gpuwatch group (only when missing).")
    _common(install)
    install.add_argument("--now", action="store_true",
                         help="also run systemctl daemon-reload and systemctl enable --now "
                              "gpuwatch (and reload udev's rules)")
    install.set_defaults(func=run_install)
    uninstall = verbs.add_parser(
        "uninstall", help="stop the service and remove what install wrote",
        description="Stop and disable the service and remove the unit and udev rules, and the "
                    "config unless it was edited. The event log (/var/log/gpuwatch), the state "
                    "(/var/lib/gpuwatch) and the group are kept.")
    _common(uninstall)
    uninstall.set_defaults(func=run_uninstall)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", default="/", metavar="DIR",
                   help="install into DIR instead of the running system (a fixture or an "
                        "image being built); nothing outside DIR changes")
    p.add_argument("--dry-run", action="store_true",
                   help="print what would be written and run, change nothing")


def running_gpuwatch() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(argv that starts this gpuwatch, paths the service must be able to see)``.

    The console script when that is what runs (pip, pipx, a venv: its path as invoked, so a
    pipx link in /usr/local/bin survives upgrades), else this interpreter with ``-m``.
    """
    argv0 = sys.argv[0] if sys.argv else ""
    if (os.path.basename(argv0) == "gpuwatch" and os.path.isfile(argv0)
            and os.access(argv0, os.X_OK)):
        program = os.path.abspath(argv0)
        argv: tuple[str, ...] = (program,)
    else:
        program = os.path.abspath(sys.executable)
        argv = (program, "-m", "gpuwatch")
    seen = (os.path.realpath(program), os.path.realpath(sys.executable))
    return argv, tuple(dict.fromkeys(seen))


def _prepare(args: argparse.Namespace) -> tuple[str, bool]:
    from gpuwatch.service.install import InstallError

    check_root(args.root)
    root = os.path.abspath(args.root)
    host = os.path.normpath(root) == "/"
    if host and not args.dry_run and os.geteuid() != 0:
        raise InstallError(f"service {args.verb} changes /etc and runs systemctl: run it as root "
                           f"(sudo {' '.join(running_gpuwatch()[0])} service {args.verb}), or "
                           f"add --dry-run to see what it would do")
    return root, host


def run_install(args: argparse.Namespace) -> int:
    from gpuwatch.service.install import (
        InstallError,
        check_program,
        execute,
        gather_facts,
        plan_install,
    )

    root, host = _prepare(args)
    exec_argv, seen = running_gpuwatch()
    if host:  # a tree being built (--root) runs its programs elsewhere: nothing to check
        try:
            check_program((exec_argv[0], *seen))
        except InstallError as exc:
            if not args.dry_run:
                raise
            print(f"gpuwatch: warning: {exc}", file=sys.stderr)
    if os.environ.get("PYTHONPATH"):
        print("gpuwatch: note: PYTHONPATH is set here but the service does not inherit it",
              file=sys.stderr)
    facts = gather_facts(root, (*exec_argv, ), seen)
    steps = plan_install(facts, now=args.now)
    execute(steps, root, dry_run=args.dry_run)
    if not args.now and host:
        print("next: systemctl daemon-reload && systemctl enable --now gpuwatch "
              "(or run this again with --now)")
    return EXIT_OK


def run_uninstall(args: argparse.Namespace) -> int:
    from gpuwatch.service.install import execute, gather_facts, plan_uninstall

    root, _ = _prepare(args)
    execute(plan_uninstall(gather_facts(root)), root, dry_run=args.dry_run)
    return EXIT_OK
