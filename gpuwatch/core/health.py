"""What to do about a function that is not healthy: the operator's advice, from the model. Pure.

The kernel names recovery methods in a DRM wedge uevent (``WEDGED=rebind,bus-reset``); PCI
error recovery says only whether it began, succeeded or failed.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Health states a switch refuses: the device needs its recovery first, not another rebind.
UNSWITCHABLE = frozenset({"wedged", "failed"})
#: Seconds after its ``BEGIN_RECOVERY`` that a PCI error recovery with no end seen is taken
#: as over. The kernel's own waits in a recovery (a link or bus reset, the device coming
#: back) are bounded at 60 s; past five times that, the last uevent was lost (or never sent:
#: a failed recovery is reported on the bridge alone), and refusing the group until a reboot
#: would help nobody.
RECOVERY_STALE_AFTER = 300.0
#: The DRM wedge recovery method that asks nothing of anyone: the driver already recovered
#: the device itself (an amdgpu ring or GPU reset that succeeded sends ``WEDGED=none``), and
#: the uevent is for telemetry. Taken as a wedge, it refused every switch of a working card
#: until a rebind nobody was told to do.
RECOVERED_METHOD = "none"


def wedge_needs_recovery(methods: Sequence[str]) -> bool:
    """Whether a DRM wedge uevent's methods leave the device wedged: any method but
    `RECOVERED_METHOD`, or none named at all (a malformed ``WEDGED=``: taken as a wedge)."""
    return not methods or any(m != RECOVERED_METHOD for m in methods)


def method_advice(method: str, addr: str, driver: str) -> str:
    """One WEDGED recovery method as something to do."""
    drv = driver or "DRIVER"
    if method == "rebind":
        return (f"rebind its driver (echo {addr} > /sys/bus/pci/drivers/{drv}/unbind, then "
                f"bind)")
    if method == "bus-reset":
        return f"reset it (echo 1 > /sys/bus/pci/devices/{addr}/reset), then rebind"
    if method == "vendor-specific":
        return "follow the vendor's recovery procedure"
    if method == "none":
        return "nothing: the driver recovered it (telemetry only)"
    if method == "unknown":
        return "no known recovery: reboot"
    return f"recovery method {method!r}"


def health_advice(health: str, addr: str, driver: str, recovery: Sequence[str] = ()) -> str:
    """A line for ``status`` and refusals; ``""`` for a healthy function."""
    if health == "wedged":
        steps = "; or ".join(method_advice(m, addr, driver) for m in recovery) or (
            "the recovery methods are in its gpu-wedged event; or reboot")
        return f"the driver declared the GPU wedged: {steps}"
    if health == "failed":
        return (f"PCI error recovery failed: remove and rescan it (echo 1 > "
                f"/sys/bus/pci/devices/{addr}/remove; echo 1 > /sys/bus/pci/rescan) or reboot")
    if health == "recovering":
        return "PCI error recovery is in progress: wait for it to finish"
    return ""


__all__ = ["RECOVERED_METHOD", "RECOVERY_STALE_AFTER", "UNSWITCHABLE", "health_advice",
           "method_advice", "wedge_needs_recovery"]
