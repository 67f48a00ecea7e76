"""The driver switch: a GPU's whole IOMMU group between vfio-pci and nvidia (docs/switch.md).

Kept light on purpose: importing the errors must not pull in the engine, because the pure
planner (`gpuwatch.core.plan`) and the probe dispatch import them too.
"""

from gpuwatch.switch.errors import (
    GroupBusy,
    GroupPoisoned,
    HostStepError,
    NotPrivileged,
    RebootRequired,
    StepTimedOut,
    SwitchError,
    SwitchFailed,
    SwitchRefused,
    SwitchWedged,
    UnsafeName,
    UnsafeStep,
)

__all__ = [
    "GroupBusy",
    "GroupPoisoned",
    "HostStepError",
    "NotPrivileged",
    "RebootRequired",
    "StepTimedOut",
    "SwitchError",
    "SwitchFailed",
    "SwitchRefused",
    "SwitchWedged",
    "UnsafeName",
    "UnsafeStep",
]
