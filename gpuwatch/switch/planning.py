"""Plans and holder reports for a scanned host: the ``plan`` probe, ``gpuwatch plan`` and
``gpuwatch holders``. Reads files (holders, modules), writes nothing, needs no privilege."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpuwatch.core.modes import Mode, group_mode
from gpuwatch.core.plan import SwitchPlan, example_card, find_card, plan_switch
from gpuwatch.core.results import PciFunction
from gpuwatch.errors import DeviceNotFound
from gpuwatch.switch.facts import card_holders, gather_facts_now

if TYPE_CHECKING:
    from gpuwatch.model import HostModel


def plan_for_host(model: HostModel, mode: Mode, *, addr: str | None = None,
                  vendor: str | None = None, euid: int | None = None,
                  which: Callable[[str], str | None] | None = None,
                  force: bool = False) -> SwitchPlan:
    """The plan for the named card; for the documented example card when there is none."""
    paths, state = model.paths, model.state
    try:
        _card, members = find_card(state, addr=addr, vendor=vendor)
    except DeviceNotFound:
        members, facts = example_card(mode)
        return plan_switch(members, mode, dataclasses.replace(facts, root=paths.root),
                           example=True)
    facts = gather_facts_now(paths, state, members, mode,
                             euid=os.geteuid() if euid is None else euid,
                             which=which or shutil.which)
    return plan_switch(members, mode, facts, force=force)


def default_mode(members: tuple[PciFunction, ...]) -> Mode:
    """With no mode asked for, plan the way out of the current one."""
    return "vfio" if group_mode(members) == "nvidia" else "nvidia"


def holders_report(model: HostModel, *, addr: str | None = None, vendor: str | None = None,
                   euid: int | None = None) -> dict[str, Any]:
    """Who holds the card's nodes (``/dev/nvidia*``, its DRI and sound nodes, /dev/vfio/N)."""
    paths, state = model.paths, model.state
    card, members = find_card(state, addr=addr, vendor=vendor)
    complete = (os.geteuid() if euid is None else euid) == 0
    holders = card_holders(paths, state, members)
    return {
        "addr": card.addr,
        "group": card.iommu_group,
        "complete": complete,
        "holders": [h.model_dump() for h in holders],
        "note": "" if complete else ("not root: processes of other users cannot be seen, the "
                                     "list may be incomplete"),
    }


__all__ = ["default_mode", "holders_report", "plan_for_host"]
