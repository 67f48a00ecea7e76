"""Every exception gpuwatch raises on purpose, named after the condition and split by blame.

Three branches say whose move it is: `CallerError` (the request is wrong: fix the call),
`HostError` (the host refuses or fails: look at the machine) and `InternalError`
(gpuwatch itself: report it). Each class carries a stable ``code`` string: the one the
socket puts in its error replies (docs/socket.md) and the key of the CLI's exit-status table
`EXIT_STATUS` below, so a code means the same thing on every surface.

Pure and light: imported by the core, the CLI's ``--help`` path and every layer above.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    from gpuwatch.core.results import Holding

Blame = Literal["caller", "host", "gpuwatch"]

# --------------------------------------------------------------------------- codes

#: The request was wrong: unknown action, bad address, mode or parameter.
INVALID_PARAMS = "invalid-params"
#: No such PCI function, or no card of that vendor.
NOT_FOUND = "not-found"
#: The configuration file (or a setting) is missing, unreadable or has a bad value.
BAD_CONFIG = "bad-config"
#: A subscriber fell further behind than its buffer.
SUBSCRIBER_LAGGED = "subscriber-lagged"
#: The event source cannot be opened (netlink refused, no such file).
SOURCE_UNAVAILABLE = "source-unavailable"
SWITCH_REFUSED = "switch-refused"
GROUP_POISONED = "group-poisoned"
REBOOT_REQUIRED = "reboot-required"
GROUP_BUSY = "group-busy"
SWITCH_FAILED = "switch-failed"
SWITCH_WEDGED = "switch-wedged"
NOT_ROOT = "not-root"
#: A host file could not be read safely (a FIFO or device where a file belongs).
UNREADABLE = "unreadable"
#: The event log could not be written (disk full, I/O error).
EVENT_LOG = "event-log-failed"
#: The daemon or its socket could not be set up, or a daemon answer was lost.
SERVICE = "service-error"
#: A command's stdout refused its output (a full disk, an I/O error).
OUTPUT = "output-failed"
INTERNAL = "internal-error"

#: Exit statuses of the ``gpuwatch`` command (docs/probes.md, docs/switch.md).
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
#: ``gpuwatch watch`` only: a listener cannot bind or listen *yet* (its address in use, its
#: directory missing); a later start may succeed. sysexits' EX_TEMPFAIL. The unit prevents
#: restarts on 2 (a configuration to fix), not on this.
EXIT_RETRY = 75
#: Ended by SIGINT (Ctrl-C) before it finished: 128 + 2, as a shell reports it.
EXIT_INTERRUPTED = 130

#: The CLI's exit status for every code: 2 when the request itself was wrong, else 1.
EXIT_STATUS: dict[str, int] = {
    INVALID_PARAMS: EXIT_USAGE,
    BAD_CONFIG: EXIT_USAGE,
    NOT_FOUND: EXIT_FAILURE,
    SUBSCRIBER_LAGGED: EXIT_FAILURE,
    SOURCE_UNAVAILABLE: EXIT_FAILURE,
    SWITCH_REFUSED: EXIT_FAILURE,
    GROUP_POISONED: EXIT_FAILURE,
    REBOOT_REQUIRED: EXIT_FAILURE,
    GROUP_BUSY: EXIT_FAILURE,
    SWITCH_FAILED: EXIT_FAILURE,
    SWITCH_WEDGED: EXIT_FAILURE,
    NOT_ROOT: EXIT_FAILURE,
    UNREADABLE: EXIT_FAILURE,
    EVENT_LOG: EXIT_FAILURE,
    SERVICE: EXIT_FAILURE,
    OUTPUT: EXIT_FAILURE,
    INTERNAL: EXIT_FAILURE,
}


def exit_status(code: str) -> int:
    """The CLI's exit status for an error code (an unknown code from a newer daemon: 1)."""
    return EXIT_STATUS.get(code, EXIT_FAILURE)


# --------------------------------------------------------------------------- the hierarchy


class GpuwatchError(Exception):
    """Base of every error gpuwatch raises on purpose."""

    #: Stable across releases: socket error replies and `EXIT_STATUS` key on it.
    code: str = INTERNAL
    blame: ClassVar[Blame] = "gpuwatch"

    @property
    def exit_status(self) -> int:
        return exit_status(self.code)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (a multiprocessing worker's error), copied or deep-copied whole, without
        calling ``__init__`` again: a subclass's takes its own arguments (``missed``;
        ``code`` and ``message``), which ``args`` (the message) does not hold, so the
        default rebuild raised TypeError in the receiving process or said the message twice."""
        # The base's own arguments: ``args``, or for an OSError its errno, strerror and filename.
        return (_rebuild, (type(self), super().__reduce__()[1], self.args, self.__dict__))


def _rebuild(cls: type[GpuwatchError], new_args: tuple[Any, ...], args: tuple[Any, ...],
             state: dict[str, Any]) -> GpuwatchError:
    """A pickled `GpuwatchError` again, with no ``__init__`` run: ``__new__`` given what
    the base class rebuilds from (an OSError sets its errno, strerror and filename from
    it), then its args and attributes as they were."""
    exc = cls.__new__(cls, *new_args)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class CallerError(GpuwatchError):
    """The caller's request is wrong or names nothing: fix the call, not the host."""

    code = INVALID_PARAMS
    blame: ClassVar[Blame] = "caller"


class HostError(GpuwatchError):
    """The host refused or failed what was asked: the request was fine."""

    code = SWITCH_FAILED
    blame: ClassVar[Blame] = "host"


class InternalError(GpuwatchError):
    """gpuwatch itself went wrong (a broken invariant): report it."""

    code = INTERNAL
    blame: ClassVar[Blame] = "gpuwatch"


# --- the caller


class UsageError(CallerError, ValueError):
    """The request itself is wrong: unknown action, bad address or mode, missing parameter.

    Exit code 2.
    """


class DeviceNotFound(CallerError, LookupError):
    """No PCI function with that address (or no card of that vendor) on this host (exit 1)."""

    code = NOT_FOUND


class ConfigError(CallerError):
    """The configuration file is missing, unreadable, not YAML, or has a bad key or value.

    Exit code 2.
    """

    code = BAD_CONFIG


class SubscriberLagged(CallerError):
    """The subscriber fell behind by more than its buffer; ``missed`` events were dropped for it."""

    code = SUBSCRIBER_LAGGED

    def __init__(self, missed: int, first_missed_seq: int | None = None) -> None:
        resume = ("resubscribe and read snapshot()" if first_missed_seq is None else
                  f"resubscribe with since_seq={max(0, first_missed_seq - 1)}")
        super().__init__(f"subscriber lagged: {missed} event(s) missed; {resume}")
        self.missed = missed
        #: The first seq not received (a socket subscriber's ``lagged`` line says so).
        self.first_missed_seq = first_missed_seq


# --- the host


class SwitchError(HostError):
    """Base of every error the switch raises on purpose."""


class NotPrivileged(SwitchError, PermissionError):
    """Switching, ``recover`` and ``ensure-cdi`` write to sysfs and load modules: root only."""

    code = NOT_ROOT


class GroupBusy(SwitchError):
    """Another switch of the same IOMMU group (or one that needs the host alone) is running."""

    code = GROUP_BUSY


class SwitchRefused(SwitchError):
    """The switch would be unsafe now; nothing was written to any driver's ``unbind``.

    ``holders`` names each process keeping a node of the group open: gpuwatch never kills
    them, the operator decides.
    """

    code = SWITCH_REFUSED

    def __init__(self, reason: str, holders: Sequence[Holding] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.holders: tuple[Holding, ...] = tuple(holders)
        #: What a switch that had begun put back (services started, modules loaded again).
        self.restored: tuple[str, ...] = ()


class GroupPoisoned(SwitchRefused):
    """An earlier switch of this group wedged in this boot: reboot or ``gpuwatch recover``."""

    code = GROUP_POISONED


class UnsafeName(SwitchRefused, ValueError):
    """An address or driver name that would become part of a sysfs write is malformed. It
    comes from the host's tree (a driver link, modules.alias), never from the request, so it
    is the host's refusal (exit 1, ``switch-refused``), not a usage error."""

    code = SWITCH_REFUSED


class RebootRequired(SwitchRefused):
    """``recover`` refused: a task is stuck in the nvidia driver, and touching the device
    again would only add another stuck task. Nothing was written."""

    code = REBOOT_REQUIRED


class SwitchFailed(SwitchError):
    """A step ran and failed, or the group never reached its target drivers in time."""

    code = SWITCH_FAILED
    #: What the switch put back before giving up (services started, modules loaded again).
    restored: tuple[str, ...] = ()


class SwitchWedged(SwitchFailed):
    """A kernel step did not return within its timeout: the device is stuck (poisoned)."""

    code = SWITCH_WEDGED


class StepTimedOut(SwitchError, TimeoutError):
    """One host step (a sysfs write in its child process, a command) did not finish in time."""

    code = SWITCH_FAILED

    def __init__(self, what: str, timeout: float) -> None:
        super().__init__(f"{what} did not return within {timeout:.3g}s")
        self.what = what
        self.timeout = timeout


class HostStepError(SwitchError, OSError):
    """A host step returned an error: a write's errno or a command's non-zero exit."""

    code = SWITCH_FAILED


class OutputFailed(HostError):
    """A command's stdout refused its output (a full disk, an I/O error): exit 1, one line
    naming the failure, where an unexplained write error would read as gpuwatch's own bug."""

    code = OUTPUT


# --- gpuwatch itself


class UnsafeStep(InternalError, ValueError):
    """The seam refused a write or command outside its allow-list (checked before running):
    the planner produced a step it must never produce."""

    code = SWITCH_FAILED


__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_RETRY",
    "EXIT_STATUS",
    "EXIT_USAGE",
    "Blame",
    "CallerError",
    "ConfigError",
    "DeviceNotFound",
    "GpuwatchError",
    "GroupBusy",
    "GroupPoisoned",
    "HostError",
    "HostStepError",
    "InternalError",
    "NotPrivileged",
    "OutputFailed",
    "RebootRequired",
    "StepTimedOut",
    "SubscriberLagged",
    "SwitchError",
    "SwitchFailed",
    "SwitchRefused",
    "SwitchWedged",
    "UnsafeName",
    "UnsafeStep",
    "UsageError",
    "exit_status",
]
