"""``gpuwatch mode [vfio|nvidia]``: show or switch the mode of a GPU's whole IOMMU group.

With a mode, the switch runs inside a watcher of its own, so completion is what the model
sees from uevents (docs/switch.md). The helpers here (card selection flags, result output)
are shared by the other switch commands: plan, recover, holders.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import anyio

from gpuwatch.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    UsageProblem,
    add_root_args,
    check_root,
    config_of,
    fail,
    positive_seconds,
    to_stderr,
    warnings_to_stderr,
)
from gpuwatch.cli.daemon import add_daemon_args, ask_daemon
from gpuwatch.core.events import SwitchMember
from gpuwatch.core.modes import MODES, Mode, driver_key, group_mode, target_driver
from gpuwatch.core.pci import card_in_group, parse_addr
from gpuwatch.core.plan import (
    NVIDIA_VENDOR,
    already_in_mode,
    find_card,
    parse_mode,
    parse_vendor,
    parse_vfio_driver,
    poison_key,
    switch_guard,
    unhealthy_reason,
)
from gpuwatch.core.reporttext import addr_width
from gpuwatch.core.results import PciFunction
from gpuwatch.core.text import terminal_safe
from gpuwatch.errors import GroupPoisoned, NotPrivileged, SwitchFailed, SwitchRefused
from gpuwatch.host import open_host
from gpuwatch.hostfs.facts import health_facts
from gpuwatch.hostfs.journal import find_abandoned
from gpuwatch.jsonout import dumps
from gpuwatch.model import HostModel, scan
from gpuwatch.sources import SourceUnavailable
from gpuwatch.switch.engine import DEFAULT_TIMEOUT, SwitchResult
from gpuwatch.switch.hostops import Backend, make_backend
from gpuwatch.switch.poison import PoisonStore


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "mode",
        description="Without a mode, show the mode of the card's IOMMU group. With one, switch "
                    "every function of the group to its driver for that mode (root only).")
    p.add_argument("mode", nargs="?", choices=MODES, help="vfio or nvidia (omit to show)")
    add_target_args(p)
    p.add_argument("--timeout", type=positive_seconds, default=DEFAULT_TIMEOUT, metavar="S",
                   help=f"bound of the whole switch in seconds (default {DEFAULT_TIMEOUT:g})")
    add_vfio_driver_arg(p)
    add_root_args(p)
    add_daemon_args(p)
    p.add_argument("--log", default=None, metavar="PATH|-",
                   help="append the watcher's events (switch-started, …) to this log")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_force_arg(p)
    p.set_defaults(func=run)


# --------------------------------------------------------------------------- shared helpers


def add_target_args(p: argparse.ArgumentParser) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--addr", metavar="ADDR", help="a PCI address of the card (DDDD:BB:DD.F)")
    group.add_argument("--vendor", metavar="VENDOR",
                       help=f"the card's PCI vendor id (default {NVIDIA_VENDOR}, one card only)")


def add_vfio_driver_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vfio-driver", metavar="NAME", default=None,
                   help="the VFIO driver for the card's display functions (vfio-pci or a "
                        "variant such as nvgrace_gpu_vfio_pci); default: what modules.alias "
                        "says the kernel would pick")


def vfio_driver_of(args: argparse.Namespace, mode: Mode | None) -> str | None:
    """``--vfio-driver``, checked as far as it can be without the host (exit 2 when wrong)."""
    name: str | None = args.vfio_driver
    if name is None:
        return None
    if mode != "vfio":
        raise UsageProblem("--vfio-driver needs mode vfio")
    return parse_vfio_driver(name, mode, frozenset({driver_key(name)}))


def add_force_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true",
                   help="vfio: pass a group kept for the host (its BMC/console VGA, its only "
                        "boot display, a VMD controller's domain) through anyway; either "
                        "mode: move a NIC, NVMe drive or NVSwitch sharing the group (no ACS) "
                        "off its host driver too")


def load_poison(model: HostModel) -> None:
    """Fill the model's poisoned groups from the record a wedged switch left in this boot,
    as the daemon's engine does: a poisoned group is refused here too."""
    for group, entry in PoisonStore(model.root).load().items():
        model.poisoned.setdefault(group, entry.error)


def target_of(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """``(addr, vendor)`` from the flags, validated; the vendor defaults to NVIDIA's."""
    if args.addr is not None:
        return parse_addr(args.addr), None
    return None, parse_vendor(args.vendor if args.vendor is not None else NVIDIA_VENDOR)


def print_result(result: SwitchResult, as_json: bool) -> None:
    if as_json:
        print(dumps(result.as_result()))
    else:
        where = card_in_group(result.addr, result.group)
        if result.changed:
            print(f"{where}: {result.from_mode} -> {result.to_mode} in "
                  f"{result.duration_ms:.0f} ms")
        elif result.addr:
            print(f"{where}: already {result.to_mode}, nothing to do")
        for m in result.members:
            print(terminal_safe(f"  {m.addr}  {m.driver or '(no driver)'}"))
    for note in result.notes:
        to_stderr(f"gpuwatch: note: {note}")


class _Signalled(BaseException):
    """SIGINT or SIGTERM while no switch runs (before it began, or in the instant after it
    ended): exit 128 + the signal's number, no switch left half-done."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _before_switch(signum: int, _frame: FrameType | None) -> None:
    raise _Signalled(signum)


class Interrupted(SwitchFailed):
    """SIGINT or SIGTERM came during the switch: it ended with ``switch-failed``
    (``"error": "interrupted"``), never with ``switch-started`` alone."""


async def run_in_watcher(args: argparse.Namespace, backend: Backend, action: str,
                         target: str, mode: Mode | None) -> SwitchResult:
    """Run ``action`` in a host of our own; SIGINT and SIGTERM cancel it cleanly.

    What a signal means is read from the switch's own events, not guessed: none begun (no
    ``switch-started``: the host still opening, the checks, the holder scan) is a stop with
    nothing written (`_Signalled`: exit 128 + the signal); one that completed
    (``switch-completed`` published, the host closing) is that result; one under way ended
    as ``switch-failed`` "interrupted" (`Interrupted`: exit 1)."""
    result: list[SwitchResult] = []
    seen: list[Any] = []  # this run's switch-started / switch-completed, as published
    signalled: list[int] = []
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        try:
            await _in_group(signals, result, seen, signalled, args, backend, action, target,
                            mode)
        except BaseExceptionGroup as group:  # the switch's own error, as itself
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
    if result:
        return result[0]
    completed = [e for e in seen if isinstance(e, SwitchResult)]
    if completed:
        return completed[-1]  # the signal came after the end: it changes nothing
    if signalled and not seen:
        raise _Signalled(signalled[0])
    raise Interrupted("interrupted by a signal: a switch under way ended as switch-failed "
                      "(interrupted), its group put back as it was where that was safe "
                      "(the event's `restored`); check `gpuwatch mode` before retrying")


async def _in_group(signals: Any, result: list[SwitchResult], seen: list[Any],
                    signalled: list[int], args: argparse.Namespace, backend: Backend,
                    action: str, target: str, mode: Mode | None) -> None:
    """Run the switch beside a signal watcher: the first SIGTERM/SIGINT cancels it cleanly."""
    async with anyio.create_task_group() as tg:

        async def on_signal() -> None:
            async for signum in signals:
                signalled.append(signum)
                if seen:  # a switch under way: its roll-back may take a while, say why
                    _log_interrupt(signum)
                tg.cancel_scope.cancel()
                return

        async def work() -> None:
            result.append(await _run_in_host(args, backend, action, target, mode, seen))
            tg.cancel_scope.cancel()

        tg.start_soon(on_signal)
        tg.start_soon(work)


def _log_interrupt(signum: int) -> None:
    print(f"gpuwatch: {signal.Signals(signum).name}: stopping the switch", file=sys.stderr)


async def _run_in_host(args: argparse.Namespace, backend: Backend, action: str,
                       target: str, mode: Mode | None, seen: list[Any]) -> SwitchResult:
    """Open a host of our own for the switch's duration and run ``action`` in it; ``seen``
    gets the switch's ``switch-started`` and ``switch-completed`` as they are published."""
    async with open_host(args.root, source=backend.source, config=config_of(args), log=args.log,
                         ops=backend.ops, geteuid=backend.geteuid, reconcile_interval=0,
                         cdi_poll_interval=0) as host:
        host.listeners.append(lambda event: seen.append(event) if getattr(
            event, "type", None) in ("switch-started", "switch-completed") else None)
        if action == "recover":
            return await host.recover(target, timeout=args.timeout)
        assert mode is not None
        return await host.switch(target, mode, timeout=args.timeout,
                                 force=bool(getattr(args, "force", False)),
                                 vfio_driver=getattr(args, "vfio_driver", None))


def run_switch(args: argparse.Namespace, backend: Backend, action: str, target: str,
               mode: Mode | None) -> SwitchResult | int:
    try:
        return anyio.run(run_in_watcher, args, backend, action, target, mode)
    except SourceUnavailable as exc:
        return fail(f"cannot watch for completion: {exc}", EXIT_FAILURE)
    except _Signalled as stop:
        return stopped(stop.signum)


def stopped(signum: int) -> int:
    """A signal before any switch began: one line, exit 128 + its number."""
    print(f"gpuwatch: {signal.Signals(signum).name}: stopped; no switch was under way",
          file=sys.stderr)
    return 128 + signum


# --------------------------------------------------------------------------- mode


def _show(model: HostModel, card: PciFunction, members: tuple[PciFunction, ...],
          as_json: bool) -> None:
    poisoned = PoisonStore(model.root).load().get(poison_key(card))
    mode = group_mode(members, model.state.vfio_variants)
    kept = model.kept_for_host(card.addr)
    if as_json:
        print(dumps({
            "addr": card.addr, "group": card.iommu_group, "mode": mode,
            "poisoned": poisoned.error if poisoned is not None else None,
            "kept_for_host": bool(kept), "reason": kept,
            "members": [{"addr": m.addr, "class": m.class_, "driver": m.driver,
                         "vfio": target_driver(m, "vfio"), "nvidia": target_driver(m, "nvidia"),
                         "health": m.health}
                        for m in members],
        }))
        return
    print(f"{card_in_group(card.addr, card.iommu_group)}: {mode}")
    width = addr_width(m.addr for m in members)
    for m in members:
        print(terminal_safe(f"  {m.addr:<{width}}  {m.class_label:<20} "
                            f"{m.driver or '(no driver)'}"))
    if poisoned is not None:
        lift = "reboot or `gpuwatch recover`" if card.iommu_group >= 0 else "reboot"
        print(terminal_safe(f"  poisoned until {lift}: {poisoned.error}"))
    if kept:
        print(terminal_safe(f"  kept for the host: {kept}"))


def run(args: argparse.Namespace) -> int:
    return stopped_before_switch(lambda switch_over: _run(args, switch_over))


def stopped_before_switch(body: Callable[[Callable[[], None]], int]) -> int:
    """Run ``body`` (``mode`` or ``recover``) so that SIGINT/SIGTERM before the switch begins
    end the command with 128 + the signal's number, nothing written; once its watcher runs,
    the switch ends as switch-failed ("interrupted", the group put back), exit 1, or
    completes (`run_in_watcher`). ``body`` gets the call that restores the usual handlers
    once the switch has ended."""
    previous = ({s: signal.signal(s, _before_switch) for s in (signal.SIGINT, signal.SIGTERM)}
                if threading.current_thread() is threading.main_thread() else {})

    def switch_over() -> None:  # the switch ended: a signal now has its usual effect
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    try:
        with warnings_to_stderr():
            return body(switch_over)
    except _Signalled as stop:
        return stopped(stop.signum)
    finally:
        switch_over()


def _run(args: argparse.Namespace, switch_over: Callable[[], None]) -> int:
    addr, vendor = target_of(args)
    mode = parse_mode(args.mode) if args.mode is not None else None
    vfio_driver = vfio_driver_of(args, mode)
    check_root(args.root)
    if mode is not None and args.log is None:
        # A running daemon owns the switch lock and the log: it switches, we report.
        answer = ask_daemon(args, lambda c: c.switch(mode, addr=addr, vendor=vendor,
                                                     timeout=args.timeout,
                                                     force=args.force or None,
                                                     vfio_driver=vfio_driver), mutating=True)
        if answer is not None:
            print_result(SwitchResult.model_validate(answer.value), args.json)
            return EXIT_OK
    model = scan(args.root, config_of(args))
    card, members = find_card(model.state, addr=addr, vendor=vendor)
    if mode is None:
        _show(model, card, members, args.json)
        return EXIT_OK
    load_poison(model)
    # Poison, vendor, kept for the host: refused before "already in mode" and before the
    # privilege check (a wedged card "in mode nvidia" must not read as ready: exit 1).
    guard = switch_guard(card, mode, poisoned=model.poisoned.get(poison_key(card), ""),
                         kept_for_host=model.kept_for_host(card.addr) if mode == "vfio" else "",
                         force=args.force)
    if guard is not None:
        raise (GroupPoisoned if guard.poisoned else SwitchRefused)(guard.reason)
    variants = model.state.vfio_variants
    parse_vfio_driver(vfio_driver, mode, variants)
    unhealthy = unhealthy_reason(members, health_facts(model.state, members))
    if unhealthy is not None:
        raise SwitchRefused(unhealthy)
    backend = None
    if already_in_mode(members, mode, variants, vfio_driver):
        # No write, so no privilege needed: a claim can run this on every start. Unless a
        # switch of the group was killed half-way and may have left a driver_override that
        # vfio mode never leaves: root clears it (the switch below), anyone else is told.
        left = find_abandoned(args.root, poison_key(card)) if mode == "vfio" else None
        backend = make_backend(args.root, config=config_of(args)) if left is not None else None
        if backend is None or backend.geteuid() != 0:
            notes = [] if left is None else [
                f"an earlier switch of group {card.iommu_group} to {left.to_mode} (pid "
                f"{left.pid}) was killed half-way and may have left a driver_override on "
                f"{', '.join(left.members)}: `gpuwatch recover` or this switch as root "
                "clears it"]
            print_result(SwitchResult(
                addr=card.addr, group=card.iommu_group, from_mode=mode, to_mode=mode,
                members=[SwitchMember(addr=m.addr, driver=m.driver) for m in members],
                duration_ms=0.0, changed=False, notes=notes), args.json)
            return EXIT_OK
    backend = backend or make_backend(args.root, config=config_of(args))
    if backend.geteuid() != 0:
        raise NotPrivileged("switching drivers needs root (it writes to sysfs and loads "
                            "modules)")
    try:
        result = run_switch(args, backend, "switch", addr or vendor or NVIDIA_VENDOR, mode)
    finally:
        switch_over()
    if isinstance(result, int):
        return result
    print_result(result, args.json)
    return EXIT_OK
