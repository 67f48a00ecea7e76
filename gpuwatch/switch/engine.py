"""The switch engine: moves a GPU's whole IOMMU group between vfio-pci and nvidia, safely.

One engine per host, wired by its constructor: the model it reads, the `HostOps` seam it
writes through, and three callables of the watcher that owns the model (publish events,
subscribe to them, fold re-read observations in under the pump's lock). It never sees the
watcher itself. A switch is: resolve the card, return at once if the group is
already in mode (no write, no privilege), check root, claim the group (a second request
for it fails at once), read the host facts off the event loop, plan (`gpuwatch.core.plan`),
refuse with names or run the plan's steps one by one through the `HostOps` seam, each under
a timeout inside the whole switch's bound, then wait until the *watcher's model* sees every
function on its target driver. ``drivers_probe`` can succeed without binding anything, so
only the ``driver`` link, as the model sees it, counts; if bind events were lost, the tree
is re-read before the switch is declared failed.

A step that does not return in time means a task is stuck in the kernel: the switch fails
``wedged``, the group is poisoned (in the model and in a file keyed by the boot id) and
refused until the next boot or a successful `recover`. The watcher keeps running.
"""

from __future__ import annotations

import contextvars
import dataclasses
import errno
import fcntl
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, suppress
from dataclasses import dataclass
from typing import Any, Protocol, assert_never

import anyio
from pydantic import BaseModel

from gpuwatch.core import events as ev
from gpuwatch.core.events import format_event_time
from gpuwatch.core.modes import (
    BRIDGE_DRIVER,
    Mode,
    group_mode,
    host_bridge,
)
from gpuwatch.core.observations import Observation, PciRebound
from gpuwatch.core.plan import (
    BRIDGE_RULE,
    CLEAR_OVERRIDE,
    PERSISTENCED_UNIT,
    RETURN_MODES,
    CommandStep,
    HostFacts,
    MakeDirStep,
    NodeScope,
    PoisonKey,
    Step,
    SwitchPlan,
    WriteStep,
    already_in_mode,
    bridge_names,
    cdi_steps,
    failure_reason,
    find_card,
    foreign_bridges,
    holders_reason,
    needs_recovery,
    nvidia_scope,
    override_path,
    parse_mode,
    parse_target,
    parse_vfio_driver,
    plan_switch,
    poison_key,
    poison_subject,
    poisoned_until,
    return_steps,
    satisfied,
    switch_guard,
    target_of,
    unbind_scope,
    unhealthy_reason,
)
from gpuwatch.core.results import Holding, PciFunction
from gpuwatch.errors import (
    DeviceNotFound,
    GroupBusy,
    GroupPoisoned,
    HostStepError,
    NotPrivileged,
    RebootRequired,
    StepTimedOut,
    SubscriberLagged,
    SwitchFailed,
    SwitchRefused,
    SwitchWedged,
    UnsafeName,
    UnsafeStep,
    UsageError,
)
from gpuwatch.hostfs.bootstate import DEFAULT_STOPPED_FILE, set_service_stopped
from gpuwatch.hostfs.bootstate import boot_id as read_boot_id
from gpuwatch.hostfs.facts import (
    ModelFacts,
    call_bounded,
    card_holders,
    cdi_output,
    gather_facts,
    health_facts,
    model_facts,
    scan_holders,
)
from gpuwatch.hostfs.files import make_dirs, place_in_root
from gpuwatch.hostfs.journal import (
    LOCK_DIR,
    Journal,
    discard_journal,
    find_abandoned,
    journal_keys,
    lock_held,
    mark_reported,
    move_journal,
    read_journal,
    remove_journal,
    write_journal,
)
from gpuwatch.hostfs.scan import (
    CDI_SPECS,
    cdi_spec_exists,
    copied_entries,
    iommu_groups_now,
    read_function,
    read_modules,
)
from gpuwatch.hostfs.wedge import scan_wedge
from gpuwatch.model import HostModel, holders_report
from gpuwatch.ownership import others_control
from gpuwatch.switch.hostops import CommandResult, HostOps, make_backend
from gpuwatch.switch.poison import PoisonEntry, PoisonStore

_log = logging.getLogger("gpuwatch.switch")

#: While a switch runs its steps, its switch-refused / switch-failed event waits here until
#: what the switch changed has been put back, so the event can say what was restored.
_DEFERRED: contextvars.ContextVar[list[BaseModel] | None] = contextvars.ContextVar(
    "gpuwatch_switch_deferred", default=None)

DEFAULT_TIMEOUT = 90.0
DEFAULT_STEP_TIMEOUT = 30.0
DEFAULT_SCAN_TIMEOUT = 10.0
#: Re-read the tree this long after the last step if the events have not confirmed yet.
DEFAULT_TREE_CHECK_AFTER = 5.0
#: How long an interrupted switch may take to put its group back before it gives up.
DEFAULT_ROLLBACK_TIMEOUT = 30.0
#: Held shared by every switch, alone by one that unloads the nvidia module.
_HOST_LOCK = "switch.lock"
#: How often a switch held by a PCI error recovery under way looks at the model again.
_RECOVERY_POLL = 0.05
#: What may complete a switch: ``device-changed`` too, for the health a rebind clears; and
#: what must end one at once: a function of the group failing or wedging meanwhile.
_PROGRESS_EVENTS = ("driver-changed", "device-added", "device-removed", "device-changed",
                    "resync", "device-error", "gpu-wedged")


#: What a switch did: the ``switch-completed`` event record itself (one record, two JSON
#: views; see `gpuwatch.core.events.SwitchCompleted`). ``changed`` is False for a no-op
#: (already in mode, or no card), which is never published.
SwitchResult = ev.SwitchCompleted


@dataclass(frozen=True, slots=True)
class CdiOutcome:
    ok: bool
    generated: bool
    spec: str | None
    message: str


class EventStream(Protocol):
    """What the engine reads progress from: a subscription (`gpuwatch.watch.subscription`)."""

    async def receive(self) -> Any: ...


#: Publish events (stamped, logged and fanned out by the watcher; never awaits).
Publish = Callable[[Sequence[Any]], None]
#: Subscribe to the events of the given types from now on.
Subscribe = Callable[[Iterable[str]], AbstractAsyncContextManager[EventStream]]
#: Fold freshly read observations into the model, ordered against the pump and resyncs.
Refresh = Callable[[Sequence[Observation]], Awaitable[None]]


class SwitchEngine:
    """Driver switches of one host. `gpuwatch.host.Host` builds one over its watcher."""

    def __init__(
        self,
        model: HostModel,
        ops: HostOps | None = None,
        *,
        publish: Publish,
        subscribe: Subscribe,
        refresh: Refresh,
        geteuid: Callable[[], int] | None = None,
        poison_path: str | os.PathLike[str] | None = None,
        step_timeout: float = DEFAULT_STEP_TIMEOUT,
        scan_timeout: float = DEFAULT_SCAN_TIMEOUT,
        tree_check_after: float = DEFAULT_TREE_CHECK_AFTER,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        self.model = model
        #: Called when the last switch under way has ended (the host's ``stopped`` waits).
        self.on_idle = on_idle
        self._publish = publish
        self._subscribe = subscribe
        self._refresh = refresh
        root = model.paths.root
        if ops is None or geteuid is None:
            backend = make_backend(root)
            ops = ops if ops is not None else backend.ops
            geteuid = geteuid if geteuid is not None else backend.geteuid
        self.ops: HostOps = ops
        self._geteuid: Callable[[], int] = geteuid
        self.poison = PoisonStore(root, poison_path)
        self.step_timeout = step_timeout
        self.scan_timeout = scan_timeout
        self.tree_check_after = tree_check_after
        self.rollback_timeout = DEFAULT_ROLLBACK_TIMEOUT
        self._busy: set[int | str] = set()
        self._idle: anyio.Event | None = None  # set by the `_release` that leaves none busy
        self._exclusive: int | str | None = None
        #: Per switch under way (by its poison key): the functions of its group that were
        #: already unusable until their recovery when it was decided (`_failures`), which
        #: only `recover` plans for; any other failure seen meanwhile is new, and stops it.
        self._failed_at_start: dict[PoisonKey, dict[str, tuple[str, ...]]] = {}
        #: The groups whose switch record (`gpuwatch.switch.journal`) this engine wrote.
        self._journaled: set[PoisonKey] = set()
        for group, entry in self.poison.load().items():
            self.model.poisoned[group] = entry.error

    @property
    def busy(self) -> bool:
        """A switch is under way (claimed and not yet ended, its roll-back included)."""
        return bool(self._busy)

    async def idle(self) -> None:
        """Return once no switch or recover is under way (each is bounded by its steps'
        timeouts and the roll-back's)."""
        while self._busy:
            if self._idle is None:
                self._idle = anyio.Event()
            await self._idle.wait()

    @property
    def root(self) -> str:
        return self.model.paths.root

    def euid(self) -> int:
        return self._geteuid()

    # ------------------------------------------------------------------ public

    async def switch(self, target: str, mode: str, *, timeout: float = DEFAULT_TIMEOUT,
                     tolerant: bool = False, force: bool = False,
                     vfio_driver: str | None = None) -> SwitchResult:
        """Switch the group of ``target`` (an address, or a vendor id naming one card).
        ``force`` passes a group kept for the host (BMC/console, VMD) to vfio anyway, and moves
        a bystander of the group off its host driver (`gpuwatch.core.plan.bystanders_reason`);
        ``vfio_driver`` names the VFIO driver for its display functions (else modules.alias
        chooses, as the kernel would)."""
        to_mode = parse_mode(mode)
        if not (timeout > 0 and math.isfinite(timeout)):
            raise UsageError(f"timeout must be a finite positive number, not {timeout!r}")
        vfio_driver = parse_vfio_driver(vfio_driver, to_mode, self.model.state.vfio_variants)
        addr, vendor = parse_target(target)
        try:
            card, members = find_card(self.model.state, addr=addr, vendor=vendor)
        except DeviceNotFound as exc:
            if not tolerant:
                raise
            return SwitchResult(addr=addr or "", group=-1, from_mode="", to_mode=to_mode,
                                members=[], duration_ms=0.0, changed=False,
                                notes=[f"{exc}: nothing to switch"])
        return await self._switch(card, members, to_mode, timeout, recovering=False,
                                  force=force, vfio_driver=vfio_driver)

    async def recover(self, target: str, *, timeout: float = DEFAULT_TIMEOUT) -> SwitchResult:
        """Rebind the whole group to vfio-pci and clear its poison, unless a task is stuck
        in the nvidia driver: then touch nothing (`RebootRequired`)."""
        if not (timeout > 0 and math.isfinite(timeout)):
            raise UsageError(f"timeout must be a finite positive number, not {timeout!r}")
        addr, vendor = parse_target(target)
        card, members = find_card(self.model.state, addr=addr, vendor=vendor)
        guard = switch_guard(card, "vfio", action="recover")
        if guard is not None:  # an AMD or Intel card: nothing of nvidia's to recover from
            self._refused(card.addr, card.iommu_group, "vfio", guard.reason, ())
            raise SwitchRefused(guard.reason)
        self._require_root("recover")
        # Busy before the wedge scan: a switch of the group under way (here or in another
        # process) has its own unbind in the kernel, which the scan would take for a stuck
        # task, answering "reboot" for a switch that is merely running. Claimed from here on,
        # so that no switch of the group starts meanwhile, and a stopping watcher waits.
        key = poison_key(card)
        self._claim(key)
        try:
            if self._switched_elsewhere(key):
                raise GroupBusy(f"{poison_subject(key)} is being switched by another process")
            if self._switched_elsewhere(None):
                raise GroupBusy("another process is unloading the nvidia module: retry after "
                                "it")
            return await self._recover(card, members, timeout)
        finally:
            self._release(key)

    async def _recover(self, card: PciFunction, members: Sequence[PciFunction],
                       timeout: float) -> SwitchResult:
        """`recover` once the group is claimed: the wedge scan, then the rebind."""
        deadline = self.model.proc_deadline
        scan = await call_bounded(lambda: scan_wedge(self.root, deadline=deadline),
                                  deadline + 1, "the wedge scan")
        # Each refusal is a `switch-refused` event too, as every other refusal of a switch or
        # a recover is: an operator counting outcomes (the metrics) sees these as well.
        if scan.wedged:
            why = f"{scan.describe()}: a reboot is required; nothing was touched"
            self._refused(card.addr, card.iommu_group, "vfio", why, ())
            raise RebootRequired(why)
        if scan.removing:
            # Not nvidia's wedge, but an unbind that has not returned (vfio-pci waiting for a
            # VM to let go, snd_hda_intel for open files): a bind now adds a second stuck task.
            why = (f"{scan.describe()}: not touching the device until it returns (close what "
                   "holds it), or reboot")
            self._refused(card.addr, card.iommu_group, "vfio", why, ())
            raise SwitchRefused(why)
        if not scan.complete:
            why = f"{scan.describe()}; not touching the device"
            self._refused(card.addr, card.iommu_group, "vfio", why, ())
            raise SwitchRefused(why)
        # After a wedge the events may lag or be lost (the stuck unbind that returned at last
        # said nothing yet): decide "already on vfio-pci" from the tree, not the model alone.
        addrs = [m.addr for m in members]
        await self._read_now(addrs)
        card, members = find_card(self.model.state, addr=card.addr)
        result = await self._switch(card, members, "vfio", timeout, recovering=True,
                                    claimed=True)
        group = card.iommu_group
        key = poison_key(card)
        try:
            cleared = self.poison.clear(key)
            # A wedge recorded under the number the group had before the card was removed
            # and added again (the kernel may renumber it): keyed by a number no longer the
            # card's, nothing else would ever lift it, and it would refuse whatever group
            # gets that number next. Its entry names the card: the card is recovered.
            ours = {m.addr for m in self.model.state.group_members(card.addr)}
            renumbered = [k for k, entry in self.poison.load().items()
                          if k != key and entry.addr in ours]
            for old in renumbered:
                self.poison.clear(old)
                self.model.poisoned.pop(old, None)
        except OSError as exc:
            # The group is on vfio-pci, but the record still says poisoned: a restarted
            # watcher (and every `gpuwatch mode`) would refuse it. Keep refusing it here too,
            # and say so, rather than report a recovery that did not stick.
            raise SwitchFailed(
                f"IOMMU group {group} is on vfio-pci again, but its poison record in "
                f"{self.poison.path} could not be cleared ({exc.strerror or exc}): it stays "
                "refused until `gpuwatch recover` can clear it, or the next boot") from None
        was = self.model.poisoned.pop(key, None) is not None
        notes = [*result.notes]
        if cleared or was:
            notes.append(f"poison of group {group} cleared")
        notes += [f"poison of {poison_subject(old)} cleared (recorded for {card.addr} before "
                  f"it was removed and added again, in {_group_text(group)})" for old in renumbered]
        return result.model_copy(update={"notes": notes})

    async def plan(self, target: str, mode: str, *, force: bool = False,
                   vfio_driver: str | None = None) -> dict[str, Any]:
        """The plan a switch would follow now, as JSON (the ``plan`` probe, over the socket)."""
        to_mode = parse_mode(mode)
        vfio_driver = parse_vfio_driver(vfio_driver, to_mode, self.model.state.vfio_variants)
        addr, vendor = parse_target(target)
        model = self.model
        card, members = find_card(model.state, addr=addr, vendor=vendor)  # never invented
        await self._reload_poison()
        known = model_facts(model.state, members, model.poisoned.get(poison_key(card), ""))
        deadline, euid = model.proc_deadline, self.euid()
        facts = await call_bounded(
            lambda: gather_facts(self.model.paths, members, to_mode, known, euid=euid,
                                 which=self.ops.which, vfio_driver=vfio_driver,
                                 deadline=deadline),
            min(self.scan_timeout, deadline + 1), "the holder scan")
        ours = [m.addr for m in members]
        unpin = _pinned_by(self._abandoned(poison_key(card), ours), ours)
        if unpin:  # what `mode` would clear too
            facts = dataclasses.replace(facts, unpin=unpin)
        return plan_switch(members, to_mode, facts, force=force).to_json()

    async def holders(self, target: str) -> dict[str, Any]:
        """Who holds the card's nodes, read off the event loop."""
        addr, vendor = parse_target(target)
        model = self.model
        find_card(model.state, addr=addr, vendor=vendor)  # DeviceNotFound before any scan
        euid = self.euid()
        return await call_bounded(
            lambda: holders_report(model, addr=addr, vendor=vendor, euid=euid),
            model.proc_deadline + 1, "the holder scan")

    # ------------------------------------------------------------------ the switch

    async def _reload_poison(self) -> None:
        """Take in the wedges other processes recorded since this engine started (a
        `gpuwatch mode --log` beside the daemon, a daemon restarted meanwhile): the file is
        the record across processes, and a switch of a group wedged there must be refused
        here too. Only added, never dropped: a poison of ours whose write failed stays."""
        try:
            entries = await call_bounded(self.poison.load, self.scan_timeout,
                                         "reading the poison record")
        except (StepTimedOut, OSError):
            return
        for key, entry in entries.items():
            self.model.poisoned.setdefault(key, entry.error)

    async def _switch(self, card: PciFunction, members: Sequence[PciFunction], to_mode: Mode,
                      timeout: float, *, recovering: bool, force: bool = False,
                      vfio_driver: str | None = None, claimed: bool = False) -> SwitchResult:
        """``claimed``: the caller (`recover`) holds the group's claim, and lets it go."""
        started = time.monotonic()
        deadline = started + timeout
        group = card.iommu_group
        # Poison first: a wedged device "in mode" is still unusable. Then the vendor (nvidia
        # drives NVIDIA cards only) and the host's own console. Saying so needs no privilege
        # and writes nothing, so it comes before "already in mode" and the root check.
        if not recovering:
            await self._reload_poison()
            guard = switch_guard(
                card, to_mode, poisoned=self.model.poisoned.get(poison_key(card), ""),
                kept_for_host=self.model.state.kept_for_host(card.addr)
                if to_mode == "vfio" else "",
                force=force)
            if guard is not None:
                self._refused(card.addr, group, to_mode, guard.reason, ())
                raise (GroupPoisoned if guard.poisoned else SwitchRefused)(guard.reason)
        # A wedged or failed function needs its recovery, not a rebind by a switch: refused
        # even when the group is in mode, since it is unusable either way. A PCI error
        # recovery under way refuses `recover` too: the kernel is resetting the device.
        health = health_facts(self.model.state, members)
        unhealthy = unhealthy_reason(members, health, recover=recovering)
        if unhealthy is not None:
            self._refused(card.addr, group, to_mode, unhealthy, ())
            raise SwitchRefused(unhealthy)
        key = poison_key(card)  # the lock's name too: a card without a group by its address
        if key in self._busy and not claimed:
            # Before "already in mode": a switch of the group that has begun but not yet
            # moved a driver leaves the model in the mode it is leaving, and answering "in
            # mode" would send the caller off to use a card on its way out.
            raise GroupBusy(f"{poison_subject(key)} is already being switched")
        # `recover` rebinds a wedged or failed function even where it already is (its
        # recovery): "already in mode" would leave it refused as it was.
        rebind = recovering and any(needs_recovery(m, health) for m in members)
        if not rebind and already_in_mode(members, to_mode, self.model.state.vfio_variants,
                                          vfio_driver):
            if self._switched_elsewhere(key):
                # The same reason as `_busy` above, for a switch another process runs (a
                # `gpuwatch mode` beside the daemon, a second orchestrator).
                raise GroupBusy(f"{poison_subject(key)} is being switched by another process")
            # In mode, but an earlier switch's process died half-way (SIGKILL): a function
            # may still be pinned by its driver_override, which vfio mode never leaves. Root
            # clears it (below); anyone else is told.
            left = self._abandoned(key, [m.addr for m in members]) if to_mode == "vfio" \
                else []
            if not left or self.euid() != 0:
                notes = [f"already in mode {to_mode}: nothing written"]
                notes += [self._abandoned_note(j) for _, j in left]
                return self._result(card.addr, group, to_mode, to_mode, started,
                                    changed=False, notes=notes)
        self._require_root("switching drivers")
        if not claimed:
            self._claim(key)
        try:
            fd = self._flock(key)
            try:
                host_fd = self._host_flock()
                try:
                    return await self._locked(card.addr, key, to_mode, started, deadline,
                                              host_fd, force=force or recovering,
                                              recovering=recovering, vfio_driver=vfio_driver)
                finally:
                    # Its end is published (or it never began): the record goes. Not on a
                    # SIGKILL, which runs nothing: then the record tells the next one.
                    if key in self._journaled:
                        self._journaled.discard(key)
                        with suppress(OSError):
                            remove_journal(self._lock_dir(), key)
                    os.close(host_fd)
            finally:
                os.close(fd)
        finally:
            if not claimed:
                self._release(key)

    async def _locked(self, addr: str, key: int | str, to_mode: Mode, started: float,
                      deadline: float, host_fd: int, *, force: bool = False,
                      recovering: bool = False,
                      vfio_driver: str | None = None) -> SwitchResult:
        # Holding the group's lock: a record of a switch found now is one whose process
        # ended without ending it (SIGKILL). Say so, once, and clear what it may have pinned.
        state = self.model.state
        ours = [m.addr for m in state.group_members(addr)] if addr in state.functions else []
        abandoned = self._leftover(key, ours)
        unpin = _pinned_by(abandoned, ours)
        facts, plan = await self._decide(addr, to_mode, deadline, force=force,
                                         recovering=recovering, vfio_driver=vfio_driver,
                                         unpin=unpin)
        if plan.unloads_nvidia:
            others = sorted(str(k) for k in self._busy if k != key)
            if others:
                raise GroupBusy(f"unloading the nvidia module needs the host to itself, and "
                                f"group {', '.join(others)} is being switched: retry after it")
            self._exclusive = key
            self._host_exclusive(host_fd)
            # The facts were read while other switches could still run (and end): one may
            # have put a card on nvidia since. Decide again with the host to ourselves, or the
            # unload would take that card off its driver.
            facts, plan = await self._decide(addr, to_mode, deadline, force=force,
                                             recovering=recovering, vfio_driver=vfio_driver,
                                             unpin=unpin)
        group = plan.group
        if not plan.steps:
            # In mode, nothing of them left to clear: they are over.
            self._drop_adopted(key, abandoned, own=True)
            return self._result(plan.addr, group, plan.from_mode, to_mode, started, changed=False,
                                notes=list(plan.notes))
        await self._refuse_a_copy(plan)
        self._journal(key, plan, unpin)
        if key in self._journaled:  # its own record says what they may have left now
            self._drop_adopted(key, abandoned, own=False)
        self._failed_at_start[plan.poison_key] = self._failures(plan)
        self._publish([ev.SwitchStarted(
            addr=plan.addr, group=group, from_mode=plan.from_mode, to_mode=to_mode,
            members=[a for a, _ in plan.targets])])
        _log.info("switch of group %s to %s: %d step(s)", group, to_mode, len(plan.steps))
        notes = list(plan.notes)
        done: list[CommandStep] = []  # the service and module steps that ran and succeeded
        pending: list[BaseModel] = []
        token: contextvars.Token[list[BaseModel] | None] | None = _DEFERRED.set(pending)
        in_flight: list[Step] = []  # the step under way: a write that has not returned
        pinned: list[str] = []  # functions given a driver_override of ours not yet cleared
        try:
            try:
                async with self._subscribe(_PROGRESS_EVENTS) as sub:
                    no_folder = False  # the CDI folder could not be made: no nvidia-ctk
                    for step in plan.steps:
                        if no_folder and isinstance(step, CommandStep) \
                                and step.argv[0] == "nvidia-ctk":
                            continue
                        # Before the step counts as begun: nothing of it was written.
                        await self._await_recovery(plan, step, deadline, notes)
                        self._stop_on_failure(plan, f"before {step.describe()}")
                        if isinstance(step, WriteStep):
                            await self._stop_if_renumbered(plan, f"before {step.describe()}")
                        in_flight[:] = [step]
                        _track_pin(pinned, step, before=True)  # a write that fails may count
                        ok = await self._step(plan, facts, step, deadline, notes)
                        no_folder = no_folder or (not ok and isinstance(step, MakeDirStep))
                        in_flight.clear()
                        _track_pin(pinned, step, before=False)
                        if ok and isinstance(step, CommandStep):
                            done.append(step)
                            self._note_service(step.argv)
                    await self._verify(plan, facts, sub, deadline, notes)
            except (SwitchRefused, SwitchFailed):
                raise
            except Exception as exc:
                # Not one of ours (an embedder's HostOps, a bug): still a failure of this
                # switch, restored from and ended like any other, never `switch-started` alone.
                _log.info("switch of group %s: unexpected error", group, exc_info=True)
                self._fail(plan, f"{type(exc).__name__}: {exc}")
        except (SwitchRefused, SwitchFailed) as exc:
            if token is not None:
                _DEFERRED.reset(token)
                token = None
            # Leave the host as found: a refused or failed switch starts again what it stopped
            # and loads again what it unloaded. Not after a wedge: touching a device a task is
            # stuck on only adds another stuck task (reboot, or `gpuwatch recover`).
            wedged = isinstance(exc, SwitchWedged)
            commands: list[str] = []
            stuck = False
            left = ""
            # Shielded and bounded like an interrupted switch's roll-back: a signal arriving
            # now must not leave the modules unloaded, nor `switch-started` without its end.
            with anyio.CancelScope(shield=True), anyio.move_on_after(
                    self.rollback_timeout) as bound:
                if not wedged:
                    commands, stuck = await self._unpin(plan, pinned)
                if not (wedged or stuck):
                    more, stuck = await self._restore(plan, facts, done)
                    commands += more
                # The drivers are not put back (only an interrupted switch does that): say
                # which functions are left on another driver, so nobody reads "restored" as
                # "as found".
                if not (wedged or stuck):
                    left = await self._left_changed(plan)
            if bound.cancelled_caught:
                commands.append(f"(restoring ran out of its {self.rollback_timeout:g}s)")
            restored = [*commands, left] if left else commands
            for event in pending:
                update: dict[str, Any] = {"restored": restored}
                if stuck and isinstance(event, ev.SwitchFailed):
                    update["wedged"] = True
                self._publish([event.model_copy(update=update) if restored else event])
            if restored:
                exc.restored = tuple(restored)
                text = str(exc)
                if commands:
                    text += f"; restored what the switch had changed: {', '.join(commands)}"
                if left:
                    text += f"; {left}"
                exc.args = (text,)
                if isinstance(exc, SwitchRefused):
                    exc.reason = text
            raise
        except BaseException as exc:
            # Cancelled (SIGINT/SIGTERM, a caller's timeout): `switch-started` must not be
            # left without an end. Failures and refusals published their own already.
            # Before saying so, the group goes back to the mode it was in (shielded, bounded):
            # an interrupted switch never leaves a half-switched group behind.
            if not isinstance(exc, Exception):
                if token is not None:
                    _DEFERRED.reset(token)
                    token = None
                undone: list[str] = []
                rolling: list[Step] = []  # the roll-back's step under way
                wedged = False
                with anyio.CancelScope(shield=True), anyio.move_on_after(
                        self.rollback_timeout) as bound:
                    wedged = await self._roll_back(plan, facts, done, in_flight, undone,
                                                   rolling, pinned, host_fd)
                if bound.cancelled_caught:
                    undone.append(f"(the roll-back ran out of its {self.rollback_timeout:g}s)")
                    if rolling:  # cut off in the middle of a kernel write: it may be stuck
                        undone.append(self._poison(plan, (
                            f"{rolling[0].describe()} had not returned when the roll-back ran "
                            "out of time: the device may be wedged")))
                        wedged = True
                self._publish([ev.SwitchFailed(addr=plan.addr, group=group, to_mode=to_mode,
                                               error="interrupted", wedged=wedged,
                                               restored=undone)])
            raise
        finally:
            if token is not None:
                _DEFERRED.reset(token)
        if to_mode == "nvidia" and facts.persistenced:
            # Someone started it while the card was away: the record of the switch that stopped
            # it is spent (kept, it would restart the unit later against a deliberate stop).
            self._note_service(("systemctl", "start", PERSISTENCED_UNIT))
        result = self._result(plan.addr, group, plan.from_mode, to_mode, started, changed=True,
                              notes=notes)
        self._publish([result])  # the caller gets the record its subscribers got
        return result

    async def _decide(self, addr: str, to_mode: Mode, deadline: float, *, force: bool,
                      recovering: bool, vfio_driver: str | None,
                      unpin: tuple[str, ...] = ()) -> tuple[HostFacts, SwitchPlan]:
        """Read the host facts off the event loop and plan from them; a refusal is published
        and raised here."""
        state = self.model.state
        if addr not in state.functions:
            raise DeviceNotFound(f"{addr} is gone from this host: nothing to switch")
        members = state.group_members(addr)
        known = model_facts(state, members)
        group = members[0].iommu_group
        proc_deadline, euid = self.model.proc_deadline, self.euid()
        try:
            facts = await call_bounded(
                lambda: gather_facts(self.model.paths, members, to_mode, known,
                                     euid=euid, which=self.ops.which,
                                     vfio_driver=vfio_driver, deadline=proc_deadline),
                max(0.1, min(self.scan_timeout, proc_deadline + 1,
                           deadline - time.monotonic())),
                "the holder scan")
        except StepTimedOut as exc:
            reason = f"{exc}: a process may be stuck (gpuwatch probe wedge-detected)"
            self._refused(addr, group, to_mode, reason, ())
            raise SwitchRefused(reason) from None
        if unpin:
            facts = dataclasses.replace(facts, unpin=unpin)
        try:
            plan = plan_switch(members, to_mode, facts, force=force, recovering=recovering)
        except UnsafeName as exc:
            self._refused(addr, group, to_mode, str(exc), ())
            raise
        if plan.refusal is not None:
            self._refused(plan.addr, group, to_mode, plan.refusal.reason, plan.refusal.holders)
            raise SwitchRefused(plan.refusal.reason, plan.refusal.holders)
        return facts, plan

    async def _refuse_a_copy(self, plan: SwitchPlan) -> None:
        """A tree whose bus entries are folders (a capture with its links flattened), or whose
        functions have no ``vendor`` (an ``rsync -a`` copy, `copied_entries`), is no
        host: every write of the switch would land in a copy, and the switch would then wait
        for binds that cannot come and blame another driver. Refused before anything is
        written, naming the entry."""
        paths, addrs = self.model.paths, [m.addr for m in plan.members]
        try:
            copied = await call_bounded(lambda: copied_entries(paths, addrs), self.scan_timeout,
                                        "reading the tree")
        except StepTimedOut as exc:
            copied, why = [], f"{exc}; nothing was written"
        else:
            why = ""
        if copied:
            addr, folder = copied[0]
            entry = os.path.join(paths.bus_pci, addr)
            if folder:
                why = (f"{entry} is a folder, not the kernel's link to the device: this tree is "
                       "a copy of a host's sysfs (links flattened into folders, as capture "
                       "tools leave them), and a write to it would land in the copy, not in a "
                       "device; switch on the live host (nothing was written)")
            else:
                why = (f"{entry} has no vendor attribute: this tree is a copy of a host's "
                       "sysfs (text attributes dropped, as rsync leaves them), and a write to "
                       "it would land in the copy, not in a device; switch on the live host "
                       "(nothing was written)")
        if why:
            self._refused(plan.addr, plan.group, plan.to_mode, why, ())
            raise SwitchRefused(why)

    async def _roll_back(self, plan: SwitchPlan, facts: HostFacts, done: Sequence[CommandStep],
                         in_flight: Sequence[Step], restored: list[str],
                         rolling: list[Step], pinned: Sequence[str] = (),
                         host_fd: int | None = None) -> bool:
        """An interrupted switch: clear the ``driver_override`` values it wrote (``pinned``),
        bring the group back to the mode it was in (a switch back, planned from the tree as
        it is now, with a fresh holder scan), then start again what the switch stopped.
        ``restored`` says what was done, step by step; ``rolling`` holds the step under way.
        True when a step of the roll-back wedged (the group poisoned).

        The overrides go first, whatever follows: a group that was in no one mode (mixed) is
        not put back, and a switch back can be refused or fail, yet neither may leave a
        function pinned to a driver by a switch that did not happen.

        Not when the interrupted step was an unbind and a task is (or may be) stuck in the
        driver's remove: touching that device only adds a second stuck task (the wedge rule)."""
        unbind = next((s for s in in_flight if isinstance(s, WriteStep)
                       and s.path.endswith("/unbind")), None)
        if unbind is not None:
            deadline = self.model.proc_deadline
            try:
                wedge = await call_bounded(lambda: scan_wedge(self.root, deadline=deadline),
                                           deadline + 1, "the wedge scan")
                stuck = wedge.any_stuck
            except StepTimedOut:
                stuck = True
            if stuck:
                restored.append(f"nothing: interrupted during `{unbind.describe()}`, and a "
                                "task may be stuck in the kernel (gpuwatch probe "
                                "wedge-detected)")
                return False
        cleared, stuck = await self._unpin(plan, pinned, rolling)
        restored.extend(cleared)
        if stuck:
            return True  # a wedge: nothing more is touched
        functions = self.model.state.functions
        moved = [f"{a} is in {_group_text(fn.iommu_group)} now" for a in
                 (m.addr for m in plan.members) if (fn := functions.get(a)) is not None
                 and _renumbered(plan.group, fn.iommu_group)]
        if moved:
            # Removed and added again under the switch: its new group is not the one this
            # switch holds, and a switch back planned from it would write there unlocked.
            restored.append(f"group {plan.group} not put back: {', '.join(moved)} (removed "
                            "and added again during the switch)")
            commands, stuck = await self._restore(plan, facts, done)
            restored.extend(commands)
            return stuck
        failure = self._new_failure(plan)
        if failure is not None:
            # Putting the drivers back is an unbind and a bind of a device the kernel gave up
            # on (or wedged): the group is left for its recovery, as it is now.
            left = await self._left_changed(plan)
            restored.append(f"group {plan.group} not put back: {failure}: left for its "
                            "recovery" + (f"; {left}" if left else ""))
            commands, stuck = await self._restore(plan, facts, done)
            restored.extend(commands)
            return stuck
        # A group that was neither wholly (a half-done earlier switch) is left as it is now.
        back = next((m for m in ("vfio", "nvidia") if m == plan.from_mode), None)
        home = plan.from_mode in RETURN_MODES  # a host driver's group (amdgpu), or unbound
        started: list[str] = []  # services the switch back started (persistenced, recorded)
        if back is not None and await self._drivers_back(plan, back, restored, rolling,
                                                         started, host_fd):
            return True  # a wedge: nothing more is touched
        if home and await self._drivers_home(plan, restored, rolling):
            return True
        commands, stuck = await self._restore(plan, facts, done, started)
        restored.extend(commands)
        if back is None and not home and not stuck:
            # Not put back: say so, and where each function is now, so that nobody reads
            # `restored` as "as found".
            left = await self._left_changed(plan)
            restored.append(f"group {plan.group} was {plan.from_mode} before the switch (in "
                            "no one mode): its drivers are not put back"
                            + (f"; {left}" if left else ""))
        return stuck

    async def _drivers_back(self, plan: SwitchPlan, back: Mode, restored: list[str],
                            rolling: list[Step], started: list[str],
                            host_fd: int | None = None) -> bool:
        """The switch back of an interrupted switch. Back to vfio on a host where no other
        card is on nvidia, it would unload the nvidia module; the interrupted switch (to
        nvidia) never took the host to itself, so another switch may be under way that
        needs the module (one between its `modprobe nvidia` and its bind, or just done).
        Then the card is unbound from nvidia alone (after its holder scan), as on a host
        whose other GPUs stay on nvidia, and the module stays."""
        addrs = [m.addr for m in plan.members]
        paths, state = self.model.paths, self.model.state
        try:
            await self._read_now(addrs)
            members = state.group_members(plan.addr)
            known = model_facts(state, members)
            euid, proc_deadline = self.euid(), self.model.proc_deadline

            async def planned(known: ModelFacts) -> tuple[HostFacts, SwitchPlan]:
                facts = await call_bounded(
                    lambda: gather_facts(paths, members, back, known, euid=euid,
                                         which=self.ops.which, deadline=proc_deadline),
                    min(self.scan_timeout, proc_deadline + 1), "the holder scan")
                return facts, plan_switch(members, back, facts, force=True, recovering=True,
                                          rebind=False)

            facts, undo = await planned(known)
            if undo.unloads_nvidia:
                others = self._others_switching(plan.poison_key, host_fd)
                if others:
                    facts, undo = await planned(dataclasses.replace(known, other_nvidia=others))
        except (StepTimedOut, UnsafeName, DeviceNotFound, OSError) as exc:
            restored.append(f"group {plan.group} not put back: {exc}")
            return False
        if undo.refusal is not None:
            restored.append(f"group {plan.group} not put back: {undo.refusal.reason}")
            return False
        pins: list[str] = []  # the switch back's own overrides, not yet cleared
        ended = await self._run_back(plan, undo.steps, restored, rolling, started, pins)
        if ended is not None:
            return ended
        targets = dict(undo.targets)
        if not self._reached(undo, facts):
            restored.append(f"group {plan.group} not back in mode {back}: "
                            + self._drivers_text(targets))
            # Not back: the overrides of a switch back that did not happen go too.
            return await self._unpin_back(plan, pins, restored, rolling)
        return False

    async def _drivers_home(self, plan: SwitchPlan, restored: list[str],
                            rolling: list[Step]) -> bool:
        """The roll-back of a group that was in a `RETURN_MODES` state (the display on a
        host driver such as amdgpu, or nothing bound): no switch goes there, so each
        function is put back on the driver it had (`return_steps`), after a fresh holder scan
        of what must be unbound (a VM may have opened the group meanwhile). True on a wedge."""
        addrs = [m.addr for m in plan.members]
        before = {m.addr: m.driver for m in plan.members}
        paths, state = self.model.paths, self.model.state
        try:
            await self._read_now(addrs)
            now = [fn for a in addrs if (fn := state.functions.get(a)) is not None]
            steps = return_steps(now, before)
            leaving = [fn for fn in now if fn.driver and any(
                isinstance(s, WriteStep) and s.value == fn.addr and s.path.endswith("/unbind")
                for s in steps)]
            known = model_facts(state, leaving)
            deadline = self.model.proc_deadline
            holders = await call_bounded(
                lambda: card_holders(paths, known, leaving, deadline=deadline),
                min(self.scan_timeout, deadline + 1), "the holder scan") if leaving else []
        except (StepTimedOut, OSError) as exc:
            restored.append(f"group {plan.group} not put back: {exc}")
            return False
        if holders:
            restored.append(f"group {plan.group} not put back: {holders_reason(holders)}")
            return False
        pins: list[str] = []
        ended = await self._run_back(plan, steps, restored, rolling, [], pins)
        if ended is not None:
            return ended
        off = [a for a, was in before.items() if (fn := state.functions.get(a)) is not None
               and fn.driver != was and not host_bridge(fn)]
        if off:
            where = ", ".join(f"{a} on {state.functions[a].driver or 'no driver'} (was "
                              f"{before[a] or 'no driver'})" for a in off)
            restored.append(f"group {plan.group} not back as it was ({plan.from_mode}): {where}")
            return await self._unpin_back(plan, pins, restored, rolling)
        return False

    async def _run_back(self, plan: SwitchPlan, steps: Sequence[Step], restored: list[str],
                        rolling: list[Step], started: list[str], pins: list[str]) -> bool | None:
        """Run the steps of a switch back one by one, saying each in ``restored``; None when
        every one ran and the group's functions were read again (the caller then judges
        where they are), else the roll-back's end: True on a wedge (the group poisoned),
        False when a step failed (the overrides it wrote cleared) or the read did not
        return."""
        for step in steps:
            rolling[:] = [step]
            _track_pin(pins, step, before=True)
            try:
                match step:
                    case WriteStep(path=path, value=value):
                        await self.ops.write(path, value, self.step_timeout)
                    case CommandStep(argv=argv):
                        result = await self.ops.run(argv, self.step_timeout)
                        if not result.ok and step.on_error != "warn":
                            rolling.clear()
                            restored.append(f"{step.describe()} (failed: {result.message()})")
                            return await self._unpin_back(plan, pins, restored, rolling)
                        if result.ok:
                            self._note_service(argv)
                            if argv[:2] == ("systemctl", "start"):
                                started.append(argv[2])
                    case MakeDirStep(path=path):
                        await self.ops.makedirs(path)
            except StepTimedOut as exc:
                # Stuck in the kernel, as any step that does not return: the wedge rule.
                rolling.clear()
                restored.append(self._poison(plan, (
                    f"{step.describe()} did not return within {exc.timeout:.3g}s: the device "
                    "is wedged")))
                return True
            except (HostStepError, UnsafeStep, OSError) as exc:
                rolling.clear()
                restored.append(f"{step.describe()} (failed: {exc})")
                return await self._unpin_back(plan, pins, restored, rolling)
            rolling.clear()  # not on cancellation: a step cut off by the bound may be stuck
            _track_pin(pins, step, before=False)
            restored.append(step.describe())
        try:
            await self._read_now([m.addr for m in plan.members])
        except StepTimedOut as exc:
            restored.append(f"group {plan.group}: {exc}")
            return False
        return None

    async def _unpin_back(self, plan: SwitchPlan, pins: Sequence[str], restored: list[str],
                          rolling: list[Step]) -> bool:
        """A switch back that failed half-way clears the overrides it wrote, as any failed
        switch does; True on a wedge."""
        cleared, stuck = await self._unpin(plan, pins, rolling)
        restored.extend(cleared)
        return stuck

    async def _unpin(self, plan: SwitchPlan, pinned: Sequence[str],
                     rolling: list[Step] | None = None) -> tuple[list[str], bool]:
        """A switch that failed or was interrupted after a function's ``driver_override``
        write (and, to vfio, before its clearing) left the function pinned to that driver:
        nothing else would ever bind it (not the module reloaded next, not an operator's
        ``drivers_probe``). Clear each one, and say so; a function gone from the bus has no
        override left. True when a write did not return (the wedge rule: nothing more is
        run). ``rolling`` holds the write under way, for a bound that cuts it off.

        Only to a function that is still there and not newly unusable: the tree is read
        again first (a removal's uevent may lag), and a function gone from the bus, or one
        that failed or wedged during the switch (`_new_failure`), gets no write at all (the
        write takes the lock of a device the kernel gave up on; its recovery, a remove and
        rescan, a reboot, drops the override with the device)."""
        done: list[str] = []
        if pinned:
            addrs = list(pinned)
            # Not read in time: the model as it is (a write to a function gone fails, and
            # says so).
            with suppress(StepTimedOut):
                await self._read_now(addrs)
        failures = self._new_failures(plan)
        for addr in pinned:
            fn = self.model.state.functions.get(addr)
            if fn is None:
                done.append(f"{addr} gone: no override left to clear")
                continue
            if _renumbered(plan.group, fn.iommu_group):
                # Removed and added again (`_stop_on_a_renumbered_function`): the override
                # went with the device that left, and the new group is not ours to write to.
                done.append(f"{addr} is in {_group_text(fn.iommu_group)} now (removed and "
                            "added again): no override of this switch's left to clear")
                continue
            if addr in failures:
                done.append(f"{failures[addr]}: its driver_override is left for its "
                            "recovery, not cleared")
                continue
            step = WriteStep(override_path(addr), CLEAR_OVERRIDE)
            if rolling is not None:
                rolling[:] = [step]
            try:
                await self.ops.write(step.path, step.value, self.step_timeout)
            except StepTimedOut as exc:
                if rolling is not None:
                    rolling.clear()
                done.append(self._poison(plan, f"{step.describe()} did not return within "
                                               f"{exc.timeout:.3g}s: the device is wedged"))
                return done, True
            except (HostStepError, UnsafeStep, OSError) as exc:
                if rolling is not None:
                    rolling.clear()
                gone = isinstance(exc, OSError) and exc.errno in (errno.ENODEV, errno.ENOENT)
                done.append(f"{addr} gone: no override left to clear" if gone
                            else f"{step.describe()} (failed: {exc})")
                continue
            if rolling is not None:
                rolling.clear()
            done.append(step.describe())
        return done, False

    async def _left_changed(self, plan: SwitchPlan) -> str:
        """After a failed or refused switch has restored its services and modules: ``""``
        when every function of the group is on the driver it had before, else the group's
        drivers now, as the tree shows them (folded into the model too)."""
        addrs = [m.addr for m in plan.members]
        paths = self.model.paths
        try:
            seen = await call_bounded(lambda: [read_function(paths, a) for a in addrs],
                                      self.scan_timeout, "re-reading the tree")
        except StepTimedOut as exc:
            return f"group {plan.group} may not be as it was: {exc}"
        await self._refresh(seen)
        functions = self.model.state.functions
        parts: list[str] = []
        changed = False
        for before in plan.members:
            was = before.driver or "no driver"
            fn = functions.get(before.addr)
            if fn is None:
                parts.append(f"{before.addr} gone (was {was})")
            elif _renumbered(before.iommu_group, fn.iommu_group):
                parts.append(f"{before.addr} on {fn.driver or 'no driver'} in "
                             f"{_group_text(fn.iommu_group)} (was {was} in "
                             f"{_group_text(before.iommu_group)})")
            elif fn.driver != before.driver:
                parts.append(f"{before.addr} on {fn.driver or 'no driver'} (was {was})")
            else:
                parts.append(f"{before.addr} on {was}")
                continue
            changed = True
        return f"group {plan.group} is not as it was: {', '.join(parts)}" if changed else ""

    async def _restore(self, plan: SwitchPlan, facts: HostFacts, done: Sequence[CommandStep],
                       started: Sequence[str] = ()) -> tuple[list[str], bool]:
        """Start again the services the switch stopped and load again the modules it
        removed (those that are gone now), newest first; return what was run, and True when
        one of them did not return (a wedge: the group is poisoned, nothing more is run)."""
        stopped = [s.argv[2] for s in done if s.argv[:2] == ("systemctl", "stop")]
        restarted = {s.argv[2] for s in done if s.argv[:2] == ("systemctl", "start")}
        restarted.update(started)  # by a roll-back's switch back already
        removal = [name for s in done if s.argv[:2] == ("modprobe", "-r") for name in s.argv[2:]]
        # A `modprobe -r` that failed half-way removed some of its modules: look, don't guess.
        tried = [name for s in plan.steps if isinstance(s, CommandStep)
                 and s.argv[:2] == ("modprobe", "-r") for name in s.argv[2:]]
        try:
            now = await call_bounded(lambda: read_modules(self.model.paths),
                                     self.step_timeout, "reading sys/module")
        except StepTimedOut:
            now = frozenset(m for m in facts.modules if m not in removal)
        gone = [m for m in dict.fromkeys([*removal, *tried])
                if m in facts.modules and m not in now]
        steps: list[tuple[str, ...]] = [("modprobe", m) for m in reversed(gone)]
        steps += [("systemctl", "start", unit) for unit in dict.fromkeys(reversed(stopped))
                  if unit not in restarted]
        hold = self._recovery_under_way(plan) if steps else None
        failure = self._new_failure(plan) if steps and hold is None else None
        if hold is not None or failure is not None:
            # Loading nvidia again probes the card (a bind), and its service may load it:
            # not while the kernel resets the device, nor onto one that failed or wedged
            # during the switch. Say what is left to do.
            left = "; ".join(" ".join(argv) for argv in steps)
            _log.info("switch of group %s: not restoring while %s", plan.group,
                      hold or failure)
            if hold is not None:
                return [f"not run while {hold}: {left} (run once it ends)"], False
            return [f"not run while {failure}: {left} (run once it is recovered)"], False
        restored: list[str] = []
        for argv in steps:
            what = " ".join(argv)
            try:
                result = await self.ops.run(argv, self.step_timeout)
            except StepTimedOut as exc:
                # A module load stuck in its probe of the card, like any step that does not
                # return: the wedge rule, and nothing more loaded on top of it.
                restored.append(self._poison(plan, f"`{what}` did not return within "
                                                   f"{exc.timeout:.3g}s: the device is wedged"))
                _log.info("switch of group %s: restored %s", plan.group, ", ".join(restored))
                return restored, True
            except (HostStepError, UnsafeStep, OSError) as exc:
                restored.append(f"{what} (failed: {exc})")
                continue
            restored.append(what if result.ok else f"{what} (failed: {result.message()})")
            if result.ok:
                self._note_service(argv)
        if restored:
            _log.info("switch of group %s: restored %s", plan.group, ", ".join(restored))
        return restored, False

    async def _step(self, plan: SwitchPlan, facts: HostFacts, step: Step, deadline: float,
                    notes: list[str]) -> bool:
        """Run one step; False when a command failed in a way that only warns, or the CDI
        spec's folder could not be made (a note, as such a command's failure)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            self._fail(plan, f"the switch ran out of time before: {step.describe()}")
        timeout = min(self.step_timeout, remaining)
        _log.info("step: %s", step.describe())
        try:
            match step:
                case WriteStep(path=path, value=value):
                    if path.endswith("/unbind"):
                        await self._guard_unbind(plan, facts, step, deadline)
                    await self.ops.write(path, value, timeout)
                case CommandStep(argv=argv):
                    result = await self.ops.run(argv, timeout)
                    if not result.ok:
                        await self._command_failed(plan, facts, step, result, deadline, notes)
                        return False
                case MakeDirStep():
                    why = await _make_dir(self.ops, step)
                    if why is not None:
                        # Only the CDI spec's folder is made, and that spec only warns (as its
                        # nvidia-ctk step does): the drivers have moved, the switch completes.
                        _log.info("%s", why)
                        notes.append(why)
                        return False
                case _:
                    assert_never(step)
        except StepTimedOut as exc:
            self._wedge(plan, step, exc)
        except (HostStepError, UnsafeStep, OSError) as exc:
            if isinstance(exc, OSError) and exc.errno == errno.ENODEV:
                # No such device: maybe removed and added again under the switch (its uevents
                # not read yet). Say that rather than the bare errno, from the tree.
                with suppress(StepTimedOut):
                    await self._read_now([a for a, _ in plan.targets])
                self._stop_on_a_renumbered_function(plan, f"at {step.describe()}")
            self._fail(plan, f"{step.describe()}: {exc}")
        return True

    async def _await_recovery(self, plan: SwitchPlan, step: Step, deadline: float,
                              notes: list[str]) -> None:
        """A PCI error recovery that began after the switch was decided (of a member, or of
        a bridge above one) holds the next step until it ends, as it would have refused the
        switch: an unbind or a bind while the kernel resets the device can wedge the host.
        It reads the model only; bounded by the switch's deadline (then the switch fails,
        as one out of time does), and a recovery past `RECOVERY_STALE_AFTER` holds nothing."""
        began = time.monotonic()
        waited = ""
        while True:
            reason = self._recovery_under_way(plan)
            if reason is None:
                break
            if not waited:
                _log.info("switch of group %s: waiting before %s: %s", plan.group,
                          step.describe(), reason)
            waited = reason
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(plan, f"{reason}: the switch ran out of time waiting for it to end "
                                 f"before {step.describe()}")
            await anyio.sleep(min(_RECOVERY_POLL, left))
        if waited:
            notes.append(f"a PCI error recovery began during the switch: waited "
                         f"{time.monotonic() - began:.0f} s for it to end before "
                         f"{step.describe()}")

    def _recovery_under_way(self, plan: SwitchPlan) -> str | None:
        """What PCI error recovery of a member, or of a bridge above one, the switch must
        not bind or unbind through (`unhealthy_reason` of `recover`: a young one), read from
        the model; None when there is none."""
        state = self.model.state
        members = (state.group_members(plan.addr) if plan.addr in state.functions
                   else plan.members)
        reason = unhealthy_reason(members, health_facts(state, members), recover=True)
        return None if reason is None else reason.split(";", 1)[0]

    def _failures(self, plan: SwitchPlan) -> dict[str, tuple[str, ...]]:
        """Each function of the group, as the model has it now, that is unusable until its
        recovery (`failure_reason`), with what says so: its health, the failed bridge above
        it, and the rank of the uevent that made it so (`HostState.recovery_marks`,
        `HostState.wedge_marks`: a second failure is a new one)."""
        state = self.model.state
        members = (state.group_members(plan.addr) if plan.addr in state.functions else
                   [fn for m in plan.members if (fn := state.functions.get(m.addr))])
        facts = health_facts(state, members)
        found: dict[str, tuple[str, ...]] = {}
        for fn in members:
            reason = failure_reason(fn, facts, advice=False)
            if reason is None:
                continue
            bridge = (facts.failed_bridge.get(fn.addr, "")
                      or facts.recovery_failed_above.get(fn.addr, ""))
            if fn.health == "wedged" and not bridge:
                order = state.wedge_marks.get(fn.addr, 0)
            else:
                mark = state.recovery_marks.get(bridge or fn.addr)
                order = mark.order if mark is not None else 0
            found[fn.addr] = (reason, fn.health, bridge, str(order))
        return found

    def _new_failures(self, plan: SwitchPlan, *, advice: bool = False) -> dict[str, str]:
        """The functions of the group that failed or wedged (or whose bridge failed) since
        the switch was decided, each with what happened (and what to do, with ``advice``):
        not those `recover` was asked to rebind, unless they failed again."""
        known = self._failed_at_start.get(plan.poison_key, {})
        now = self._failures(plan)
        for addr in [a for a in known if a not in now]:
            # Recovered meanwhile (its bind seen): failing again is a new failure, though a
            # wedge's uevent carries no rank to tell the second from the first.
            del known[addr]
        found = {addr: sign for addr, sign in now.items() if known.get(addr) != sign}
        if not advice or not found:
            return {addr: sign[0] for addr, sign in found.items()}
        state = self.model.state
        fns = [state.functions[a] for a in found]
        facts = health_facts(state, fns)
        return {fn.addr: failure_reason(fn, facts) or found[fn.addr][0] for fn in fns}

    def _new_failure(self, plan: SwitchPlan, *, advice: bool = False) -> str | None:
        return next(iter(self._new_failures(plan, advice=advice).values()), None)

    def _stop_on_failure(self, plan: SwitchPlan, where: str) -> None:
        """A function of the group failed or wedged during the switch (an AER fatal error
        whose recovery failed, a DRM wedge, its bridge's recovery failing): not one more
        write goes to the group. The switch fails naming it; what follows touches no such
        function (`_unpin`, `_restore`, `_roll_back`), and the group is left for its
        recovery (refused until then; `gpuwatch recover`)."""
        failure = self._new_failure(plan, advice=True)
        if failure is not None:
            self._fail(plan, f"{failure} (seen during the switch, which stopped {where}: "
                             f"nothing more is written to {poison_subject(plan.poison_key)}, "
                             "left for its recovery)")

    async def _guard_unbind(self, plan: SwitchPlan, facts: HostFacts, step: WriteStep,
                            deadline: float) -> None:
        """Right before an unbind, look again: a holder now (persistenced that would not stop,
        a client that just opened the card) would make the kernel's remove block forever."""
        driver = step.path.split("/")[-2]
        fn = next((m for m in plan.members if m.addr == step.value), None)
        if fn is None:
            return
        scope = unbind_scope(fn.model_copy(update={"driver": driver}), facts)
        holders = await self._scan(scope, deadline, plan)
        if holders:
            reason = holders_reason(holders)
            self._refused(plan.addr, plan.group, plan.to_mode, reason, holders)
            raise SwitchRefused(reason, holders)

    async def _scan(self, scope: NodeScope, deadline: float,
                    plan: SwitchPlan) -> list[Holding]:
        proc_deadline = self.model.proc_deadline
        timeout = max(0.1, min(self.scan_timeout, proc_deadline + 1, deadline - time.monotonic()))
        try:
            return await call_bounded(
                lambda: scan_holders(self.root, scope, deadline=proc_deadline), timeout,
                "the holder scan")
        except StepTimedOut as exc:
            reason = f"{exc}: a process may be stuck (gpuwatch probe wedge-detected)"
            self._refused(plan.addr, plan.group, plan.to_mode, reason, ())
            raise SwitchRefused(reason) from None

    async def _command_failed(self, plan: SwitchPlan, facts: HostFacts, step: CommandStep,
                              result: CommandResult, deadline: float, notes: list[str]) -> None:
        what = f"`{' '.join(step.argv)}` failed: {result.message()}"
        if step.on_error == "warn":
            _log.info("%s", what)  # said once, as a note of the result
            notes.append(what)
            return
        if step.on_error == "refuse":
            holders = await self._scan(nvidia_scope(facts), deadline, plan)
            reason = f"{what}: the nvidia module is in use"
            if holders:
                reason += "; " + holders_reason(holders)
            self._refused(plan.addr, plan.group, plan.to_mode, reason, holders)
            raise SwitchRefused(reason, holders)
        self._fail(plan, what)

    async def _verify(self, plan: SwitchPlan, facts: HostFacts, sub: EventStream,
                      deadline: float, notes: list[str]) -> None:
        """Wait for the model to see every function on its target; re-read the tree when the
        events are slow (they may have been lost) and once more before giving up."""
        targets = dict(plan.targets)
        check_at = min(deadline, time.monotonic() + self.tree_check_after)
        events_open = True
        waiting = "while it waited for the binds"
        #: Planned functions whose removal was seen: one present again is a new device,
        #: which never got this switch's writes (`_stop_on_a_returned_function`).
        removed: set[str] = set()
        settled_at = time.monotonic() + self.tree_check_after
        while not (self._reached(plan, facts) and await self._still_there(plan, deadline)):
            self._stop_on_failure(plan, waiting)
            self._stop_on_a_renumbered_function(plan, waiting)
            self._stop_on_a_moved_bridge(plan)
            now = time.monotonic()
            if now >= check_at:
                await self._reread(plan, deadline)
                if plan.rebinds and self._reached(plan, facts, drivers_only=True):
                    # The writes returned and the tree shows each function on its target:
                    # the rebind happened, though its bind event was lost.
                    await self._refresh([PciRebound(a) for a in self._unrecovered(plan)])
                self._stop_on_failure(plan, "while it waited for the binds")
                self._stop_on_a_renumbered_function(plan, waiting)
                if self._reached(plan, facts):
                    notes.append("bind events were lost: completion read from the tree")
                    _log.info("switch of group %s: bind events lost, read the tree", plan.group)
                    self._check_gained(plan, facts)
                    return
                self._stop_on_a_taken_function(plan, facts)
                if now >= deadline:
                    self._fail(plan, "the group did not reach its target drivers in time: "
                                     + self._drivers_text(targets))
                gone = [a for a in targets if a not in self.model.state.functions]
                if gone:
                    # Removed from the bus (surprise removal, a reset that dropped it), as the
                    # tree confirms: it will not bind, so waiting out --timeout helps nobody.
                    self._fail(plan, f"{', '.join(gone)} left the bus during the switch: "
                                     + self._drivers_text(targets))
                if removed and now < settled_at:
                    check_at = settled_at  # a device that came back: give its probe time
                    continue
                self._stop_on_a_returned_function(plan, facts, removed)
                check_at = deadline if events_open else now + 0.2
                continue
            if not events_open:
                await anyio.sleep(max(0.0, check_at - now))
                continue
            with anyio.move_on_after(max(0.0, check_at - now)):
                try:
                    event = await sub.receive()
                except (SubscriberLagged, StopAsyncIteration):
                    events_open = False
                    check_at = now
                else:
                    if getattr(event, "type", "") == "device-removed" \
                            and getattr(event, "addr", "") in targets:
                        removed.add(event.addr)
                        check_at = min(check_at, settled_at)
            if any(a not in self.model.state.functions for a in targets):
                check_at = time.monotonic()  # a function was removed: confirm from the tree
        self._stop_on_a_renumbered_function(plan, waiting)
        self._check_gained(plan, facts)

    async def _groups_now(self, addrs: list[str]) -> dict[str, int] | None:
        """`iommu_groups_now` of ``addrs``, read off the loop within the scan bound; None
        when the read did not return in time."""
        paths = self.model.paths
        try:
            return await call_bounded(lambda: iommu_groups_now(paths, addrs),
                                      self.scan_timeout, "reading the IOMMU groups")
        except StepTimedOut:
            return None

    async def _still_there(self, plan: SwitchPlan, deadline: float) -> bool:
        """Before a completion read from the model: every planned function is still in the
        tree, in the group planned. The model may not have seen a removal yet (its uevent
        behind the bind's), and a function gone, or back in another group, completes
        nothing: then the tree is read into the model (False), and the wait judges it."""
        addrs = [a for a, _ in plan.targets]
        seen = await self._groups_now(addrs)
        if seen is None:
            return True  # the model's word, as before any tree read
        if all(a in seen and not _renumbered(plan.group, seen[a]) for a in addrs):
            return True
        await self._reread(plan, deadline)
        return False

    async def _stop_if_renumbered(self, plan: SwitchPlan, where: str) -> None:
        """Before a write: the planned functions' IOMMU group links, read from the tree (the
        uevents of a removal and add may not have reached the model yet), and the model
        folded in for any that moved; then `_stop_on_a_renumbered_function`."""
        seen = await self._groups_now([a for a, _ in plan.targets]) or {}
        moved = [a for a, g in seen.items() if _renumbered(plan.group, g)]
        if moved:
            with suppress(StepTimedOut):
                await self._read_now(moved)
        self._stop_on_a_renumbered_function(plan, where)

    def _stop_on_a_renumbered_function(self, plan: SwitchPlan, where: str) -> None:
        """A planned function now in another IOMMU group was removed and added again (a
        surprise removal and rescan, a hotplug: the kernel may give it another group number).
        The switch holds the lock of the group it planned, not of the new one, which another
        switch may take meanwhile; and its writes went to the device that left. Not one more
        write: fail at once, naming where the function is now, so that the next switch (by
        address) takes the new group with its own lock and checks."""
        functions = self.model.state.functions
        moved = [fn for a, _ in plan.targets if (fn := functions.get(a)) is not None
                 and _renumbered(plan.group, fn.iommu_group)]
        if moved:
            names = ", ".join(f"{fn.addr} is in {_group_text(fn.iommu_group)} now"
                              for fn in moved)
            self._fail(plan, f"{names}, not {_group_text(plan.group)}: it was removed and "
                             f"added again during the switch (which stopped {where}: nothing "
                             "more is written to it); switch again by its address")

    def _stop_on_a_returned_function(self, plan: SwitchPlan, facts: HostFacts,
                                     removed: set[str]) -> None:
        """A planned function whose removal was seen during the switch is there again, but
        not on its target: the device that came back is a new one, which never got the
        switch's writes (its ``driver_override`` went with the one that left), and nothing
        will bind it to its target now. Fail rather than wait out ``--timeout``."""
        functions = self.model.state.functions
        back = [a for a, _ in plan.targets if a in removed and (fn := functions.get(a))
                is not None and not satisfied(fn.driver, fn, target_of(fn, plan.to_mode, facts),
                                              facts)]
        if back:
            self._fail(plan, f"{', '.join(back)} left the bus and came back during the switch "
                             "(a surprise removal and rescan, a hotplug): the device that came "
                             "back never got the switch's writes; switch again: "
                             + self._drivers_text(dict(plan.targets)))

    def _stop_on_a_moved_bridge(self, plan: SwitchPlan) -> None:
        """A bridge the plan leaves on pcieport (or on none) that another driver took
        meanwhile will not come back by itself, and keeps the group from VFIO: fail now,
        naming it, rather than wait out ``--timeout`` for it."""
        functions = self.model.state.functions
        moved = [fn for a, t in plan.targets if t == BRIDGE_DRIVER
                 and (fn := functions.get(a)) is not None and fn.driver not in ("", t)]
        if moved:
            names = ", ".join(f"{fn.addr} (now on {fn.driver})" for fn in moved)
            self._fail(plan, f"PCI bridge {names} left {BRIDGE_DRIVER} during the switch: a "
                             f"group VFIO takes needs its bridges on {BRIDGE_DRIVER} or on no "
                             f"driver, and gpuwatch does not move bridges; bind it to "
                             f"{BRIDGE_DRIVER}, then switch again")

    def _stop_on_a_taken_function(self, plan: SwitchPlan, facts: HostFacts) -> None:
        """Every write has returned and the tree (just read into the model) shows a planned
        function bound to a driver that is not its target: another driver took it between
        its unbind and its probe (a ``drivers_probe`` or module load of someone else's, a
        racing snd_hda_intel or nouveau), or its unbind did not take. ``driver_override``
        only steers a probe of an unbound device, so nothing will move it now: fail at
        once, naming it and the driver, rather than wait out ``--timeout`` for a bind that
        cannot come. An unbound function is not judged: its probe may still be running."""
        functions = self.model.state.functions
        taken = [(fn, want) for a, want in plan.targets if want != BRIDGE_DRIVER
                 and (fn := functions.get(a)) is not None and fn.driver
                 and not satisfied(fn.driver, fn, target_of(fn, plan.to_mode, facts), facts)]
        if taken:
            names = ", ".join(f"{fn.addr} is on {fn.driver}, not {want}" for fn, want in taken)
            self._fail(plan, f"{names}, once every write of the switch returned (read from "
                             "the tree): another driver took it, or its unbind did not take, "
                             "and nothing will move it now; find what binds it (a udev rule, a "
                             "module loaded meanwhile), then switch again: "
                             + self._drivers_text(dict(plan.targets)))

    def _check_gained(self, plan: SwitchPlan, facts: HostFacts) -> None:
        """The planned functions are there; but a function that joined the group meanwhile
        (hot-added, or made visible by a driver) was neither planned nor checked for holders,
        and one on a driver of another mode leaves the group unusable in ``to_mode`` (a VM
        cannot open a VFIO group one of whose devices is on a host driver). That is no
        completion: fail, naming it, rather than rebind what nobody looked at.

        A bridge that joined follows the plan's own rule for bridges: on pcieport or on no
        driver it is where every mode wants it (`satisfied`), so the switch completes; on
        another driver the next switch would refuse it by name (`foreign_bridges`), so the
        failure says what that refusal says, not "switch again": gpuwatch moves no bridge."""
        state = self.model.state
        if plan.addr not in state.functions:
            return
        planned = {a for a, _ in plan.targets}
        gained = [fn for fn in state.group_members(plan.addr) if fn.addr not in planned
                  and not satisfied(fn.driver, fn, target_of(fn, plan.to_mode, facts), facts)]
        bridges = foreign_bridges(gained)
        names = ", ".join(f"{fn.addr} (on {fn.driver or 'no driver'})" for fn in gained
                          if fn not in bridges)
        if bridges:
            also = f"; it also gained {names}, not switched (nor checked for holders)"
            self._fail(plan, f"IOMMU group {plan.group} gained PCI bridge "
                             f"{bridge_names(bridges)} during the switch: {BRIDGE_RULE}; bind "
                             f"it to {BRIDGE_DRIVER}, then switch again{also if names else ''}")
        if gained:
            self._fail(plan, f"IOMMU group {plan.group} gained {names} during the switch: it was "
                             f"not switched (nor checked for holders), so the group is not in "
                             f"mode {plan.to_mode}; switch again to include it")

    async def _reread(self, plan: SwitchPlan, deadline: float) -> None:
        timeout = max(0.5, min(self.scan_timeout, deadline - time.monotonic()))
        try:
            await self._read_now([a for a, _ in plan.targets], timeout)
        except StepTimedOut as exc:
            self._fail(plan, str(exc))

    # ------------------------------------------------------------------ outcomes

    def _reached(self, plan: SwitchPlan, facts: HostFacts, *,
                 drivers_only: bool = False) -> bool:
        """The model sees every function of the plan where it should be, by the plan's own
        rule (`satisfied`): another VFIO driver counts for a VFIO target, except for one asked
        for by name (``--vfio-driver``), where the model still showing the old variant means
        its uevents have not been read yet, not that the switch is done. A function rebound
        where it was (`SwitchPlan.rebinds`) counts once its bind is seen (its bad health
        cleared): before that, the model may not even have seen its unbind."""
        functions = self.model.state.functions
        return all((fn := functions.get(a)) is not None
                   and satisfied(fn.driver, fn, target_of(fn, plan.to_mode, facts), facts)
                   for a, _ in plan.targets) and (drivers_only or not self._unrecovered(plan))

    def _unrecovered(self, plan: SwitchPlan) -> list[str]:
        """The functions `recover` rebinds (`SwitchPlan.rebinds`) whose health, as the model
        has it, still needs that rebind (`needs_recovery`: no bind of theirs seen yet)."""
        state = self.model.state
        fns = [fn for a in plan.rebinds if (fn := state.functions.get(a)) is not None]
        health = health_facts(state, fns) if fns else HostFacts()
        return [fn.addr for fn in fns if needs_recovery(fn, health)]

    def _drivers_text(self, targets: dict[str, str]) -> str:
        functions = self.model.state.functions
        return ", ".join(
            f"{a} on {(functions[a].driver if a in functions else 'gone') or 'no driver'} "
            f"(wants {d})" for a, d in targets.items())

    def _result(self, addr: str, group: int, from_mode: str, to_mode: str, started: float, *,
                changed: bool, notes: list[str]) -> SwitchResult:
        state = self.model.state
        members = state.group_members(addr) if addr in state.functions else ()
        return SwitchResult(
            addr=addr, group=group,
            from_mode=from_mode if changed else group_mode(members) if members else from_mode,
            to_mode=to_mode,
            members=[ev.SwitchMember(addr=m.addr, driver=m.driver) for m in members],
            duration_ms=round((time.monotonic() - started) * 1000, 3), changed=changed,
            notes=notes,
        )

    async def _read_now(self, addrs: Sequence[str], timeout: float | None = None) -> None:
        """Read the functions ``addrs`` from the tree now and fold them into the model,
        within ``timeout`` (default ``scan_timeout``; `StepTimedOut` past it)."""
        paths = self.model.paths
        await self._refresh(await call_bounded(
            lambda: [read_function(paths, a) for a in addrs],
            self.scan_timeout if timeout is None else timeout, "re-reading the tree"))

    def _refused(self, addr: str, group: int, to_mode: str, reason: str,
                 holders: Sequence[Holding]) -> None:
        # INFO: the refusal is the caller's error (printed once, by the CLI) and an event;
        # a warning here would reach stderr a second time through logging's last resort.
        _log.info("switch of group %s refused: %s", group, reason)
        self._emit(ev.SwitchRefused(addr=addr, group=group, to_mode=to_mode,
                                    reason=reason, holders=list(holders)))

    def _emit(self, event: BaseModel) -> None:
        """Publish now, or, while a switch runs its steps, once it has restored the host."""
        pending = _DEFERRED.get()
        if pending is not None:
            pending.append(event)
        else:
            self._publish([event])

    def _fail(self, plan: SwitchPlan, error: str) -> None:
        self._emit(ev.SwitchFailed(addr=plan.addr, group=plan.group,
                                   to_mode=plan.to_mode, error=error, wedged=False))
        raise SwitchFailed(error)

    def _poison(self, plan: SwitchPlan, error: str) -> str:
        """Mark the group poisoned, in the model and in the file of this boot; say so."""
        key = plan.poison_key
        try:
            self.poison.add(key, PoisonEntry(addr=plan.addr, to_mode=plan.to_mode,
                                             error=error, time=format_event_time()))
        except OSError as err:
            _log.warning("cannot record the poison of group %s in %s: %s", key,
                         self.poison.path, err)
        self.model.poisoned[key] = error
        return f"{error}; {poisoned_until(key)}"

    def _wedge(self, plan: SwitchPlan, step: Step, exc: StepTimedOut) -> None:
        error = (f"{step.describe()} did not return within {exc.timeout:.3g}s: the device "
                 "is wedged")
        said = self._poison(plan, error)
        self._emit(ev.SwitchFailed(addr=plan.addr, group=plan.group,
                                   to_mode=plan.to_mode, error=error, wedged=True))
        raise SwitchWedged(said)

    def _note_service(self, argv: Sequence[str]) -> None:
        """Remember a service this switch stopped (``systemctl stop``), forget one it started,
        so that the switch back to nvidia starts again only what a switch stopped."""
        if len(argv) < 3 or argv[0] != "systemctl" or argv[1] not in ("stop", "start"):
            return
        try:
            set_service_stopped(self.root, argv[2], argv[1] == "stop")
        except OSError as exc:
            _log.warning("cannot record that %s was %s in %s: %s (the switch back to nvidia "
                         "will not start it)", argv[2], "stopped" if argv[1] == "stop"
                         else "started", DEFAULT_STOPPED_FILE, exc.strerror or exc)

    # ------------------------------------------------------------------ abandoned switches

    def _boot(self) -> str:
        return read_boot_id(self.root)

    def _journal(self, key: PoisonKey, plan: SwitchPlan, unpin: Sequence[str]) -> None:
        """Record the switch about to begin (`gpuwatch.switch.journal`): a SIGKILL leaves it
        behind. Its members are what it may pin, with what an abandoned one may have."""
        members = tuple(dict.fromkeys([*(a for a, _ in plan.targets), *unpin]))
        record = Journal(addr=plan.addr, group=plan.group, from_mode=plan.from_mode,
                         to_mode=plan.to_mode, members=members, pid=os.getpid(),
                         started=format_event_time())
        try:
            write_journal(self._lock_dir(), key, self._boot(), record)
        except OSError as exc:
            _log.warning("cannot record the switch of %s in %s: %s (were its process killed, "
                         "nothing would tell)", poison_subject(key), self._lock_dir(),
                         exc.strerror or exc)
            return
        self._journaled.add(key)

    def _abandoned(self, key: PoisonKey, ours: Sequence[str]) -> list[tuple[PoisonKey, Journal]]:
        """The records of switches of the group's functions (``ours``, its members now) whose
        processes are gone without ending them, seen without the lock: its own, and any
        under another key that names one of them (`_adopted`). None while its switch may
        still be running."""
        left = find_abandoned(self.root, key)
        own = [(key, left)] if left is not None and _names_any(left, ours) else []
        return own + self._adopted(key, ours)

    def _adopted(self, key: PoisonKey, ours: Sequence[str]) -> list[tuple[PoisonKey, Journal]]:
        """The abandoned records under keys other than the group's that name one of its
        functions now: the card was removed and added again under another group number
        (or a no-IOMMU group came or went) since its switch was killed. Keyed by a number
        no longer the card's, nothing else would ever end them."""
        found = []
        for other in journal_keys(self._lock_dir()):
            if other == key or other in self._busy:
                continue
            left = find_abandoned(self.root, other)
            if left is not None and _names_any(left, ours):
                found.append((other, left))
        return found

    def _leftover(self, key: PoisonKey,
                  ours: Sequence[str]) -> list[tuple[PoisonKey, Journal]]:
        """Holding the group's lock: the group's record found is an abandoned switch's, and
        so are the others naming its functions (`_adopted`). Each published once
        (``switch-failed``, ``abandoned``), then kept until a switch clears it. A record
        under the group's number naming none of its functions is another card's, from
        when that card had the number: moved out of this group's way (`_set_aside`)."""
        folder, boot = self._lock_dir(), self._boot()
        left = read_journal(folder, key, boot)
        found: list[tuple[PoisonKey, Journal]] = []
        if left is None:
            with suppress(OSError):
                remove_journal(folder, key)  # another boot's, or garbage
        elif _names_any(left, ours):
            found.append((key, left))
        else:
            self._set_aside(key, left)
        found += self._adopted(key, ours)
        for at, record in found:
            if not record.reported:
                self._publish([self._abandoned_event(record)])
                mark_reported(folder, at, boot, record)
        return found

    def _set_aside(self, key: PoisonKey, left: Journal) -> None:
        """Holding the lock of ``key``: another card's record is under it (`_leftover`).
        Not this group's to report, clear or drop, and this group's own record would take
        its place: it moves to its card's address, where that card's next switch or
        `recover` finds it by its members, whatever group the card is in now. Where that
        name is taken, it stays, and this group's next record replaces it."""
        folder = self._lock_dir()
        if move_journal(folder, key, left.addr):
            _log.info("switch record of %s (%s, killed) moved from %s: the number is "
                      "another group's now", left.addr, _group_text(left.group),
                      poison_subject(key))

    def _drop_adopted(self, key: PoisonKey, found: Sequence[tuple[PoisonKey, Journal]], *,
                      own: bool) -> None:
        """The records ``found`` are ended: in mode with nothing left to clear, or this
        switch's own record now lists what they may have pinned (``own`` False: the
        group's own is that record already). Another key's goes only while it is still the
        one adopted: a switch of that key begun since wrote its own."""
        folder, boot = self._lock_dir(), self._boot()
        for at, record in found:
            if at == key:
                if own:
                    with suppress(OSError):
                        remove_journal(folder, key)
            else:
                discard_journal(folder, at, boot, record)

    def report_abandoned(self) -> None:
        """At start-up (a daemon restarted after a SIGKILL mid-switch): publish the end of
        every switch whose process died without ending it, so that a log tailer waiting on
        its ``switch-started`` learns it is over. Writes nothing to the host: the next
        switch or `recover` of the group clears what it left."""
        folder = self._lock_dir()
        for key in journal_keys(folder):
            left = None if key in self._busy else find_abandoned(self.root, key)
            if left is None or left.reported:
                continue
            self._publish([self._abandoned_event(left)])
            mark_reported(folder, key, self._boot(), left)

    def _abandoned_event(self, left: Journal) -> ev.SwitchFailed:
        _log.warning("switch of group %s to %s (pid %s, started %s) was abandoned half-way",
                     left.group, left.to_mode, left.pid, left.started)
        return ev.SwitchFailed(
            addr=left.addr, group=left.group, to_mode=left.to_mode,
            error=(f"abandoned: the process running it (pid {left.pid}, switch started "
                   f"{left.started}) ended before the switch did (killed, or it crashed); "
                   "nothing was put back"),
            wedged=False, restored=[self._abandoned_note(left)])

    def _abandoned_note(self, left: Journal) -> str:
        functions = self.model.state.functions
        where = ", ".join(
            f"{a} on {functions[a].driver or 'no driver'}" if a in functions else f"{a} gone"
            for a in left.members)
        return (f"nothing: group {left.group} is left as that switch left it ({where}), "
                "maybe with a driver_override of its; the next switch or `gpuwatch recover` "
                "of the group brings it to one mode and clears them")

    # ------------------------------------------------------------------ locks and privilege

    def _require_root(self, what: str) -> None:
        if self.euid() != 0:
            raise NotPrivileged(f"{what} needs root (it writes to sysfs and loads modules)")

    def _claim(self, key: int | str) -> None:
        if key in self._busy:
            raise GroupBusy(f"{poison_subject(key)} is already being switched")
        if self._exclusive is not None:
            raise GroupBusy(f"group {self._exclusive} is unloading the nvidia module: retry "
                            "after it")
        self._busy.add(key)

    def _release(self, key: int | str) -> None:
        """The end of a `_claim`: the group is free again; the last one tells the host."""
        self._busy.discard(key)
        self._failed_at_start.pop(key, None)
        if self._exclusive == key:
            self._exclusive = None
        if not self._busy:
            if self._idle is not None:
                self._idle.set()
                self._idle = None
            if self.on_idle is not None:
                self.on_idle()

    def _flock(self, key: int | str) -> int:
        """Across processes too: a CLI ``gpuwatch mode`` and a daemon must not race."""
        folder = self._lock_dir()
        path = os.path.join(folder, f"switch-{key}.lock")
        try:
            make_dirs(folder)  # 0755 whatever the umask
            why = others_control(path)
        except OSError as exc:
            raise self._no_lock(folder, exc) from None
        if why is not None:
            # Whoever may add names there may hold the lock, remove a running switch's
            # record, or plant one that names this group (whose overrides root would clear).
            raise SwitchFailed(f"cannot take the switch lock {path}: {why}, so another user "
                               "could take it or forge the switch records beside it; nothing "
                               "was written")
        fd = self._open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise GroupBusy(f"{poison_subject(key)} is being switched by another "
                            "process") from None
        return fd

    def _switched_elsewhere(self, key: int | str | None) -> bool:
        """Whether another process holds the group's switch lock (``key`` None: the host
        lock, alone, as a switch that unloads nvidia does), seen without taking it
        (`gpuwatch.hostfs.journal.lock_held`)."""
        return lock_held(self._lock_dir(), key)

    def _lock_dir(self) -> str:
        """``run/gpuwatch`` in the tree, its links read as in a chroot (`place_in_root`)."""
        return place_in_root(self.root, LOCK_DIR)

    def _open_lock(self, path: str) -> int:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise self._no_lock(path, exc) from None

    @staticmethod
    def _no_lock(path: str, exc: OSError) -> SwitchFailed:
        """A read-only or full host root: one line saying so, before anything is written."""
        return SwitchFailed(f"cannot take the switch lock {path}: {exc.strerror or exc}; "
                            "nothing was written")

    def _host_flock(self) -> int:
        """The host-wide lock, shared by every switch under way in any process; a switch
        that unloads the nvidia module takes it alone (`_host_exclusive`)."""
        fd = self._open_lock(os.path.join(self._lock_dir(), _HOST_LOCK))
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise GroupBusy("another process is unloading the nvidia module: retry after "
                            "it") from None
        return fd

    def _others_switching(self, key: int | str, host_fd: int | None) -> tuple[str, ...]:
        """For a roll-back that would unload nvidia: the cards other switches are moving now
        (their addresses; for another process's, a description), or none, and then the host
        is this switch's alone, here (`_exclusive`) and across processes (the host lock
        taken alone), until it ends."""
        others = [k for k in self._busy if k != key]
        if others:
            state = self.model.state
            return tuple(sorted(a for a, fn in state.functions.items()
                                if fn.iommu_group in others or a in others)) or tuple(
                                    poison_subject(k) for k in others)
        if host_fd is not None:
            try:
                fcntl.flock(host_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                # A failed upgrade lets go of the shared lock (flock(2)): take it again.
                with suppress(BlockingIOError):
                    fcntl.flock(host_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return ("a card another process is switching",)
        self._exclusive = key
        return ()

    def _host_exclusive(self, fd: int) -> None:
        """Unloading nvidia takes every card off it: no other switch may run, here or in
        another process (a CLI `gpuwatch mode` beside the daemon)."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise GroupBusy("unloading the nvidia module needs the host to itself, and "
                            "another process is switching a group: retry after it") from None


def _names_any(left: Journal, ours: Sequence[str]) -> bool:
    """Whether a switch record names one of the group's functions now (by address)."""
    return not {left.addr, *left.members}.isdisjoint(ours)


def _pinned_by(found: Sequence[tuple[PoisonKey, Journal]], ours: Sequence[str]) -> tuple[str, ...]:
    """The group's functions (only those: the others are another group's, or gone) that the
    abandoned switches ``found`` may have left pinned by a driver_override."""
    named = {a for _, left in found for a in left.members}
    return tuple(a for a in ours if a in named)


def _renumbered(before: int, now: int) -> bool:
    """Whether a function's IOMMU group number changed: only a removal and a new add does
    that. A group appearing or going is no renumbering (no-IOMMU VFIO makes a group of its
    own on bind and drops it on unbind)."""
    return before >= 0 and now >= 0 and before != now


def _group_text(group: int) -> str:
    """``IOMMU group 16``, or ``no IOMMU group``."""
    return f"IOMMU group {group}" if group >= 0 else "no IOMMU group"


def _track_pin(pinned: list[str], step: Step, *, before: bool) -> None:
    """Keep ``pinned``, the functions given a ``driver_override`` by these steps and not
    cleared since, up to date: a driver name counts from before its write (a write that
    fails may still have landed), a clearing from after it returned."""
    if not isinstance(step, WriteStep):
        return
    head, _, name = step.path.rpartition("/")
    if name != "driver_override":
        return
    addr = head.rpartition("/")[2]
    if before and step.value != CLEAR_OVERRIDE and addr not in pinned:
        pinned.append(addr)
    elif not before and step.value == CLEAR_OVERRIDE and addr in pinned:
        pinned.remove(addr)


async def _make_dir(ops: HostOps, step: MakeDirStep) -> str | None:
    """Make the CDI spec's folder; None when it is there, else why not, in one line: a
    read-only ``/etc`` (the unit's ``ProtectSystem=strict`` where ``/etc/cdi`` was missing
    when it started), a file in its place, links that loop or leave the tree. That is no
    failure of a switch nor an internal error of ``ensure-cdi``: no spec is all it costs."""
    try:
        await ops.makedirs(step.path)
    except (OSError, UnsafeStep) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return f"{step.describe()} failed: {reason}: no CDI spec generated"
    return None


async def ensure_cdi(root: str, ops: HostOps, *, euid: int,
                     timeout: float = 60.0) -> CdiOutcome:
    """Make sure a CDI spec for the NVIDIA GPUs exists, generating it when nvidia-ctk can."""
    if euid != 0:
        raise NotPrivileged("ensure-cdi needs root (it writes the CDI spec)")
    for rel in CDI_SPECS:
        if cdi_spec_exists(root, rel):
            return CdiOutcome(True, False, "/" + rel, f"CDI spec present: /{rel}")
    steps, why = cdi_steps(cdi_output(root), False, ops.which("nvidia-ctk") is not None)
    if not steps:
        return CdiOutcome(False, False, None, why[0])
    for step in steps:
        match step:
            case MakeDirStep():
                failed = await _make_dir(ops, step)
                if failed is not None:
                    return CdiOutcome(False, False, None, failed)
            case CommandStep(argv=argv):
                try:
                    result = await ops.run(argv, timeout)
                except StepTimedOut as exc:
                    return CdiOutcome(False, False, None, str(exc))
                if not result.ok:
                    return CdiOutcome(False, False, None,
                                      f"`{' '.join(argv)}` failed: {result.message()}")
            case WriteStep():
                raise UnsafeStep(f"ensure-cdi never writes to sysfs: {step.describe()}")
            case _:
                assert_never(step)
    spec = "/" + CDI_SPECS[0]
    if not cdi_spec_exists(root, CDI_SPECS[0]):
        return CdiOutcome(False, False, None, f"nvidia-ctk ran but {spec} does not exist")
    return CdiOutcome(True, True, spec, f"CDI spec generated: {spec}")


__all__ = [
    "DEFAULT_TIMEOUT",
    "CdiOutcome",
    "EventStream",
    "Publish",
    "Refresh",
    "Subscribe",
    "SwitchEngine",
    "SwitchResult",
    "ensure_cdi",
]
