"""The per-event fast paths against the general ones they stand in for, over generated input.

Each shortcut of the storm path (a function record updated without validation, a
``driver-changed`` line formatted directly, a JSONL line parsed by the C scanner) must give
exactly what the general path gives: the same records, the same events, the same bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuwatch
from gpuwatch.core.events import (
    DeviceChanged,
    DriverChanged,
    IommuGroupChanged,
    NodeAdded,
    ProbeChanged,
    VgpuChanged,
    driver_changed,
    event_json,
    scrub_surrogates,
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
from gpuwatch.hostfs import scan as scan_mod
from gpuwatch.hostfs.scan import HostPaths, read_function, read_function_known
from gpuwatch.settings import default_tables
from gpuwatch.sources.jsonl import _LineSplitter, parse_jsonl_line
from gpuwatch.testing import SysRoot
from gpuwatch.watch.eventlog import EventLog

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


text_st = st.text(max_size=12) | st.text(st.characters(codec=None, categories=["Cs"]),
                                          max_size=3)


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
    except ValueError:  # a lone surrogate: written as U+FFFD (never raised), as pydantic's
        # fields would be (tests/test_fast_path_differential.py draws these)
        assert json.loads(event_json(fast)) == scrub_surrogates(slow.model_dump())
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


def _gpu(addr: str, driver: str, label: str) -> GpuInfo:
    fn = PciFunction(addr=addr, vendor_id="0x10de", device_id="0x2204", class_="0x0300",
                     class_label=label, driver=driver, iommu_group=3)
    return GpuInfo(**fn.model_dump(), group_members=(fn,))


gpu_st = st.builds(_gpu, st.sampled_from(["0000:01:00.0", "0000:02:00.0"]),
                   st.sampled_from(["", "nvidia", "vfio-pci"]),
                   st.sampled_from(["VGA", 'a"b\\c', "ünï", "\x7f"]))
side_st = st.one_of(
    st.just({}),
    st.builds(lambda gpus: {"gpus": gpus}, st.lists(gpu_st, max_size=3)),
    st.builds(lambda gpus: {"gpus": gpus, "iommu_enabled": True}, st.lists(gpu_st, max_size=2)),
    st.builds(lambda gpus: {"gpus": tuple(gpus)}, st.lists(gpu_st, max_size=2)),
    st.just({"gpus": ["not a gpu"]}),
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["detect-vfio", "detect-gpu"]), side_st, side_st, st.integers(1, 2**40),
       st.sampled_from(["2026-12-03T07:00:00.123456Z", 'odd"time']), st.booleans())
def test_a_probe_changed_line_equals_pydantics_bytes(
    action: str, old: dict[str, Any], new: dict[str, Any], seq: int, time: str, again: bool
) -> None:
    """The detect-vfio line assembled from each GPU entry's JSON made once is pydantic's
    line, the first time and from the cache (the entries of one are the next one's old)."""
    event = ProbeChanged(action=action, old=old, new=new)
    stamp([event], seq, time)
    assert event_json(event) == event.model_dump_json()
    if again:
        repeat = ProbeChanged(action=action, old=new, new=old)
        stamp([repeat], seq + 1, time)
        assert event_json(repeat) == repeat.model_dump_json()


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
            totalvfs=seen.sriov.totalvfs, numvfs=seen.sriov.numvfs, vfs=seen.sriov.vfs),
        physfn=seen.physfn,
        vgpu=None if seen.vgpu is None else Vgpu(type=seen.vgpu.type,
                                                 creatable=seen.vgpu.creatable),
        # A bind to another driver clears a bad health, but not a recovery under way (no
        # bridge above failed here): only the kernel's end of it does.
        health=(old.health if old.driver == seen.driver or not seen.driver
                or old.health == "recovering" else "ok"),
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
        sriov=st.sampled_from([None, SriovSeen(8, (), 0), SriovSeen(8, ("0000:01:00.4",), 1)]),
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


# --------------------------------------------------------------------------- the bind/unbind read


@pytest.fixture
def tmpfs_root() -> Iterator[Path]:
    """The shortcut needs inode numbers that name one directory for good (tmpfs)."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        pytest.skip("no writable /dev/shm")
    path = Path(tempfile.mkdtemp(prefix="gpuwatch-fast-", dir=shm))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


F = "0000:05:00.0"


def _steps(kind: str) -> list[tuple[str, Callable[[SysRoot], None]]]:
    """What a kernel does to a function's directory around a bind or unbind, by driver kind."""
    def bind(driver: str, group: int | None = None,
             vfio: bool = False) -> Callable[[SysRoot], None]:
        def step(s: SysRoot) -> None:
            if group is not None:
                s.set_iommu_group(F, group)  # no-IOMMU VFIO makes its own group on bind
            s.bind(F, driver)
            if vfio:
                s.add_vfio_dev(F, 4)
        return step

    def unbind(drop_group: bool = False) -> Callable[[SysRoot], None]:
        def step(s: SysRoot) -> None:
            s.unbind(F)
            if drop_group:
                s.set_iommu_group(F, None)
        return step

    def late_group_then_bind(s: SysRoot) -> None:
        s.set_iommu_group(F, 9)  # an IOMMU probed after the device (no uevent of its own)
        s.bind(F, "igb")

    return {
        "plain": [("unbind", unbind()), ("bind", bind("igb")), ("unbind", unbind()),
                  ("bind", bind("ixgbe"))],
        "vfio": [("unbind", unbind()), ("bind", bind("vfio-pci", vfio=True)),
                 ("unbind", unbind()), ("bind", bind("mlx5_vfio_pci", vfio=True)),
                 ("unbind", unbind()), ("bind", bind("igb"))],
        "noiommu": [("bind", bind("vfio-pci", group=17, vfio=True)),
                    ("unbind", unbind(drop_group=True)), ("bind", bind("igb")),
                    ("unbind", unbind()), ("bind", bind("vfio-pci", group=18, vfio=True))],
        "late-iommu": [("unbind", unbind()), ("bind", late_group_then_bind)],
        "noiommu-bound": [("unbind", unbind(drop_group=True)), ("bind", bind("igb")),
                          ("unbind", unbind()),
                          ("bind", bind("vfio-pci", group=19, vfio=True)),
                          ("unbind", unbind(drop_group=True))],
        "iommu-vfio": [("unbind", unbind()), ("bind", bind("vfio-pci", vfio=True)),
                       ("unbind", unbind()), ("bind", bind("vfio-pci", vfio=True))],
    }[kind]


@pytest.mark.parametrize("kind", ["plain", "vfio", "noiommu", "late-iommu", "noiommu-bound",
                                  "iommu-vfio"])
def test_a_bind_or_unbind_read_equals_a_full_read(tmpfs_root: Path, kind: str) -> None:
    """Whatever a bind or unbind changes in the tree, the shortcut reads what a full read
    reads: the driver, and where a VFIO driver comes or goes its device and group."""
    host = SysRoot(tmpfs_root / "host")
    group = {"noiommu": None, "late-iommu": None, "noiommu-bound": 17}.get(kind, 3)
    driver = {"noiommu": None, "noiommu-bound": "vfio-pci", "iommu-vfio": "vfio-pci"}.get(
        kind, "igb")
    devpath = host.add_function(F, vendor="0x8086", device="0x1533", klass="0x020000",
                                driver=driver, iommu_group=group)
    paths = HostPaths(host.root)
    assert paths.stable_inodes()
    read_function(paths, F, devpath)  # the full read the shortcut builds on
    for action, step in _steps(kind):
        step(host)
        fast = read_function_known(paths, F, devpath, action)
        assert fast == read_function(HostPaths(host.root), F, devpath), (kind, action)


def test_an_unbind_lists_no_vfio_dev(tmpfs_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    host = SysRoot(tmpfs_root / "host")
    devpath = host.add_function(F, klass="0x020000", driver="vfio-pci", iommu_group=3)
    host.add_vfio_dev(F, 1)
    paths = HostPaths(host.root)
    assert read_function(paths, F, devpath).vfio_dev == "vfio1"  # type: ignore[union-attr]
    host.unbind(F)
    listed: list[str] = []
    monkeypatch.setattr(scan_mod, "list_dir", lambda p: listed.append(p) or [])
    seen = read_function_known(paths, F, devpath, "unbind")
    assert isinstance(seen, PciSeen) and (seen.driver, seen.vfio_dev) == ("", "")
    assert listed == []


# --------------------------------------------------------------------------- the log's one write


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.text(st.characters(blacklist_characters="\n",
                                              blacklist_categories=("Cs",)), max_size=30),
                         max_size=6), max_size=6),
       st.integers(1, 120))
def test_a_batch_is_written_and_rotated_as_line_by_line(batches: list[list[str]],
                                                        max_bytes: int) -> None:
    with tempfile.TemporaryDirectory() as work:
        path = os.path.join(work, "log.jsonl")
        log = EventLog(path, max_bytes=max_bytes, keep=1000)
        expected: list[list[bytes]] = [[]]
        size = 0
        try:
            for batch in batches:
                log.write_lines(batch)
                for line in batch:  # the rule: rotate before a line that would not fit
                    data = (line + "\n").encode()
                    if size > 0 and size + len(data) > max_bytes:
                        expected.append([])
                        size = 0
                    expected[-1].append(data)
                    size += len(data)
        finally:
            log.close()
        # Oldest first: log.jsonl.N … log.jsonl.1, then log.jsonl (the lock file aside).
        files = sorted((n for n in os.listdir(work) if not n.endswith(".lock")),
                       key=lambda n: -int(n.rsplit(".", 1)[1]) if n[-1].isdigit() else 0)
        got = [Path(work, n).read_bytes() for n in files]
        assert [g for g in got if g] == [b"".join(e) for e in expected if e]


def test_a_line_break_inside_a_line_is_refused(tmp_path: Path) -> None:
    log = EventLog(str(tmp_path / "log.jsonl"))
    try:
        with pytest.raises(ValueError):
            log.write_lines(['{"a":1}', '{"b":\n2}'])
        log.write_lines([])
    finally:
        log.close()
    assert (tmp_path / "log.jsonl").read_bytes() == b""


def test_the_prepared_answers_equal_validated_ones(tmp_path: Path) -> None:
    """The GPU entries and answers the model builds without validation are the records
    validation builds from the same values: equal, and dumped to the same bytes."""
    from gpuwatch.core.results import DetectVfioResult, HostDevicesResult
    from gpuwatch.testing import synthetic_host

    host = synthetic_host(tmp_path / "host", 64)
    model = gpuwatch.scan(host.root)
    state = model.state
    vfio = state.answer("detect-vfio")
    assert vfio.gpus
    for info in vfio.gpus:
        fn = state.functions[info.addr]
        validated = GpuInfo(**fn.__dict__, group_members=state.group_members(info.addr))
        assert info == validated and repr(info) == repr(validated)
        assert info.model_dump_json() == validated.model_dump_json()
        assert info.__pydantic_fields_set__ == validated.__pydantic_fields_set__
    for answer, cls in ((vfio, DetectVfioResult),
                        (state.answer("detect-host-devices"), HostDevicesResult)):
        validated = cls.model_validate(answer.__dict__)
        assert answer == validated and answer.model_dump_json() == validated.model_dump_json()
    for cls in (DetectVfioResult, HostDevicesResult):
        assert trusted_ok(cls)


def test_a_scan_remembers_identities_so_the_first_bind_reads_only_its_links(
    tmpfs_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = SysRoot(tmpfs_root / "host")
    devpath = host.add_function(F, vendor="0x8086", device="0x1533", klass="0x020000",
                                driver="igb", iommu_group=3)
    paths = HostPaths(host.root)
    scan_mod.scan_functions(paths)
    full: list[str] = []
    real = scan_mod._read_function_dir
    monkeypatch.setattr(scan_mod, "_read_function_dir",
                        lambda d, a, p, **kw: full.append(a) or real(d, a, p, **kw))
    host.unbind(F)
    assert read_function_known(paths, F, devpath, "unbind") == \
        read_function(HostPaths(host.root), F, devpath)
    assert full == [F]  # only the reference read above, none by the shortcut
    # A card swapped in after the scan is read in full and seen as what it is.
    host.remove_function(F)
    host.add_function(F, vendor="0x15b3", device="0x1017", klass="0x020000", driver="mlx5_core",
                      iommu_group=3)
    seen = read_function_known(paths, F, devpath, "bind")
    assert isinstance(seen, PciSeen) and (seen.vendor_id, seen.driver) == ("0x15b3", "mlx5_core")


# --------------------------------------------------------------------------- the plain lane


def _through_lane(paths: HostPaths, state: HostState, events: list[UEvent]) -> list[Any]:
    observations = scan_mod.observe_batch(paths, TABLES, events, state.devpaths)
    return [e for e in state.apply(observations) if not isinstance(e, ProbeChanged)]


def _fresh_state(root: Path) -> tuple[HostPaths, HostState]:
    paths = HostPaths(root)
    return paths, HostState(TABLES, scan_mod.scan(paths, TABLES))


@pytest.mark.parametrize("where", ["tmp", "tmpfs"])
@pytest.mark.parametrize("kind", ["plain", "vfio", "noiommu", "late-iommu", "noiommu-bound",
                                  "iommu-vfio"])
def test_a_bind_or_unbind_through_the_lane_leaves_the_model_a_fresh_scan_builds(
    tmp_path: Path, tmpfs_root: Path, kind: str, where: str
) -> None:
    """Each step through `observe_batch` (the lane where the function is plain, the full way
    where not) leaves the model equal to one built from a fresh scan, on a filesystem that
    reuses inode numbers (no identity shortcut there) and on tmpfs."""
    parent = tmp_path if where == "tmp" else tmpfs_root
    host = SysRoot(parent / "host")
    group = {"noiommu": None, "late-iommu": None, "noiommu-bound": 17}.get(kind, 3)
    driver = {"noiommu": None, "noiommu-bound": "vfio-pci", "iommu-vfio": "vfio-pci"}.get(
        kind, "igb")
    host.add_function(F, vendor="0x8086", device="0x1533", klass="0x020000",
                      driver=driver, iommu_group=group)
    paths, state = _fresh_state(host.root)
    for action, step in _steps(kind):
        step(host)
        before = state.functions[F]
        got = _through_lane(paths, state, [UEvent.from_properties(host.uevent_props(action, F))])
        state.apply(scan_mod.scan_nodes(paths, TABLES))  # what the vfio-dev uevents bring
        _, fresh = _fresh_state(host.root)
        assert state.functions == fresh.functions, (kind, action)
        assert state.groups == fresh.groups, (kind, action)
        if before.driver != state.functions[F].driver:
            assert got[0] == DriverChanged(addr=F, old=before.driver,
                                           new=state.functions[F].driver)


def test_a_plain_bind_reads_only_the_driver_link(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    host = SysRoot(tmp_path / "host")
    host.add_function(F, vendor="0x8086", device="0x1533", klass="0x020000", driver="igb",
                      iommu_group=3)
    paths, state = _fresh_state(host.root)
    assert str(host.device_dir(F)) in paths.plain
    calls: list[str] = []
    for name in ("stat", "lstat", "access", "readlink", "listdir", "open", "scandir"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda p, *a, _r=real, _n=name, **k:
                            calls.append(f"{_n} {p}") or _r(p, *a, **k))
    host.unbind(F)
    unbind = UEvent.from_properties(host.uevent_props("unbind", F))
    calls.clear()
    assert [e.type for e in _through_lane(paths, state, [unbind])] == ["driver-changed"]
    # No driver link: and the function itself still there (a vanished one is its removal,
    # as the full read says: test_event_exactness). Two checks of existence, nothing read.
    assert calls == [f"access {host.device_dir(F)}/driver", f"access {host.device_dir(F)}"]
    host.bind(F, "ixgbe")
    bind = UEvent.from_properties(host.uevent_props("bind", F))
    calls.clear()
    assert [(e.old, e.new) for e in _through_lane(paths, state, [bind])] == [("", "ixgbe")]
    assert calls == [f"readlink {host.device_dir(F)}/driver"]


@pytest.mark.parametrize("props", [
    {"PCI_ID": "15B3:1017"},  # another card's ids: a swap the uevent names
    {"PCI_CLASS": "10802"},  # another class
    {"PCI_ID": None},  # no ids at all (a hand-written line): nothing to vouch with
])
def test_a_uevent_that_does_not_vouch_for_the_card_is_read_in_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, props: dict[str, str | None]
) -> None:
    host = SysRoot(tmp_path / "host")
    host.add_function(F, vendor="0x8086", device="0x1533", klass="0x020000", driver="igb",
                      iommu_group=3)
    paths, state = _fresh_state(host.root)
    full: list[str] = []
    real = scan_mod._read_function_dir
    monkeypatch.setattr(scan_mod, "_read_function_dir",
                        lambda d, a, p, **kw: full.append(a) or real(d, a, p, **kw))
    host.unbind(F)
    raw = host.uevent_props("unbind", F)
    for key, value in props.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    _through_lane(paths, state, [UEvent.from_properties(raw)])
    assert full == [F]
    assert state.functions[F].driver == ""


def test_a_run_of_plain_functions_is_one_observation_in_order(tmp_path: Path) -> None:
    host = SysRoot(tmp_path / "host")
    addrs = [f"0000:0{i}:00.0" for i in range(5, 9)]
    for n, addr in enumerate(addrs):
        host.add_function(addr, vendor="0x8086", device="0x1533", klass="0x020000",
                          driver="igb", iommu_group=n + 3)
    pf = "0000:09:00.0"
    host.add_function(pf, vendor="0x15b3", device="0x1017", klass="0x020000",
                      driver="mlx5_core", iommu_group=20)
    host.enable_sriov(pf, 4)
    paths, state = _fresh_state(host.root)
    assert str(host.device_dir(pf)) not in paths.plain  # SR-IOV: not plain
    order = [addrs[2], addrs[0], pf, addrs[3]]
    for addr in order:
        host.unbind(addr)
    events = [UEvent.from_properties(host.uevent_props("unbind", a)) for a in order]
    observations = scan_mod.observe_batch(paths, TABLES, events, state.devpaths)
    assert [type(o).__name__ for o in observations] == ["DriversSeen", "PciSeen", "DriversSeen"]
    got = [e.addr for e in state.apply(observations) if e.type == "driver-changed"]
    assert got == order


@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from(["0x0300", "0x0200"]),
       st.sampled_from(["ok", "failed", "recovering"]), st.booleans(),
       st.sampled_from(["", "igb", "snd_hda_intel", "nvidia-not"]))
def test_a_drivers_seen_entry_gives_what_its_full_observation_gives(
    data: st.DataObject, klass: str, health: str, cdev_node: bool, driver: str
) -> None:
    """`DriversSeen` stands for the full read of a function bound to a driver that brings no
    VFIO device or vGPU: the same records, events and answers, whatever state it left."""
    from gpuwatch.core.observations import DriversSeen

    before = data.draw(seen_st(klass))
    lane, full = _state(before, health, cdev_node), _state(before, health, cdev_node)
    seen = before._replace(driver=driver, vfio_dev="", vfio_cdev="", vgpu=None)
    got = lane.apply(DriversSeen(((ADDR, driver),)))
    expected = full.apply(seen)
    assert lane.functions == full.functions
    assert lane.functions[ADDR].model_dump_json() == full.functions[ADDR].model_dump_json()
    assert [e.model_dump() for e in got] == [e.model_dump() for e in expected]
    for action in ("detect-vfio", "detect-host-devices", "detect-gpu"):
        assert lane.answer(action) == full.answer(action)


uevent_st = st.builds(
    lambda action, sub, name, extra: UEvent.from_properties({
        "ACTION": action, "SUBSYSTEM": sub,
        "DEVPATH": f"/devices/pci0000:00/0000:00:01.0/{name}", **extra}),
    st.sampled_from(["bind", "unbind", "add", "remove", "change", "move"]),
    st.sampled_from(["pci", "drm", "vfio-dev", ""]),
    st.sampled_from(["0000:01:00.0", "0000:01:00.0/drm/card1", "card0", "garbage", ""]),
    st.dictionaries(st.sampled_from(["ERROR_EVENT", "DEVICE_ONLINE", "WEDGED", "PID", "TASK",
                                     "PCI_SLOT_NAME"]),
                    st.sampled_from(["", "1", "0", "BEGIN_RECOVERY", "rebind,bus-reset",
                                     "0000:02:00.0", "x" * 70]), max_size=4),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(uevent_st, max_size=12))
def test_batch_facts_are_every_uevents_facts_in_order(batch: list[UEvent]) -> None:
    from gpuwatch.core.uevent_facts import batch_facts, uevent_facts

    expected = [fact for event in batch for fact in uevent_facts(event)]
    assert batch_facts(batch) == expected
