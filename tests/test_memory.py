"""What a watcher keeps resident: the model and nothing of how it was built.

A daemon holds its model for life, so what the first scan leaves behind is paid for as long
as it runs (issue 5's RSS target). These tests pin the parts that are behaviour: the scan's
snapshot is let go once the model holds it, equal strings read per function are one object,
records given the same fields share one fields-set (which nothing may then change in place),
and the first build does not keep its unheard events alive all at once.
"""

from __future__ import annotations

import copy
import gc
import tracemalloc
from collections import defaultdict
from pathlib import Path

import pytest

import gpuwatch
from gpuwatch.core.observations import Snapshot
from gpuwatch.core.results import PciFunction
from gpuwatch.core.state import HostState
from gpuwatch.core.trusted import evolve
from gpuwatch.hostfs.scan import HostPaths, scan
from gpuwatch.settings import default_tables
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot, synthetic_host
from gpuwatch.watch.watcher import open_watcher


def alive_snapshots() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if type(obj) is Snapshot)


async def test_the_first_scan_is_let_go_once_the_watcher_is_ready(host: SysRoot) -> None:
    # Two holders kept it before: the idle worker thread (its last job's result) and
    # open_watcher's own frame, suspended for the watcher's life. A resync's scan neither.
    assert alive_snapshots() == 0
    async with open_watcher(host.root, MemorySource(), reconcile_interval=0,
                            cdi_poll_interval=0) as watcher:
        assert len(watcher.model.state.functions) == 7
        assert alive_snapshots() == 0
        await watcher.resync("reconcile")
        assert alive_snapshots() == 0


@pytest.mark.parametrize("layout", ["symlink", "flat"])
def test_equal_strings_read_per_function_are_one_object(tmp_path: Path, layout: str) -> None:
    host = synthetic_host(tmp_path / "host", 96, layout=layout)  # type: ignore[arg-type]
    model = gpuwatch.scan(str(host.root))
    by_value: dict[tuple[str, str], set[int]] = defaultdict(set)
    for fn in model.state.functions.values():
        for field in ("vendor_id", "device_id", "class_", "class_label", "driver"):
            value = getattr(fn, field)
            by_value[field, value].add(id(value))
    for known in model.paths.plain.values():
        by_value["pci_id", known.pci_id].add(id(known.pci_id))
        by_value["pci_class", known.pci_class].add(id(known.pci_class))
    shared = {key: ids for key, ids in by_value.items() if len(ids) > 1}
    assert not shared, sorted(shared)[:5]
    # The host has repeats to share: many functions of one vendor, driver and class.
    assert len(model.state.functions) > 2 * len({k for k in by_value if k[0] == "vendor_id"})


def test_records_given_the_same_fields_share_one_set_nothing_changes(host: SysRoot) -> None:
    model = gpuwatch.scan(str(host.root))
    functions = list(model.state.functions.values())
    sets = {id(fn.__pydantic_fields_set__) for fn in functions}
    assert len(sets) == len({frozenset(fn.model_fields_set) for fn in functions}) == 1
    shared = functions[0].model_fields_set
    names = frozenset(shared)
    # pydantic copies the set before it changes a record's: the shared one stays as it is.
    changed = functions[0].model_copy(update={"health": "failed"})
    assert "health" in changed.model_fields_set and frozenset(shared) == names
    assert copy.copy(functions[0]).model_fields_set == names
    assert copy.deepcopy(functions[0]).model_fields_set == names
    with pytest.raises(ValueError):
        functions[0].driver = "vfio-pci"  # frozen: the one in-place writer refuses
    assert frozenset(shared) == names
    # evolve gives the same set for fields already set, a shared one for new names.
    assert evolve(functions[0], {"driver": ""}).__pydantic_fields_set__ is shared
    failed = evolve(functions[0], {"health": "failed"})
    assert failed.model_fields_set == names | {"health"}
    assert evolve(functions[1], {"health": "failed"}).__pydantic_fields_set__ is (
        failed.__pydantic_fields_set__)
    assert frozenset(shared) == names
    # And the records still equal, dump and hash as validated ones do.
    for fn in functions:
        again = PciFunction.model_validate(fn.model_dump())
        assert fn == again and hash(fn) == hash(again)
        assert fn.model_dump_json() == again.model_dump_json()
        # The names given as before: every field but the health a new function starts with.
        assert fn.model_fields_set == set(PciFunction.model_fields) - {"health"}


def test_the_first_build_does_not_hold_its_events_at_once(tmp_path: Path) -> None:
    # Nobody hears the events of a state's first build; held until its end, one
    # device-added per function left their memory in holes between the records that stay.
    host = synthetic_host(tmp_path / "host", 512)
    tables = default_tables()
    snapshot = scan(HostPaths(str(host.root)), tables)
    HostState(tables, snapshot)  # warm: caches, lazily built validators
    tracemalloc.start()
    try:
        state = HostState(tables, snapshot)
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(state.functions) == 512
    assert peak - held < held / 4, (held, peak)
    # Still the state an empty one reaches by applying the same snapshot (the events it
    # reports are the ones the first build drops).
    built = HostState(tables)
    events = built.apply_snapshot(snapshot)
    assert sum(1 for e in events if getattr(e, "type", "") == "device-added") == 512
    assert built.functions == state.functions and built.groups == state.groups
    assert {a: built.answer(a) for a in ("detect-vfio", "detect-host-devices")} == {
        a: state.answer(a) for a in ("detect-vfio", "detect-host-devices")}
