"""``gpuwatch service install|uninstall``: run this gpuwatch as the host's systemd service.

The unit's ``ExecStart=`` names the gpuwatch running this command, wherever pip, pipx or a
venv put it, so the unit never points at a program that is not there (docs/service.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from gpuwatch.cli.common import EXIT_OK, check_root
from gpuwatch.errors import OutputFailed


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "service",
        description="Install or remove gpuwatch as the host's systemd service: the unit (its "
                    "ExecStart= naming this gpuwatch), the udev rules for /dev/vfio, "
                    "/etc/gpuwatch/config.yaml when absent and the gpuwatch and kvm groups "
                    "when missing. Every file written and command run is printed.")
    verbs = p.add_subparsers(dest="verb", metavar="install|uninstall")
    verbs.required = True
    install = verbs.add_parser(
        "install", help="write the unit, udev rules, config and groups",
        description="Write the systemd unit, the udev rules, /etc/gpuwatch/config.yaml (only "
                    "when absent) and the gpuwatch and kvm groups (only when missing).")
    _common(install)
    install.add_argument("--now", action="store_true",
                         help="also run systemctl daemon-reload, systemctl try-restart gpuwatch "
                              "when it replaced the unit, systemctl enable --now gpuwatch "
                              "(and reload udev's rules)")
    install.set_defaults(func=run_install)
    uninstall = verbs.add_parser(
        "uninstall", help="stop the service and remove what install wrote",
        description="Stop and disable the service and remove the unit and udev rules, and the "
                    "config unless it was edited. The event log (/var/log/gpuwatch), the state "
                    "(/var/lib/gpuwatch) and the groups are kept.")
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
    pipx link in /usr/local/bin survives upgrades), else this interpreter with ``-m``. The
    paths are the program's, the interpreter's and the package's: an editable install
    (``pip install -e``) imports gpuwatch from its checkout, in a home directory or /tmp
    while the script and the interpreter are elsewhere, and a unit that hides it
    (``ProtectHome=yes``, ``PrivateTmp=yes``) fails at every start with no module to import.
    """
    import gpuwatch

    argv0 = sys.argv[0] if sys.argv else ""
    if (os.path.basename(argv0) == "gpuwatch" and os.path.isfile(argv0)
            and os.access(argv0, os.X_OK)):
        program = os.path.abspath(argv0)
        argv: tuple[str, ...] = (program,)
    else:
        program = os.path.abspath(sys.executable)
        argv = (program, "-m", "gpuwatch")
    seen = (os.path.realpath(program), os.path.realpath(sys.executable),
            os.path.realpath(os.path.dirname(gpuwatch.__file__)))
    return argv, tuple(dict.fromkeys(seen))


class _Progress:
    """The steps' lines on stdout for as long as it takes them. A reader that leaves
    (``| head -1``) or a stdout that fails (a full disk) must not stop an install or an
    uninstall half way, nor skip its roll-back: the lines stop, the work runs to its end,
    and the exit status is the work's."""

    def __init__(self) -> None:
        #: Why stdout stopped taking lines ("" for a reader that left), None while it takes them.
        self.lost: str | None = None

    def __call__(self, line: str) -> None:
        if self.lost is not None:
            return
        try:
            print(line, flush=True)  # flushed: a failure shows here, not at exit
        except BrokenPipeError:
            self._stop("")
        except OutputFailed as exc:
            self._stop(str(exc))

    def _stop(self, why: str) -> None:
        """What stdout still holds goes to /dev/null (Python's advice for EPIPE), so the
        flush at exit neither fails nor turns the work's exit status into 0."""
        self.lost = why
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, sys.stdout.fileno())
            finally:
                os.close(devnull)

    def warn(self) -> None:
        """A write failure is said once on stderr; a reader that left is no failure."""
        if self.lost:
            print(f"gpuwatch: warning: {self.lost} (the steps went on, unreported)",
                  file=sys.stderr)


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
        replaces_unit,
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
    say = _Progress()
    try:
        execute(steps, root, dry_run=args.dry_run, say=say)
        if not args.now and host and replaces_unit(facts):
            # Run again with --now, install would find the unit already so: no restart.
            say("next: systemctl daemon-reload && systemctl try-restart gpuwatch && "
                "systemctl enable --now gpuwatch (a daemon already running keeps the old "
                "unit until restarted)")
        elif not args.now and host:
            say("next: systemctl daemon-reload && systemctl enable --now gpuwatch "
                "(or run this again with --now)")
    finally:
        say.warn()
    return EXIT_OK


def run_uninstall(args: argparse.Namespace) -> int:
    from gpuwatch.service.install import execute, gather_facts, plan_uninstall

    root, _ = _prepare(args)
    say = _Progress()
    try:
        execute(plan_uninstall(gather_facts(root)), root, dry_run=args.dry_run, say=say)
    finally:
        say.warn()
    return EXIT_OK
