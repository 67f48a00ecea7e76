"""The per-event fast paths against the general ones they stand in for, over generated input.

Each shortcut of the storm path (a function record updated without validation, a
``driver-changed`` line formatted directly, a JSONL line parsed by the C scanner) must give
exactly what the general path gives: the same records, the same events, the same bytes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwatch.core.events import (
    DeviceChanged,
    DriverChanged,
    IommuGroupChanged,
    NodeAdded,
    ProbeChanged,
    VgpuChanged,
    driver_changed,
    event_json,
    stamp,
)
from gpuwatch.core.observations import (
    CdiSeen,
    IommuSeen,
    KfdSeen,
    NodesSeen,
    NodeStat,
    PciErrorSeen,
    PciSeen,
    Snapshot,
    SriovSeen,
    VgpuSeen,
)
from gpuwatch.core.results import GpuInfo, PciFunction, Sriov, Vgpu
from gpuwatch.core.state import HostState
from gpuwatch.core.trusted import build, evolve, trusted_ok
from gpuwatch.core.uevent import UEvent
from gpuwatch.settings import default_tables
from gpuwatch.sources.jsonl import _LineSplitter, parse_jsonl_line

TABLES = default_tables()
ADDR = "0000:01:00.0"
CDEV = "/dev/vfio/devices/vfio3"

# --------------------------------------------------------------------------- trusted records


def test_the_records_built_without_validation_have_no_hooks_to_skip() -> None:
    for cls in (PciFunction, GpuInfo, DriverChanged, Sriov, Vgpu):
        assert trusted_ok(cls), cls


function_st = st.builds(
    PciFunction,
    addr=st.just(ADDR),
    vendor_id=st.sampled_from(["0x10de", "0x1002"]),
    device_id=st.just("0x2204"),
    class_=st.sampled_from(["0x0300", "0x0200"]),
    class_label=st.just("label"),
    driver=st.sampled_from(["", "nvidia", "vfio-pci"]),
    iommu_group=st.integers(-1, 3),
    vfio_dev=st.sampled_from(["", "vfio0"]),
    health=st.sampled_from(["ok", "failed", "wedged"]),
)
update_st = st.fixed_dictionaries({}, optional={
    "driver": st.sampled_from(["", "nvidia", "ixgbe"]),
    "iommu_group": st.integers(-1, 5),
    "vfio_dev": st.sampled_from(["", "vfio1"]),
    "vfio_cdev": st.sampled_from(["", CDEV]),
    "health": st.sampled_from(["ok", "recovering"]),
    "sriov": st.sampled_from([None, Sriov(totalvfs=4, numvfs=1, vfs=("0000:01:00.4",))]),
    "vgpu": st.sampled_from([None, Vgpu(type=0, creatable=(1, 2))]),
})


@settings(max_examples=200, deadline=None)
@given(function_st, update_st)
def test_evolve_is_model_copy(old: PciFunction, update: dict[str, Any]) -> None:
    fast = evolve(old, update)
    slow = old.model_copy(update=update)
    validated = PciFunction(**{**old.model_dump(), **update})
    assert fast == slow == validated
    assert fast.model_dump_json() == validated.model_dump_json()
    assert repr(fast) == repr(validated)
    assert hash(fast) == hash(validated)
    assert fast.__pydantic_fields_set__ == slow.__pydantic_fields_set__
    assert old.model_dump() == PciFunction(**old.model_dump()).model_dump()  # untouched


text_st = st.text(max_size=12)


@settings(max_examples=300, deadline=None)
@given(text_st, text_st, text_st, st.integers(0, 2**40), text_st)
def test_driver_changed_and_its_line_are_the_validated_ones(
    addr: str, old: str, new: str, seq: int, time: str
) -> None:
    fast = driver_changed(addr, old, new)
    slow = DriverChanged(addr=addr, old=old, new=new)
    assert fast == slow and repr(fast) == repr(slow)
    assert fast.__pydantic_fields_set__ == slow.__pydantic_fields_set__
    stamp([fast], seq or 1, time)
    stamp([slow], seq or 1, time)
    try:
        expected = slow.model_dump_json()
    except Exception as exc:  # odd surrogates: the fast path must fail (or agree) the same way
        with pytest.raises(type(exc)):
            event_json(fast)
        return
    assert event_json(fast) == expected


@pytest.mark.parametrize("addr, old, new", [
    ("0000:01:00.0", "nvidia", ""),
    ("0000:01:00.0", "", "vfio-pci"),
    ("0000:01:00.0", 'a"b', "c\\d"),
    ("0000:01:00.0", "tab\there", "ünï"),
    ("0000:01:00.0", "\x7f", "\x00"),
])
def test_a_driver_changed_line_equals_pydantics_bytes(addr: str, old: str, new: str) -> None:
    event = driver_changed(addr, old, new)
    stamp([event], 7, "2026-12-03T07:00:00.123456Z")
    assert event_json(event) == event.model_dump_json()
    assert json.loads(event_json(event))["new"] == new


def test_other_events_go_to_pydantic() -> None:
    events = [NodeAdded(path="/dev/kvm"), ProbeChanged(action="detect-gpu", old=False, new=True)]
    stamp(events, 3, "2026-12-03T07:00:00.123456Z")
    assert [event_json(e) for e in events] == [e.model_dump_json() for e in events]


# --------------------------------------------------------------------------- the function update


def _state(old: PciSeen, health: str, cdev_node: bool) -> HostState:
    nodes = ((CDEV, NodeStat(0o600, 0, 0)),) if cdev_node else ()
    state = HostState(TABLES, Snapshot(
        functions=(old,), drm=(), modules=frozenset(), kfd=KfdSeen(()),
        nodes=NodesSeen(nodes), cdi=CdiSeen(False, False, False),
        iommu=IommuSeen(enabled=True, kind="intel"),
    ))
    error = {"failed": "FAILED_RECOVERY", "recovering": "BEGIN_RECOVERY"}.get(health)
    if error:
        state.apply(PciErrorSeen(old.addr, error, None))
    return state


def reference(state: HostState, old: PciFunction, seen: PciSeen) -> tuple[PciFunction, list[Any]]:
    """What the general path builds: a validated record from the observation, and the events
    its fields' differences name (the rules of docs/events.md)."""
    cdev = seen.vfio_cdev if seen.vfio_cdev and seen.vfio_cdev in state.nodes else ""
    new = PciFunction(
        addr=seen.addr, vendor_id=seen.vendor_id, device_id=seen.device_id, class_=seen.klass,
        class_label=TABLES.class_label(seen.klass) if seen.klass else "",
        driver=seen.driver, iommu_group=seen.iommu_group, vfio_dev=seen.vfio_dev,
        vfio_cdev=cdev,
        sriov=None if seen.sriov is None else Sriov(
            totalvfs=seen.sriov.totalvfs, numvfs=len(seen.sriov.vfs), vfs=seen.sriov.vfs),
        physfn=seen.physfn,
        vgpu=None if seen.vgpu is None else Vgpu(type=seen.vgpu.type,
                                                 creatable=seen.vgpu.creatable),
        health=old.health if old.driver == seen.driver or not seen.driver else "ok",
    )
    events: list[Any] = []
    if old.driver != new.driver:
        events.append(DriverChanged(addr=ADDR, old=old.driver, new=new.driver))
    if old.iommu_group != new.iommu_group:
        events.append(IommuGroupChanged(addr=ADDR, old=old.iommu_group, new=new.iommu_group))
    changed = [n for n in ("vfio_dev", "vfio_cdev", "sriov", "physfn", "health")
               if getattr(old, n) != getattr(new, n)]
    if changed:
        events.append(DeviceChanged(addr=ADDR, changed=changed, device=new))
    if old.vgpu != new.vgpu:
        events.append(VgpuChanged(addr=ADDR, vgpu=new.vgpu))
    return new, events


def seen_st(klass: str) -> st.SearchStrategy[PciSeen]:
    return st.builds(
        PciSeen,
        addr=st.just(ADDR),
        devpath=st.just(f"/devices/pci0000:00/{ADDR}"),
        vendor_id=st.just("0x10de"),
        device_id=st.just("0x2204"),
        klass=st.just(klass),
        driver=st.sampled_from(["", "nvidia", "vfio-pci", "snd_hda_intel"]),
        iommu_group=st.integers(-1, 3),
        vfio_dev=st.sampled_from(["", "vfio3"]),
        vfio_cdev=st.sampled_from(["", CDEV]),
        sriov=st.sampled_from([None, SriovSeen(8, ()), SriovSeen(8, ("0000:01:00.4",))]),
        physfn=st.sampled_from(["", "0000:01:00.1"]),
        vgpu=st.sampled_from([None, VgpuSeen(0, (1, 2)), VgpuSeen(1, (1,))]),
    )


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from(["0x0300", "0x0200"]),
       st.sampled_from(["ok", "failed", "recovering"]), st.booleans())
def test_a_same_card_update_gives_what_the_general_path_gives(
    data: st.DataObject, klass: str, health: str, cdev_node: bool
) -> None:
    before = data.draw(seen_st(klass))
    state = _state(before, health, cdev_node)
    old = state.functions[ADDR]
    seen = data.draw(seen_st(klass))
    new, expected = reference(state, old, seen)
    events = [e for e in state.apply(seen) if not isinstance(e, ProbeChanged)]
    assert state.functions[ADDR] == new
    assert state.functions[ADDR].model_dump_json() == new.model_dump_json()
    assert [e.model_dump() for e in events] == [e.model_dump() for e in expected]
    # And the model it leaves is the one a fresh build from the same observation gives.
    fresh = _state(seen, new.health, cdev_node)
    assert state.functions == fresh.functions
    assert state.groups == fresh.groups
    for action in ("detect-vfio", "detect-host-devices", "detect-gpu"):
        assert state.answer(action) == fresh.answer(action)


# --------------------------------------------------------------------------- JSONL lines

value_st = st.one_of(st.text(max_size=8), st.integers(-5, 10**6),
                     st.floats(allow_nan=False, allow_infinity=False), st.booleans(), st.none())
props_st = st.dictionaries(st.sampled_from(["ACTION", "DEVPATH", "SUBSYSTEM", "DRIVER", "SEQNUM",
                                            "X", "ü"]), value_st, max_size=6)


def line_st() -> st.SearchStrategy[bytes]:
    compact = props_st.map(lambda d: json.dumps(d, separators=(",", ":")).encode())
    spaced = props_st.map(lambda d: (" " + json.dumps(d) + " \r").encode())
    raw = st.binary(max_size=20)
    other = st.sampled_from([b"", b"[]", b'"x"', b"{}", b'{"A":"b"}{', b'{"A":"b"} x', b"\xff{}",
                             b'{"A":{"b":"c"}}', b'{"A":"\\ud800"}', b"  "])
    return st.one_of(compact, spaced, raw, other)


def general(lines: list[bytes]) -> tuple[list[UEvent], int]:
    out: list[UEvent] = []
    bad = 0
    for raw in lines:
        try:
            out.append(parse_jsonl_line(raw))
        except ValueError:
            bad += bool(raw.strip())
    return out, bad


@settings(max_examples=300, deadline=None)
@given(st.lists(line_st(), max_size=8), st.integers(1, 40))
def test_the_chunk_parser_gives_what_the_line_parser_gives(lines: list[bytes], cut: int) -> None:
    lines = [ln.replace(b"\n", b"") for ln in lines]
    data = b"\n".join(lines) + b"\n"
    splitter = _LineSplitter("test")
    got: list[UEvent] = []
    for start in range(0, len(data), cut):  # chunk boundaries anywhere, mid-line too
        got.extend(splitter.feed(data[start : start + cut]))
    got.extend(splitter.finish())
    expected, bad = general(lines)
    assert [(e.action, e.devpath, e.subsystem, dict(e.properties)) for e in got] == \
        [(e.action, e.devpath, e.subsystem, dict(e.properties)) for e in expected]
    assert splitter.skipped == bad
    assert all(type(e) is UEvent for e in got)


def test_build_takes_the_given_dict() -> None:
    fields = {"seq": 0, "time": "", "type": "driver-changed", "addr": ADDR, "old": "a", "new": "b"}
    event = build(DriverChanged, fields, {"addr", "old", "new"})
    assert event == DriverChanged(addr=ADDR, old="a", new="b")
