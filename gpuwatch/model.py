"""`HostModel`: the probe contract answered from a `HostState` (docs/probes.md).

The state is pure; this facade adds the root it was read from and the two live probes
(``memlock``, ``nvidia-holders``) that no uevent can keep current.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Literal, TypeVar, overload

from gpuwatch.core.modes import Mode, current_mode, group_in_mode, parse_mode
from gpuwatch.core.pci import canonical_addr
from gpuwatch.core.probes import (
    ACTIONS,
    WATCHED_PROBES,
    BoolAction,
    TextAction,
    check_params,
    group_access,
    may_read_write,
    no_such_function,
    vfio_backend_fields,
)
from gpuwatch.core.results import (
    DetectVfioResult,
    Holder,
    HostDevicesResult,
    MemlockResult,
    PciFunction,
    VfioBackend,
)
from gpuwatch.core.state import HostState
from gpuwatch.core.tables import Tables
from gpuwatch.errors import GroupPoisoned, SwitchRefused, UsageError
from gpuwatch.hostfs import procfs
from gpuwatch.hostfs.scan import HostPaths
from gpuwatch.hostfs.scan import scan as scan_tree
from gpuwatch.settings import (
    ConfigInForce,
    host_namespaces_in_force,
    proc_read_timeout_in_force,
    read_once,
    root_in_force,
    tables_in_force,
)

if TYPE_CHECKING:
    from gpuwatch.core.plan import SwitchPlan

_T = TypeVar("_T")

#: Probes that read files, not the model: answered as they are, never tried again.
_LIVE_PROBES = frozenset(("memlock", "nvidia-holders", "wedge-detected"))

# The switch planner and the facts it reads (anyio, modules.alias, holders) are imported
# where a plan or a holders report is made: a probe, `status` or `list` never needs them.


class HostModel:
    """One host's model plus the probe dispatch. Probes read memory only (two live ones aside)."""

    def __init__(self, paths: HostPaths, state: HostState) -> None:
        self.paths = paths
        self.state = state
        if state.clock is None:  # PCI error recoveries are aged by it (wall-clock steps aside)
            state.clock = time.monotonic
        #: Even between two batches, odd while a watcher folds one in (`begin_change`):
        #: what a read in another thread checks to know it saw one state (`consistent`).
        self.version = 0
        self._changer = 0  # the thread folding the batch in, while the version is odd
        self._uid = os.geteuid()
        self._gids = frozenset((os.getegid(), *os.getgroups()))
        #: vfio-group-accessible for every group, and the ``vfio_nodes_version`` it was
        #: prepared at (`_prepare_access`).
        self._access: dict[int, bool] = {}
        self._access_version = -1
        self._access_lock = threading.Lock()
        #: Whether this process holds CAP_DAC_OVERRIDE (None: not known), read with the
        #: first answers (`_prepare_access`): root without it is refused others' nodes.
        self._dac_override: bool | None = None
        self._own_caps_read = False
        #: IOMMU groups a wedged switch left unusable in this boot (group -> why); the switch
        #: engine fills it and refuses them until a reboot or ``recover``.
        #: Why each poisoned group (or group-less card, by address) is refused: keyed by
        #: `gpuwatch.core.plan.poison_key`.
        self.poisoned: dict[int | str, str] = {}
        #: The budget of one /proc scan (``proc_read_timeout``, the daemon's setting).
        self.proc_deadline: float = procfs.DEFAULT_PROC_DEADLINE
        self._handlers: dict[str, Callable[[int | None, str | None, str | None], Any]] = {
            "memlock": lambda g, a, m: procfs.memlock(),
            "nvidia-holders": lambda g, a, m: procfs.nvidia_holders(
                self.paths.root, deadline=self.proc_deadline),
            "vfio-group-accessible": lambda g, a, m: self.vfio_group_accessible(g),
            "display-driver": lambda g, a, m: self.function(a).driver,
            "current-mode": lambda g, a, m: current_mode(self.function(a)),
            "group-in-mode": lambda g, a, m: group_in_mode(
                self.state.group_members(self.function(a).addr), parse_mode(m),
                self.state.vfio_variants,
            ),
            "vfio-backend": lambda g, a, m: self.vfio_backend(a),
            "wedge-detected": lambda g, a, m: self._wedge_detected(),
        }

    def begin_change(self) -> None:
        """A batch is being folded into the state (the watcher's loop, never waiting):
        reads in other threads started meanwhile are tried again once it is in."""
        self._changer = threading.get_ident()
        self.version += 1

    def end_change(self) -> None:
        """The batch is in: the state is one the model passed through."""
        self.version += 1

    def consistent(self, read: Callable[[], _T]) -> _T:
        """``read()`` as of one state between two batches, never a mix of two.

        The watcher's loop does not wait for readers: a read in another thread (a server's
        thread pool, ``anyio.to_thread``) that overlapped a batch is thrown away and tried
        again, a failure included (a function the batch removed midway), so it costs the
        reader a retry, never the loop a lock. On the loop's own thread, between batches,
        and with no watcher at all, ``read`` runs once."""
        tries = 0
        while True:
            before = self.version
            if before & 1 and self._changer == threading.get_ident():
                return read()  # the batch's own thread: nothing else can change it
            if not before & 1:
                try:
                    result = read()
                except Exception:
                    if self.version == before:
                        raise
                else:
                    if self.version == before:
                        return result
            tries += 1
            time.sleep(0 if tries < 64 else 0.0005)  # let the loop finish the batch

    def _wedge_detected(self) -> Any:
        from gpuwatch.hostfs.wedge import wedge_detected

        return wedge_detected(self.paths.root, deadline=self.proc_deadline)

    @property
    def root(self) -> str:
        return self.paths.root

    @property
    def tables(self) -> Tables:
        return self.state.tables

    @overload
    def probe(self, action: Literal["detect-vfio"], *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> DetectVfioResult: ...
    @overload
    def probe(self, action: BoolAction, *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> bool: ...
    @overload
    def probe(self, action: TextAction, *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> str: ...
    @overload
    def probe(self, action: Literal["detect-host-devices"], *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> HostDevicesResult: ...
    @overload
    def probe(self, action: Literal["memlock"], *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> MemlockResult: ...
    @overload
    def probe(self, action: Literal["nvidia-holders"], *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> tuple[Holder, ...]: ...
    @overload
    def probe(self, action: Literal["vfio-backend"], *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> VfioBackend: ...
    @overload
    def probe(self, action: Literal["plan"], *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> list[dict[str, Any]]: ...
    @overload
    def probe(self, action: str, *,
              group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
              vendor: str | None = ...) -> Any: ...
    def probe(
        self,
        action: str,
        *,
        group: int | None = None,
        addr: str | None = None,
        mode: str | None = None,
        vendor: str | None = None,
    ) -> Any:
        """Answer a probe action from memory. Raises `UsageError` or `DeviceNotFound`.

        A literal action's answer has its own type (``probe("detect-vfio")`` is a
        `DetectVfioResult`, ``probe("group-in-mode", …)`` a ``bool``), so a strictly
        type-checked caller uses it without a cast; an action computed at run time: Any."""
        answers = self.state._answers
        try:
            if action in answers:  # the hot path: the cached immutable answer itself
                return answers[action]
        except TypeError:  # an unhashable action (a try costs nothing until it raises)
            check_params(action, group, addr, mode, vendor)
            raise
        if (
            action == "vfio-group-accessible"
            and group.__class__ is int
            and (addr is None and mode is None and vendor is None)
        ):
            # Prepared per group: nothing to compute, nothing here for check_params to reject.
            if self._access_version != self.state.vfio_nodes_version:
                self._prepare_access()
            return self._access.get(group, False)
        if action == "plan":
            check_params(action, group, addr, mode, vendor)
            return self.plan(parse_mode(mode), addr=addr, vendor=vendor)
        handler = self._handlers.get(action)
        if handler is None:
            check_params(action, group, addr, mode, vendor)
            raise AssertionError(action)  # pragma: no cover - every action has a handler
        if ACTIONS[action] or vendor is not None:
            addr = check_params(action, group, addr, mode, vendor)
        if action in _LIVE_PROBES:
            return handler(group, addr, mode)
        # (a partial, not a lambda: a closure would make cells of this method's arguments,
        # and every cached probe above would pay for them)
        return self.consistent(partial(handler, group, addr, mode))

    def function(self, addr: str | None) -> PciFunction:
        norm = canonical_addr(addr or "")
        fn = self.state.functions.get(norm or "")
        if fn is None:
            raise no_such_function(addr)
        return fn

    def vfio_group_accessible(self, group: int | None) -> bool:
        if group is None or group < 0:
            return False
        if self._access_version != self.state.vfio_nodes_version:
            self._prepare_access()
        return self._access.get(group, False)

    def _prepare_access(self) -> None:
        """Whether this process may open each ``/dev/vfio/N``, for every group at once: done
        when a vfio node appears, goes or changes mode, so the probe is a dict lookup.

        Readers in several threads may prepare it at once: the answers go in before their
        version, and a newer version is never replaced by an older one, so a reader that
        sees the version it expects finds answers at least that new."""
        state = self.state
        if not self._own_caps_read:
            self._dac_override = procfs.own_dac_override()
            self._own_caps_read = True
        override = self._dac_override
        version, access = self.consistent(
            lambda: (state.vfio_nodes_version,
                     group_access(state.nodes, self._uid, self._gids, override)))
        with self._access_lock:
            if version > self._access_version:
                self._access = access
                self._access_version = version

    def vfio_backend(self, addr: str | None) -> VfioBackend:
        """How to open the function through VFIO: its cdev with iommufd when both exist, else
        its group node, else nothing (a function not on VFIO has neither to offer)."""
        state = self.state
        fields = self.consistent(lambda: vfio_backend_fields(self.function(addr), state.nodes,
                                                             state.vfio_variants))
        return VfioBackend(**fields)

    def functions(self) -> list[PciFunction]:
        """Every function, by address, as one state of the model had them."""
        return self.consistent(self._functions_now)

    def _functions_now(self) -> list[PciFunction]:
        functions = self.state.functions
        return [functions[a] for a in sorted(functions)]

    def kept_for_host(self, addr: str) -> str:
        """Why the group of ``addr`` is the host's own (BMC/console, VMD), ``""`` when it is not."""
        return self.consistent(lambda: self.state.kept_for_host(self.function(addr).addr))

    def module_loaded(self, name: str) -> bool:
        return name in self.state.modules

    def plan(self, mode: Mode, *, addr: str | None = None, vendor: str | None = None,
             vfio_driver: str | None = None) -> list[dict[str, Any]]:
        """The ``plan`` probe: the steps a switch would take now, as JSON-ready dicts (live:
        it reads holders and modules). No such card is `DeviceNotFound`, a refusal
        `SwitchRefused` (`GroupPoisoned` for a poisoned group)."""
        from gpuwatch.core.plan import step_json

        plan = plan_for_host(self, mode, addr=addr, vendor=vendor, vfio_driver=vfio_driver)
        if plan.refusal is not None:
            cls = GroupPoisoned if plan.refusal.poisoned else SwitchRefused
            raise cls(plan.refusal.reason, plan.refusal.holders)
        return [step_json(s) for s in plan.steps]


def plan_for_host(model: HostModel, mode: Mode, *, addr: str | None = None,
                  vendor: str | None = None, euid: int | None = None,
                  which: Callable[[str], str | None] | None = None,
                  force: bool = False, vfio_driver: str | None = None,
                  example: bool = False) -> SwitchPlan:
    """The plan for the named card, from facts read now. No such card is `DeviceNotFound`:
    a plan is never invented. ``example`` plans for the documented example card instead
    (the plan says ``example``), whatever the host holds. Reads files (holders, modules),
    writes nothing, needs no privilege."""
    import dataclasses
    import shutil

    from gpuwatch.core.plan import (
        example_card,
        find_card,
        parse_vfio_driver,
        plan_switch,
        poison_key,
    )
    from gpuwatch.hostfs.facts import ModelFacts, gather_facts, model_facts

    paths, state = model.paths, model.state
    vfio_driver = parse_vfio_driver(vfio_driver, mode, state.vfio_variants)
    if example:
        members, facts = example_card(mode)
        return plan_switch(members, mode, dataclasses.replace(facts, root=paths.root),
                           example=True)

    def from_model() -> tuple[tuple[PciFunction, ...], ModelFacts]:
        card, members = find_card(state, addr=addr, vendor=vendor)
        return members, model_facts(state, members, model.poisoned.get(poison_key(card), ""))

    members, known = model.consistent(from_model)  # one state; the files outside it
    facts = gather_facts(paths, members, mode, known,
                         euid=os.geteuid() if euid is None else euid,
                         which=which or shutil.which, vfio_driver=vfio_driver,
                         deadline=model.proc_deadline)
    from gpuwatch.hostfs.journal import find_abandoned

    left = find_abandoned(paths.root, poison_key(members[0])) if members else None
    if left is not None:  # a switch killed half-way: what `mode` would clear too
        facts = dataclasses.replace(facts, unpin=left.members)
    return plan_switch(members, mode, facts, force=force)


def holders_report(model: HostModel, *, addr: str | None = None, vendor: str | None = None,
                   euid: int | None = None) -> dict[str, Any]:
    """Who holds the card's nodes (``/dev/nvidia*``, its DRI and sound nodes, /dev/vfio/N)."""
    from gpuwatch.core.plan import find_card
    from gpuwatch.hostfs.facts import ModelFacts, card_holders, model_facts

    paths, state = model.paths, model.state

    def from_model() -> tuple[PciFunction, tuple[PciFunction, ...], ModelFacts]:
        card, members = find_card(state, addr=addr, vendor=vendor)
        return card, members, model_facts(state, members)

    # `Host.holders` runs this in a thread of its own while the loop applies batches.
    card, members, known = model.consistent(from_model)
    complete = (os.geteuid() if euid is None else euid) == 0
    holders = card_holders(paths, known, members, deadline=model.proc_deadline)
    return {
        "addr": card.addr,
        "group": card.iommu_group,
        "complete": complete,
        "holders": [h.model_dump() for h in holders],
        "note": "" if complete else ("not root: processes of other users cannot be seen, the "
                                     "list may be incomplete"),
    }


def scan(
    root: str | os.PathLike[str] | None = None,
    config: str | os.PathLike[str] | Tables | ConfigInForce | None = None,
) -> HostModel:
    """Read the whole host under ``root`` once and return its model.

    Unnamed, the root and the config file are the daemon's: ``$GPUWATCH_ROOT``,
    ``$GPUWATCH_CONFIG``, ``/etc/gpuwatch/config.yaml`` (`gpuwatch.settings.tables_in_force`),
    so a direct probe answers with the tables the daemon uses. The file is read once, for
    the tables, the root, ``proc_read_timeout`` and ``host_namespaces`` (which PATH
    ``nvidia-ctk`` is looked for on) alike (a `ConfigInForce` given: not again)."""
    config = read_once(config)
    tables = tables_in_force(config)
    where = root_in_force(root, config)
    if not os.path.isdir(where):  # a typo would otherwise read as an empty host, silently
        raise UsageError(f"root {where!r} is not a directory")
    paths = HostPaths(where, host_namespaces=host_namespaces_in_force(config)[0])
    model = HostModel(paths, HostState(tables, scan_tree(paths, tables)))
    model.proc_deadline = proc_read_timeout_in_force(config)
    return model


@overload
def probe(action: Literal["detect-vfio"],
          root: str | os.PathLike[str] | None = ...,
          config: str | os.PathLike[str] | Tables | ConfigInForce | None = ..., *,
          group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
          vendor: str | None = ...) -> DetectVfioResult: ...
@overload
def probe(action: BoolAction,
          root: str | os.PathLike[str] | None = ...,
          config: str | os.PathLike[str] | Tables | ConfigInForce | None = ..., *,
          group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
          vendor: str | None = ...) -> bool: ...
@overload
def probe(action: TextAction,
          root: str | os.PathLike[str] | None = ...,
          config: str | os.PathLike[str] | Tables | ConfigInForce | None = ..., *,
          group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
          vendor: str | None = ...) -> str: ...
@overload
def probe(action: Literal["detect-host-devices"],
          root: str | os.PathLike[str] | None = ...,
          config: str | os.PathLike[str] | Tables | ConfigInForce | None = ..., *,
          group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
          vendor: str | None = ...) -> HostDevicesResult: ...
@overload
def probe(action: Literal["memlock"],
          root: str | os.PathLike[str] | None = ...,
          config: str | os.PathLike[str] | Tables | ConfigInForce | None = ..., *,
          group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
          vendor: str | None = ...) -> MemlockResult: ...
@overload
def probe(action: Literal["nvidia-holders"],
          root: str | os.PathLike[str] | None = ...,
          config: str | os.PathLike[str] | Tables | ConfigInForce | None = ..., *,
          group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
          vendor: str | None = ...) -> tuple[Holder, ...]: ...
@overload
def probe(action: Literal["vfio-backend"],
          root: str | os.PathLike[str] | None = ...,
          config: str | os.PathLike[str] | Tables | ConfigInForce | None = ..., *,
          group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
          vendor: str | None = ...) -> VfioBackend: ...
@overload
def probe(action: Literal["plan"],
          root: str | os.PathLike[str] | None = ...,
          config: str | os.PathLike[str] | Tables | ConfigInForce | None = ..., *,
          group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
          vendor: str | None = ...) -> list[dict[str, Any]]: ...
@overload
def probe(action: str,
          root: str | os.PathLike[str] | None = ...,
          config: str | os.PathLike[str] | Tables | ConfigInForce | None = ..., *,
          group: int | None = ..., addr: str | None = ..., mode: str | None = ...,
          vendor: str | None = ...) -> Any: ...
def probe(
    action: str,
    root: str | os.PathLike[str] | None = None,
    config: str | os.PathLike[str] | Tables | ConfigInForce | None = None,
    *,
    group: int | None = None,
    addr: str | None = None,
    mode: str | None = None,
    vendor: str | None = None,
) -> Any:
    """Scan anew and answer one probe: the no-cache baseline (``gpuwatch probe --fresh``).
    Typed per action as `HostModel.probe` is."""
    check_params(action, group, addr, mode, vendor)
    return scan(root, config).probe(action, group=group, addr=addr, mode=mode, vendor=vendor)


__all__ = [
    "ACTIONS",
    "WATCHED_PROBES",
    "HostModel",
    "check_params",
    "holders_report",
    "may_read_write",
    "plan_for_host",
    "probe",
    "scan",
]
