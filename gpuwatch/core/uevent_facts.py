"""What a uevent says that sysfs does not keep: PCI error recovery, a DRM wedge, a fresh bind.

Pure parsing of the uevent's own properties (no reads): the watcher folds these in, in the
order the kernel sent them, after the batch's sysfs reads, so a batch that names one device
several times still reports every recovery step and wedge.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable

from gpuwatch.core.observations import DrmWedgeSeen, Observation, PciErrorSeen, PciRebound
from gpuwatch.core.pci import is_pci_addr
from gpuwatch.core.uevent import UEvent

_CARD_RE = re.compile(r"^card[0-9]+$")
#: Uevent actions after which a function starts afresh (its bad health is cleared)...
FRESH_ACTIONS = frozenset(("bind", "add"))
#: ...unless the kernel marks the uevent synthetic: one written into the device's ``uevent``
#: file (``udevadm trigger``, a coldplug) carries this key and tells of no new start.
SYNTHETIC = "SYNTH_UUID"
#: Bounds on what one uevent may make us keep: WEDGED methods and their length, TASK.
MAX_METHODS = 8
MAX_WORD = 64
#: What a drain after a loss keeps at most: uevents carrying facts, and their raw bytes.
MAX_KEPT = 1024
MAX_KEPT_BYTES = 1 << 20


def uevent_facts(event: UEvent) -> list[Observation]:
    """The health observations one uevent carries (usually none)."""
    props = event.properties
    subsystem = event.subsystem
    if subsystem == "pci":
        if event.action not in FRESH_ACTIONS and "ERROR_EVENT" not in props:
            return []  # most of them (a change, an unbind): nothing to take
        name = event.devpath.rsplit("/", 1)[-1]
        addr = name if is_pci_addr(name) else props.get("PCI_SLOT_NAME", "")
        if not is_pci_addr(addr):
            return []
        out: list[Observation] = []
        if event.action in FRESH_ACTIONS and SYNTHETIC not in props:
            out.append(PciRebound(addr))
        error_event = props.get("ERROR_EVENT")
        if error_event:
            out.append(PciErrorSeen(addr, error_event.strip()[:MAX_WORD],
                                    online(props.get("DEVICE_ONLINE", ""))))
        return out
    if subsystem == "drm" and "WEDGED" in props:
        parts = event.devpath.rsplit("/", 3)
        if len(parts) == 4 and _CARD_RE.match(parts[3]):
            parent = parts[1] if parts[2] == "drm" and is_pci_addr(parts[1]) else ""
            return [wedge(parts[3], parent, event)]
    return []


_tuple_new = tuple.__new__


def batch_facts(batch: Iterable[UEvent]) -> list[Observation]:
    """`uevent_facts` of every uevent of a batch, in order. The common ones cost a test or
    two: an unbind or a change says nothing here, and a plain bind one `PciRebound`."""
    out: list[Observation] = []
    append = out.append
    for event in batch:
        action, devpath, subsystem, props = event
        if subsystem == "pci":
            if action == "bind" and "ERROR_EVENT" not in props:
                if SYNTHETIC in props:
                    continue  # a `udevadm trigger`: nothing bound
                name = devpath[devpath.rfind("/") + 1:]
                if is_pci_addr(name):
                    # PciRebound(name) without the NamedTuple's Python-level __new__.
                    append(_tuple_new(PciRebound, (name,)))
                    continue
            elif action != "add" and "ERROR_EVENT" not in props:
                continue
            out.extend(uevent_facts(event))
        elif subsystem == "drm" and "WEDGED" in props:
            out.extend(uevent_facts(event))
    return out


def online(text: str) -> bool | None:
    """``DEVICE_ONLINE``: ``1`` true, ``0`` false, absent or anything else ``None``."""
    return {"1": True, "0": False}.get(text.strip())


def wedge(card: str, addr: str, event: UEvent) -> DrmWedgeSeen:
    """``WEDGED=<method>[,…]`` (bounded, duplicates dropped), ``PID=`` and ``TASK=``."""
    methods = tuple(dict.fromkeys(
        m.strip()[:MAX_WORD] for m in event.get("WEDGED").split(",") if m.strip()
    ))[:MAX_METHODS]
    pid_text = event.get("PID").strip()
    task = event.properties.get("TASK")
    return DrmWedgeSeen(
        addr=addr,
        card=card,
        recovery=methods,
        pid=int(pid_text) if pid_text.isascii() and pid_text.isdigit() and len(pid_text) <= 10
        else None,
        task=task[:MAX_WORD] if task is not None else None,
    )


def may_carry_facts(data: bytes) -> bool:
    """Whether a raw message (a kernel or a udevd one) may carry a fact: bytes found in
    every uevent `uevent_facts` takes anything from, and in few others. The test a drain
    after a loss makes of each message it reads (a million in a full queue): a few
    substring tests, written out (``any`` over a tuple cost twice as much)."""
    return (b"ERROR_EVENT=" in data or b"WEDGED=" in data or b"ACTION=bind\0" in data
            or b"ACTION=add\0" in data)


class LostFacts:
    """The uevents a drain after a loss keeps from what it discards: those carrying facts a
    rescan cannot see (`uevent_facts`: an error recovery's step, a wedge, a real bind or add
    that clears a bad health), in the kernel's order, for the watcher to apply after its
    rescan. Bounded (``max_count`` uevents, ``max_bytes`` of their messages): past that the
    oldest go (the newest decide the health the model ends with), counted in `unkept`. A
    bind or add of a function already kept since the last other fact is not kept again: it
    would change nothing, and a flapping link would otherwise fill the bound with them."""

    def __init__(self, max_count: int = MAX_KEPT, max_bytes: int = MAX_KEPT_BYTES) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        #: Fact-carrying uevents the bound made it discard.
        self.unkept = 0
        self._kept: deque[tuple[UEvent, int]] = deque()
        self._bytes = 0
        self._rebound: set[str] = set()

    def offer(self, event: UEvent, size: int) -> bool:
        """Keep ``event`` (its message ``size`` bytes) if it carries a fact; True if kept."""
        facts = uevent_facts(event)
        if not facts:
            return False
        rebound = {f.addr for f in facts if isinstance(f, PciRebound)}
        if len(rebound) == len(facts):
            if rebound <= self._rebound:
                return False
            self._rebound |= rebound
        else:  # an error or a wedge (after any bind of the same uevent): binds count again
            self._rebound = set()
        self._kept.append((event, size))
        self._bytes += size
        while len(self._kept) > self.max_count or self._bytes > self.max_bytes:
            _old, old_size = self._kept.popleft()
            self._bytes -= old_size
            self.unkept += 1
            self._rebound.clear()  # it may have held one: a bind kept twice changes nothing
        return True

    def __len__(self) -> int:
        return len(self._kept)

    def events(self) -> list[UEvent]:
        """What is kept, oldest first."""
        return [event for event, _size in self._kept]
