"""The switch on a simulated kernel: both directions, refusals, wedges, lost events, locks.

Every test runs against a fixture root under tmp_path; the simulated kernel records every
write and command, so "nothing was written" is asserted, not assumed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
from pydantic import BaseModel

from gpuwatch.core import events as ev
from gpuwatch.core.plan import step_json
from gpuwatch.errors import (
    DeviceNotFound,
    GroupBusy,
    GroupPoisoned,
    NotPrivileged,
    RebootRequired,
    SwitchFailed,
    SwitchRefused,
    SwitchWedged,
    UnsafeName,
    UnsafeStep,
    UsageError,
)
from gpuwatch.switch.engine import SwitchResult, ensure_cdi
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.testing.simkernel import SimKernel, simulated_switch

NV, AUDIO = "0000:01:00.0", "0000:01:00.1"
NV2, AUDIO2 = "0000:03:00.0", "0000:03:00.1"
NVIDIA_UNBIND = "/sys/bus/pci/drivers/nvidia/unbind"


def of_type(events: list[BaseModel], kind: str) -> list[Any]:
    return [e for e in events if getattr(e, "type", None) == kind]


def drivers(watcher: Any, *addrs: str) -> list[str]:
    return [watcher.model.state.functions[a].driver for a in addrs]


def add_second_card(host: SysRoot, driver: str = "nvidia", audio: str = "snd_hda_intel") -> None:
    """Another NVIDIA card in its own group (15): the nvidia module must then stay loaded."""
    host.add_bridge("0000:00:03.0", iommu_group=3)
    host.add_function(NV2, parent="0000:00:03.0", device="0x2684", driver=driver, iommu_group=15)
    host.add_function(AUDIO2, parent="0000:00:03.0", device="0x22ba", klass="0x040300",
                      driver=audio, iommu_group=15)
    host.add_dev_node("/dev/nvidia1")
    for addr, minor in ((NV, 0), (NV2, 1)):
        folder = host.root / "proc/driver/nvidia/gpus" / addr
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "information").write_text(f"Model: \t\t NVIDIA GeForce RTX\nIRQ:   \t\t 140\n"
                                             f"Device Minor: \t {minor}\nBus Type: \t PCIe\n")


def to_vfio(host: SysRoot) -> None:
    """Put the example card on vfio-pci (nvidia unloaded), as after a switch to vfio."""
    host.unbind(NV)
    host.unbind(AUDIO)
    for name in ("nvidia_drm", "nvidia_modeset", "nvidia_uvm", "nvidia"):
        host.remove_module(name)
    host.bind(NV, "vfio-pci")
    host.bind(AUDIO, "vfio-pci")
    host.add_vfio_group(13)


# --------------------------------------------------------------------------- both directions


async def test_switch_to_vfio_and_back_on_a_display_and_audio_group(host: SysRoot) -> None:
    async with simulated_switch(host) as (w, sim, _engine, events):
        done = await w.switch("0x10de", "vfio", timeout=5)
        assert isinstance(done, SwitchResult) and done.changed
        assert (done.addr, done.group, done.from_mode, done.to_mode) == (NV, 13, "nvidia", "vfio")
        assert [(m.addr, m.driver) for m in done.members] == [(NV, "vfio-pci"), (AUDIO, "vfio-pci")]
        assert drivers(w, NV, AUDIO) == ["vfio-pci", "vfio-pci"]
        assert w.probe("group-in-mode", addr=NV, mode="vfio") is True
        assert NVIDIA_UNBIND not in [p for p, _ in sim.writes]
        assert not (host.root / "sys/module/nvidia").exists()
        assert (host.root / "dev/vfio/13").exists()
        assert (host.device_dir(NV) / "driver_override").read_text() == "(null)\n"

        back = await w.switch(AUDIO, "nvidia", timeout=5)
        assert (back.from_mode, back.to_mode) == ("vfio", "nvidia")
        assert drivers(w, NV, AUDIO) == ["nvidia", "snd_hda_intel"]
        assert ("command", "nvidia-modprobe", "-c", "0", "-u") in sim.record
        assert (host.root / "dev/nvidia-uvm").exists()

    started, completed = of_type(events, "switch-started"), of_type(events, "switch-completed")
    assert [(e.from_mode, e.to_mode) for e in started] == [("nvidia", "vfio"), ("vfio", "nvidia")]
    assert started[0].members == [NV, AUDIO] and started[0].addr == NV and started[0].group == 13
    assert completed[1].members == [ev.SwitchMember(addr=NV, driver="nvidia"),
                                    ev.SwitchMember(addr=AUDIO, driver="snd_hda_intel")]
    assert all(e.duration_ms > 0 for e in completed)
    # Completion is published after the model saw the binds, never before.
    kinds = [getattr(e, "type", "") for e in events]
    first_done = kinds.index("switch-completed")
    assert kinds.index("switch-started") < kinds.index("driver-changed") < first_done
    changes: list[Any] = [e for e in events[:first_done]
                          if getattr(e, "type", "") == "driver-changed"]
    assert {(e.addr, e.new) for e in changes} >= {(NV, "vfio-pci"), (AUDIO, "vfio-pci")}


async def test_cdi_spec_is_generated_when_missing_and_ctk_is_there(host: SysRoot) -> None:
    to_vfio(host)
    host.remove_cdi_spec("etc")
    async with simulated_switch(host) as (w, sim, _e, _ev):
        await w.switch(NV, "nvidia", timeout=5)
    out = f"--output={host.root}/etc/cdi/nvidia.yaml"
    assert sim.record[-2:] == [("mkdir", "/etc/cdi"),
                               ("command", "nvidia-ctk", "cdi", "generate", out)]
    assert (host.root / "etc/cdi/nvidia.yaml").exists()


def _etc_cdi_linked_to_run(host: SysRoot) -> Path:
    """The tree's ``etc/cdi`` a link spelled absolute, ``/run/cdi``, as some hosts keep their
    generated specs: read as in a chroot it is the tree's ``run/cdi``."""
    host.remove_cdi_spec("etc")
    os.rmdir(host.root / "etc/cdi")
    (host.root / "run/cdi").mkdir(parents=True)
    os.symlink("/run/cdi", host.root / "etc/cdi")
    return host.root / "run/cdi/nvidia.yaml"


async def test_cdi_spec_is_generated_in_the_tree_through_its_links(host: SysRoot) -> None:
    """nvidia-ctk runs outside the root and follows links as this host does: given
    ``root/etc/cdi/nvidia.yaml`` it would write the ``/run/cdi`` of the host running gpuwatch.
    Its output is the place in the tree, where a container runtime of that root looks."""
    to_vfio(host)
    spec = _etc_cdi_linked_to_run(host)
    async with simulated_switch(host) as (w, sim, _e, _ev):
        await w.switch(NV, "nvidia", timeout=5)
    assert sim.record[-1] == ("command", "nvidia-ctk", "cdi", "generate", f"--output={spec}")
    assert spec.is_file()


async def test_ensure_cdi_writes_in_the_tree_through_its_links(host: SysRoot) -> None:
    spec = _etc_cdi_linked_to_run(host)
    sim = SimKernel(host)
    made = await ensure_cdi(str(host.root), sim, euid=0)
    assert (made.ok, made.generated, made.spec) == (True, True, "/etc/cdi/nvidia.yaml")
    assert sim.record == [("mkdir", "/etc/cdi"),
                          ("command", "nvidia-ctk", "cdi", "generate", f"--output={spec}")]
    assert spec.is_file()


def _no_cdi_folder(host: SysRoot, how: str) -> None:
    """``etc/cdi`` cannot be made: a file in its place, or a link to itself (a loop)."""
    host.remove_cdi_spec("etc")
    os.rmdir(host.root / "etc/cdi")
    if how == "file":
        (host.root / "etc/cdi").write_text("")
    else:
        os.symlink("cdi", host.root / "etc/cdi")


@pytest.mark.parametrize("how", ["file", "loop"])
async def test_a_cdi_folder_that_cannot_be_made_is_a_note_not_a_failed_switch(
        host: SysRoot, how: str) -> None:
    """The spec's folder is the CDI step's, and that step only warns: the switch to nvidia
    completes with a note, and nvidia-ctk is not run (was: `SwitchFailed`, the group left
    half way, on a read-only ``/etc`` where ``/etc/cdi`` was missing)."""
    to_vfio(host)
    _no_cdi_folder(host, how)
    async with simulated_switch(host) as (w, sim, _e, _ev):
        done = await w.switch(NV, "nvidia", timeout=5)
        assert drivers(w, NV, AUDIO) == ["nvidia", "snd_hda_intel"]
    assert done.changed and done.to_mode == "nvidia"
    cdi_notes = [n for n in done.notes if "/etc/cdi" in n]
    assert len(cdi_notes) == 1, done.notes
    assert cdi_notes[0].startswith("mkdir -p /etc/cdi ")
    assert cdi_notes[0].endswith(": no CDI spec generated")
    assert sim.record[-1] == ("mkdir", "/etc/cdi")
    assert not any(r[:2] == ("command", "nvidia-ctk") for r in sim.record)


@pytest.mark.parametrize("how", ["file", "loop"])
async def test_ensure_cdi_says_why_the_folder_cannot_be_made(host: SysRoot, how: str) -> None:
    _no_cdi_folder(host, how)
    sim = SimKernel(host)
    outcome = await ensure_cdi(str(host.root), sim, euid=0)
    assert (outcome.ok, outcome.generated, outcome.spec) == (False, False, None)
    assert outcome.message.startswith("mkdir -p /etc/cdi ")
    assert outcome.message.endswith(": no CDI spec generated") and "\n" not in outcome.message
    assert sim.record == [("mkdir", "/etc/cdi")]


async def test_a_dangling_spec_link_is_followed_in_the_tree(host: SysRoot) -> None:
    """``etc/cdi/nvidia.yaml`` a link to ``/run/cdi/nvidia.yaml`` not made yet: no spec, so
    one is generated, where the link leads in the tree. nvidia-ctk, outside the root, given
    the link itself would follow it to the ``/run`` of the host running gpuwatch."""
    host.remove_cdi_spec("etc")
    (host.root / "run/cdi").mkdir(parents=True)
    os.symlink("/run/cdi/nvidia.yaml", host.root / "etc/cdi/nvidia.yaml")
    sim = SimKernel(host)
    made = await ensure_cdi(str(host.root), sim, euid=0)
    assert (made.ok, made.generated, made.spec) == (True, True, "/etc/cdi/nvidia.yaml"), made
    spec = host.root / "run/cdi/nvidia.yaml"
    assert sim.record[-1] == ("command", "nvidia-ctk", "cdi", "generate", f"--output={spec}")
    assert spec.is_file()
    assert os.readlink(host.root / "etc/cdi/nvidia.yaml") == "/run/cdi/nvidia.yaml"


async def test_idempotent_switch_writes_nothing_and_needs_no_root(host: SysRoot) -> None:
    async with simulated_switch(host, euid=1000) as (w, sim, _e, events):
        result = await w.switch(NV, "nvidia", timeout=5)
    assert result.changed is False and result.to_mode == "nvidia"
    assert "nothing written" in result.notes[0]
    assert sim.record == []
    assert not of_type(events, "switch-started")


async def test_absent_card_is_an_error_or_a_tolerated_note(host: SysRoot) -> None:
    async with simulated_switch(host) as (w, sim, _e, _ev):
        with pytest.raises(DeviceNotFound, match="no card of vendor 0x1002"):
            await w.switch("0x1002", "vfio")
        noop = await w.switch("0x1002", "vfio", tolerant=True)
    assert noop.changed is False and "no card of vendor 0x1002" in noop.notes[0]
    assert sim.record == []


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("via", ["fd", "maps"])
async def test_holders_refuse_by_name_and_nothing_is_written(host: SysRoot, via: str) -> None:
    sim = SimKernel(host)
    sim.add_holder(4242, "python3", "/dev/nvidia0", via=via)
    sim.add_holder(4243, "Xorg", "/dev/dri/card1")
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, events):
        with pytest.raises(SwitchRefused) as info:
            await w.switch(NV, "vfio", timeout=5)
        assert drivers(w, NV, AUDIO) == ["nvidia", "snd_hda_intel"]
        assert w.probe("current-mode", addr=NV) == "nvidia"
    assert [(h.pid, h.comm, h.node) for h in info.value.holders] == [
        (4242, "python3", "/dev/nvidia0"), (4243, "Xorg", "/dev/dri/card1")]
    assert "python3 (pid 4242) holds /dev/nvidia0" in str(info.value)
    assert sim.record == []  # no write at all, in particular none to nvidia's unbind
    refused = of_type(events, "switch-refused")
    assert len(refused) == 1 and refused[0].to_mode == "vfio" and refused[0].group == 13
    assert [h.pid for h in refused[0].holders] == [4242, 4243]
    assert not of_type(events, "switch-started")


async def test_an_open_sound_node_of_the_audio_function_refuses(host: SysRoot) -> None:
    sound = host.device_dir(AUDIO) / "sound/card1"
    sound.mkdir(parents=True)
    for name in ("controlC1", "pcmC1D3p"):
        (sound / name).mkdir()
        host.add_dev_node(f"/dev/snd/{name}")
    host.add_dev_node("/dev/snd/controlC0")
    sim = SimKernel(host)
    sim.add_holder(900, "pipewire", "/dev/snd/controlC0")  # another card's: not a holder
    sim.add_holder(901, "pipewire", "/dev/snd/pcmC1D3p")
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, _ev):
        with pytest.raises(SwitchRefused) as info:
            await w.switch(NV, "vfio", timeout=5)
    assert [(h.pid, h.node) for h in info.value.holders] == [(901, "/dev/snd/pcmC1D3p")]
    assert sim.record == []


async def test_a_running_vm_holding_the_vfio_group_refuses_the_way_back(host: SysRoot) -> None:
    to_vfio(host)
    sim = SimKernel(host)
    sim.add_holder(5000, "qemu-system-x86", "/dev/vfio/13")
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, _ev):
        with pytest.raises(SwitchRefused, match="qemu-system-x86"):
            await w.switch(NV, "nvidia", timeout=5)
    assert sim.record == []


async def test_a_holder_racing_the_unload_gets_ebusy_and_a_refusal(host: SysRoot) -> None:
    class RacingKernel(SimKernel):
        async def run(self, argv: Any, timeout: float) -> Any:
            if list(argv) == ["modprobe", "-r", "nvidia"]:
                self.add_holder(6000, "nvidia-smi", "/dev/nvidiactl")
            return await super().run(argv, timeout)

    sim = RacingKernel(host)
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, events):
        with pytest.raises(SwitchRefused, match="in use") as info:
            await w.switch(NV, "vfio", timeout=5)
        assert drivers(w, NV) == ["nvidia"]
    assert [h.comm for h in info.value.holders] == ["nvidia-smi"]
    # Refused after it had begun: the modules it had removed are loaded again, newest first.
    unload = sim.commands.index(("modprobe", "-r", "nvidia"))
    assert sim.commands[unload + 1:] == [("modprobe", "nvidia_uvm"), ("modprobe", "nvidia_modeset"),
                                         ("modprobe", "nvidia_drm")]
    assert sim.writes == []
    refused = of_type(events, "switch-refused")
    assert len(refused) == 1 and refused[0].holders[0].pid == 6000
    assert refused[0].restored == ["modprobe nvidia_uvm", "modprobe nvidia_modeset",
                                   "modprobe nvidia_drm"]
    assert info.value.restored == tuple(refused[0].restored)
    assert "restored" in str(info.value) and "modprobe nvidia_drm" in str(info.value)
    for name in ("nvidia", "nvidia_drm", "nvidia_modeset", "nvidia_uvm"):
        assert (host.root / "sys/module" / name).is_dir(), name


async def test_a_kernel_user_of_nvidia_refuses_before_any_command(host: SysRoot) -> None:
    (host.root / "sys/module/nvidia/refcnt").write_text("3\n")
    async with simulated_switch(host) as (w, sim, _e, _ev):
        with pytest.raises(SwitchRefused, match="kernel user"):
            await w.switch(NV, "vfio", timeout=5)
    assert sim.record == []


async def test_persistenced_is_stopped_not_counted_as_a_holder(host: SysRoot) -> None:
    sim = SimKernel(host)
    sim.start_persistenced(777)
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, _ev):
        await w.switch(NV, "vfio", timeout=5)
    assert sim.record[0] == ("command", "systemctl", "stop", "nvidia-persistenced")
    assert not (host.root / "proc/777").exists()


# --------------------------------------------------------------------------- multi-GPU host


async def test_multi_gpu_host_unbinds_this_card_only_and_keeps_the_module(host: SysRoot) -> None:
    add_second_card(host)
    sim = SimKernel(host)
    sim.add_holder(7000, "ollama", "/dev/nvidia1")  # a client of the other card
    sim.add_holder(7001, "ollama", "/dev/nvidiactl")
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, _ev):
        plan = await w.plan(NV, "vfio")
        await w.switch(NV, "vfio", timeout=5)
        assert drivers(w, NV, AUDIO, NV2) == ["vfio-pci", "vfio-pci", "nvidia"]
    assert (host.root / "sys/module/nvidia").is_dir()
    assert tuple(plan["steps"][0].values())[:3] == ("write", NVIDIA_UNBIND, NV)
    assert ("write", NVIDIA_UNBIND, NV) in sim.record
    assert not any(c[:2] == ("modprobe", "-r") for c in sim.commands)


async def test_multi_gpu_host_refuses_a_holder_of_this_cards_node(host: SysRoot) -> None:
    add_second_card(host)
    sim = SimKernel(host)
    sim.add_holder(7100, "python3", "/dev/nvidia0")
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, _ev):
        with pytest.raises(SwitchRefused, match="/dev/nvidia0"):
            await w.switch(NV, "vfio", timeout=5)
    assert sim.record == []


async def test_persistenced_that_will_not_stop_blocks_the_unbind(host: SysRoot) -> None:
    add_second_card(host)

    class StubbornKernel(SimKernel):
        async def run(self, argv: Any, timeout: float) -> Any:
            if argv[0] == "systemctl":
                self.record.append(("command", *argv))
                return await super().run(["modprobe", "nvidia"], timeout)  # does nothing new
            return await super().run(argv, timeout)

    sim = StubbornKernel(host)
    sim.start_persistenced(778)
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, _ev):
        with pytest.raises(SwitchRefused, match="nvidia-persiste"):
            await w.switch(NV, "vfio", timeout=5)
    assert NVIDIA_UNBIND not in [p for p, _ in sim.writes]


# --------------------------------------------------------------------------- the wedge path


async def test_wedge_poisons_the_group_until_the_next_boot(host: SysRoot) -> None:
    add_second_card(host)
    poison = host.root / "var/lib/gpuwatch/poison.json"
    sim = SimKernel(host)
    sim.wedge_unbind.add("nvidia")
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, events):
        answers: list[Any] = []

        async def probe_meanwhile() -> None:
            await anyio.sleep(0.3)
            answers.append(w.probe("detect-vfio"))
            answers.append(w.probe("wedge-detected"))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(probe_meanwhile)
                with pytest.raises(SwitchWedged, match="poisoned"):
                    await w.switch(NV, "vfio", timeout=1.0)
        assert answers[0].gpus and answers[1] is True  # answered while the write hung
        failed = of_type(events, "switch-failed")
        assert len(failed) == 1 and failed[0].wedged is True and failed[0].group == 13
        assert "did not return" in failed[0].error
        assert 13 in w.model.poisoned
        assert w.probe("current-mode", addr=NV2) == "nvidia"  # the watcher keeps answering

        with pytest.raises(GroupPoisoned, match="poisoned"):
            await w.switch(NV, "vfio", timeout=1.0)
        assert of_type(events, "switch-refused")[-1].reason.startswith("IOMMU group 13 is poisoned")
        with pytest.raises(GroupPoisoned):
            await w.switch(NV, "nvidia", timeout=1.0)  # no direction is safe
    data = json.loads(poison.read_text())
    assert data["boot_id"] == (host.root / "proc/sys/kernel/random/boot_id").read_text().strip()
    assert data["groups"]["13"]["addr"] == NV

    record = list(sim.record)
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, _ev):  # a restarted watcher
        with pytest.raises(GroupPoisoned):
            await w.switch(NV, "vfio", timeout=1.0)
        assert 13 in w.model.poisoned
        assert w.probe("group-in-mode", addr=NV2, mode="nvidia") is True
    assert sim.record == record  # refused before anything was written

    sim.reboot("0b8e7d6c-5a4f-4e3d-9c2b-1a0f9e8d7c6b")
    sim.wedge_unbind.clear()
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, _ev):
        assert w.model.poisoned == {}
        assert w.probe("wedge-detected") is False
        await w.switch(NV, "vfio", timeout=5)
        assert drivers(w, NV, AUDIO) == ["vfio-pci", "vfio-pci"]


async def test_recover_refuses_while_a_task_is_stuck_then_rebinds_and_clears(
        host: SysRoot) -> None:
    add_second_card(host)
    sim = SimKernel(host)
    sim.wedge_unbind.add("nvidia")
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, events):
        with pytest.raises(SwitchWedged):
            await w.switch(NV, "vfio", timeout=0.5)
        before = list(sim.record)
        with pytest.raises(RebootRequired, match=r"nv_pci_remove|os_delay") as info:
            await w.recover(NV)
        assert sim.record == before  # touched nothing
        # Refused as an event too, so that whoever counts switch outcomes sees it.
        refused = of_type(events, "switch-refused")
        assert [(e.addr, e.group, e.to_mode, e.reason) for e in refused] == [
            (NV, 13, "vfio", str(info.value))]

        sim.wedge_unbind.clear()
        sim.release_stuck()  # the stuck unbind returned at last
        result = await w.recover(NV, timeout=5)
        assert drivers(w, NV, AUDIO) == ["vfio-pci", "vfio-pci"]
        assert any("poison of group 13 cleared" in n for n in result.notes)
        assert 13 not in w.model.poisoned
        done = await w.switch(NV, "nvidia", timeout=5)  # allowed again
        assert done.changed
    assert json.loads((host.root / "var/lib/gpuwatch/poison.json").read_text())["groups"] == {}


async def test_poison_file_location_is_configurable(host: SysRoot, tmp_path: Path) -> None:
    add_second_card(host)
    sim = SimKernel(host)
    sim.wedge_unbind.add("nvidia")
    where = tmp_path / "state" / "poison.json"
    async with simulated_switch(host, sim=sim, poison_path=where) as (w, _sim, _e, _ev):
        with pytest.raises(SwitchWedged):
            await w.switch(NV, "vfio", timeout=0.5)
    assert "13" in json.loads(where.read_text())["groups"]
    assert not (host.root / "var/lib/gpuwatch/poison.json").exists()


# --------------------------------------------------------------------------- verification


async def test_lost_bind_events_fall_back_to_reading_the_tree(host: SysRoot) -> None:
    sim = SimKernel(host)
    sim.lose_bind_events = True
    async with simulated_switch(host, sim=sim, tree_check_after=0.3) as (w, _sim, _e, events):
        result = await w.switch(NV, "vfio", timeout=5)
        assert drivers(w, NV, AUDIO) == ["vfio-pci", "vfio-pci"]
    assert any("bind events were lost" in n for n in result.notes)
    assert of_type(events, "switch-completed")


async def test_lost_events_with_no_early_check_still_read_the_tree_at_the_deadline(
        host: SysRoot) -> None:
    sim = SimKernel(host)
    sim.lose_bind_events = True
    async with simulated_switch(host, sim=sim, tree_check_after=60) as (w, _sim, _e, _ev):
        result = await w.switch(NV, "vfio", timeout=1.0)
    assert result.changed and "lost" in result.notes[0]


async def test_drivers_probe_that_binds_nothing_fails_after_the_tree_check(
        host: SysRoot) -> None:
    class DeafProbe(SimKernel):
        def _probe(self, addr: str) -> None:
            return None  # reports success, binds nothing

    sim = DeafProbe(host)
    async with simulated_switch(host, sim=sim, tree_check_after=0.2) as (w, _sim, _e, events):
        with pytest.raises(SwitchFailed, match="did not reach") as info:
            await w.switch(NV, "vfio", timeout=1.0)
        assert not isinstance(info.value, SwitchWedged)
        assert w.model.poisoned == {}
    failed = of_type(events, "switch-failed")
    assert failed and failed[0].wedged is False and "no driver" in failed[0].error


async def test_a_failing_module_load_fails_the_switch(host: SysRoot) -> None:
    to_vfio(host)
    sim = SimKernel(host)
    sim.fail_modules.add("nvidia")
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, events):
        with pytest.raises(SwitchFailed, match="not found"):
            await w.switch(NV, "nvidia", timeout=5)
    assert sim.writes == []
    assert of_type(events, "switch-failed")[0].wedged is False


# --------------------------------------------------------------------------- concurrency


class SlowKernel(SimKernel):
    """Each write takes a moment, so a switch is still running when the next request comes."""

    async def write(self, path: str, value: str, timeout: float) -> None:
        await anyio.sleep(0.05)
        await super().write(path, value, timeout)


async def test_a_second_switch_of_a_busy_group_fails_at_once(host: SysRoot) -> None:
    sim = SlowKernel(host)
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, _ev):
        outcome: dict[str, Any] = {}

        async def first() -> None:
            outcome["first"] = await w.switch(NV, "vfio", timeout=5)

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await anyio.sleep(0.1)
            with anyio.fail_after(0.5):  # "at once"
                with pytest.raises(GroupBusy, match="group 13"):
                    await w.switch(AUDIO, "vfio", timeout=5)
                with pytest.raises(GroupBusy):
                    await w.switch(NV, "nvidia", timeout=5)
        assert outcome["first"].changed
        assert drivers(w, NV, AUDIO) == ["vfio-pci", "vfio-pci"]


async def test_the_mode_a_busy_group_is_leaving_is_busy_not_already_in_mode(
        host: SysRoot) -> None:
    """While a switch to vfio has begun but not yet moved a driver (its first command still
    running), the model still shows the group on nvidia. A second request for nvidia must
    not answer "already in mode" (exit 0: a caller would start a CDI container on a card
    leaving nvidia): the group is busy, and it says so at once, writing nothing. Once the
    switch has ended, the same request switches it back."""
    sim = SimKernel(host)
    sim.step_delay = 0.3
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, events):
        outcome: dict[str, Any] = {}

        async def first() -> None:
            outcome["first"] = await w.switch(NV, "vfio", timeout=10)

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            with anyio.fail_after(5):
                while not of_type(events, "switch-started"):
                    await anyio.sleep(0.005)
            assert drivers(w, NV, AUDIO) == ["nvidia", "snd_hda_intel"]  # nothing moved yet
            assert w.probe("group-in-mode", addr=NV, mode="nvidia") is True
            writes = len(sim.record)
            with anyio.fail_after(0.2):  # "at once"
                with pytest.raises(GroupBusy, match="group 13 is already being switched"):
                    await w.switch(NV, "nvidia", timeout=5)
            assert len(sim.record) == writes
        assert outcome["first"].changed
        back = await w.switch(NV, "nvidia", timeout=10)
        assert back.changed and drivers(w, NV, AUDIO) == ["nvidia", "snd_hda_intel"]


async def test_switches_of_two_groups_run_concurrently(host: SysRoot) -> None:
    to_vfio(host)
    add_second_card(host, driver="vfio-pci", audio="vfio-pci")
    sim = SlowKernel(host)
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, events):
        results: list[Any] = []

        async def one(addr: str) -> None:
            results.append(await w.switch(addr, "nvidia", timeout=5))

        start = anyio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(one, NV)
            tg.start_soon(one, NV2)
        elapsed = anyio.current_time() - start
        assert drivers(w, NV, AUDIO, NV2, AUDIO2) == ["nvidia", "snd_hda_intel"] * 2
    assert sorted(r.group for r in results) == [13, 15]
    started = [e.seq for e in of_type(events, "switch-started")]
    completed = [e.seq for e in of_type(events, "switch-completed")]
    assert max(started) < min(completed)  # both were in flight at the same time
    assert elapsed < 6 * 0.05 * 2  # not one after the other


async def test_unloading_nvidia_waits_for_no_one_else(host: SysRoot) -> None:
    # Group 15 goes vfio -> nvidia (slowly) while group 13 would unload the nvidia module.
    add_second_card(host, driver="vfio-pci", audio="vfio-pci")
    sim = SlowKernel(host)
    async with (simulated_switch(host, sim=sim) as (w, _sim, _e, _ev),
                anyio.create_task_group() as tg):
        tg.start_soon(lambda: w.switch(NV2, "nvidia", timeout=5))
        await anyio.sleep(0.06)
        with pytest.raises(GroupBusy, match="nvidia module"):
            await w.switch(NV, "vfio", timeout=5)
    assert ("command", "modprobe", "-r", "nvidia") not in sim.record


class ProbeGatedKernel(SimKernel):
    """The second card's ``drivers_probe`` waits for ``gate``: its switch to nvidia has
    loaded the module and unbound the card from vfio-pci, and has not bound it yet."""

    gate: anyio.Event

    async def write(self, path: str, value: str, timeout: float) -> None:
        if path.endswith("/drivers_probe") and value == NV2:
            await self.gate.wait()
        await anyio.sleep(0.02)
        await super().write(path, value, timeout)


@pytest.mark.timeout(60)
async def test_a_roll_back_never_unloads_nvidia_under_another_switch(host: SysRoot) -> None:
    """Groups 13 and 15 go vfio -> nvidia at once; group 13's switch is cancelled once its
    card is on nvidia, while group 15's card is between its unbind and its probe (on no
    driver). The roll-back of group 13 back to vfio sees no other card on nvidia, but it
    does not have the host to itself: it unbinds its own card from nvidia and leaves the
    module loaded, never `modprobe -r nvidia` under group 15's switch."""
    to_vfio(host)
    add_second_card(host, driver="vfio-pci", audio="vfio-pci")
    host.add_vfio_group(15)
    sim = ProbeGatedKernel(host)
    sim.gate = anyio.Event()
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, events):
        outcome: dict[str, Any] = {}
        scope = anyio.CancelScope()

        async def card15() -> None:
            outcome["15"] = await w.switch(NV2, "nvidia", timeout=10)

        async def card13() -> None:
            with scope:
                await w.switch(NV, "nvidia", timeout=10)

        async with anyio.create_task_group() as tg:
            tg.start_soon(card15)
            with anyio.fail_after(10):
                while ("write", f"/sys/bus/pci/devices/{NV2}/driver_override",
                       "nvidia") not in sim.record:
                    await anyio.sleep(0.01)
                tg.start_soon(card13)
                while drivers(w, NV) != ["nvidia"]:
                    await anyio.sleep(0.01)
            scope.cancel()
            with anyio.fail_after(10):
                while not of_type(events, "switch-failed"):
                    await anyio.sleep(0.01)
            sim.gate.set()
        assert ("command", "modprobe", "-r", "nvidia") not in sim.record
        assert ("write", NVIDIA_UNBIND, NV) in sim.record
        failed = of_type(events, "switch-failed")
        assert [(e.group, e.error) for e in failed] == [(13, "interrupted")]
        assert f"write '{NV}' to {NVIDIA_UNBIND}" in failed[0].restored
        assert drivers(w, NV, AUDIO, NV2, AUDIO2) == [
            "vfio-pci", "vfio-pci", "nvidia", "snd_hda_intel"]
        assert outcome["15"].changed
        assert (host.root / "sys/module/nvidia").is_dir()


class SlowRemoveKernel(SimKernel):
    """snd_hda_intel's remove takes a second, its task in D state in ``pci_device_remove``
    meanwhile, as a real unbind does for a moment; then it returns."""

    in_remove: anyio.Event

    async def write(self, path: str, value: str, timeout: float) -> None:
        if path.endswith("/snd_hda_intel/unbind"):
            self.sys.add_process(4242, "python3", state="D", stack=(
                "[<0>] pci_device_remove+0x3e/0xb0\n"
                "[<0>] device_release_driver_internal+0x1b/0x30\n"
                "[<0>] unbind_store+0xd9/0x100\n"))
            self.in_remove.set()
            await anyio.sleep(1.0)
            self.sys.remove_process(4242)
        await super().write(path, value, timeout)


async def test_recover_during_a_switch_of_the_group_is_busy_not_a_stuck_task(
        host: SysRoot) -> None:
    """`recover` of a group whose switch is under way is `GroupBusy`, at once, nothing
    published: not a refusal (or "reboot required") because the wedge scan saw the
    switch's own unbind in the kernel, with a `switch-refused` between the switch's
    `switch-started` and its end."""
    sim = SlowRemoveKernel(host)
    sim.in_remove = anyio.Event()
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, events):
        outcome: dict[str, Any] = {}

        async def first() -> None:
            outcome["switch"] = await w.switch(NV, "vfio", timeout=10)

        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            with anyio.fail_after(5):
                await sim.in_remove.wait()
            with anyio.fail_after(0.5), pytest.raises(GroupBusy, match="group 13"):
                await w.recover(NV, timeout=5)
        assert outcome["switch"].changed
    assert [e.type for e in events if e.type.startswith("switch-")] == [  # type: ignore[attr-defined]
        "switch-started", "switch-completed"]


async def test_another_process_switching_the_group_is_busy_too(host: SysRoot) -> None:
    import fcntl

    lock_dir = host.root / "run/gpuwatch"
    lock_dir.mkdir(parents=True)
    fd = os.open(lock_dir / "switch-13.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        async with simulated_switch(host) as (w, sim, _e, _ev):
            with pytest.raises(GroupBusy, match="another process"):
                await w.switch(NV, "vfio", timeout=5)
        assert sim.record == []
    finally:
        os.close(fd)


async def test_the_mode_a_group_another_process_switches_is_busy_not_already_in_mode(
        host: SysRoot) -> None:
    """A second orchestrator asking for the mode the group is in while another process
    holds the group's switch lock (its switch has not moved a driver yet) is told the group
    is busy, not "already in mode"; once the lock is let go, the same request is the no-op.
    A lock on another group's file busies nothing."""
    import fcntl

    lock_dir = host.root / "run/gpuwatch"
    lock_dir.mkdir(parents=True)
    other = os.open(lock_dir / "switch-14.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(other, fcntl.LOCK_EX)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
         str(lock_dir / "switch-13.lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        async with simulated_switch(host) as (w, sim, _e, _ev):
            with anyio.fail_after(2), pytest.raises(GroupBusy, match="another process"):
                await w.switch(NV, "nvidia", timeout=5)
            holder.communicate(timeout=10)  # it lets go of the lock and ends
            assert holder.returncode == 0
            result = await w.switch(NV, "nvidia", timeout=5)
            assert not result.changed
        assert sim.record == []
    finally:
        holder.kill()
        holder.communicate(timeout=10)  # closes its pipes too
        os.close(other)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("target", ["0000:01:00.0/../../x", "01:00.0", "0000:01:00.0\n",
                                    "nvidia", "0000:01:00.0; reboot"])
async def test_malformed_targets_are_rejected_before_any_write(host: SysRoot,
                                                               target: str) -> None:
    async with simulated_switch(host) as (w, sim, _e, events):
        with pytest.raises(UsageError):
            await w.switch(target, "vfio", timeout=5)
        with pytest.raises(UsageError):
            await w.switch(NV, "host", timeout=5)
    assert sim.record == [] and not of_type(events, "switch-started")


async def test_a_malformed_driver_name_on_the_host_is_refused_before_any_write(
        host: SysRoot) -> None:
    # A driver link whose name could not have come from the kernel.
    bad = host.root / "sys/bus/pci/drivers/snd hda;x"
    bad.mkdir()
    link = host.device_dir(AUDIO) / "driver"
    link.unlink()
    link.symlink_to("../../../../bus/pci/drivers/snd hda;x")
    async with simulated_switch(host) as (w, sim, _e, events):
        assert w.model.state.functions[AUDIO].driver == "snd hda;x"
        with pytest.raises(UnsafeName, match="driver name"):
            await w.switch(NV, "vfio", timeout=5)
    assert sim.record == []
    assert of_type(events, "switch-refused")


@pytest.mark.parametrize(("path", "value"), [
    ("/sys/bus/pci/devices/0000:01:00.0/remove", "1"),
    ("/sys/bus/pci/devices/../../../etc/passwd", "x"),
    ("/sys/bus/pci/devices/0000:01:00.0/driver_override", "vfio pci"),
    ("/sys/bus/pci/devices/0000:01:00.0/driver_override", "nvidia\n"),
    ("/sys/bus/pci/drivers/nvidia/unbind", "0000:01:00.0\n"),
    ("/sys/bus/pci/drivers/nv;x/unbind", "0000:01:00.0"),
    ("/sys/bus/pci/drivers_probe", "01:00.0"),
])
async def test_the_seam_refuses_writes_outside_its_allow_list(host: SysRoot, path: str,
                                                              value: str) -> None:
    sim = SimKernel(host)
    with pytest.raises(UnsafeStep):
        await sim.write(path, value, 1.0)
    assert sim.record == []


async def test_the_non_root_refusal_comes_before_anything(host: SysRoot) -> None:
    async with simulated_switch(host, euid=1000) as (w, sim, _e, events):
        with pytest.raises(NotPrivileged, match="needs root"):
            await w.switch(NV, "vfio", timeout=5)
        with pytest.raises(NotPrivileged):
            await w.recover(NV)
    assert sim.record == []
    assert not [e for e in events if getattr(e, "type", "").startswith("switch-")]
    assert not (host.root / "run/gpuwatch").exists()


# --------------------------------------------------------------------------- plan == record


@pytest.mark.parametrize("setup", ["single", "persistenced", "multi", "to-nvidia"])
async def test_the_plan_is_exactly_what_the_switch_then_does(host: SysRoot, setup: str) -> None:
    mode = "vfio"
    sim = SimKernel(host)
    if setup == "persistenced":
        sim.start_persistenced()
    elif setup == "multi":
        add_second_card(host)
        sim.start_persistenced()
    elif setup == "to-nvidia":
        to_vfio(host)
        host.remove_cdi_spec("etc")
        mode = "nvidia"
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, _ev):
        plan = await w.plan("0x10de" if setup != "multi" else NV, mode)
        probed = w.model.probe("plan", addr=NV, mode=mode)
        assert sim.record == []  # planning executes nothing
        await w.switch(NV, mode, timeout=5)
    assert plan["refused"] is None and plan["steps"]
    if setup != "to-nvidia":  # the probe asks the real PATH about nvidia-ctk
        assert probed == plan["steps"]
    recorded: list[dict[str, object]] = []
    for r in sim.record:
        if r[0] == "write":
            recorded.append({"kind": "write", "path": r[1], "value": r[2]})
        elif r[0] == "mkdir":
            recorded.append({"kind": "mkdir", "path": r[1]})
        else:
            recorded.append({"kind": "command", "argv": list(r[1:])})
    assert recorded == [{k: v for k, v in s.items() if k != "on_error"} for s in plan["steps"]]


async def test_the_plan_probe_raises_the_refusal(host: SysRoot) -> None:
    SimKernel(host).add_holder(4242, "python3", "/dev/nvidia0")
    async with simulated_switch(host) as (w, _sim, _e, _ev):
        with pytest.raises(SwitchRefused, match="python3"):
            w.model.probe("plan", vendor="0x10de", mode="vfio")
        plan = await w.plan(NV, "vfio")
    assert plan["steps"] == [] and plan["refused"]["holders"][0]["pid"] == 4242


def test_step_json_spells_each_kind() -> None:
    from gpuwatch.core.plan import CommandStep, MakeDirStep, WriteStep

    assert step_json(WriteStep("/sys/x", "v")) == {"kind": "write", "path": "/sys/x",
                                                   "value": "v"}
    assert step_json(CommandStep(("modprobe", "x"))) == {"kind": "command",
                                                         "argv": ["modprobe", "x"],
                                                         "on_error": "fail"}
    assert step_json(MakeDirStep("/etc/cdi")) == {"kind": "mkdir", "path": "/etc/cdi"}


# --------------------------------------------------------------------------- holders, cdi


async def test_holders_lists_every_node_of_the_card(host: SysRoot) -> None:
    sim = SimKernel(host)
    sim.start_persistenced(777)
    sim.add_holder(4243, "Xorg", "/dev/dri/renderD129")
    sim.add_holder(4244, "Xorg", "/dev/dri/renderD128")  # the iGPU's: not this card
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, _ev):
        report = await w.holders("0x10de")
    assert [(h["pid"], h["node"]) for h in report["holders"]] == [
        (777, "/dev/nvidia0"), (777, "/dev/nvidiactl"), (4243, "/dev/dri/renderD129")]
    assert report["complete"] is True and report["group"] == 13


async def test_ensure_cdi_generates_reports_or_explains(host: SysRoot) -> None:
    sim = SimKernel(host)
    present = await ensure_cdi(str(host.root), sim, euid=0)
    assert present.ok and not present.generated and sim.record == []
    host.remove_cdi_spec("etc")
    made = await ensure_cdi(str(host.root), sim, euid=0)
    assert made.ok and made.generated and made.spec == "/etc/cdi/nvidia.yaml"
    assert sim.record[-1] == ("command", "nvidia-ctk", "cdi", "generate",
                              f"--output={host.root}/etc/cdi/nvidia.yaml")
    host.remove_cdi_spec("etc")
    bare = SimKernel(host, tools={"modprobe"})
    missing = await ensure_cdi(str(host.root), bare, euid=0)
    assert not missing.ok and "not on PATH" in missing.message and bare.record == []
    with pytest.raises(NotPrivileged):
        await ensure_cdi(str(host.root), sim, euid=1000)


def test_example_host_fixture_is_untouched_by_planning(tmp_path: Path) -> None:
    host = example_gpu_host(tmp_path / "h")
    before = sorted(str(p) for p in host.root.rglob("*"))
    import gpuwatch

    steps = gpuwatch.scan(host.root).probe("plan", addr=NV, mode="vfio")
    assert steps and sorted(str(p) for p in host.root.rglob("*")) == before


async def test_a_cancelled_switch_ends_with_switch_failed_interrupted(host: SysRoot) -> None:
    """SIGINT/SIGTERM in `gpuwatch mode` cancel the switch: it must end with `switch-failed`
    ("interrupted"), never leave `switch-started` alone."""
    add_second_card(host)  # nvidia stays loaded: the card is unbound from it, and that hangs
    sim = SimKernel(host)
    sim.wedge_unbind.add("nvidia")  # the unbind hangs: the cancel lands mid-switch
    async with simulated_switch(host, sim=sim) as (w, _sim, _e, events):
        with anyio.move_on_after(0.5) as scope:
            await w.switch(NV, "vfio", timeout=30)
        assert scope.cancelled_caught
        await anyio.sleep(0.05)
    assert len(of_type(events, "switch-started")) == 1
    failed = of_type(events, "switch-failed")
    assert [(f.error, f.wedged, f.addr) for f in failed] == [("interrupted", False, NV)]
    kinds = [getattr(e, "type", "") for e in events]
    assert kinds.index("switch-started") < kinds.index("switch-failed")


async def test_a_wedge_another_process_recorded_is_refused_here_too(host: SysRoot) -> None:
    """A `gpuwatch mode --log` beside the daemon wedged group 13 and recorded it in the
    poison file after this engine had loaded it: the engine's next switch (and plan) of that
    group is refused, nothing written, rather than adding a second stuck task."""
    from gpuwatch.switch.poison import PoisonEntry, PoisonStore

    async with simulated_switch(host) as (w, sim, _engine, events):
        PoisonStore(str(host.root)).add(13, PoisonEntry(
            addr=NV, to_mode="vfio", time="2026-12-03T10:00:00.000000Z",
            error="write '0000:01:00.0' to /sys/bus/pci/drivers/nvidia/unbind did not "
                  "return within 30s: the device is wedged"))
        with pytest.raises(GroupPoisoned, match="IOMMU group 13 is poisoned"):
            await w.switch(NV, "vfio", timeout=5)
        plan = await w.engine.plan(NV, "vfio")
        assert plan["refused"] is not None and "poisoned" in plan["refused"]["reason"]
        assert sim.record == []
        assert [e.type for e in of_type(events, "switch-refused")] == ["switch-refused"]
