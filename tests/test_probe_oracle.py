"""gpuwatch's probe answers against a naive oracle of the written contract (tests/probe_oracle.py).

Hypothesis builds host trees with `SysRoot` (PCI functions of many classes, vendors, drivers
and IOMMU groups, DRM nodes, KFD nodes, modules, CDI specs, /dev nodes, /dev/vfio groups,
processes holding /dev/nvidia*) in the kernel's symlink layout, the flat one and a capture's
(links copied as folders), and every action must answer as the oracle does: from a scan's
memory, from `gpuwatch.probe`, and from the CLI's JSON, both its stdlib path and the full
command (a config file sends it there).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import run_main
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from probe_oracle import NOT_FOUND, TABLES, Oracle

import gpuwatch
from gpuwatch.hostfs import procfs
from gpuwatch.jsonout import jsonable
from gpuwatch.testing import SysRoot

FIELDS = ("addr", "vendor_id", "device_id", "class", "class_label", "driver", "iommu_group",
          "vfio_dev", "vfio_cdev")
#: What every function of these trees has beyond the fields the oracle reads.
DEFAULTS = {"sriov": None, "physfn": "", "vgpu": None, "health": "ok"}
ABSENT = "0000:0f:1f.7"

CLASSES = ("0x030000", "0x030200", "0x038000", "0x040300", "0x060400", "0x0c0330",
           "0x020000", "0x010802", "0x088000", "0x060000", "0x060900", "0x060700",
           "0x080700")
ODD_CLASSES: tuple[str | bytes | None, ...] = (
    "0X030200", "030000", "0x04", "0x0300", b"\xff\xfeclass", None)
VENDORS = ("0x10de", "0x1002", "0x8086", "0x1af4", "0x15b3", "0x1a03")
ODD_VENDORS: tuple[str | bytes | None, ...] = ("0x10DE", "1002", b"0x10\xe9", "", None, "dir")
DRIVERS = (None, "nvidia", "vfio-pci", "snd_hda_intel", "snd-hda-intel", "amdgpu", "i915",
           "pcieport", "igb", "xhci_hcd", "mlx5_vfio_pci", "nvgrace_gpu_vfio_pci",
           "virtio-pci", "nouveau")
FDS = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-caps/nvidia-cap1",
       "/dev/null", "socket:[4242]", "/dev/dri/renderD128", "/dev/nvidia", "anon_inode:[x]")
DEV_NODES = ("/dev/kfd", "/dev/kvm", "/dev/vhost-net", "/dev/vhost-vsock", "/dev/fuse",
             "/dev/net/tun", "/dev/hwrng", "/dev/iommu", "/dev/nvidia0", "/dev/nvidiactl",
             "/dev/random")
GFX: tuple[int | str | None, ...] = (0, 0, None, 90010, 90012, 90402, 100306, 110000, 120001,
                                     "garbage", "+110000", "99999999999", "4294967295")
CMDLINE_WORDS = ("quiet", "intel_iommu=on", "intel_iommu=off", "amd_iommu=on", "iommu=pt",
                 "intel_iommu=on,sm_on", "amd_iommu=off", "iommu=off")
#: What a copier (or a damaged tree) leaves out: docs/probes.md, captured trees.
DAMAGE = ("drop-driver", "drop-group", "drop-uevent", "drop-drm-device", "empty-bus",
          "dangle-bus", "bad-group")
UNITS = (None, "dmar0", "ivhd0", "smmu3.0x0000000009050000")


@dataclass
class Fn:
    addr: str
    klass: str | bytes | None
    vendor: str | bytes | None
    driver: str | None
    group: int | None
    vfio_dev: tuple[bool, bool] | None = None  # with a cdev, its node kept


@dataclass
class Host:
    layout: str
    pad: bool
    fns: list[Fn]
    drm: list[tuple[str, int | None, bool]]
    kfd: dict[int, int | str | None]
    kfd_class_link: bool
    modules: list[str]
    cdi: list[str]
    ctk: str
    dev: list[str]
    vfio: list[tuple[int, int, int, int]]
    procs: list[tuple[int, bytes, list[str], bool]]
    unit: str | None
    cmdline: list[str]
    euid: int
    gids: frozenset[int] = field(default_factory=frozenset)
    junk: bool = False
    damage: list[tuple[str, int]] = field(default_factory=list)


@st.composite
def addrs(draw: st.DrawFn) -> str:
    domain = draw(st.sampled_from(("0000", "0000", "0000", "0001", "10000")))
    bus, dev, fn = draw(st.integers(0, 5)), draw(st.integers(0, 3)), draw(st.integers(0, 3))
    return f"{domain}:{bus:02x}:{dev:02x}.{fn}"


@st.composite
def functions(draw: st.DrawFn) -> Fn:
    return Fn(
        addr=draw(addrs()),
        klass=draw(st.sampled_from(CLASSES) | st.sampled_from(ODD_CLASSES)),
        vendor=draw(st.sampled_from(VENDORS) | st.sampled_from(ODD_VENDORS)),
        driver=draw(st.sampled_from(DRIVERS)),
        group=draw(st.none() | st.integers(0, 4)),
        vfio_dev=draw(st.none() | st.none() | st.tuples(st.booleans(), st.booleans())),
    )


@st.composite
def hosts(draw: st.DrawFn) -> Host:
    fns = draw(st.lists(functions(), max_size=8, unique_by=lambda f: f.addr))
    owners = st.none() | st.integers(0, len(fns) - 1) if fns else st.none()
    drm_names = draw(st.lists(st.sampled_from(("card0", "card1", "card2", "renderD128",
                                                "renderD129", "renderD130", "renderD131")),
                              unique=True, max_size=5))
    drm = [(name, draw(owners), draw(st.booleans() | st.just(True))) for name in drm_names]
    kfd = draw(st.dictionaries(st.integers(0, 11), st.sampled_from(GFX), max_size=4))
    procs = draw(st.lists(
        st.tuples(st.integers(1, 99999),
                  st.binary(max_size=14).filter(lambda b: b"\0" not in b)
                  .map(lambda b: b + b"\n" if b[:1] == b"a" else b),
                  st.lists(st.sampled_from(FDS), max_size=3),
                  st.sampled_from((False, False, True))),
        max_size=4, unique_by=lambda p: p[0]))
    euid = draw(st.sampled_from((0, 1000)))
    return Host(
        layout=draw(st.sampled_from(("symlink", "flat", "capture", "capture-shallow"))),
        pad=draw(st.sampled_from((False, False, False, True))),
        fns=fns,
        drm=drm,
        kfd=kfd,
        kfd_class_link=draw(st.sampled_from((True, True, False))),
        modules=draw(st.lists(st.sampled_from(("nvidia", "amdgpu", "vfio_pci", "nvidia_uvm")),
                              unique=True)),
        cdi=draw(st.lists(st.sampled_from(("etc", "var", "run-link", "run-rel-link",
                                            "etc-link", "dir", "dangling")),
                          unique=True, max_size=2)),
        ctk=draw(st.sampled_from(("none", "none", "exec", "noexec"))),
        dev=draw(st.lists(st.sampled_from(DEV_NODES), unique=True)),
        vfio=draw(st.lists(st.tuples(st.integers(0, 6), st.sampled_from((0o600, 0o660, 0o666,
                                                                          0o606, 0o640, 0o066)),
                                     st.sampled_from((0, 1000)), st.sampled_from((0, 36))),
                           unique_by=lambda v: v[0], max_size=3)),
        procs=procs,
        unit=draw(st.sampled_from(UNITS)),
        cmdline=draw(st.lists(st.sampled_from(CMDLINE_WORDS), max_size=3)),
        euid=euid,
        gids=frozenset(draw(st.sampled_from(((0,), (1000,), (1000, 36))))),
        junk=draw(st.booleans()),
        damage=draw(st.lists(st.tuples(st.sampled_from(DAMAGE), st.integers(0, 7)),
                             max_size=3)),
    )


def build(h: Host, base: Path) -> tuple[SysRoot, Path]:
    """The tree ``h`` describes under ``base/root``; returns it and a PATH folder."""
    s = SysRoot(base / "root", layout="flat" if h.layout == "flat" else "symlink")
    for f in h.fns:
        if f.addr.startswith("10000:") and "pci10000:00" not in s._roots:
            s.add_function("0000:00:0e.0", vendor="0x8086", device="0x467f",
                           klass="0x010400", driver="vmd")
            s.add_vmd_domain("0000:00:0e.0")
    for index, f in enumerate(h.fns):
        if f.addr == "0000:00:0e.0" and f.addr in s.functions:
            continue
        klass = f.klass if isinstance(f.klass, str) else "0x000000"
        vendor = f.vendor if isinstance(f.vendor, str) and f.vendor not in ("", "dir") \
            else "0x10de"
        parent = "pci10000:00" if f.addr.startswith("10000:") else None
        s.add_function(f.addr, klass=klass, vendor=vendor, driver=f.driver,
                       iommu_group=f.group, parent=parent)
        folder = s.device_dir(f.addr)
        if isinstance(f.klass, bytes):
            s.set_attr(f.addr, "class", f.klass + b"\n")
        elif f.klass is None:
            (folder / "class").unlink()
        if f.vendor == "dir":
            (folder / "vendor").unlink()
            (folder / "vendor").mkdir()  # unreadable, even as root
        elif f.vendor is None:
            (folder / "vendor").unlink()
        elif isinstance(f.vendor, bytes):
            s.set_attr(f.addr, "vendor", f.vendor + b"\n")
        elif f.vendor == "":
            s.set_attr(f.addr, "vendor", "")
        if f.vfio_dev is not None:
            cdev, keep = f.vfio_dev
            s.add_vfio_dev(f.addr, index, cdev=cdev)
            if cdev and not keep:
                s.remove_dev_node(f"/dev/vfio/devices/vfio{index}")
    for name, owner, node in h.drm:
        addr = None if owner is None or not h.fns else h.fns[owner].addr
        s.add_drm(name, addr, dev_node=node)
    for node, version in h.kfd.items():
        s.add_kfd_node(node, version if isinstance(version, int) or version is None else 110000)
        if isinstance(version, str):
            props = s.root / f"sys/devices/virtual/kfd/kfd/topology/nodes/{node}/properties"
            props.write_text(props.read_text().replace("gfx_target_version 110000",
                                                       f"gfx_target_version {version}"))
    for name in h.modules:
        s.add_module(name)
    for where in h.cdi:
        if where in ("dir", "etc-link") and ("etc" in h.cdi or {"dir", "etc-link"} <= {*h.cdi}):
            continue  # one etc/cdi each
        if where in ("etc", "var"):
            s.add_cdi_spec(where)  # type: ignore[arg-type]
        elif where == "etc-link":  # etc/cdi a link spelled absolute: read in the root
            (s.root / "opt/cdi").mkdir(parents=True)
            (s.root / "opt/cdi/nvidia.yaml").write_text("cdiVersion: 0.5.0\n")
            (s.root / "etc/cdi").symlink_to("/opt/cdi")
        elif where == "dir":
            (s.root / "etc/cdi/nvidia.yaml").mkdir(parents=True)
        elif where == "dangling":
            if "var" in h.cdi or "run-link" in h.cdi or "run-rel-link" in h.cdi:
                continue
            (s.root / "var/run/cdi").mkdir(parents=True, exist_ok=True)
            (s.root / "var/run/cdi/nvidia.yaml").symlink_to("/nowhere/nvidia.yaml")
        else:  # var/run a link to /run (or ../run), as on current distributions
            var_run = s.root / "var/run"
            if var_run.is_dir() and not var_run.is_symlink():
                shutil.rmtree(var_run)
                var_run.symlink_to("/run" if where == "run-link" else "../run")
            (s.root / "run/cdi").mkdir(parents=True, exist_ok=True)
            (s.root / "run/cdi/nvidia.yaml").write_text("cdiVersion: 0.5.0\n")
    for path in h.dev:
        s.add_dev_node(path)
    for group, mode, uid, gid in h.vfio:
        if group == 6:  # a no-IOMMU group's node: no /dev/vfio/N
            node = s.add_dev_node("/dev/vfio/noiommu-5")
            node.chmod(mode)
            give_to(node, uid, gid)
            continue
        s.add_vfio_group(group, mode=mode)
        give_to(s.root / f"dev/vfio/{group}", uid, gid)
    for pid, comm, fds, unreadable in h.procs:
        s.add_process(pid, comm, fds=dict(enumerate(fds)))
        if unreadable:
            shutil.rmtree(s.root / f"proc/{pid}/fd")
    (s.root / "proc/self").mkdir(exist_ok=True)  # not a pid
    if h.unit is not None:
        s.add_iommu_unit(h.unit)
    s.set_cmdline(" ".join(h.cmdline))
    if h.junk:
        bus = s.root / "sys/bus/pci/devices"
        (bus / "README").write_text("x")
        (bus / "pci0000:00").mkdir(exist_ok=True)
    if h.layout == "capture":
        s.capture()
    elif h.layout == "capture-shallow":  # the drm nodes' device links copied as links
        s.capture(nested=("driver", "iommu_group"))
    damage(s, h)
    if not h.kfd_class_link and (s.root / "sys/class/kfd/kfd").exists():
        target = s.root / "sys/class/kfd/kfd"
        if target.is_symlink():
            target.unlink()
        else:
            shutil.rmtree(target)
    if h.pad:
        s.pad_like_tar()
    bindir = base / "bin"
    bindir.mkdir()
    if h.ctk != "none":
        tool = bindir / "nvidia-ctk"
        tool.write_text("#!/bin/sh\n")
        tool.chmod(0o755 if h.ctk == "exec" else 0o644)
    return s, bindir


def give_to(path: Path, uid: int, gid: int) -> None:
    """Give ``path`` to ``uid``:``gid`` where we may (as root); else it stays ours."""
    with contextlib.suppress(PermissionError):
        os.chown(path, uid, gid)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def damage(s: SysRoot, h: Host) -> None:
    """Leave out what ``h.damage`` says, as a copier or a damaged tree does."""
    bus = s.root / "sys/bus/pci/devices"
    addrs_ = sorted(s.functions)
    for what, i in sorted(h.damage, key=lambda d: d[0] in ("empty-bus", "dangle-bus")):
        if what == "drop-drm-device":
            if h.drm:
                name = h.drm[i % len(h.drm)][0]
                _remove(Path(os.path.realpath(s.root / "sys/class/drm" / name)) / "device")
            continue
        if not addrs_:
            continue
        addr = addrs_[i % len(addrs_)]
        folder = Path(os.path.realpath(bus / addr))
        if what == "bad-group" and h.layout == "symlink":  # a link naming no number
            _remove(folder / "iommu_group")
            (folder / "iommu_group").symlink_to("../../../kernel/iommu_groups/notanumber")
        elif what in ("drop-driver", "drop-group", "drop-uevent"):
            _remove(folder / {"drop-driver": "driver", "drop-group": "iommu_group",
                              "drop-uevent": "uevent"}[what])
        elif what == "empty-bus" and h.layout != "flat":
            for name in addrs_:
                _remove(bus / name)
        elif what == "dangle-bus" and h.layout != "flat" and os.path.lexists(bus / addr):
            _remove(bus / addr)
            (bus / addr).symlink_to(f"../../../devices/nowhere/{addr}")


def requests(s: SysRoot, oracle: Oracle) -> list[tuple[str, dict[str, Any]]]:
    """Every action, with every address (those built, those the tree shows, one absent)
    and mode, and several groups."""
    out: list[tuple[str, dict[str, Any]]] = [
        (a, {}) for a in ("detect-vfio", "detect-gpu", "detect-amd-gpu", "amd-gfx-version",
                          "amd-gfx-target", "detect-host-devices", "memlock", "nvidia-holders")]
    out += [("vfio-group-accessible", {"group": n}) for n in (-1, 0, 1, 2, 3, 4, 5, 6, 7)]
    for addr in sorted({*s.functions, *oracle.function_dirs(), ABSENT}):
        out += [("display-driver", {"addr": addr}), ("current-mode", {"addr": addr})]
        out += [("group-in-mode", {"addr": addr, "mode": m}) for m in ("vfio", "nvidia")]
    return out


def project(action: str, value: Any) -> Any:
    """gpuwatch's answer with the function fields the oracle does not model checked at
    their defaults and left out."""
    if action != "detect-vfio":
        return value

    def fn(record: dict[str, Any]) -> dict[str, Any]:
        assert {k: record[k] for k in DEFAULTS} == DEFAULTS, record
        return {k: record[k] for k in FIELDS}

    gpus = [dict(fn(g), group_members=[fn(m) for m in g["group_members"]])
            for g in value["gpus"]]
    return {**value, "gpus": gpus}


def cli_args(action: str, kw: dict[str, Any]) -> list[str]:
    args = ["probe", action]
    for key in ("group", "addr", "mode"):
        if key in kw:
            args += [f"--{key}", str(kw[key])]
    return args


def check(h: Host, capsys: pytest.CaptureFixture[str], *, every_way: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        base = Path(tmp)
        s, bindir = build(h, base)
        mp.setenv("PATH", str(bindir))
        for var in ("GPUWATCH_CONFIG", "GPUWATCH_ROOT"):
            mp.delenv(var, raising=False)
        mp.setattr(os, "geteuid", lambda: h.euid)
        # The caller posed as holds CAP_DAC_OVERRIDE as root does (the oracle's "root
        # always may"), whatever this test process holds.
        mp.setattr(procfs, "own_dac_override", lambda: h.euid == 0)
        mp.setattr(os, "getegid", lambda: min(h.gids))
        mp.setattr(os, "getgroups", lambda: sorted(h.gids))
        oracle = Oracle(str(s.root), h.euid, h.gids)
        config = base / "config.yaml"
        config.write_text(json.dumps(TABLES))  # the embedded tables: the full command's path
        model = gpuwatch.scan(s.root)
        for action, kw in requests(s, oracle):
            expected = oracle.answer(action, **kw)
            where = f"{action} {kw}"
            assert library(model.probe, action, kw) == expected, where
            if not every_way:
                continue
            assert library(functools.partial(gpuwatch.probe, root=s.root), action, kw) == \
                expected, where
            for extra in ([], ["--config", str(config)]):
                code, out, err = run_main(capsys, *cli_args(action, kw), *extra,
                                          "--root", str(s.root))
                if code == 1 and expected == NOT_FOUND:
                    assert err.startswith("gpuwatch: no PCI function"), (where, extra, err)
                    continue
                assert (code, err) == (0, ""), (where, extra)
                assert project(action, json.loads(out)["result"]) == expected, (where, extra)


def library(probe: Any, action: str, kw: dict[str, Any]) -> Any:
    """A library call's answer as JSON, `NOT_FOUND` for `gpuwatch.DeviceNotFound`."""
    try:
        return project(action, jsonable(probe(action, **kw)))
    except gpuwatch.DeviceNotFound:
        return NOT_FOUND


#: ``GPUWATCH_ORACLE_EXAMPLES=2000``: a longer, random search than the suite's fixed one.
LONG_SEARCH = os.environ.get("GPUWATCH_ORACLE_EXAMPLES")


def oracle_settings(examples: int) -> settings:
    """Modest and repeatable in the suite (the trees are built on disk); no deadline."""
    return settings(max_examples=int(LONG_SEARCH or examples), deadline=None,
                    derandomize=LONG_SEARCH is None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


#: The flat layout with a node's ``device`` link left out: the function whose ``drm/`` holds
#: it is its device (it was read as having none, and a virtual node won the render node).
FLAT_UNLINKED_NODE = Host(
    layout="flat", pad=False,
    fns=[Fn("0000:03:00.0", "0x030000", "0x1002", "amdgpu", 5)],
    drm=[("renderD128", None, True), ("card0", 0, True), ("renderD129", 0, True)],
    kfd={1: 110000}, kfd_class_link=True, modules=[], cdi=[], ctk="none", dev=[], vfio=[],
    procs=[], unit=None, cmdline=[], euid=0, gids=frozenset({0}),
    damage=[("drop-drm-device", 1), ("drop-drm-device", 2)])


#: A capture with no function in its bus listing (only a stray entry) and a node copied
#: without its ``device``: the walked function whose ``drm/`` lists it is its device.
WALKED_UNLINKED_NODE = Host(
    layout="capture", pad=False,
    fns=[Fn("0000:00:00.0", "0x030000", "0x10de", None, None)],
    drm=[("renderD128", None, True), ("renderD129", 0, True)], kfd={}, kfd_class_link=True,
    modules=[], cdi=[], ctk="none", dev=[], vfio=[], procs=[], unit=None, cmdline=[], euid=0,
    gids=frozenset({0}), junk=True, damage=[("drop-drm-device", 1), ("empty-bus", 0)])


@pytest.mark.timeout(300)
@oracle_settings(60)
@given(h=hosts())
@example(h=FLAT_UNLINKED_NODE)
@example(h=WALKED_UNLINKED_NODE)
def test_model_answers_as_the_contract_says(h: Host,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A scan's answers, from memory, for every action on generated trees."""
    check(h, capsys, every_way=False)


#: A process that named itself with a newline at the end (``prctl(PR_SET_NAME)`` takes any
#: byte but NUL): ``/proc/<pid>/comm`` reads ``b"worker\n\n"``, the name and the kernel's
#: newline, and the name keeps its own.
NEWLINE_COMM = Host(
    layout="symlink", pad=False,
    fns=[Fn("0000:01:00.0", "0x030000", "0x10de", "nvidia", 1),
         Fn("0000:01:00.1", "0x040300", "0x10de", "snd_hda_intel", 1)],
    drm=[("card0", 0, True), ("renderD128", 0, True)], kfd={}, kfd_class_link=True,
    modules=["nvidia"], cdi=["etc"], ctk="none", dev=["/dev/nvidia0"], vfio=[],
    procs=[(7, b"worker\n", ["/dev/nvidia0"], False), (8, b"\n\xff", ["/dev/nvidiactl"], False)],
    unit="dmar0", cmdline=[], euid=0, gids=frozenset({0}))


@pytest.mark.timeout(300)
@oracle_settings(15)
@given(h=hosts())
@example(h=NEWLINE_COMM)
def test_every_way_of_asking_answers_as_the_contract_says(
        h: Host, capsys: pytest.CaptureFixture[str]) -> None:
    """`gpuwatch.probe` and both paths of the CLI answer as a scan does, and as the oracle."""
    check(h, capsys, every_way=True)
