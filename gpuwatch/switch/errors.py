"""Switch errors, named after the condition. Every one is a `GpuwatchError`: the CLI exits 1.

A refusal (`SwitchRefused` and its kinds) means nothing hazardous was written; a failure
(`SwitchFailed`) means a step ran and the host said no; `SwitchWedged` means a step never
returned and the group is poisoned until the next boot or a successful ``recover``.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuwatch.core.events import Holding
from gpuwatch.errors import GpuwatchError


class SwitchError(GpuwatchError):
    """Base of every error the switch raises on purpose."""


class NotPrivileged(SwitchError, PermissionError):
    """Switching, ``recover`` and ``ensure-cdi`` write to sysfs and load modules: root only."""


class GroupBusy(SwitchError):
    """Another switch of the same IOMMU group (or one that needs the host alone) is running."""


class SwitchRefused(SwitchError):
    """The switch would be unsafe now; nothing was written to any driver's ``unbind``.

    ``holders`` names each process keeping a node of the group open: gpuwatch never kills
    them, the operator decides.
    """

    def __init__(self, reason: str, holders: Sequence[Holding] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.holders: tuple[Holding, ...] = tuple(holders)


class GroupPoisoned(SwitchRefused):
    """An earlier switch of this group wedged in this boot: reboot or ``gpuwatch recover``."""


class UnsafeName(SwitchRefused, ValueError):
    """An address or driver name that would become part of a sysfs write is malformed."""


class SwitchFailed(SwitchError):
    """A step ran and failed, or the group never reached its target drivers in time."""


class SwitchWedged(SwitchFailed):
    """A kernel step did not return within its timeout: the device is stuck (poisoned)."""


class RebootRequired(SwitchRefused):
    """``recover`` refused: a task is stuck in the nvidia driver, and touching the device
    again would only add another stuck task. Nothing was written."""


class StepTimedOut(SwitchError, TimeoutError):
    """One host step (a sysfs write in its child process, a command) did not finish in time."""

    def __init__(self, what: str, timeout: float) -> None:
        super().__init__(f"{what} did not return within {timeout:.3g}s")
        self.what = what
        self.timeout = timeout


class HostStepError(SwitchError, OSError):
    """A host step returned an error: a write's errno or a command's non-zero exit."""


class UnsafeStep(SwitchError, ValueError):
    """The seam refused a write or command outside its allow-list (checked before running)."""
