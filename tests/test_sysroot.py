"""SysRoot builds trees that look like a real host: right links on both sides, kernel formats."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import yaml

from gpuwatch.testing import (
    DeviceExistsError,
    SysRoot,
    UnknownDeviceError,
    example_gpu_host,
    synthetic_host,
)

GPU = "0000:01:00.0"
AUDIO = "0000:01:00.1"
PORT = "0000:00:01.0"


def links_under(root: Path) -> list[str]:
    """Every symlink in the tree except process fds (which point at host paths on purpose)."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root).split(os.sep)
        if len(rel) >= 3 and rel[0] == "proc" and rel[2] == "fd":
            continue
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                found.append(path)
    return found


def assert_links_sound(root: Path) -> None:
    """No dangling link, every link relative and resolving inside root."""
    real_root = os.path.realpath(root)
    for link in links_under(root):
        target = os.readlink(link)
        assert not target.startswith("/"), link
        resolved = os.path.realpath(link)
        assert os.path.exists(resolved), f"dangling: {link} -> {target}"
        assert resolved.startswith(real_root + "/"), link


def read(path: Path | str) -> str:
    with open(path) as fh:
        return fh.read()


def gpu_host(tmp_path: Path, layout: str = "symlink") -> SysRoot:
    s = SysRoot(tmp_path / "root", layout=layout)  # type: ignore[arg-type]
    s.add_bridge(PORT, iommu_group=2)
    s.add_function(GPU, parent=PORT, device="0x2204", driver="nvidia", iommu_group=13)
    s.add_function(AUDIO, parent=PORT, device="0x1aef", klass="0x040300",
                   driver="snd_hda_intel", iommu_group=13)
    return s


# --------------------------------------------------------------------------- layouts


def test_symlink_layout_matches_kernel_link_spelling(tmp_path: Path) -> None:
    s = gpu_host(tmp_path)
    r = s.root
    devpath = f"/devices/pci0000:00/{PORT}/{GPU}"
    assert s.devpath(GPU) == devpath
    d = r / "sys" / devpath.lstrip("/")
    assert s.device_dir(GPU) == d and d.is_dir() and not d.is_symlink()

    bus = r / "sys/bus/pci/devices" / GPU
    assert os.readlink(bus) == f"../../../devices/pci0000:00/{PORT}/{GPU}"
    assert os.path.realpath(bus) == os.path.realpath(d)
    assert os.readlink(d / "driver") == "../../../../bus/pci/drivers/nvidia"
    assert os.readlink(d / "subsystem") == "../../../../bus/pci"
    assert os.readlink(d / "iommu_group") == "../../../../kernel/iommu_groups/13"
    assert os.readlink(s.device_dir(PORT) / "subsystem") == "../../../bus/pci"
    assert os.path.realpath(d / "driver") == os.path.realpath(r / "sys/bus/pci/drivers/nvidia")
    back = r / "sys/bus/pci/drivers/nvidia" / GPU
    assert os.readlink(back) == f"../../../../devices/pci0000:00/{PORT}/{GPU}"
    member = r / "sys/kernel/iommu_groups/13/devices" / AUDIO
    assert os.path.realpath(member) == os.path.realpath(s.device_dir(AUDIO))
    assert_links_sound(r)


def test_function_files_have_kernel_content(tmp_path: Path) -> None:
    s = gpu_host(tmp_path)
    d = s.device_dir(GPU)
    assert read(d / "vendor") == "0x10de\n"
    assert read(d / "device") == "0x2204\n"
    assert read(d / "class") == "0x030000\n"
    assert read(d / "numa_node") == "-1\n"
    assert read(d / "driver_override") == "(null)\n"
    for name in ("enable", "remove", "rescan"):
        assert (d / name).is_file()
    assert read(d / "uevent").splitlines() == [
        "DRIVER=nvidia",
        "PCI_CLASS=30000",
        "PCI_ID=10DE:2204",
        "PCI_SUBSYS_ID=10DE:2204",
        f"PCI_SLOT_NAME={GPU}",
        "MODALIAS=pci:v000010DEd00002204sv000010DEsd00002204bc03sc00i00",
    ]
    assert read(s.device_dir(PORT) / "class") == "0x060400\n"
    drv = s.root / "sys/bus/pci/drivers/nvidia"
    for name in ("bind", "unbind", "new_id"):
        assert (drv / name).is_file() and not (drv / name).is_symlink()


def test_flat_layout_keeps_real_dirs_on_the_bus(tmp_path: Path) -> None:
    s = gpu_host(tmp_path, "flat")
    r = s.root
    bus = r / "sys/bus/pci/devices" / GPU
    assert bus.is_dir() and not bus.is_symlink()
    assert s.device_dir(GPU) == bus
    assert s.devpath(GPU) == f"/devices/pci0000:00/{PORT}/{GPU}"
    assert not (r / "sys/devices/pci0000:00").exists()
    assert os.path.realpath(bus / "driver") == os.path.realpath(r / "sys/bus/pci/drivers/nvidia")
    assert os.path.realpath(bus / "subsystem") == os.path.realpath(r / "sys/bus/pci")
    back = r / "sys/bus/pci/drivers/nvidia" / GPU
    assert os.path.realpath(back) == os.path.realpath(bus)
    s.add_drm("card0", GPU)
    assert os.path.realpath(r / "sys/class/drm/card0/device") == os.path.realpath(bus)
    assert_links_sound(r)


def test_function_without_parent_sits_on_the_root_complex(tmp_path: Path) -> None:
    s = SysRoot(tmp_path)
    assert s.add_function("0000:00:02.0") == "/devices/pci0000:00/0000:00:02.0"
    assert s.add_function("0000:40:01.0", parent="pci0000:40") == "/devices/pci0000:40/0000:40:01.0"
    assert (tmp_path / "sys/devices/pci0000:40/0000:40:01.0/vendor").is_file()


# --------------------------------------------------------------------------- mutations


def test_bind_rebind_unbind_update_both_sides(tmp_path: Path) -> None:
    s = gpu_host(tmp_path)
    r, d = s.root, s.device_dir(GPU)
    s.bind(GPU, "vfio-pci")
    assert os.path.realpath(d / "driver") == os.path.realpath(r / "sys/bus/pci/drivers/vfio-pci")
    assert os.path.realpath(r / "sys/bus/pci/drivers/vfio-pci" / GPU) == os.path.realpath(d)
    assert not os.path.lexists(r / "sys/bus/pci/drivers/nvidia" / GPU)
    assert (r / "sys/bus/pci/drivers/vfio-pci/bind").is_file()
    assert read(d / "uevent").splitlines()[0] == "DRIVER=vfio-pci"

    s.unbind(GPU)
    assert not os.path.lexists(d / "driver")
    assert not os.path.lexists(r / "sys/bus/pci/drivers/vfio-pci" / GPU)
    assert (r / "sys/bus/pci/drivers/vfio-pci").is_dir()  # the driver stays registered
    assert "DRIVER=" not in read(d / "uevent")
    s.unbind(GPU)  # unbinding an unbound device is harmless
    assert_links_sound(r)


def test_group_moves_update_both_sides_and_free_empty_groups(tmp_path: Path) -> None:
    s = gpu_host(tmp_path)
    groups = s.root / "sys/kernel/iommu_groups"
    s.set_iommu_group(AUDIO, 20)
    assert not os.path.lexists(groups / "13/devices" / AUDIO)
    assert (groups / "13/devices" / GPU).is_symlink()
    assert os.path.realpath(groups / "20/devices" / AUDIO) == os.path.realpath(s.device_dir(AUDIO))
    assert os.readlink(s.device_dir(AUDIO) / "iommu_group").endswith("kernel/iommu_groups/20")
    s.set_iommu_group(GPU, 20)
    assert not (groups / "13").exists()
    assert read(groups / "20/type") == "DMA\n"
    s.set_iommu_group(GPU, None)
    assert not os.path.lexists(s.device_dir(GPU) / "iommu_group")
    assert sorted(os.listdir(groups / "20/devices")) == [AUDIO]
    assert_links_sound(s.root)


def test_set_attr_overwrites_with_odd_bytes(tmp_path: Path) -> None:
    s = gpu_host(tmp_path)
    s.set_attr(GPU, "vendor", b"\xff\xfe garbage")
    assert (s.device_dir(GPU) / "vendor").read_bytes() == b"\xff\xfe garbage"
    s.set_attr(GPU, "driver", "not a link\n")  # a link is replaced, never written through
    assert not (s.device_dir(GPU) / "driver").is_symlink()
    assert (s.root / "sys/bus/pci/drivers/nvidia/bind").stat().st_size == 0  # 0200: unreadable
    with pytest.raises(ValueError):
        s.set_attr(GPU, "../../../../escape", "x")


@pytest.mark.parametrize("layout", ["symlink", "flat"])
def test_remove_function_cleans_every_link(tmp_path: Path, layout: str) -> None:
    s = gpu_host(tmp_path, layout)
    s.add_drm("card1", GPU)
    s.add_drm("renderD129", GPU)
    r = s.root
    s.remove_function(PORT)  # a bridge takes its subtree along
    for addr in (PORT, GPU, AUDIO):
        assert not os.path.lexists(r / "sys/bus/pci/devices" / addr)
        with pytest.raises(UnknownDeviceError):
            s.device_dir(addr)
    assert not os.path.lexists(r / "sys/bus/pci/drivers/nvidia" / GPU)
    assert not os.path.lexists(r / "sys/bus/pci/drivers/pcieport" / PORT)
    assert not (r / "sys/kernel/iommu_groups/13").exists()
    assert not os.path.lexists(r / "sys/class/drm/card1")
    assert not (r / "dev/dri/renderD129").exists()
    assert links_under(r) == []
    props = s.uevent_props("remove", GPU)  # still describable after the fact
    assert props["DEVPATH"] == f"/devices/pci0000:00/{PORT}/{GPU}"
    assert "DRIVER" not in props
    s.add_function(GPU)  # the address is free again
    assert s.devpath(GPU) == f"/devices/pci0000:00/{GPU}"


# --------------------------------------------------------------------------- other devices


def test_drm_nodes(tmp_path: Path) -> None:
    s = gpu_host(tmp_path)
    devpath = s.add_drm("renderD129", GPU)
    r = s.root
    assert devpath == f"{s.devpath(GPU)}/drm/renderD129"
    node = r / "sys" / devpath.lstrip("/")
    assert read(node / "dev") == "226:129\n"
    assert "DEVNAME=dri/renderD129\n" in read(node / "uevent")
    assert os.readlink(node / "device") == f"../../../{GPU}"
    assert os.path.realpath(node / "subsystem") == os.path.realpath(r / "sys/class/drm")
    assert os.path.realpath(r / "sys/class/drm/renderD129") == os.path.realpath(node)
    assert (r / "dev/dri/renderD129").is_file()
    virtual = s.add_drm("card7", None, dev_node=False)
    assert virtual == "/devices/virtual/drm/card7"
    assert not os.path.lexists(r / "sys" / virtual.lstrip("/") / "device")
    assert not (r / "dev/dri/card7").exists()
    with pytest.raises(DeviceExistsError):
        s.add_drm("card7", None)
    with pytest.raises(ValueError):
        s.add_drm("card0-HDMI-A-1", GPU)
    s.remove_drm("renderD129")
    assert not node.exists() and not (r / "dev/dri/renderD129").exists()
    assert not (s.device_dir(GPU) / "drm").exists()
    assert_links_sound(r)


def test_modules_kfd_iommu_vfio_cdi_proc_files(tmp_path: Path) -> None:
    s = SysRoot(tmp_path)
    r = s.root
    assert s.add_module("nvidia", refcnt=2, holders=["nvidia_uvm"]) == "/module/nvidia"
    s.add_module("nvidia_uvm")
    assert read(r / "sys/module/nvidia/refcnt") == "2\n"
    assert read(r / "sys/module/nvidia/initstate") == "live\n"
    assert os.readlink(r / "sys/module/nvidia/holders/nvidia_uvm") == "../../nvidia_uvm"
    s.remove_module("nvidia_uvm")
    assert os.listdir(r / "sys/module/nvidia/holders") == []

    s.add_kfd_node(0, 0)
    s.add_kfd_node(1, 110000, simd_count=96)
    s.add_kfd_node(2, None)
    nodes = r / "sys/class/kfd/kfd/topology/nodes"
    gpu_props = dict(line.split() for line in read(nodes / "1/properties").splitlines())
    assert gpu_props["gfx_target_version"] == "110000" and gpu_props["simd_count"] == "96"
    assert gpu_props["vendor_id"] == "4098"
    cpu_props = dict(line.split() for line in read(nodes / "0/properties").splitlines())
    assert cpu_props["cpu_cores_count"] != "0" and cpu_props["gfx_target_version"] == "0"
    assert "gfx_target_version" not in read(nodes / "2/properties")
    assert read(nodes / "1/name") == "gfx1100\n"
    assert os.readlink(r / "sys/class/kfd/kfd") == "../../devices/virtual/kfd/kfd"

    s.add_iommu_unit("dmar0")
    assert os.path.realpath(r / "sys/class/iommu/dmar0") == str(
        r / "sys/devices/virtual/iommu/dmar0"
    )
    s.add_iommu_unit("smmu3.0x0000000009050000", at="arm-smmu-v3.0.auto")
    assert os.path.realpath(r / "sys/class/iommu/smmu3.0x0000000009050000") == str(
        r / "sys/devices/platform/arm-smmu-v3.0.auto/iommu/smmu3.0x0000000009050000")
    s.remove_iommu_unit("smmu3.0x0000000009050000")
    assert not (r / "sys/devices/platform/arm-smmu-v3.0.auto/iommu/smmu3.0x0000000009050000"
                ).exists()

    assert s.add_vfio_group(13, mode=0o660) == "/devices/virtual/vfio/13"
    assert stat.S_IMODE(os.stat(r / "dev/vfio/13").st_mode) == 0o660
    assert "DEVNAME=vfio/13\n" in read(r / "sys/class/vfio/13/uevent")
    s.remove_vfio_group(13)
    assert not (r / "dev/vfio/13").exists() and not os.path.lexists(r / "sys/class/vfio/13")

    for where, rel in (("etc", "etc/cdi/nvidia.yaml"), ("var", "var/run/cdi/nvidia.yaml")):
        path = s.add_cdi_spec(where)  # type: ignore[arg-type]
        assert path == r / rel
        spec = yaml.safe_load(path.read_text())
        assert spec["kind"] == "nvidia.com/gpu" and spec["devices"]
        s.remove_cdi_spec(where)  # type: ignore[arg-type]
        assert not path.exists()

    s.set_cmdline("intel_iommu=on")
    assert read(r / "proc/cmdline") == "intel_iommu=on\n"
    s.set_boot_id("abc")
    assert read(r / "proc/sys/kernel/random/boot_id") == "abc\n"
    assert s.add_dev_node("/dev/net/tun") == r / "dev/net/tun"
    s.remove_dev_node("dev/net/tun")
    assert not (r / "dev/net/tun").exists()
    assert_links_sound(r)


def test_add_process_files(tmp_path: Path) -> None:
    s = SysRoot(tmp_path)
    s.add_process(
        4242,
        b"py\xffthon",
        fds={0: "/dev/null", 7: "/dev/nvidia0", 9: "socket:[123]"},
        maps=["/dev/nvidia0", "7f00-7f01 r--p 00000000 00:00 0 [vdso]"],
        state="D",
        stack="[<0>] nvidia_ioctl+0x1/0x2\n",
    )
    p = s.root / "proc/4242"
    assert (p / "comm").read_bytes() == b"py\xffthon\n"
    assert {n: os.readlink(p / "fd" / n) for n in os.listdir(p / "fd")} == {
        "0": "/dev/null",
        "7": "/dev/nvidia0",
        "9": "socket:[123]",
    }
    maps = read(p / "maps").splitlines()
    assert maps[0].split()[1:] == ["rw-s", "00000000", "00:05", "1000", "/dev/nvidia0"]
    assert maps[1] == "7f00-7f01 r--p 00000000 00:00 0 [vdso]"
    raw = (p / "stat").read_bytes()
    assert raw.startswith(b"4242 (py\xffthon) D 1 ")
    assert len(raw[raw.rindex(b")") + 2 :].split()) == 50  # 52 fields in all
    status = (p / "status").read_bytes()
    assert status.startswith(b"Name:\tpy\xffthon\n")
    assert b"State:\tD (disk sleep)\n" in status
    assert read(p / "stack") == "[<0>] nvidia_ioctl+0x1/0x2\n"
    s.add_process(4242, "again")  # replaces
    assert os.listdir(p / "fd") == []
    s.remove_process(4242)
    assert not p.exists()
    with pytest.raises(ValueError):
        s.add_process(1, "x", state="Q")


# --------------------------------------------------------------------------- uevents


def test_uevent_props_follow_the_device(tmp_path: Path) -> None:
    s = gpu_host(tmp_path)
    bind = s.uevent_props("bind", GPU)
    assert bind["ACTION"] == "bind" and bind["SUBSYSTEM"] == "pci"
    assert bind["DEVPATH"] == s.devpath(GPU) and bind["DRIVER"] == "nvidia"
    assert bind["PCI_SLOT_NAME"] == GPU and bind["PCI_ID"] == "10DE:2204"
    assert bind["MODALIAS"].startswith("pci:v000010DEd00002204")
    unbind = s.uevent_props("unbind", s.devpath(GPU))
    assert "DRIVER" not in unbind
    assert int(unbind["SEQNUM"]) == int(bind["SEQNUM"]) + 1
    drm = s.uevent_props("change", s.add_drm("card1", GPU), HOTPLUG="1")
    assert drm["SUBSYSTEM"] == "drm" and drm["DEVNAME"] == "dri/card1" and drm["HOTPLUG"] == "1"
    assert drm["MINOR"] == "1"
    mod = s.uevent_props("add", s.add_module("vfio_pci"))
    assert mod["SUBSYSTEM"] == "module" and mod["DEVPATH"] == "/module/vfio_pci"
    vfio = s.uevent_props("add", s.add_vfio_group(13))
    assert vfio["SUBSYSTEM"] == "vfio" and vfio["DEVNAME"] == "vfio/13"
    s.remove_module("vfio_pci")
    assert s.uevent_props("remove", "/module/vfio_pci")["SUBSYSTEM"] == "module"
    assert s.uevent_props("add", GPU, SEQNUM="7")["SEQNUM"] == "7"
    with pytest.raises(UnknownDeviceError):
        s.uevent_props("add", "0000:09:00.0")


# --------------------------------------------------------------------------- containment


def test_names_that_would_escape_root_are_refused(tmp_path: Path) -> None:
    s = gpu_host(tmp_path)
    with pytest.raises(ValueError):
        s.add_function("../../etc")
    with pytest.raises(ValueError):
        s.add_function("0000:0A:00.0")  # not canonical
    with pytest.raises(ValueError):
        s.bind(GPU, "../../x")
    for bad in ("/etc/passwd", "dev/../x", "dev", "/dev/"):
        with pytest.raises(ValueError):
            s.add_dev_node(bad)
    for bad in ("..", "a/b", ""):
        with pytest.raises(ValueError):
            s.add_module(bad)
        with pytest.raises(ValueError):
            s.add_iommu_unit(bad)
    with pytest.raises(DeviceExistsError):
        s.add_function(GPU)
    with pytest.raises(UnknownDeviceError):
        s.add_function("0000:05:00.0", parent="0000:04:00.0")
    assert sorted(os.listdir(tmp_path)) == ["root"]


# --------------------------------------------------------------------------- canned hosts


@pytest.mark.parametrize("layout", ["symlink", "flat"])
def test_example_gpu_host_shape(tmp_path: Path, layout: str) -> None:
    s = example_gpu_host(tmp_path, layout=layout)  # type: ignore[arg-type]
    r = s.root
    bus = r / "sys/bus/pci/devices"
    assert {"0000:00:01.0", "0000:00:02.0", GPU, AUDIO, "0000:02:00.0"} <= set(os.listdir(bus))

    def drv(addr: str) -> str:
        return os.path.basename(os.readlink(bus / addr / "driver"))

    def grp(addr: str) -> str:
        return os.path.basename(os.readlink(bus / addr / "iommu_group"))

    assert (drv(GPU), drv(AUDIO), drv("0000:00:02.0"), drv("0000:02:00.0")) == (
        "nvidia", "snd_hda_intel", "i915", "igb",
    )
    assert (grp(GPU), grp(AUDIO), grp("0000:00:02.0"), grp("0000:02:00.0")) == (
        "13", "13", "0", "14",
    )
    assert sorted(os.listdir(r / "sys/kernel/iommu_groups/13/devices")) == [GPU, AUDIO]
    assert read(bus / GPU / "device") == "0x2204\n"
    assert read(bus / AUDIO / "class") == "0x040300\n"
    assert read(bus / "0000:02:00.0" / "device") == "0x1533\n"
    assert s.devpath(GPU) == f"/devices/pci0000:00/0000:00:01.0/{GPU}"

    def card_of(name: str) -> str:
        return os.path.basename(os.readlink(r / "sys/class/drm" / name / "device"))

    assert card_of("card0") == card_of("renderD128") == "0000:00:02.0"
    assert card_of("card1") == card_of("renderD129") == GPU
    for node in ("kvm", "vhost-net", "fuse", "net/tun", "nvidia0", "nvidiactl", "dri/card1",
                 "dri/renderD129"):
        assert (r / "dev" / node).is_file(), node
    assert set(os.listdir(r / "sys/module")) == {
        "nvidia", "nvidia_drm", "nvidia_modeset", "nvidia_uvm", "vfio_pci", "vfio",
    }
    assert os.listdir(r / "sys/class/iommu") == ["dmar0"]
    assert read(r / "proc/cmdline") == "intel_iommu=on iommu=pt\n"
    assert (r / "etc/cdi/nvidia.yaml").is_file()
    assert read(r / "proc/sys/kernel/random/boot_id").strip()
    assert_links_sound(r)


def test_synthetic_host_1024(tmp_path: Path) -> None:
    synthetic_host(tmp_path, 1024, seed=3)
    bus = tmp_path / "sys/bus/pci/devices"
    names = os.listdir(bus)
    assert len(names) == 1024
    classes = {n: read(bus / n / "class").strip() for n in names}
    gpus = [n for n, c in classes.items() if c.startswith("0x03")]
    assert 1024 // 8 - 2 <= len(gpus) <= 1024 // 8 + 2
    for gpu in gpus:
        audio = gpu[:-1] + "1"
        assert classes[audio] == "0x040300"
        group = os.readlink(bus / gpu / "iommu_group")
        assert os.readlink(bus / audio / "iommu_group") == group
        members = os.listdir(tmp_path / "sys/kernel/iommu_groups" / os.path.basename(group)
                             / "devices")
        assert sorted(members) == [gpu, audio]
        driver = os.path.basename(os.readlink(bus / gpu / "driver")) if os.path.lexists(
            bus / gpu / "driver") else ""
        has_card = os.path.isdir(bus / gpu / "drm")
        assert has_card == (driver not in ("", "vfio-pci")), gpu
        if driver == "vfio-pci":
            assert (tmp_path / "dev/vfio" / os.path.basename(group)).is_file()
    vendors = {read(bus / g / "vendor").strip() for g in gpus}
    assert vendors == {"0x10de", "0x1002", "0x8086"}
    assert len(os.listdir(tmp_path / "sys/class/kfd/kfd/topology/nodes")) > 1


def test_synthetic_host_is_exact_and_deterministic(tmp_path: Path) -> None:
    def shape(root: Path) -> list[tuple[str, str, str]]:
        bus = root / "sys/bus/pci/devices"
        return sorted(
            (n, read(bus / n / "device").strip(), os.readlink(bus / n)) for n in os.listdir(bus)
        )

    for n in (0, 1, 2, 3, 4, 7, 64):
        synthetic_host(tmp_path / f"n{n}", n)
        assert len(os.listdir(tmp_path / f"n{n}/sys/bus/pci/devices")) == n
    a = synthetic_host(tmp_path / "a", 120, seed=5)
    b = synthetic_host(tmp_path / "b", 120, seed=5)
    c = synthetic_host(tmp_path / "c", 120, seed=6)
    assert shape(a.root) == shape(b.root)
    assert shape(a.root) != shape(c.root)
    assert_links_sound(a.root)
