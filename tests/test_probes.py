"""The probe contract on realistic trees: every action and every rule of docs/probes.md."""

from __future__ import annotations

import os
import resource
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_main

import gpuwatch
from gpuwatch.core.observations import NodeStat
from gpuwatch.jsonout import jsonable
from gpuwatch.model import may_read_write
from gpuwatch.testing import SysRoot, example_gpu_host

NV, NV_AUDIO, IGPU, NIC = "0000:01:00.0", "0000:01:00.1", "0000:00:02.0", "0000:02:00.0"


def answer(root: SysRoot | Path, action: str, **kw: object) -> object:
    base = root.root if isinstance(root, SysRoot) else root
    return jsonable(gpuwatch.scan(base).probe(action, **kw))  # type: ignore[arg-type]


# ------------------------------------------------------------ PCI functions


def test_function_fields_follow_the_contract(host: SysRoot) -> None:
    gpus = answer(host, "detect-vfio")["gpus"]  # type: ignore[index]
    nv = next(g for g in gpus if g["addr"] == NV)
    assert {
        k: nv[k]
        for k in ("addr", "vendor_id", "device_id", "class", "class_label", "driver", "iommu_group")
    } == {
        "addr": NV,
        "vendor_id": "0x10de",
        "device_id": "0x2204",
        "class": "0x0300",
        "class_label": "VGA controller",
        "driver": "nvidia",
        "iommu_group": 13,
    }


def test_unlabelled_class_falls_back_to_the_class_itself(host: SysRoot) -> None:
    model = gpuwatch.scan(host.root)
    nic = next(f for f in model.functions() if f.addr == NIC)
    assert (nic.class_, nic.class_label) == ("0x0200", "0x0200")


def test_detect_vfio_lists_gpus_sorted_with_their_groups(host: SysRoot) -> None:
    result = answer(host, "detect-vfio")
    assert result["iommu_enabled"] is True  # type: ignore[index]
    assert result["iommu_kind"] == "intel"  # type: ignore[index]
    gpus = result["gpus"]  # type: ignore[index]
    assert [g["addr"] for g in gpus] == [IGPU, NV]
    nv = gpus[1]
    assert [m["addr"] for m in nv["group_members"]] == [NV, NV_AUDIO]
    assert nv["group_members"][1]["class_label"] == "Audio device"
    assert [m["addr"] for m in gpus[0]["group_members"]] == [IGPU]


def test_gpu_without_group_is_its_own_only_member(empty_host: SysRoot) -> None:
    empty_host.add_function("0000:03:00.0", klass="0x030200", driver="nvidia", iommu_group=None)
    empty_host.add_function("0000:04:00.0", klass="0x030200", driver="nvidia", iommu_group=None)
    result = answer(empty_host, "detect-vfio")
    assert result["iommu_enabled"] is False  # type: ignore[index]
    gpus = result["gpus"]  # type: ignore[index]
    assert [g["iommu_group"] for g in gpus] == [-1, -1]
    assert [[m["addr"] for m in g["group_members"]] for g in gpus] == [
        ["0000:03:00.0"],
        ["0000:04:00.0"],
    ]


def test_entries_that_are_not_addresses_are_ignored(host: SysRoot) -> None:
    bus = host.root / "sys/bus/pci/devices"
    (bus / "pci0000:00").mkdir()
    (bus / "README").write_text("x")
    os.symlink("../../../devices/nowhere", bus / "0000:09:00.0")  # dangling: went away
    model = gpuwatch.scan(host.root)
    assert [f.addr for f in model.functions()] == sorted(host.functions)


@pytest.mark.parametrize(
    ("units", "cmdline", "kind"),
    [
        (["dmar0", "dmar1"], "", "intel"),
        (["ivhd0"], "", "amd"),
        (["smmu3.0x0000000009050000"], "", "arm"),
        ([], "quiet intel_iommu=on iommu=pt", "intel"),
        ([], "amd_iommu=on", "amd"),
        ([], "quiet splash", ""),
        (["ivhd0"], "intel_iommu=on", "amd"),  # the hardware unit wins over the cmdline
    ],
)
def test_iommu_kind(empty_host: SysRoot, units: list[str], cmdline: str, kind: str) -> None:
    for unit in units:
        empty_host.add_iommu_unit(unit)
    empty_host.set_cmdline(cmdline)
    empty_host.add_function("0000:01:00.0", iommu_group=3)
    result = answer(empty_host, "detect-vfio")
    assert result == {"iommu_enabled": True, "iommu_kind": kind, "iommufd": False,  # type: ignore[index]
                      "gpus": result["gpus"]}  # type: ignore[index]


def test_iommu_off_when_no_groups(empty_host: SysRoot) -> None:
    empty_host.add_function("0000:01:00.0", iommu_group=None)
    assert answer(empty_host, "detect-vfio")["iommu_enabled"] is False  # type: ignore[index]


def test_flat_layout_answers_like_the_symlink_layout(tmp_path: Path) -> None:
    linked = example_gpu_host(tmp_path / "linked")
    flat = example_gpu_host(tmp_path / "flat", layout="flat")
    assert not os.path.islink(flat.root / "sys/bus/pci/devices" / NV)
    for action in ("detect-vfio", "detect-host-devices", "detect-gpu", "detect-amd-gpu"):
        assert answer(flat, action) == answer(linked, action)


# ------------------------------------------------------------ detect-gpu (CDI)


@pytest.mark.parametrize(
    ("module", "etc", "var", "ctk", "expected"),
    [
        (False, True, True, True, False),  # no driver
        (True, True, False, False, True),  # driver + spec in etc
        (True, False, True, False, True),  # driver + spec in var/run
        (True, False, False, True, True),  # driver + only nvidia-ctk
        (True, False, False, False, False),  # driver and nothing
    ],
)
def test_cdi_decision_table(
    empty_host: SysRoot,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    module: bool,
    etc: bool,
    var: bool,
    ctk: bool,
    expected: bool,
) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    if ctk:
        tool = bindir / "nvidia-ctk"
        tool.write_text("#!/bin/sh\n")
        tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(bindir))
    empty_host.add_function("0000:01:00.0", driver="nvidia", iommu_group=1)
    if module:
        empty_host.add_module("nvidia")
    if etc:
        empty_host.add_cdi_spec("etc")
    if var:
        empty_host.add_cdi_spec("var")
    assert answer(empty_host, "detect-gpu") is expected


# ------------------------------------------------------------ AMD


def test_detect_amd_gpu_follows_the_card_driver(empty_host: SysRoot) -> None:
    empty_host.add_function(
        "0000:03:00.0", vendor="0x1002", device="0x744c", driver="amdgpu", iommu_group=5
    )
    assert answer(empty_host, "detect-amd-gpu") is False  # no DRM card yet
    empty_host.add_drm("renderD128", "0000:03:00.0")
    assert answer(empty_host, "detect-amd-gpu") is False  # a render node is not a card
    empty_host.add_drm("card0", "0000:03:00.0")
    assert answer(empty_host, "detect-amd-gpu") is True
    empty_host.bind("0000:03:00.0", "vfio-pci")
    assert answer(empty_host, "detect-amd-gpu") is False


@pytest.mark.parametrize(
    ("versions", "expected"),
    [
        ({0: 0, 1: 100306}, "10.3.0"),
        ({0: 0, 1: 110000}, "11.0.0"),
        ({1: 90012}, "9.0.0"),
        ({0: 0, 1: 0}, ""),
        ({0: None, 1: None}, ""),  # field missing
        ({}, ""),
        ({0: 0, 2: 90012, 10: 110000}, "9.0.0"),  # numeric order: 2 before 10
        ({10: 110000, 2: 0}, "11.0.0"),
    ],
)
def test_amd_gfx_version(
    empty_host: SysRoot, versions: dict[int, int | None], expected: str
) -> None:
    for node, version in versions.items():
        empty_host.add_kfd_node(node, version)
    assert answer(empty_host, "amd-gfx-version") == expected


def test_garbage_kfd_properties_give_empty(empty_host: SysRoot) -> None:
    empty_host.add_kfd_node(1, 100306)
    props = empty_host.root / "sys/devices/virtual/kfd/kfd/topology/nodes/1/properties"
    props.write_bytes(b"gfx_target_version \xff\xfe\ncpu_cores_count zz\n")
    assert answer(empty_host, "amd-gfx-version") == ""


@pytest.mark.parametrize(
    "value",
    ["11_00_00", "+110000", "\u0661\u0661\u0660\u0660\u0660\u0660", "99999999999999999999",
     "9" * 5000],
)
def test_a_kfd_version_the_kernel_cannot_write_is_garbage(empty_host: SysRoot, value: str) -> None:
    # The kernel writes a u32 in ASCII decimal; int() would take these too (or refuse with a
    # ValueError past 4300 digits): each is no version, not gfx1100 or a 20-digit major.
    empty_host.add_kfd_node(1, 100306)
    props = empty_host.root / "sys/devices/virtual/kfd/kfd/topology/nodes/1/properties"
    props.write_text(f"cpu_cores_count 0\ngfx_target_version {value}\n")
    assert answer(empty_host, "amd-gfx-version") == ""
    assert answer(empty_host, "amd-gfx-target") == ""


def test_a_topology_renumbered_mid_read_is_read_again(
    empty_host: SysRoot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """amdkfd rebuilds every node folder, numbered anew, when a GPU goes (here the MI210 on
    node 1), then counts up generation_id. A read caught in it sees node 1 vanish and node 2
    already the next numbering's: that mix is no topology the host ever had."""
    import gpuwatch.hostfs.scan as scan_mod

    for node, version in ((0, 0), (1, 90010), (2, 90402), (3, 110000)):
        empty_host.add_kfd_node(node, version)
    topology = empty_host.root / "sys/devices/virtual/kfd/kfd/topology"
    real_read = scan_mod.read_text
    rebuilt: list[str] = []

    def read_text(path: str) -> str | None:
        if path.endswith("nodes/1/properties") and not rebuilt:
            rebuilt.append(path)  # the MI210 leaves: the MI300X is node 1, the 7900 XTX 2
            empty_host.remove_kfd_node(3)
            empty_host.add_kfd_node(1, 90402)
            empty_host.add_kfd_node(2, 110000)
            (topology / "generation_id").write_text("2\n")
            return None  # node 1 was gone as this read came
        return real_read(path)

    monkeypatch.setattr(scan_mod, "read_text", read_text)
    assert answer(empty_host, "amd-gfx-target") == "gfx942"
    assert rebuilt


def test_host_devices_gfx_only_with_amd_gpu(empty_host: SysRoot) -> None:
    empty_host.add_kfd_node(1, 110000)
    assert answer(empty_host, "detect-host-devices")["amd_gfx_version"] == ""  # type: ignore[index]
    empty_host.add_function("0000:03:00.0", vendor="0x1002", driver="amdgpu", iommu_group=5)
    empty_host.add_drm("card0", "0000:03:00.0")
    result = answer(empty_host, "detect-host-devices")
    assert (result["amd_gpu"], result["amd_gfx_version"]) == (True, "11.0.0")  # type: ignore[index]


# ------------------------------------------------------------ host devices / render node


def test_devices_in_pattern_order_sorted_within(host: SysRoot) -> None:
    host.add_dev_node("/dev/kfd")
    host.add_dev_node("/dev/hwrng")
    devices = answer(host, "detect-host-devices")["devices"]  # type: ignore[index]
    assert devices == [
        "/dev/dri/renderD128",
        "/dev/dri/renderD129",
        "/dev/kfd",
        "/dev/kvm",
        "/dev/vhost-net",
        "/dev/fuse",
        "/dev/net/tun",
        "/dev/hwrng",
    ]


def test_render_node_skips_virtio_head_for_the_nvidia_card(empty_host: SysRoot) -> None:
    empty_host.add_function("0000:00:01.0", vendor="0x1af4", device="0x1050", driver="virtio-pci")
    empty_host.add_function("0000:01:00.0", driver="nvidia", iommu_group=1)
    empty_host.add_drm("renderD128", "0000:00:01.0")
    empty_host.add_drm("renderD129", "0000:01:00.0")
    assert answer(empty_host, "detect-host-devices")["render_node"] == "/dev/dri/renderD129"  # type: ignore[index]


def test_render_node_single_gpu(empty_host: SysRoot) -> None:
    empty_host.add_function("0000:01:00.0", vendor="0x1002", driver="amdgpu", iommu_group=1)
    empty_host.add_drm("renderD128", "0000:01:00.0")
    assert answer(empty_host, "detect-host-devices")["render_node"] == "/dev/dri/renderD128"  # type: ignore[index]


def test_render_node_unreadable_vendors_first_wins(empty_host: SysRoot) -> None:
    for i, addr in enumerate(("0000:01:00.0", "0000:02:00.0")):
        empty_host.add_function(addr, iommu_group=i)
        empty_host.add_drm(f"renderD{128 + i}", addr)
        vendor = empty_host.device_dir(addr) / "vendor"
        vendor.unlink()
        vendor.mkdir()  # reading it fails (EISDIR), even as root
    assert answer(empty_host, "detect-host-devices")["render_node"] == "/dev/dri/renderD128"  # type: ignore[index]


def test_no_render_node(host: SysRoot) -> None:
    for node in ("renderD128", "renderD129"):
        host.remove_drm(node)
    assert answer(host, "detect-host-devices")["render_node"] == ""  # type: ignore[index]


def test_render_node_present_in_sysfs_but_not_in_dev_is_not_chosen(empty_host: SysRoot) -> None:
    empty_host.add_function("0000:01:00.0", iommu_group=1)
    empty_host.add_drm("renderD128", "0000:01:00.0", dev_node=False)
    result = answer(empty_host, "detect-host-devices")
    assert (result["devices"], result["render_node"]) == ([], "")  # type: ignore[index]


# ------------------------------------------------------------ vfio access, holders, memlock


def test_vfio_group_accessible(host: SysRoot) -> None:
    host.add_vfio_group(13)  # mode 0600, owned by whoever builds the fixture
    model = gpuwatch.scan(host.root)
    owner = (host.root / "dev/vfio/13").stat().st_uid  # root on a real host; we may not chown
    assert model.probe("vfio-group-accessible", group=13) is (os.geteuid() in (0, owner))
    assert model.probe("vfio-group-accessible", group=14) is False  # no node
    assert model.probe("vfio-group-accessible", group=-1) is False


def test_vfio_group_access_is_prepared_again_when_a_node_changes(host: SysRoot) -> None:
    """The per-group answers are prepared once and rebuilt on any vfio node change."""
    from gpuwatch.core.observations import NodeSeen

    host.add_vfio_group(13)
    model = gpuwatch.scan(host.root)
    model._uid, model._gids = 1000, frozenset({1000})  # as an unprivileged caller
    model._dac_override, model._own_caps_read = False, True  # (without CAP_DAC_OVERRIDE)
    node = "/dev/vfio/13"
    model.state.apply(NodeSeen(node, NodeStat(mode=0o600, uid=0, gid=0)))
    assert model.probe("vfio-group-accessible", group=13) is False
    model.state.apply(NodeSeen(node, NodeStat(mode=0o660, uid=0, gid=1000)))  # chgrp+chmod
    assert model.probe("vfio-group-accessible", group=13) is True
    model.state.apply(NodeSeen("/dev/vfio/14", NodeStat(mode=0o666, uid=0, gid=0)))
    assert model.probe("vfio-group-accessible", group=14) is True
    model.state.apply(NodeSeen(node, None))
    assert model.probe("vfio-group-accessible", group=13) is False
    assert model.vfio_group_accessible(14) is True


@pytest.mark.parametrize(
    ("mode", "owner", "group", "uid", "gids", "expected"),
    [
        (0o600, 1000, 0, 1000, {100}, True),
        (0o400, 1000, 0, 1000, {100}, False),
        (0o660, 0, 36, 1000, {36}, True),
        (0o640, 0, 36, 1000, {36}, False),
        (0o666, 0, 0, 1000, set(), True),
        (0o660, 0, 0, 1000, {100}, False),
        (0o000, 0, 0, 0, set(), True),  # root
        (0o606, 1000, 0, 1000, set(), True),
        (0o066, 1000, 0, 1000, set(), False),  # the owner class decides, not "other"
    ],
)
def test_access_rule(
    mode: int, owner: int, group: int, uid: int, gids: set[int], expected: bool
) -> None:
    assert (
        may_read_write(NodeStat(mode=mode, uid=owner, gid=group), uid, frozenset(gids)) is expected
    )


def test_nvidia_holders(host: SysRoot) -> None:
    host.add_process(4242, "python3", fds={0: "/dev/null", 5: "/dev/nvidia0", 6: "/dev/nvidiactl"})
    host.add_process(17, b"\xffbad\xfe", fds={3: "/dev/nvidia-uvm"})
    host.add_process(99, "bash", fds={0: "/dev/pts/0"})
    host.add_process(300, "gone", fds={4: "/dev/nvidia0"})
    shutil.rmtree(host.root / "proc/300/fd")  # unreadable pid: skipped
    result = answer(host, "nvidia-holders")
    assert result == [{"pid": 17, "comm": "\ufffdbad\ufffd"}, {"pid": 4242, "comm": "python3"}]


def test_a_holder_keeps_the_newline_it_named_itself_with(host: SysRoot) -> None:
    """``/proc/<pid>/comm`` is the name and one newline of the kernel's: a name that ends in a
    newline of its own (``prctl(PR_SET_NAME)`` takes any byte but NUL) keeps it."""
    host.add_process(7, b"worker\n", fds={3: "/dev/nvidia0"})
    host.add_process(8, b"\n", fds={3: "/dev/nvidiactl"})
    assert (host.root / "proc/7/comm").read_bytes() == b"worker\n\n"
    assert answer(host, "nvidia-holders") == [{"pid": 7, "comm": "worker\n"},
                                              {"pid": 8, "comm": "\n"}]


def test_memlock_is_read_live() -> None:
    code = (
        "import resource, gpuwatch, json\n"
        "m = gpuwatch.scan('/')\n"
        "before = m.probe('memlock')\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)\n"
        "resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, hard))\n"
        "after = m.probe('memlock')\n"
        "expected_hard = None if hard == resource.RLIM_INFINITY else hard\n"
        "print(json.dumps([before.soft, after.soft, after.hard == expected_hard]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    expected_before = None if soft == resource.RLIM_INFINITY else soft
    assert (
        out.stdout.strip()
        == f"[{'null' if expected_before is None else expected_before}, 65536, true]"
    )


# ------------------------------------------------------------ per-address probes


def test_display_driver_and_current_mode(host: SysRoot) -> None:
    model = gpuwatch.scan(host.root)
    assert model.probe("display-driver", addr=NV) == "nvidia"
    assert model.probe("current-mode", addr=NV) == "nvidia"
    assert model.probe("current-mode", addr=IGPU) == "vfio"  # anything but nvidia
    assert model.probe("display-driver", addr="0000:01:00.0".upper()) == "nvidia"
    host.unbind(NV)
    model = gpuwatch.scan(host.root)
    assert model.probe("display-driver", addr=NV) == ""
    assert model.probe("current-mode", addr=NV) == "vfio"


def test_group_in_mode(host: SysRoot) -> None:
    model = gpuwatch.scan(host.root)
    assert model.probe("group-in-mode", addr=NV, mode="nvidia") is True
    assert model.probe("group-in-mode", addr=NV_AUDIO, mode="nvidia") is True
    assert model.probe("group-in-mode", addr=NV, mode="vfio") is False
    host.bind(NV, "vfio-pci")
    model = gpuwatch.scan(host.root)
    assert (
        model.probe("group-in-mode", addr=NV, mode="vfio") is False
    )  # audio still on snd_hda_intel
    assert model.probe("group-in-mode", addr=NV, mode="nvidia") is False
    host.bind(NV_AUDIO, "vfio-pci")
    model = gpuwatch.scan(host.root)
    assert model.probe("group-in-mode", addr=NV, mode="vfio") is True


def test_group_in_mode_nvidia_wants_vfio_for_other_functions(empty_host: SysRoot) -> None:
    empty_host.add_function("0000:01:00.0", driver="nvidia", iommu_group=7)
    empty_host.add_function("0000:01:00.1", klass="0x040300", driver="snd_hda_intel", iommu_group=7)
    empty_host.add_function("0000:01:00.2", klass="0x0c0330", driver="xhci_hcd", iommu_group=7)
    model = gpuwatch.scan(empty_host.root)
    assert model.probe("group-in-mode", addr="0000:01:00.0", mode="nvidia") is False
    empty_host.bind("0000:01:00.2", "vfio-pci")
    model = gpuwatch.scan(empty_host.root)
    assert model.probe("group-in-mode", addr="0000:01:00.0", mode="nvidia") is True


def test_usage_errors_are_typed(host: SysRoot) -> None:
    model = gpuwatch.scan(host.root)
    with pytest.raises(gpuwatch.UsageError, match="unknown action"):
        model.probe("detect-everything")
    with pytest.raises(gpuwatch.UsageError, match="needs --addr"):
        model.probe("display-driver")
    with pytest.raises(gpuwatch.UsageError, match="not a PCI address"):
        model.probe("display-driver", addr="01:00.0")
    with pytest.raises(gpuwatch.UsageError, match="vfio or nvidia"):
        model.probe("group-in-mode", addr=NV, mode="amdgpu")
    with pytest.raises(gpuwatch.UsageError, match="needs --group"):
        model.probe("vfio-group-accessible")
    with pytest.raises(gpuwatch.DeviceNotFound):
        model.probe("display-driver", addr="0000:0a:00.0")


# ------------------------------------------------------------ answered from memory


CACHED = ("detect-vfio", "detect-gpu", "detect-amd-gpu", "amd-gfx-version", "detect-host-devices")


def test_probes_answer_from_memory_after_the_tree_is_gone(host: SysRoot) -> None:
    host.add_vfio_group(13)
    model = gpuwatch.scan(host.root)
    before = {a: jsonable(model.probe(a)) for a in CACHED}
    per_addr = {
        "display-driver": model.probe("display-driver", addr=NV),
        "group-in-mode": model.probe("group-in-mode", addr=NV, mode="nvidia"),
        "vfio-group-accessible": model.probe("vfio-group-accessible", group=13),
    }
    shutil.rmtree(host.root)
    assert {a: jsonable(model.probe(a)) for a in CACHED} == before
    assert model.probe("display-driver", addr=NV) == per_addr["display-driver"]
    assert model.probe("group-in-mode", addr=NV, mode="nvidia") == per_addr["group-in-mode"]
    assert model.probe("vfio-group-accessible", group=13) == per_addr["vfio-group-accessible"]


def test_cached_answer_is_the_same_object(host: SysRoot) -> None:
    model = gpuwatch.scan(host.root)
    assert model.probe("detect-vfio") is model.probe("detect-vfio")
    with pytest.raises(Exception, match="frozen"):
        model.probe("detect-vfio").iommu_kind = "amd"


def test_fresh_probe_equals_cached(host: SysRoot) -> None:
    model = gpuwatch.scan(host.root)
    for action in CACHED:
        assert jsonable(gpuwatch.probe(action, host.root)) == jsonable(model.probe(action))


# ------------------------------------------------------------ hostile trees


def test_hostile_tree_never_fails_a_probe(host: SysRoot) -> None:
    host.set_attr(NV, "class", b"\x00\xffgarbage")  # not a class at all
    host.set_attr(NV_AUDIO, "class", "0x04")  # too short
    vendor = host.device_dir(NIC) / "vendor"
    vendor.unlink()
    vendor.mkdir()  # unreadable
    host.set_attr(IGPU, "device", b"0x3e\xe9\x92\n")  # odd bytes
    group_link = host.device_dir(NV_AUDIO) / "iommu_group"
    group_link.unlink()
    os.symlink("../../../../kernel/iommu_groups/notanumber", group_link)
    os.unlink(host.device_dir(IGPU) / "class")  # vanished
    model = gpuwatch.scan(host.root)
    fns = {f.addr: f for f in model.functions()}
    assert fns[NV].class_ == "\x00\ufffdgarb"  # first six characters, odd bytes replaced
    assert fns[NV_AUDIO].class_ == ""
    assert fns[NV_AUDIO].iommu_group == -1
    assert fns[NIC].vendor_id == ""
    assert fns[NIC].driver == "igb"  # the rest of the record is complete
    assert fns[IGPU].device_id == "0x3e\ufffd"
    assert fns[IGPU].class_ == ""
    gpus = [g.addr for g in model.probe("detect-vfio").gpus]
    assert gpus == []  # neither GPU has a readable display class any more
    assert model.probe("detect-host-devices").render_node == "/dev/dri/renderD128"


def test_an_overlong_number_in_an_attribute_is_garbage(host: SysRoot) -> None:
    # int() refuses a string of more than 4300 digits: the file is garbage, not a failed scan.
    host.set_attr(NV, "sriov_totalvfs", "9" * 5000 + "\n")
    model = gpuwatch.scan(host.root)
    fn = next(f for f in model.functions() if f.addr == NV)
    assert fn.sriov is not None and fn.sriov.totalvfs == 0
    assert fn.driver == "nvidia"


def test_function_vanishing_mid_read_is_a_removal(host: SysRoot) -> None:
    from gpuwatch.core.observations import PciGone
    from gpuwatch.hostfs.scan import HostPaths, read_function
    from gpuwatch.settings import default_tables

    devpath = host.devpath(NIC)
    host.remove_function(NIC)
    assert read_function(HostPaths(host.root), NIC, devpath) == PciGone(NIC)
    assert default_tables()  # tables untouched by the failed read


def test_dangling_driver_link_reads_its_name(host: SysRoot) -> None:
    shutil.rmtree(host.root / "sys/bus/pci/drivers/igb")
    model = gpuwatch.scan(host.root)
    assert model.probe("display-driver", addr=NIC) == "igb"


def test_stat_of_mode_is_permission_bits_only(host: SysRoot) -> None:
    node = host.add_vfio_group(5, mode=0o660)
    assert node
    model = gpuwatch.scan(host.root)
    assert model.state.nodes["/dev/vfio/5"].mode == stat.S_IMODE(0o660)


@pytest.mark.parametrize("params", [
    {"group": "1"}, {"group": True}, {"group": 1.0}, {"addr": 5}, {"mode": 3},
    {"vendor": b"nvidia"},
])
@pytest.mark.parametrize("action", ["vfio-group-accessible", "vfio-backend", "group-in-mode"])
def test_library_params_of_the_wrong_type_are_usage_errors(
        host: SysRoot, action: str, params: dict[str, object]) -> None:
    """From Python a group "1" or an addr 5 reached the rules and failed there as a TypeError
    (or a comparison of a str with an int); the socket's JSON is checked the same way. (A
    cached answer, detect-vfio say, takes no parameters: its hot path looks at none.)"""
    model = gpuwatch.scan(host.root)
    with pytest.raises(gpuwatch.UsageError, match=r"must be an? (integer|string), not"):
        model.probe(action, **params)  # type: ignore[arg-type]
    with pytest.raises(gpuwatch.UsageError):
        gpuwatch.probe(action, host.root, **params)  # type: ignore[arg-type]


def test_an_action_that_is_not_a_string_is_a_usage_error(host: SysRoot) -> None:
    with pytest.raises(gpuwatch.UsageError, match="unknown action"):
        gpuwatch.scan(host.root).probe(["detect-vfio"])  # type: ignore[arg-type]


def test_a_root_that_is_not_a_directory_is_a_usage_error(tmp_path: Path) -> None:
    """A typo in the root read as an empty host, silently, where the CLI and the watcher
    refuse it."""
    (tmp_path / "file").write_text("")
    for root in (tmp_path / "missing", tmp_path / "file"):
        with pytest.raises(gpuwatch.UsageError, match="is not a directory"):
            gpuwatch.scan(root)
        with pytest.raises(gpuwatch.UsageError, match="is not a directory"):
            gpuwatch.probe("detect-vfio", root)


@pytest.mark.parametrize("subsystem", ["drm", "vfio-dev"])
def test_a_hand_written_devpath_never_leads_out_of_the_tree(host: SysRoot, tmp_path: Path,
                                                            subsystem: str) -> None:
    """A uevent line (a JSONL source) whose DEVPATH climbs out of ``sys/`` with ``..``: the
    device is read where the tree has it, never from the folder the path leads to."""
    from gpuwatch.core.observations import DrmSeen, PciSeen
    from gpuwatch.core.uevent import UEvent
    from gpuwatch.hostfs.scan import HostPaths, observe
    from gpuwatch.settings import default_tables

    outside = tmp_path / "outside"
    fake = outside / (NV if subsystem == "vfio-dev" else "card1")
    fake.mkdir(parents=True)
    for name, text in (("vendor", "0x1002\n"), ("class", "0x030000\n")):
        (fake / name).write_text(text)
        (outside / name).write_text(text)
    os.symlink("..", fake / "device")
    climb = "/" + "../" * (len(host.root.parts) + 4) + str(outside).lstrip("/")
    devpath = f"{climb}/{NV}/vfio-dev/vfio0" if subsystem == "vfio-dev" else f"{climb}/card1"
    event = UEvent("add", devpath, subsystem,
                   {"ACTION": "add", "DEVPATH": devpath, "SUBSYSTEM": subsystem})
    seen = observe(HostPaths(host.root), default_tables(), event)
    if subsystem == "drm":
        assert seen == [DrmSeen("card1", host.devpath(NV) + "/drm/card1", NV, "0x10de", "nvidia")]
    else:
        assert len(seen) == 1 and isinstance(seen[0], PciSeen)
        assert (seen[0].devpath, seen[0].vendor_id, seen[0].driver, seen[0].iommu_group) == (
            host.devpath(NV), "0x10de", "nvidia", 13)


def test_a_hand_written_devname_is_no_node_out_of_the_tree(host: SysRoot) -> None:
    """``DEVNAME=dri/../../<…>`` names no node: nothing out of the tree is looked at."""
    from gpuwatch.core.observations import NodeSeen
    from gpuwatch.core.uevent import UEvent
    from gpuwatch.hostfs.scan import HostPaths, observe
    from gpuwatch.settings import default_tables

    outside = host.root.parent / "outside-node"
    outside.write_text("")
    climb = "dri/" + "../" * (len(host.root.parts) + 4) + str(outside).lstrip("/")
    assert os.path.exists(host.root / "dev" / climb)  # it does lead somewhere
    devpath = host.devpath(NV) + "/drm/renderD129"
    event = UEvent("add", devpath, "drm", {"ACTION": "add", "DEVPATH": devpath,
                                           "SUBSYSTEM": "drm", "DEVNAME": climb})
    seen = observe(HostPaths(host.root), default_tables(), event)
    assert seen[-1] == NodeSeen("/dev/" + climb, None)


@pytest.mark.parametrize(("driver", "spec", "says"), [
    ("nvidia", False, "not usable: a GPU is on nvidia, but there is no CDI spec "
     "(/etc/cdi/nvidia.yaml, /var/run/cdi/nvidia.yaml) and no nvidia-ctk on PATH"),
    ("nvidia", True, "usable (nvidia loaded, CDI reachable, a GPU on nvidia)"),
    ("vfio-pci", True, "not usable (needs nvidia loaded, a CDI spec or nvidia-ctk, and a GPU "
     "on nvidia)"),
])
def test_status_says_what_keeps_nvidia_from_being_usable(
        empty_host: SysRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], driver: str, spec: bool, says: str) -> None:
    """A host with the driver up and no container toolkit (a real H100 guest was one) is
    told that CDI is what it lacks, not handed the whole list of needs."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-ctk
    empty_host.add_function("0000:01:00.0", driver=driver, iommu_group=1)
    empty_host.add_module("nvidia")
    if spec:
        empty_host.add_cdi_spec("etc")
    code, out, _ = run_main(capsys, "status", "--no-daemon", "--root", str(empty_host.root))
    assert code == 0
    assert f"NVIDIA:   {says}" in out
