"""Entry point of the ``gpuwatch`` command: parse, dispatch, and map errors to exit codes.

Nothing escapes as a traceback: every error becomes one line on stderr and a documented
exit code (docs/probes.md "Exit codes and errors"). ``GPUWATCH_DEBUG=1`` shows the
traceback of an unexpected error.
"""

from __future__ import annotations

import codecs
import contextlib
import importlib
import io
import os
import sys
from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from gpuwatch.cli.common import EXIT_FAILURE, EXIT_USAGE, check_root, fail
from gpuwatch.errors import (
    EXIT_INTERRUPTED,
    INVALID_PARAMS,
    NOT_FOUND,
    GpuwatchError,
    OutputFailed,
)

if TYPE_CHECKING:
    import argparse

#: Subcommand modules, in the order ``gpuwatch --help`` lists them.
SUBCOMMANDS = (
    "probe_cmd",
    "status_cmd",
    "list_cmd",
    "watch_cmd",
    "events_cmd",
    "record_cmd",
    "udev_rules_cmd",
    "mode_cmd",
    "plan_cmd",
    "recover_cmd",
    "holders_cmd",
    "ensure_cdi_cmd",
    "service_cmd",
    "health_cmd",
)

#: The one line ``gpuwatch --help`` shows for each subcommand. Kept here, not in the modules,
#: so the listing imports none of them (and none of pydantic, PyYAML, anyio or pyudev).
SUMMARIES: dict[str, str] = {
    "probe_cmd": "answer one probe action as JSON",
    "status_cmd": "VFIO/passthrough readiness of this host",
    "list_cmd": "passthrough-capable GPUs as libvirt <hostdev> blocks",
    "watch_cmd": "watch the host and log change events as JSON lines",
    "events_cmd": "print the event log as JSON lines",
    "record_cmd": "write live uevents as JSON lines (replayable with --source file:PATH)",
    "udev_rules_cmd": "udev rules giving a group read/write on /dev/vfio/* (rootless VMs)",
    "mode_cmd": "show or switch a GPU group between vfio-pci and nvidia",
    "plan_cmd": "the exact steps a switch would take (executes nothing)",
    "recover_cmd": "rebind a poisoned group to vfio-pci (unless a reboot is required)",
    "holders_cmd": "processes holding the card's device nodes open",
    "ensure_cdi_cmd": "generate the NVIDIA CDI spec if none exists",
    "service_cmd": "install or remove the systemd service running this gpuwatch",
    "health_cmd": "exit 0 when the daemon answers (readiness/liveness probes)",
}


def command_name(module: str) -> str:
    """``udev_rules_cmd`` -> ``udev-rules``: the command a subcommand module registers."""
    return module.removesuffix("_cmd").replace("_", "-")


def chosen_module(argv: Sequence[str]) -> str | None:
    """The subcommand module the command line names (its first word), if any."""
    for word in argv:
        if word == "--":
            return None
        if not word.startswith("-"):
            return next((m for m in SUBCOMMANDS if command_name(m) == word), None)
    return None


class _Summarised:
    """The subparsers as a module's ``register`` sees them, adding its `SUMMARIES` line."""

    def __init__(self, subparsers: Any, summary: str | None) -> None:
        self._subparsers = subparsers
        self._summary = summary

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        if self._summary is not None:
            kwargs.setdefault("help", self._summary)
        parser: argparse.ArgumentParser = self._subparsers.add_parser(name, **kwargs)
        return parser


def build_parser(only: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The parser, with the full arguments of the modules ``only`` names (None: every one)
    and a one-line entry for each other subcommand, whose module stays unloaded."""
    from gpuwatch.cli.oneline import OneLineParser  # argparse: not for the fast paths

    parser = OneLineParser(
        prog="gpuwatch",
        description="Watch a Linux GPU host: probes from memory, change events, safe driver "
        "switching.",
    )
    from gpuwatch import __version__

    parser.add_argument("--version", action="version", version=f"gpuwatch {__version__}")
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=OneLineParser
    )
    subparsers.required = True
    for name in SUBCOMMANDS:
        summary = SUMMARIES.get(name)
        if only is None or name in only or summary is None:
            module = importlib.import_module(f"gpuwatch.cli.{name}")
            module.register(_Summarised(subparsers, summary))
        else:
            subparsers.add_parser(command_name(name), help=summary)
    return parser


#: Commands that write their own stream to stdout and report its failures themselves
#: (docs/events.md: a closed stdout is exit 2, a failed write exit 1 naming it).
OWN_OUTPUT = frozenset({"watch", "events", "record"})


class _GuardedOutput:
    """stdout as the commands see it: a failed write or flush is `OutputFailed`, so the
    command ends with one line instead of an "internal error" or a traceback. A reader that
    left (``| head``) stays a `BrokenPipeError`: no error at all."""

    def __init__(self, out: Any) -> None:
        self._out = out

    def write(self, text: str) -> int:
        try:
            return int(self._out.write(text))
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputFailed(f"cannot write stdout: {exc.strerror or exc}") from None

    def flush(self) -> None:
        try:
            self._out.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputFailed(f"cannot write stdout: {exc.strerror or exc}") from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._out, name)


def _command(words: Sequence[str]) -> str | None:
    """The subcommand the command line names (its first word that is not an option)."""
    return next((w for w in words if not w.startswith("-")), None)


def _prints_nothing(words: Sequence[str]) -> bool:
    """Help and the version go to stderr when stdout is closed (argparse's own rule), and
    ``health --quiet`` prints nothing when healthy: none of them needs stdout."""
    return (any(w in ("-h", "--help", "--version") for w in words)
            or (_command(words) == "health" and any(w in ("-q", "--quiet") for w in words)))


def _drop_output() -> None:
    """Nothing more is written to stdout; silence the flush at exit of what it refused."""
    with contextlib.suppress(OSError):
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit


#: Commands whose stdout is JSON (as is any command's with ``--json``).
JSON_OUTPUT = frozenset({"probe", "events", "watch", "record"})


@contextlib.contextmanager
def _stdout_encoded_for(words: Sequence[str]) -> Iterator[None]:
    """stdout in an encoding that can say everything: a name (a process's ``comm``, an
    event's text) outside the locale's charset (``PYTHONIOENCODING=ascii``, a Latin-1
    locale) was an internal error. JSON goes out in UTF-8, as RFC 8259 has it (and the event
    log's lines as stored); text in the locale's encoding, with what it cannot say escaped
    (``\xf6``). A UTF-8 stdout is left as it is."""
    out = sys.stdout
    encoding, errors = getattr(out, "encoding", None), getattr(out, "errors", None)
    try:
        if not isinstance(out, io.TextIOWrapper) or codecs.lookup(encoding or "").name == "utf-8":
            out = None
        elif _command(words) in JSON_OUTPUT or "--json" in words:
            out.reconfigure(encoding="utf-8")
        else:
            out.reconfigure(errors="backslashreplace")
    except (LookupError, OSError, ValueError):
        out = None  # an encoding Python does not know, or stdout already failing: as it is
    try:
        yield
    finally:
        if out is not None:  # an embedding program's stdout is given back as it was
            with contextlib.suppress(OSError, ValueError):
                out.reconfigure(encoding=encoding, errors=errors)


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    with _stdout_encoded_for(words):
        return _main_guarded(words)


def _main_guarded(words: list[str]) -> int:
    guarded = _command(words) not in OWN_OUTPUT
    if guarded and sys.stdout is None and not _prints_nothing(words):
        # Started with fd 1 closed: the answer would vanish (a switch would run unreported).
        return fail("stdout is closed: redirect it to a file or /dev/null", EXIT_USAGE)
    real = sys.stdout
    if guarded and real is not None:
        sys.stdout = _GuardedOutput(real)
    try:
        try:
            code = _main(words)
        finally:
            if sys.stdout is not None:
                sys.stdout.flush()  # the output is written now, or its failure said here
    except OutputFailed as exc:
        _drop_output()
        return fail(str(exc), EXIT_FAILURE)
    except BrokenPipeError:
        _drop_output()
        return 0
    except KeyboardInterrupt:
        # Ctrl-C anywhere, a wait on a daemon that does not answer included (up to 10 s on
        # the fast paths, before any command runs): 128 + SIGINT, as inside a command, never
        # a traceback.
        return EXIT_INTERRUPTED
    finally:  # also after SystemExit (--help, a usage error): no wrapper left behind
        if isinstance(sys.stdout, _GuardedOutput):
            sys.stdout = real
    return code


def error_line(exc: GpuwatchError) -> str:
    """What the command says of ``exc``. The daemon's answer that the request is wrong or
    names nothing (``invalid-params``, ``not-found``) is given in its own words, which are
    the direct command's (the daemon runs the same checks): the same request says the same
    line whether a daemon answered it or not. Its other errors keep their ``daemon:``
    prefix, naming who refused or failed."""
    client = sys.modules.get("gpuwatch.service.client")
    if (client is not None and isinstance(exc, client.DaemonError)
            and exc.code in (INVALID_PARAMS, NOT_FOUND) and exc.message):
        return str(exc.message)
    return str(exc)


def _main(words: list[str]) -> int:
    from gpuwatch.cli.fast import UNANSWERED

    UNANSWERED.clear()  # what one command learnt of a daemon is not the next one's
    # A probe (holders, plan, status, list) the daemon answers takes the stdlib-only path: no
    # parser of every subcommand, no pydantic (gpuwatch.cli.fast, gpuwatch.cli.fast_report),
    # and so does a probe answered from one direct scan; anything else comes back here.
    if words[:1] in (["status"], ["list"]):
        from gpuwatch.cli.fast_report import run_report

        fast = run_report(words)
    else:
        from gpuwatch.cli.fast import run_fast

        fast = run_fast(words)
        if fast is None and words[:1] == ["probe"]:
            # No daemon answered: one scan with the stdlib (gpuwatch.cli.direct), not pydantic.
            from gpuwatch.cli.direct import run_direct

            fast = run_direct(words)
    if fast is not None:
        return fast
    argv = words
    chosen = chosen_module(argv)
    parser = build_parser(() if chosen is None else (chosen,))
    args = parser.parse_args(argv)
    try:
        if getattr(args, "resolve_root", False):
            from gpuwatch.settings import config_in_force, root_and_where

            # Read and checked whole once, even when the daemon answers and nothing of it is
            # used; the command takes its root, tables and settings from this one read, never
            # from a file written over it since.
            args.config_in_force = config_in_force(getattr(args, "config", None))
            if args.root is None:
                # The daemon's root: a direct run and the daemon must look at the same host.
                args.root, where = root_and_where(None, args.config_in_force)
                if where is not None:
                    check_root(args.root, where)  # named by the variable or the file
        code: int = args.func(args)
        return code
    except (BrokenPipeError, OutputFailed):
        raise  # the end of the output: main() says what it means
    except GpuwatchError as exc:  # UsageError, ConfigError, ...: the code says which exit
        return fail(error_line(exc), exc.exit_status)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:
        if os.environ.get("GPUWATCH_DEBUG"):
            import traceback

            traceback.print_exc()
        return fail(
            f"internal error: {type(exc).__name__}: {exc} (GPUWATCH_DEBUG=1 shows more)",
            EXIT_FAILURE,
        )
