"""The switch tells the truth about how it ended: `switch-completed` only once the model saw
every function on its target, a failure that says what it left changed, a recover that does
not claim a poison it could not clear, and the nvidia module never unloaded under another
switch (in this process or another one).

Every test runs against a fixture root with the simulated kernel.
"""

from __future__ import annotations

import errno
import fcntl
import os
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from gpuwatch.cli.main import main
from gpuwatch.errors import (
    GroupBusy,
    GroupPoisoned,
    NotPrivileged,
    StepTimedOut,
    SwitchFailed,
    SwitchRefused,
    SwitchWedged,
)
from gpuwatch.sources.memory import MemorySource
from gpuwatch.switch import engine as engine_module
from gpuwatch.switch import hostops
from gpuwatch.switch.hostops import Backend
from gpuwatch.switch.poison import PoisonStore
from gpuwatch.testing import SysRoot
from gpuwatch.testing.modern import GH_ADDR, grace_hopper_host
from gpuwatch.testing.simkernel import SimKernel, simulated_switch
from tests.test_switch_engine import (
    AUDIO,
    AUDIO2,
    NV,
    NV2,
    NVIDIA_UNBIND,
    SlowKernel,
    add_second_card,
    of_type,
    to_vfio,
)


def tree_driver(sim: SimKernel, addr: str) -> str:
    return sim._driver(addr)


# --------------------------------------------------------------------------- completion


async def test_an_explicit_vfio_driver_completes_only_once_it_is_seen_bound(
        tmp_path: Path) -> None:
    """`--vfio-driver vfio-pci` from nvgrace_gpu_vfio_pci: the model still showing the variant
    (its uevents not read yet) is not the target reached. Every uevent is lost here, so only
    the tree check can confirm, and the record must show the driver the function is on."""
    host = grace_hopper_host(tmp_path)
    nowhere = MemorySource()
    async with simulated_switch(host, tree_check_after=0.2) as (w, sim, _e, events):
        sim.source = nowhere  # the watcher hears nothing from now on
        try:
            result = await w.switch(GH_ADDR, "vfio", timeout=10, vfio_driver="vfio-pci")
        finally:
            nowhere.close()
        assert tree_driver(sim, GH_ADDR) == "vfio-pci"
        assert [(m.addr, m.driver) for m in result.members] == [(GH_ADDR, "vfio-pci")]
        assert any("lost" in n for n in result.notes)
    assert of_type(events, "switch-completed")[0].members[0].driver == "vfio-pci"


# --------------------------------------------------------------------------- failures


class DeafProbe(SimKernel):
    """drivers_probe reports success and binds nothing (a driver whose probe fails)."""

    def _probe(self, addr: str) -> None:
        return None


async def test_a_failed_switch_says_which_functions_it_left_changed(host: SysRoot) -> None:
    """To vfio, no function binds: reloading nvidia brings the display back, but the audio
    function stays unbound. The error and the event's `restored` say so, instead of reading
    as if the host were back as found."""
    sim = DeafProbe(host)
    async with simulated_switch(host, sim=sim, tree_check_after=0.2) as (w, _s, _e, events):
        with pytest.raises(SwitchFailed, match="did not reach") as info:
            await w.switch(NV, "vfio", timeout=1.5)
        assert not isinstance(info.value, SwitchWedged)
        assert [tree_driver(sim, a) for a in (NV, AUDIO)] == ["nvidia", ""]
    text = str(info.value)
    assert f"{AUDIO} on no driver (was snd_hda_intel)" in text.rpartition("restored")[2]
    assert f"{NV} on nvidia" in text.rpartition("restored")[2]
    failed = of_type(events, "switch-failed")[0]
    assert failed.restored[:1] == ["modprobe nvidia"]
    assert any(f"{AUDIO} on no driver (was snd_hda_intel)" in r for r in failed.restored)
    assert tuple(failed.restored) == info.value.restored


async def test_a_function_removed_mid_switch_is_reported_gone(host: SysRoot) -> None:
    class HotRemoval(SimKernel):
        async def write(self, path: str, value: str, timeout: float) -> None:
            if path == "/sys/bus/pci/drivers/snd_hda_intel/unbind":
                devpath = self.sys.devpath(value)
                self.sys.remove_function(value)  # surprise removal, right before the unbind
                self.source.push(self.sys.uevent_props("remove", devpath))
            await super().write(path, value, timeout)

    sim = HotRemoval(host)
    async with simulated_switch(host, sim=sim) as (w, _s, _e, events):
        with pytest.raises(SwitchFailed, match="No such device") as info:
            await w.switch(NV, "vfio", timeout=5)
    left = str(info.value).rpartition("restored")[2]
    assert f"{NV} on vfio-pci (was nvidia)" in left and f"{AUDIO} gone" in left
    assert any(f"{AUDIO} gone" in r for r in of_type(events, "switch-failed")[0].restored)


async def test_a_failure_that_changed_no_driver_adds_nothing(host: SysRoot) -> None:
    sim = SimKernel(host)
    sim.fail_modules.add("vfio_pci")
    host.remove_module("vfio_pci")
    async with simulated_switch(host, sim=sim) as (w, _s, _e, events):
        with pytest.raises(SwitchFailed, match="not found") as info:
            await w.switch(NV, "vfio", timeout=5)
        assert [tree_driver(sim, a) for a in (NV, AUDIO)] == ["nvidia", "snd_hda_intel"]
    assert "was " not in str(info.value)
    assert not any("was " in r for r in of_type(events, "switch-failed")[0].restored)


# --------------------------------------------------------------------------- recover


async def test_recover_that_cannot_clear_the_poison_record_says_so(
        host: SysRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    add_second_card(host)
    sim = SimKernel(host)
    sim.wedge_unbind.add("nvidia")
    async with simulated_switch(host, sim=sim) as (w, _s, _e, _ev):
        with pytest.raises(SwitchWedged):
            await w.switch(NV, "vfio", timeout=0.5)
        sim.wedge_unbind.clear()
        sim.release_stuck()

        def read_only(self: PoisonStore, entries: object) -> None:
            raise OSError(errno.EROFS, "Read-only file system", self.path)

        monkeypatch.setattr(PoisonStore, "_store", read_only)
        with pytest.raises(SwitchFailed, match=r"poison.*Read-only file system"):
            await w.recover(NV, timeout=5)
        assert [tree_driver(sim, a) for a in (NV, AUDIO)] == ["vfio-pci", "vfio-pci"]
        assert 13 in w.model.poisoned  # as the record still says: refused until cleared
        monkeypatch.undo()
        done = await w.recover(NV, timeout=5)  # the file system is back: the retry clears it
        assert any("poison of group 13 cleared" in n for n in done.notes)
        assert 13 not in w.model.poisoned
    assert PoisonStore(str(host.root)).load() == {}


# --------------------------------------------------------------------------- the nvidia module


def hold_host_lock(root: Path, how: int) -> int:
    folder = root / "run/gpuwatch"
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / "switch.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, how)
    return fd


async def test_unloading_nvidia_waits_for_a_switch_of_another_process(host: SysRoot) -> None:
    """Another process switching any group holds the host lock shared: a switch here that
    would unload the nvidia module is busy, nothing run."""
    fd = hold_host_lock(host.root, fcntl.LOCK_SH)
    try:
        async with simulated_switch(host) as (w, sim, _e, events):
            with pytest.raises(GroupBusy, match="nvidia module"):
                await w.switch(NV, "vfio", timeout=5)
            assert sim.record == []
            assert not of_type(events, "switch-started")
    finally:
        os.close(fd)


@pytest.mark.timeout(60)
async def test_a_roll_back_leaves_nvidia_loaded_while_another_process_switches(
        host: SysRoot) -> None:
    """An interrupted switch to nvidia goes back to vfio. No other card is on nvidia, but
    another process holds the host lock shared (its switch may need the module): the card
    is unbound from nvidia alone and the module stays loaded."""
    to_vfio(host)
    add_second_card(host, driver="vfio-pci", audio="vfio-pci")
    fd = hold_host_lock(host.root, fcntl.LOCK_SH)
    try:
        async with simulated_switch(host, sim=SlowKernel(host)) as (w, sim, _e, events):
            with anyio.move_on_after(10) as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(lambda: w.switch(NV, "nvidia", timeout=10))
                    while w.model.state.functions[NV].driver != "nvidia":
                        await anyio.sleep(0.01)
                    scope.cancel()
            assert ("command", "modprobe", "-r", "nvidia") not in sim.record
            assert ("write", NVIDIA_UNBIND, NV) in sim.record
            assert [e.error for e in of_type(events, "switch-failed")] == ["interrupted"]
            assert tree_driver(sim, NV) == "vfio-pci"
            assert (host.root / "sys/module/nvidia").is_dir()
    finally:
        os.close(fd)


async def test_no_switch_runs_while_another_process_unloads_nvidia(host: SysRoot) -> None:
    fd = hold_host_lock(host.root, fcntl.LOCK_EX)
    try:
        async with simulated_switch(host) as (w, sim, _e, _ev):
            with pytest.raises(GroupBusy, match="another process"):
                await w.switch(NV, "vfio", timeout=5)
            assert sim.record == []
    finally:
        os.close(fd)
    async with simulated_switch(host) as (w, sim, _e, _ev):  # lock released: it runs
        assert (await w.switch(NV, "vfio", timeout=5)).changed


@pytest.mark.timeout(60)
async def test_the_unload_decision_is_taken_again_with_the_host_to_itself(
        host: SysRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    """Group 13 (nvidia) to vfio reads its facts while group 15 (vfio) is not on nvidia yet:
    no other GPU on nvidia, so unload. Group 15's switch to nvidia completes meanwhile. The
    unload must be decided again once the switch has the host to itself: group 15 is on
    nvidia now, so the card is unbound alone and group 15 keeps its driver."""
    add_second_card(host, driver="vfio-pci", audio="vfio-pci")
    host.add_vfio_group(15)
    real = engine_module.gather_facts
    gate = threading.Event()
    calls: list[int] = []

    def stale_facts(*args: Any, **kwargs: Any) -> Any:
        facts = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == 1:
            gate.wait(20)  # read before group 15 moved; handed over after it did
        return facts

    monkeypatch.setattr(engine_module, "gather_facts", stale_facts)
    async with simulated_switch(host, scan_timeout=30) as (w, sim, _e, _ev):
        w.model.proc_deadline = 25.0
        outcome: dict[str, Any] = {}

        async def card13() -> None:
            outcome["13"] = await w.switch(NV, "vfio", timeout=40)

        async with anyio.create_task_group() as tg:
            tg.start_soon(card13)
            with anyio.fail_after(20):
                while not calls:  # group 13's facts are read (and held back)
                    await anyio.sleep(0.01)
            # Group 15 goes to nvidia while group 13's first facts are being read.
            outcome["15"] = await w.switch(NV2, "nvidia", timeout=20)
            gate.set()
        assert outcome["15"].changed and outcome["13"].changed
        assert ("command", "modprobe", "-r", "nvidia") not in sim.record
        assert [tree_driver(sim, a) for a in (NV2, AUDIO2)] == ["nvidia", "snd_hda_intel"]
        assert [tree_driver(sim, a) for a in (NV, AUDIO)] == ["vfio-pci", "vfio-pci"]


# --------------------------------------------------------------------------- a stuck roll-back


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["step-timeout", "roll-back-bound"])
async def test_a_roll_back_that_gets_stuck_poisons_the_group(host: SysRoot, how: str) -> None:
    """Interrupted once the display is on vfio-pci: the roll-back unbinds it from vfio-pci,
    and that write hangs (its own step timeout, or still hanging when the roll-back's bound
    runs out). A task is stuck on the device: the group is poisoned as after any wedge,
    nothing more is run (no module load on top), and the next switch is refused instead of
    adding a second stuck task."""
    sim = SimKernel(host)
    sim.step_delay = 0.05
    step_timeout = 0.5 if how == "step-timeout" else 20.0
    async with simulated_switch(host, sim=sim, step_timeout=step_timeout) as (w, _s, engine,
                                                                             events):
        engine.rollback_timeout = 30.0 if how == "step-timeout" else 1.0
        with anyio.fail_after(40):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: w.switch(NV, "vfio", timeout=30))
                while tree_driver(sim, NV) != "vfio-pci":
                    await anyio.sleep(0.005)
                sim.wedge_unbind.add("vfio-pci")
                tg.cancel_scope.cancel()
        assert len(sim.stuck) == 1
        hung = sim.record.index(("write", "/sys/bus/pci/drivers/vfio-pci/unbind", NV))
        assert sim.record[hung + 1:] == []  # nothing after the stuck write
        assert 13 in w.model.poisoned
        failed = of_type(events, "switch-failed")[-1]
        assert (failed.error, failed.wedged) == ("interrupted", True)
        assert "poisoned" in failed.restored[-1]
        before = list(sim.record)
        with pytest.raises(GroupPoisoned):
            await w.switch(NV, "nvidia", timeout=5)
        assert sim.record == before and len(sim.stuck) == 1
    assert 13 in PoisonStore(str(host.root)).load()  # a restarted watcher refuses it too


async def test_a_lock_folder_that_cannot_be_made_is_one_clear_failure(host: SysRoot) -> None:
    """`<root>/run` not writable (here: a file where the folder belongs, as on a read-only
    host root): the switch fails with what and why, nothing written, not an internal error."""
    (host.root / "run").write_text("not a folder\n")
    async with simulated_switch(host) as (w, sim, _e, events):
        with pytest.raises(SwitchFailed, match=r"switch lock .*run/gpuwatch.*nothing was written"):
            await w.switch(NV, "vfio", timeout=5)
        assert sim.record == [] and not of_type(events, "switch-started")
        assert not w.engine.busy


async def test_a_module_load_that_hangs_while_restoring_poisons_the_group(host: SysRoot) -> None:
    """The switch to vfio fails (vfio_pci cannot load) after nvidia was unloaded; loading
    nvidia again hangs in the kernel (its probe stuck on the card). That is a wedge like any
    step that does not return: the group is poisoned, no further module is loaded on top,
    and the error and the event say so."""

    class StuckLoad(SimKernel):
        async def run(self, argv: Any, timeout: float) -> Any:
            if list(argv) == ["modprobe", "nvidia"]:
                self.record.append(("command", *argv))
                await anyio.sleep(timeout)
                raise StepTimedOut("command modprobe nvidia", timeout)
            return await super().run(argv, timeout)

    sim = StuckLoad(host)
    sim.fail_modules.add("vfio_pci")
    host.remove_module("vfio_pci")
    async with simulated_switch(host, sim=sim, step_timeout=0.5) as (w, _s, _e, events):
        with pytest.raises(SwitchFailed, match="not found") as info:
            await w.switch(NV, "vfio", timeout=5)
        assert sim.record[-1] == ("command", "modprobe", "nvidia")  # nothing after it
        assert 13 in w.model.poisoned
        with pytest.raises(GroupPoisoned):
            await w.switch(NV, "nvidia", timeout=5)
    assert "poisoned" in str(info.value)
    failed = of_type(events, "switch-failed")[0]
    assert failed.wedged is True and "poisoned" in failed.restored[-1]


# --------------------------------------------------------------------------- two GPUs, one group

GPU_A, GPU_B, GPU_C = "0000:02:00.0", "0000:03:00.0", "0000:41:00.0"


def two_gpus_behind_a_switch(root: Path, *, minor_b: bool = True) -> SysRoot:
    """Two NVIDIA GPUs behind a PCIe switch without ACS share IOMMU group 13; a third card in
    group 41 stays on nvidia, so the module stays and each GPU is unbound alone."""
    s = SysRoot(root)
    s.add_bridge("0000:00:01.0", iommu_group=2)
    s.add_bridge("0000:01:00.0", parent="0000:00:01.0", iommu_group=12)
    for addr in (GPU_A, GPU_B):
        s.add_function(addr, parent="0000:01:00.0", device="0x2204", driver="nvidia",
                       iommu_group=13)
    s.add_bridge("0000:40:01.0", iommu_group=40)
    s.add_function(GPU_C, parent="0000:40:01.0", device="0x2204", driver="nvidia",
                   iommu_group=41)
    for minor, addr in enumerate((GPU_A, GPU_B, GPU_C)):
        s.add_dev_node(f"/dev/nvidia{minor}")
        if addr == GPU_B and not minor_b:
            continue
        folder = s.root / "proc/driver/nvidia/gpus" / addr
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "information").write_text(f"Model: \t\t NVIDIA GeForce RTX\n"
                                             f"Device Minor: \t {minor}\nBus Type: \t PCIe\n")
    s.add_dev_node("/dev/nvidiactl")
    for name in ("nvidia", "vfio", "vfio_pci"):
        s.add_module(name)
    s.add_iommu_unit("dmar0")
    return s


async def test_a_client_of_the_second_gpu_of_the_group_refuses(tmp_path: Path) -> None:
    """Its unbind from nvidia would wait for that client for ever (a wedge): the holders of
    every GPU of the group count, not only those of the display function named."""
    host = two_gpus_behind_a_switch(tmp_path)
    host.add_process(4242, "cuda-job", fds={3: "/dev/nvidia1", 4: "/dev/nvidiactl"})
    async with simulated_switch(host, step_timeout=2) as (w, sim, _e, events):
        plan = await w.plan(GPU_A, "vfio")
        assert plan["refused"] is not None
        assert [(h["pid"], h["node"]) for h in plan["refused"]["holders"]] == [
            (4242, "/dev/nvidia1")]
        with pytest.raises(SwitchRefused, match=r"cuda-job \(pid 4242\) holds /dev/nvidia1"):
            await w.switch(GPU_A, "vfio", timeout=5)
        assert sim.record == [] and sim.stuck == [] and w.model.poisoned == {}
        host.remove_process(4242)
        done = await w.switch(GPU_A, "vfio", timeout=5)
        assert [m.driver for m in done.members] == ["vfio-pci", "vfio-pci"]
        assert ("write", "/sys/bus/pci/drivers/nvidia/unbind", GPU_B) in sim.record
        assert tree_driver(sim, GPU_C) == "nvidia"
    assert not of_type(events, "switch-failed")


async def test_a_second_gpu_of_the_group_without_its_minor_refuses(tmp_path: Path) -> None:
    host = two_gpus_behind_a_switch(tmp_path, minor_b=False)
    async with simulated_switch(host) as (w, sim, _e, _ev):
        with pytest.raises(SwitchRefused, match=rf"{GPU_B}'s /dev/nvidiaN is unknown"):
            await w.switch(GPU_A, "vfio", timeout=5)
        assert sim.record == []


# ---------------------------------------------------------------- cancelled while restoring


@pytest.mark.timeout(60)
async def test_a_signal_while_a_failed_switch_restores_still_ends_the_switch(
        host: SysRoot) -> None:
    """The switch to vfio fails (vfio_pci cannot load) after unloading nvidia, and the caller
    is cancelled (SIGTERM) while nvidia is being loaded again. The restoring still runs to
    its end and `switch-failed` is still published: never a `switch-started` left alone, nor
    a host left without the modules the switch removed."""

    class SlowLoad(SimKernel):
        async def run(self, argv: Any, timeout: float) -> Any:
            if list(argv) == ["modprobe", "nvidia"]:
                self.loading = True
                await anyio.sleep(0.5)
            return await super().run(argv, timeout)

    sim = SlowLoad(host)
    sim.loading = False  # type: ignore[attr-defined]
    sim.fail_modules.add("vfio_pci")
    host.remove_module("vfio_pci")
    async with simulated_switch(host, sim=sim) as (w, _s, _e, events):
        failures: list[SwitchFailed] = []

        async def switch() -> None:
            try:
                await w.switch(NV, "vfio", timeout=10)
            except SwitchFailed as exc:  # what happened: it failed, then the signal came
                failures.append(exc)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(switch)
                while not sim.loading:  # type: ignore[attr-defined]
                    await anyio.sleep(0.005)
                tg.cancel_scope.cancel()
        assert [tree_driver(sim, a) for a in (NV, AUDIO)] == ["nvidia", "snd_hda_intel"]
        assert ("command", "modprobe", "nvidia_drm") in sim.record
        assert not w.engine.busy
        assert len(failures) == 1 and "restored what the switch had changed" in str(failures[0])
    kinds = [e.type for e in events if getattr(e, "type", "").startswith("switch-")]  # type: ignore[attr-defined]
    assert kinds == ["switch-started", "switch-failed"]
    assert of_type(events, "switch-failed")[0].restored[0] == "modprobe nvidia"


async def test_an_unexpected_error_of_the_host_seam_still_ends_and_restores(
        host: SysRoot) -> None:
    """A `HostOps` (an embedder's own, or a bug) raising something the engine does not know
    half-way: the switch still restores the modules it removed and ends with
    `switch-failed`, the error named; never `switch-started` alone."""

    class Broken(SimKernel):
        async def write(self, path: str, value: str, timeout: float) -> None:
            if path.endswith("/driver_override") and value == "vfio-pci":
                raise RuntimeError("the seam broke")
            await super().write(path, value, timeout)

    sim = Broken(host)
    async with simulated_switch(host, sim=sim) as (w, _s, _e, events):
        with pytest.raises(SwitchFailed, match="RuntimeError: the seam broke"):
            await w.switch(NV, "vfio", timeout=5)
        assert tree_driver(sim, NV) == "nvidia"  # nvidia loaded again, the card back on it
        assert not w.engine.busy
    kinds = [e.type for e in events if getattr(e, "type", "").startswith("switch-")]  # type: ignore[attr-defined]
    assert kinds == ["switch-started", "switch-failed"]
    # The override it was writing is cleared first (the seam may have written it), so that
    # reloading nvidia can bind the card again.
    assert of_type(events, "switch-failed")[0].restored[:2] == [
        f"write '\\n' to /sys/bus/pci/devices/{NV}/driver_override", "modprobe nvidia"]


# --------------------------------------------------------------------------- already there


@pytest.mark.parametrize("named", ["nvgrace_gpu_vfio_pci", "nvgrace-gpu-vfio-pci"])
async def test_vfio_driver_naming_the_driver_already_bound_needs_nothing(
        tmp_path: Path, named: str) -> None:
    """"Already in mode: no write, no privilege": with `--vfio-driver` naming the driver the
    card is on, too. Naming another one still needs root."""
    host = grace_hopper_host(tmp_path)
    async with simulated_switch(host, euid=1000) as (w, sim, _e, events):
        result = await w.switch(GH_ADDR, "vfio", timeout=5, vfio_driver=named)
        assert not result.changed and "already in mode vfio" in result.notes[0]
        with pytest.raises(NotPrivileged):
            await w.switch(GH_ADDR, "vfio", timeout=5, vfio_driver="vfio-pci")
        assert sim.record == [] and not events


def test_mode_with_the_bound_vfio_driver_needs_no_root(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    host = grace_hopper_host(tmp_path)
    sim = SimKernel(host)
    monkeypatch.setattr(hostops, "backend_factory",
                        lambda root: Backend(sim, sim.new_source(), lambda: 1000))
    code = main(["mode", "vfio", "--addr", GH_ADDR, "--vfio-driver", "nvgrace_gpu_vfio_pci",
                 "--root", str(host.root)])
    out, err = capsys.readouterr()
    assert (code, err) == (0, ""), err
    assert "already vfio" in out and sim.record == []

