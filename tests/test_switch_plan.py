"""The pure switch planner: which steps, in which order, and when it refuses (docs/switch.md)."""

from __future__ import annotations

import pytest

from gpuwatch.core.plan import (
    CLEAR_OVERRIDE,
    CommandStep,
    HostFacts,
    MakeDirStep,
    WriteStep,
    example_card,
    find_card,
    holder_scope,
    parse_target,
    plan_switch,
)
from gpuwatch.core.results import Holding, PciFunction, Sriov
from gpuwatch.core.state import HostState
from gpuwatch.errors import DeviceNotFound, UnsafeName, UsageError
from gpuwatch.hostfs.scan import HostPaths, scan
from gpuwatch.settings import default_tables
from gpuwatch.testing import SysRoot

NV, AUDIO = "0000:01:00.0", "0000:01:00.1"
NVIDIA_MODULES = frozenset({"nvidia", "nvidia_modeset", "nvidia_drm", "nvidia_uvm"})


def fn(addr: str, klass: str, driver: str, group: int = 13) -> PciFunction:
    return PciFunction(addr=addr, vendor_id="0x10de", device_id="0x2204", class_=klass,
                       class_label="", driver=driver, iommu_group=group)


def card(display: str, audio: str) -> tuple[PciFunction, PciFunction]:
    return fn(NV, "0x0300", display), fn(AUDIO, "0x0403", audio)


def single_gpu(**kw: object) -> HostFacts:
    base: dict[str, object] = {
        "modules": NVIDIA_MODULES | {"vfio", "vfio_pci"}, "nvidia_refcnt": 2,
        "nvidia_module_holders": ("nvidia_modeset", "nvidia_uvm"), "cdi_spec": True,
    }
    base.update(kw)
    return HostFacts(**base)  # type: ignore[arg-type]


def keys(steps: tuple[object, ...]) -> list[tuple[str, ...]]:
    return [s.key() for s in steps]  # type: ignore[attr-defined]


def test_to_vfio_on_a_single_gpu_host_unloads_nvidia_instead_of_unbinding_it() -> None:
    plan = plan_switch(card("nvidia", "snd_hda_intel"), "vfio", single_gpu())
    assert plan.refusal is None and plan.unloads_nvidia
    assert keys(plan.steps) == [
        ("command", "modprobe", "-r", "nvidia_drm", "nvidia_modeset", "nvidia_uvm"),
        ("command", "modprobe", "-r", "nvidia"),
        ("write", f"/sys/bus/pci/devices/{NV}/driver_override", "vfio-pci"),
        ("write", "/sys/bus/pci/drivers_probe", NV),
        ("write", f"/sys/bus/pci/devices/{NV}/driver_override", CLEAR_OVERRIDE),
        ("write", "/sys/bus/pci/drivers/snd_hda_intel/unbind", AUDIO),
        ("write", f"/sys/bus/pci/devices/{AUDIO}/driver_override", "vfio-pci"),
        ("write", "/sys/bus/pci/drivers_probe", AUDIO),
        ("write", f"/sys/bus/pci/devices/{AUDIO}/driver_override", CLEAR_OVERRIDE),
    ]
    assert ("write", "/sys/bus/pci/drivers/nvidia/unbind", NV) not in keys(plan.steps)
    assert (plan.addr, plan.group, plan.from_mode, plan.to_mode) == (NV, 13, "nvidia", "vfio")


def test_to_vfio_loads_vfio_pci_when_missing_and_stops_persistenced_first() -> None:
    plan = plan_switch(card("nvidia", "snd_hda_intel"), "vfio",
                       single_gpu(modules=NVIDIA_MODULES, persistenced=True))
    ks = keys(plan.steps)
    assert ks[0] == ("command", "systemctl", "stop", "nvidia-persistenced")
    assert ks.index(("command", "modprobe", "-r", "nvidia")) < ks.index(
        ("command", "modprobe", "vfio_pci"))
    assert ks.index(("command", "modprobe", "vfio_pci")) < ks.index(
        ("write", f"/sys/bus/pci/devices/{NV}/driver_override", "vfio-pci"))


def test_to_vfio_on_a_multi_gpu_host_unbinds_this_card_alone() -> None:
    facts = single_gpu(other_nvidia=("0000:03:00.0",), nvidia_minors={NV: 0},
                       persistenced=True)
    plan = plan_switch(card("nvidia", "snd_hda_intel"), "vfio", facts)
    ks = keys(plan.steps)
    assert not plan.unloads_nvidia
    assert not any(k[:3] == ("command", "modprobe", "-r") for k in ks)
    assert ks[:3] == [("command", "systemctl", "stop", "nvidia-persistenced"),
                      ("write", "/sys/bus/pci/drivers/nvidia/unbind", NV),
                      ("command", "systemctl", "start", "nvidia-persistenced")]
    # Only this card's node counts as a holder on such a host.
    scope = holder_scope(card("nvidia", "snd_hda_intel"), "vfio", facts)
    assert scope.matches("/dev/nvidia0") and not scope.matches("/dev/nvidia1")
    assert not scope.matches("/dev/nvidiactl")


def test_multi_gpu_host_without_the_minor_refuses() -> None:
    plan = plan_switch(card("nvidia", "snd_hda_intel"), "vfio",
                       single_gpu(other_nvidia=("0000:03:00.0",)))
    assert plan.refusal is not None and not plan.steps
    assert "/dev/nvidiaN is unknown" in plan.refusal.reason


def test_to_nvidia_loads_modules_binds_each_function_and_makes_nodes_and_cdi() -> None:
    facts = HostFacts(root="/r", modules=frozenset({"vfio", "vfio_pci"}), ctk_on_path=True)
    plan = plan_switch(card("vfio-pci", "vfio-pci"), "nvidia", facts)
    assert keys(plan.steps) == [
        ("command", "modprobe", "nvidia"),
        ("command", "modprobe", "snd_hda_intel"),
        ("write", "/sys/bus/pci/drivers/vfio-pci/unbind", NV),
        ("write", f"/sys/bus/pci/devices/{NV}/driver_override", "nvidia"),
        ("write", "/sys/bus/pci/drivers_probe", NV),
        ("write", "/sys/bus/pci/drivers/vfio-pci/unbind", AUDIO),
        ("write", f"/sys/bus/pci/devices/{AUDIO}/driver_override", "snd_hda_intel"),
        ("write", "/sys/bus/pci/drivers_probe", AUDIO),
        ("command", "nvidia-modprobe", "-c", "0", "-u"),
        ("mkdir", "/etc/cdi"),
        ("command", "nvidia-ctk", "cdi", "generate", "--output=/r/etc/cdi/nvidia.yaml"),
    ]


def test_to_nvidia_without_ctk_or_spec_says_so() -> None:
    plan = plan_switch(card("vfio-pci", "vfio-pci"), "nvidia", HostFacts(modules=NVIDIA_MODULES))
    assert not any(isinstance(s, MakeDirStep) for s in plan.steps)
    assert any("nvidia-ctk is not on PATH" in n for n in plan.notes)


def test_functions_already_on_target_are_left_alone() -> None:
    plan = plan_switch(card("vfio-pci", "snd_hda_intel"), "nvidia",
                       HostFacts(modules=NVIDIA_MODULES | {"snd_hda_intel"}, cdi_spec=True))
    writes = [s for s in plan.steps if isinstance(s, WriteStep)]
    assert all(AUDIO not in (s.path + s.value) for s in writes)
    assert plan.from_mode == "mixed"


def test_in_mode_is_a_plan_without_steps() -> None:
    plan = plan_switch(card("nvidia", "snd_hda_intel"), "nvidia", HostFacts())
    assert plan.in_mode and plan.steps == () and plan.refusal is None


def test_holders_refuse_with_their_names_and_no_steps() -> None:
    holders = (Holding(pid=4242, comm="python3", node="/dev/nvidia0"),)
    plan = plan_switch(card("nvidia", "snd_hda_intel"), "vfio", single_gpu(holders=holders))
    assert plan.refusal is not None and plan.steps == ()
    assert plan.refusal.holders == holders
    assert "python3 (pid 4242) holds /dev/nvidia0" in plan.refusal.reason


def test_a_kernel_user_of_the_nvidia_module_refuses() -> None:
    plan = plan_switch(card("nvidia", "snd_hda_intel"), "vfio", single_gpu(nvidia_refcnt=3))
    assert plan.refusal is not None and "kernel user" in plan.refusal.reason
    kept = single_gpu(nvidia_refcnt=3, nvidia_module_holders=("nvidia_modeset", "nvidia_uvm",
                                                               "gdrdrv"))
    refused = plan_switch(card("nvidia", "snd_hda_intel"), "vfio", kept).refusal
    assert refused is not None and "by module gdrdrv" in refused.reason


def test_a_bridge_on_pcieport_stays_and_one_on_another_driver_is_refused() -> None:
    """The kernel's VFIO takes a group whose bridge is on pcieport (or none): the plan
    switches the card and writes nothing for the bridge. A bridge some other driver holds
    keeps the group from VFIO, and gpuwatch does not move bridges: refused, naming it."""
    members = (*card("nvidia", "snd_hda_intel"), fn("0000:00:01.0", "0x0604", "pcieport"))
    plan = plan_switch(members, "vfio", single_gpu())
    assert plan.refusal is None and plan.steps
    assert dict(plan.targets)["0000:00:01.0"] == "pcieport"
    assert not [s for s in plan.steps if "0000:00:01.0" in str(s)]
    members = (*card("nvidia", "snd_hda_intel"), fn("0000:00:01.0", "0x0604", "shpchp"))
    plan = plan_switch(members, "vfio", single_gpu())
    assert plan.refusal is not None
    assert "PCI bridge 0000:00:01.0 (on shpchp)" in plan.refusal.reason


def test_vfio_without_an_iommu_group_is_refused() -> None:
    members = (fn(NV, "0x0300", "nvidia", group=-1),)
    plan = plan_switch(members, "vfio", single_gpu())
    assert plan.refusal is not None and "IOMMU" in plan.refusal.reason


@pytest.mark.parametrize("driver", ["nv idia", "nvidia;reboot", "../../x", "nvidia\n", "x/y", ".."])
def test_malformed_driver_names_are_refused_before_planning_any_write(driver: str) -> None:
    with pytest.raises(UnsafeName, match="driver name"):
        plan_switch(card(driver, "snd_hda_intel"), "vfio", single_gpu())


def test_malformed_addresses_are_refused() -> None:
    bad = fn(NV, "0x0300", "nvidia").model_copy(update={"addr": "0000:01:00.0/../x"})
    with pytest.raises(UnsafeName, match="PCI address"):
        plan_switch((bad,), "vfio", single_gpu())


@pytest.mark.parametrize(("text", "want"), [
    ("0000:01:00.0", ("0000:01:00.0", None)), ("0000:0A:00.1", ("0000:0a:00.1", None)),
    ("0x10de", (None, "0x10de")), ("10DE", (None, "0x10de")),
])
def test_targets_are_an_address_or_a_vendor(text: str, want: tuple[str | None, str | None]) -> None:
    assert parse_target(text) == want


@pytest.mark.parametrize("text", ["01:00.0", "0000:01:00.8", "nvidia", "0x10de0", "",
                                  "0000:01:00.0;reboot"])
def test_malformed_targets_are_usage_errors(text: str) -> None:
    with pytest.raises(UsageError):
        parse_target(text)


def _state(host: SysRoot) -> HostState:
    return HostState(default_tables(), scan(HostPaths(host.root), default_tables()))


def test_find_card_by_any_function_or_by_its_vendor(host: SysRoot) -> None:
    state = _state(host)
    for addr, vendor in ((NV, None), (AUDIO, None), (None, "0x10de")):
        display, members = find_card(state, addr=addr, vendor=vendor)
        assert display.addr == NV and [m.addr for m in members] == [NV, AUDIO]
    with pytest.raises(DeviceNotFound, match="no card of vendor 0x1002"):
        find_card(state, vendor="0x1002")
    with pytest.raises(DeviceNotFound, match="no PCI function"):
        find_card(state, addr="0000:09:00.0")
    with pytest.raises(UsageError, match="not a GPU"):
        find_card(state, addr="0000:02:00.0")


def test_a_vendor_naming_two_cards_is_ambiguous(host: SysRoot) -> None:
    host.add_function("0000:03:00.0", driver="nvidia", iommu_group=15)
    with pytest.raises(UsageError, match="choose one with --addr"):
        find_card(_state(host), vendor="0x10de")


def test_the_example_card_is_the_documented_one() -> None:
    members, facts = example_card("vfio")
    plan = plan_switch(members, "vfio", facts, example=True)
    assert [(m.addr, m.class_) for m in plan.members] == [(NV, "0x0300"), (AUDIO, "0x0403")]
    assert plan.example and "example card" in plan.notes[0]
    assert any(isinstance(s, CommandStep) and s.argv == ("modprobe", "-r", "nvidia")
               for s in plan.steps)
    members, facts = example_card("nvidia")
    back = plan_switch(members, "nvidia", facts, example=True)
    assert back.to_mode == "nvidia" and back.steps


def _with_vfs(f: PciFunction, vfs: tuple[str, ...]) -> PciFunction:
    return f.model_copy(update={"sriov": Sriov(totalvfs=16, numvfs=len(vfs), vfs=vfs)})


@pytest.mark.parametrize(("mode", "display", "audio"),
                         [("vfio", "nvidia", "snd_hda_intel"), ("nvidia", "vfio-pci", "vfio-pci")])
def test_a_physical_function_with_virtual_functions_enabled_is_refused(
        mode: str, display: str, audio: str) -> None:
    """Its driver's unbind would take the VFs away from whatever uses them."""
    gpu, snd = card(display, audio)
    vfs = tuple(f"0000:01:00.{n}" for n in range(4, 10))
    plan = plan_switch((_with_vfs(gpu, vfs), snd), mode, single_gpu())  # type: ignore[arg-type]
    assert plan.refusal is not None and plan.steps == ()
    assert plan.refusal.reason == (
        f"{NV} has 6 SR-IOV virtual function(s) enabled (0000:01:00.4, 0000:01:00.5, "
        "0000:01:00.6, 0000:01:00.7, … (6 in all)): rebinding it would remove them under "
        "whatever uses them; disable them first (write 0 to "
        f"/sys/bus/pci/devices/{NV}/sriov_numvfs, or stop what created them), then switch")


def test_sriov_capable_but_without_virtual_functions_switches() -> None:
    gpu, snd = card("nvidia", "snd_hda_intel")
    plan = plan_switch((_with_vfs(gpu, ()), snd), "vfio", single_gpu())
    assert plan.refusal is None and plan.steps


def test_a_physical_function_already_on_its_target_keeps_its_virtual_functions() -> None:
    """Only a function the switch would rebind is asked to give up its VFs."""
    gpu, snd = card("vfio-pci", "snd_hda_intel")
    plan = plan_switch((_with_vfs(gpu, ("0000:01:00.4",)), snd), "vfio", single_gpu())
    assert plan.refusal is None
    assert [s for s in keys(plan.steps) if NV in " ".join(s)] == []
    assert any(AUDIO in " ".join(s) for s in keys(plan.steps))
