"""``gpuwatch watch``: keep the model current, log every change event as a JSONL line, and
(as the host's service) serve the socket, metrics and the NFD features file.

Every option can also come from the environment (``GPUWATCH_<OPTION>``) or the config file;
a flag wins over both (gpuwatch/settings.py, docs/service.md).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
from typing import TYPE_CHECKING, Any

import anyio

from gpuwatch.cli.common import (
    EXIT_OK,
    EXIT_USAGE,
    check_root,
    fail,
    one_line,
)
from gpuwatch.errors import EXIT_RETRY
from gpuwatch.host import open_host
from gpuwatch.service.protocol import DEFAULT_SOCKET_PATH
from gpuwatch.settings import SETTINGS, WatchSettings, load_settings, where_set
from gpuwatch.sources import SourceUnavailable
from gpuwatch.switch.hostops import find_nsenter, make_backend
from gpuwatch.watch.eventlog import EventLog, EventLogUnavailable

if TYPE_CHECKING:
    from gpuwatch.watch.watcher import Watcher


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "watch",
        description="Follow kernel uevents, keep the host model current and write every change "
                    "event as one JSON line; optionally serve it on a Unix socket, as Prometheus "
                    "metrics and as a node-feature-discovery file. Options also come from "
                    "GPUWATCH_<OPTION> environment variables and the config file "
                    "(/etc/gpuwatch/config.yaml); a flag wins over both.")
    # Defaults are None so that "not given" can be told apart: the settings loader fills in
    # environment, file and default values below a flag. The numbers are read there too, as
    # the environment's are (no argparse type): one reading, one message, for a flag, a
    # variable and a key alike.
    p.add_argument("--root", default=None, metavar="DIR",
                   help="host root holding sys/, proc/, dev/ (default /; a fixture for tests)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="YAML file with watch options and data tables "
                        "(default $GPUWATCH_CONFIG, else /etc/gpuwatch/config.yaml if present)")
    p.add_argument("--source", default=None, metavar="auto|udev|kernel|file:PATH",
                   help="where uevents come from (default auto = kernel; udev needs udevd)")
    p.add_argument("--log", default=None, metavar="PATH|-",
                   help="event log file, - for stdout (default)")
    p.add_argument("--log-max-bytes", default=None, metavar="N",
                   help="rotate the log before it grows past N bytes ('' = never, whatever "
                        "the config file says)")
    p.add_argument("--log-keep", default=None, metavar="K",
                   help="rotated files to keep, PATH.1 … PATH.K (default 5)")
    p.add_argument("--reconcile-interval", default=None, metavar="S",
                   help="full rescan every S seconds to catch drift (default 300, 0 = off)")
    p.add_argument("--receive-buffer", default=None, metavar="BYTES",
                   help="uevent netlink receive buffer (default 128 MiB; the kernel caps it at "
                        "net.core.rmem_max without CAP_NET_ADMIN)")
    p.add_argument("--socket", nargs="?", const=DEFAULT_SOCKET_PATH, default=None, metavar="PATH",
                   help="serve the socket API (docs/socket.md) at PATH "
                        f"(default {DEFAULT_SOCKET_PATH} when given without PATH)")
    p.add_argument("--socket-group", default=None, metavar="GROUP",
                   help="group that may read through the socket (default gpuwatch if it exists, "
                        "else root only)")
    p.add_argument("--switch-group", default=None, metavar="GROUP",
                   help="group that may also switch and recover through the socket "
                        "(default: root only)")
    p.add_argument("--socket-max-request-bytes", default=None, metavar="N",
                   help="longest request line; a longer one is refused and its connection "
                        "closed (default 65536)")
    p.add_argument("--socket-max-clients", default=None, metavar="N",
                   help="connections served at once (default 1024)")
    p.add_argument("--socket-max-per-uid", default=None, metavar="N",
                   help="connections one non-root user may hold (default 16)")
    p.add_argument("--socket-root-reserve", default=None, metavar="N",
                   help="of --socket-max-clients, slots only root may take (default 64)")
    p.add_argument("--socket-stall-timeout", default=None,
                   metavar="S", help="close a connection whose partial request line waits S "
                                     "seconds for its newline, or that leaves half its output "
                                     "unread that long (default 30)")
    p.add_argument("--socket-max-output-bytes", default=None, metavar="N",
                   help="output a client may leave unread; past it a subscriber gets a "
                        "'lagged' line and is disconnected, and past half of it a client's "
                        "next requests wait (default 4194304)")
    p.add_argument("--metrics", default=None, metavar="ADDR",
                   help="serve Prometheus metrics at http://ADDR/metrics (HOST:PORT, :PORT)")
    p.add_argument("--nfd-features", default=None, metavar="PATH",
                   help="keep a node-feature-discovery features file current (a features.d/ "
                        "directory, or a features.d not made yet, gets the file 'gpuwatch')")
    p.add_argument("--nfd-expiry", default=None, metavar="S",
                   help="NFD labels expire S seconds after the last write "
                        "(default 3600, 0 = never, else at least 120)")
    p.add_argument("--proc-read-timeout", default=None, metavar="S",
                   help="budget of one /proc scan for holders and stuck tasks, in seconds "
                        "(default 2); a process not read in time counts as a holder")
    p.add_argument("--host-namespaces", action="store_true", default=None,
                   help="run a switch's host commands (systemctl, modprobe, nvidia-modprobe, "
                        "nvidia-ctk) in the host's namespaces through nsenter: for a daemon "
                        "in a container with the host's PID namespace (docs/kubernetes.md)")
    p.add_argument("-v", "--verbose", action="store_true", default=None,
                   help="log source details to stderr")
    p.set_defaults(func=run)


class _OneLineFormatter(logging.Formatter):
    """Messages name what the host chose (a log path, a devpath, a recording's contents): a
    control character in one must neither write to the operator's terminal nor start a
    line that looks like another message."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return one_line(super().formatMessage(record))


def setup_logging(verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLineFormatter("gpuwatch: %(message)s"))
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler])


def settings_from_args(args: argparse.Namespace) -> WatchSettings:
    """Flags given on the command line over environment, file and defaults."""
    flags: dict[str, Any] = {s.key: getattr(args, s.key, None) for s in SETTINGS}
    return load_settings(flags, config=args.config)


class _Terminated(BaseException):
    """SIGTERM or SIGINT before the event loop's own handler is installed (settings, log,
    imports)."""


#: Signals `_terminate` saw. Raising from a signal handler is not enough on its own: an
#: exception raised inside a weakref callback or ``__del__`` (an import lock's, say) is
#: printed and dropped by Python, and the signal would be lost. `watch` looks here first.
_caught: list[str] = []


def _terminate(signum: int, _frame: Any) -> None:
    name = signal.Signals(signum).name
    _caught.append(name)
    raise _Terminated(name)


def _noted(signum: int, _frame: Any) -> None:
    """While the log closes at the very end: the run is over, and a signal (a second SIGTERM,
    a second Ctrl-C) must neither cut that bounded close short (the ``stopped`` record may
    still be on its way to a stdout reader) nor end the process by the signal instead of the
    exit status the run earned."""
    _caught.append(signal.Signals(signum).name)


def _hangup() -> None:
    """SIGHUP (a closed terminal, a habit from daemons that reload) does not stop the
    daemon, as it stops neither udevd nor journald: killed by it, the daemon would end with
    no ``stopped`` record and leave its socket file behind. There is nothing to reload."""
    logging.getLogger("gpuwatch").warning(
        "SIGHUP ignored: settings are read at start (restart to change them); "
        "SIGTERM or SIGINT stops the daemon")


async def watch(settings: WatchSettings, log: EventLog | None = None,
                progress: dict[str, bool] | None = None) -> None:
    """Run until SIGINT/SIGTERM or the end of a file source; the event in hand is finished first
    (publishing never awaits, so cancellation can only land between events). A switch changes
    the host through `make_backend` of ``settings`` (its commands in the host's namespaces
    with ``host_namespaces``).

    A signal at any moment, even during the first scan, ends the run cleanly with a
    ``stopped`` record. ``ready`` comes only once every listener is bound (run_services).
    """
    from gpuwatch.service.daemon import run_services

    current: list[Watcher] = []
    reason = "source ended"
    backend = make_backend(settings.root, host_namespaces=settings.host_namespaces)
    progress = {} if progress is None else progress
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
        async with anyio.create_task_group() as tg:

            async def stop_on_signal() -> None:
                nonlocal reason
                if not _caught:  # else a signal came before this receiver, and was dropped
                    async for signum in signals:
                        if signum == signal.SIGHUP:
                            _hangup()
                            continue
                        _caught.append(signal.Signals(signum).name)
                        break
                reason = f"signal {_caught[0]}"
                if current:
                    current[0].stop(reason)  # subscribers hear it before the socket goes
                tg.cancel_scope.cancel()

            tg.start_soon(stop_on_signal)
            async with open_host(
                settings.root, source=settings.source, config=settings.tables(),
                log=log if log is not None else settings.log,
                log_max_bytes=settings.log_max_bytes, log_keep=settings.log_keep,
                reconcile_interval=settings.reconcile_interval,
                receive_buffer=settings.receive_buffer, announce=False,
                host_namespaces=settings.host_namespaces,
                ops=backend.ops, geteuid=backend.geteuid,
            ) as host:
                host.watcher.model.proc_deadline = settings.proc_read_timeout
                current.append(host.watcher)
                progress["watching"] = True  # from here on the watcher writes `stopped`
                async with run_services(host, settings):
                    await host.source_ended.wait()
                host.watcher.stop(reason)
            tg.cancel_scope.cancel()
    if not current and log is not None:
        write_stopped(log, reason)
    progress["watching"] = True


def write_stopped(log: EventLog, reason: str) -> None:
    """The ``stopped`` record of a run that ended before its watcher existed."""
    from gpuwatch.core.events import Stopped, format_event_time

    record = Stopped(reason=reason, seq=(log.last_seq or 0) + 1, time=format_event_time())
    with contextlib.suppress(OSError, ValueError):
        log.write_lines([record.model_dump_json()])


def open_log(settings: WatchSettings) -> EventLog:
    """The event log, locked (one writer) before anything is written to it."""
    return EventLog(settings.log, max_bytes=settings.log_max_bytes, keep=settings.log_keep)


def _first_leaf(exc: BaseException) -> BaseException:
    """The first real error inside (nested) exception groups: the CLI reports one line."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


#: Errors that mean "this configuration cannot run here": one line and exit 2.
_SETUP_ERRORS: tuple[type[BaseException], ...] = (SourceUnavailable, EventLogUnavailable)


def _setup_errors() -> tuple[type[BaseException], ...]:
    from gpuwatch.service.daemon import ServiceSetupError
    from gpuwatch.service.nfd import NfdDirectoryLocked
    from gpuwatch.service.server import SocketInUse, SocketSetupError

    # NfdDirectoryLocked: exit 2, as for the event log's lock (EventLogLocked).
    return (*_SETUP_ERRORS, ServiceSetupError, SocketSetupError, SocketInUse,
            NfdDirectoryLocked)


def _setup_status(exc: BaseException) -> int:
    """Exit 2 for a configuration that cannot run here (systemd does not restart it:
    RestartPreventExitStatus=2); `EXIT_RETRY` for a listener that cannot bind *yet*."""
    from gpuwatch.service.server import ListenerNotYet

    return EXIT_RETRY if isinstance(exc, ListenerNotYet) else EXIT_USAGE


def _stopped_early(log: EventLog | None, progress: dict[str, bool], exc: BaseException) -> None:
    """A signal before the watcher took over (or after it finished): `stopped` once."""
    if log is not None and not progress.get("watching"):
        name = "SIGINT" if isinstance(exc, KeyboardInterrupt) else str(exc)
        write_stopped(log, f"signal {name}")


def _stopping_anyway(log: EventLog | None, progress: dict[str, bool], exc: BaseException) -> bool:
    """Whether an unexpected error came out of a run that a SIGTERM or SIGINT was already
    stopping: then the run ends as that signal asked (exit 0, one ``stopped`` record) and the
    error is one line on stderr. The handler's exception is raised wherever the signal lands,
    and CPython may turn it into another error on the way out (one raised inside the import
    machinery can surface as a TypeError); the operator's stop is what happened."""
    if not _caught:
        return False
    if not isinstance(exc, BrokenPipeError):  # stdout's reader left (`| head`): nothing to say
        fail(f"stopping on {_caught[0]}; on the way out: {type(exc).__name__}: {exc}", EXIT_OK)
    if log is not None and not progress.get("watching"):
        write_stopped(log, f"signal {_caught[0]}")
    return True


def run(args: argparse.Namespace) -> int:
    _caught.clear()
    previous = {s: signal.signal(s, _terminate) for s in (signal.SIGINT, signal.SIGTERM)}
    previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until `watch`
    log: EventLog | None = None
    progress: dict[str, bool] = {}
    try:
        settings = settings_from_args(args)
        origin = settings.origins.get("root")
        check_root(settings.root, None if origin in (None, "flag") else
                   where_set("root", origin, settings.config_path))
        setup_logging(settings.verbose)
        # A switch's commands in the host's namespaces need nsenter: missing, the daemon
        # stops here (exit 2), before its log, socket or a switch writes anything.
        if settings.host_namespaces:
            find_nsenter(where_set("host_namespaces", settings.origins.get("host_namespaces"),
                                   settings.config_path))
        # Signals wait while the log is opened: one arriving then is handled (below) with
        # the log in hand, so even it leaves a `stopped` record.
        stopping = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, stopping)
        try:
            log = open_log(settings)
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stopping)
        anyio.run(watch, settings, log, progress)
    except (KeyboardInterrupt, _Terminated) as exc:
        _stopped_early(log, progress, exc)
        return EXIT_OK
    except BaseExceptionGroup as group:
        leaf = _first_leaf(group)
        if isinstance(leaf, KeyboardInterrupt | _Terminated):
            _stopped_early(log, progress, leaf)
            return EXIT_OK
        if isinstance(leaf, _setup_errors()):
            return fail(str(leaf), _setup_status(leaf))
        if isinstance(leaf, Exception):
            if _stopping_anyway(log, progress, leaf):
                return EXIT_OK
            raise leaf from None  # main() maps it to its exit code, in one line
        raise
    except _SETUP_ERRORS as exc:
        return fail(str(exc), EXIT_USAGE)
    except Exception as exc:
        if isinstance(exc, _setup_errors()):
            return fail(str(exc), _setup_status(exc))
        if _stopping_anyway(log, progress, exc):
            return EXIT_OK
        raise
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, _noted)
        try:
            if log is not None:
                log.close()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
    return EXIT_OK
