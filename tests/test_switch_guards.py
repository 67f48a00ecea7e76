"""Plan and switch guards: no invented plans, the vendor guard, poison first, kernel users
counted the way the kernel counts them, the host left as found, bounded /proc reads, one
line per refusal, finite timeouts. Every host write goes to the simulated kernel."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import simulated_cli

import gpuwatch
from gpuwatch.errors import DeviceNotFound, GroupPoisoned, SwitchRefused
from gpuwatch.hostfs.procfs import nvidia_holders, read_each
from gpuwatch.switch.poison import PoisonEntry, PoisonStore
from gpuwatch.testing import SysRoot
from gpuwatch.testing.machines import instinct_host, single_gpu_desktop
from gpuwatch.testing.simkernel import SimKernel, simulated_switch

NV, AUDIO = "0000:01:00.0", "0000:01:00.1"
Run = Callable[..., tuple[int, str, str]]


runner = simulated_cli


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def intel_arc_host(root: Path) -> SysRoot:
    """A workstation with an Intel Arc A770 (i915) and its audio in group 16."""
    s = SysRoot(root)
    s.add_bridge("0000:00:01.0", iommu_group=2)
    s.add_function("0000:03:00.0", parent="0000:00:01.0", vendor="0x8086", device="0x56a0",
                   driver="i915", iommu_group=16, subsystem_vendor="0x8086")
    s.add_function("0000:04:00.0", parent="0000:00:01.0", vendor="0x8086", device="0x4f90",
                   klass="0x040300", driver="snd_hda_intel", iommu_group=16)
    s.add_function("0000:00:02.0", vendor="0x8086", device="0xa780", driver="i915",
                   iommu_group=0)
    s.set_attr("0000:00:02.0", "boot_vga", "1\n")
    s.add_iommu_unit("dmar0")
    return s


def poison(s: SysRoot, group: int) -> None:
    PoisonStore(str(s.root)).add(group, PoisonEntry(
        addr=NV, to_mode="vfio", error="write '0000:01:00.0' to /sys/bus/pci/drivers/nvidia/"
        "unbind did not return within 30s: the device is wedged", time="2026-12-03T04:00:00Z"))


# --------------------------------------------------------------------------- no invented plans


def test_plan_probe_for_an_absent_function_is_not_found(host: SysRoot,
                                                        capsys: pytest.CaptureFixture[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    run, _ = runner(host, monkeypatch, capsys)
    code, out, err = run("probe", "plan", "--mode", "vfio", "--addr", "0000:42:00.0")
    assert (code, out) == (1, "") and "no PCI function" in one_line(err)
    code, out, err = run("probe", "plan", "--mode", "nvidia", "--vendor", "0x1002")
    assert (code, out) == (1, "") and "no card of vendor 0x1002" in one_line(err)
    with pytest.raises(DeviceNotFound):
        gpuwatch.scan(host.root).probe("plan", mode="vfio", addr="0000:42:00.0")
    code, out, err = run("plan", "--example")  # no mode: the example's way out, to vfio
    assert code == 0 and "[example card]" in out.splitlines()[0]


async def test_daemon_plan_for_an_absent_card_is_not_found(host: SysRoot) -> None:
    async with simulated_switch(host) as (w, _sim, engine, _ev):
        with pytest.raises(DeviceNotFound):
            await engine.plan("0000:42:00.0", "vfio")
        with pytest.raises(DeviceNotFound):
            await engine.plan("0x1002", "nvidia")
        assert w.model.state.functions  # the model itself is untouched


# --------------------------------------------------------------------------- vendor guard


@pytest.mark.parametrize("kind", ["amd", "intel"])
def test_nvidia_mode_plan_and_recover_refuse_other_vendors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        kind: str) -> None:
    if kind == "amd":
        s, card = instinct_host(tmp_path / "h", cards=1), "0000:11:00.0"
    else:
        s, card = intel_arc_host(tmp_path / "h"), "0000:03:00.0"
    s.bind(card, "vfio-pci")  # from vfio, `mode nvidia` would have work to do
    run, sim = runner(s, monkeypatch, capsys)
    for argv in (("mode", "nvidia", "--addr", card), ("recover", "--addr", card)):
        code, out, err = run(*argv, "--no-daemon")
        assert (code, out) == (1, ""), argv
        assert "is not an NVIDIA card" in one_line(err)
    code, out, err = run("plan", "nvidia", "--addr", card, "--json", "--no-daemon")
    assert code == 1 and "not an NVIDIA card" in json.loads(out)["refused"]["reason"]
    assert json.loads(out)["steps"] == []
    assert sim.record == []  # nothing written, nothing run
    # Non-root gets the same refusal, not "needs root".
    run_user, _ = runner(s, monkeypatch, capsys, euid=1000, sim=sim)
    code, _, err = run_user("mode", "nvidia", "--addr", card, "--no-daemon")
    assert code == 1 and "not an NVIDIA card" in err


async def test_engine_vendor_guard_and_vfio_for_any_vendor(tmp_path: Path) -> None:
    s = instinct_host(tmp_path / "h", cards=1)
    card = "0000:11:00.0"
    async with simulated_switch(s) as (_w, sim, engine, events):
        with pytest.raises(SwitchRefused, match="not an NVIDIA card"):
            await engine.switch(card, "nvidia", timeout=10)
        with pytest.raises(SwitchRefused, match="not an NVIDIA card"):
            await engine.recover(card, timeout=10)
        assert sim.record == []
        assert len([e for e in events if getattr(e, "type", "") == "switch-refused"]) == 2
        result = await engine.switch(card, "vfio", timeout=10)  # any vendor may go to vfio
        assert result.changed and {m.driver for m in result.members} == {"vfio-pci"}


# --------------------------------------------------------------------------- poison wins


def test_poisoned_group_already_in_mode_is_refused(host: SysRoot,
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    poison(host, 13)
    run, sim = runner(host, monkeypatch, capsys)
    code, out, err = run("mode", "nvidia", "--no-daemon")  # the group IS on nvidia
    assert (code, out) == (1, "") and "poisoned" in one_line(err)
    code, _, err = run("mode", "vfio", "--no-daemon")
    assert code == 1 and "poisoned" in one_line(err)
    code, out, _ = run("plan", "nvidia", "--json", "--no-daemon")
    assert code == 1 and "poisoned" in json.loads(out)["refused"]["reason"]
    assert sim.record == []


async def test_engine_poison_wins_over_already_in_mode(host: SysRoot) -> None:
    poison(host, 13)
    async with simulated_switch(host) as (_w, sim, engine, events):
        with pytest.raises(GroupPoisoned):
            await engine.switch(NV, "nvidia", timeout=10)
        plan = await engine.plan(NV, "nvidia")
        assert "poisoned" in plan["refused"]["reason"] and plan["steps"] == []
        assert sim.record == []
        refused = [e for e in events if getattr(e, "type", "") == "switch-refused"]
        assert len(refused) == 1 and "poisoned" in refused[0].reason  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- kernel users


async def test_single_gpu_host_with_persistenced_switches_to_vfio(tmp_path: Path) -> None:
    s = single_gpu_desktop(tmp_path / "h", boot_vga=False)
    sim = SimKernel(s)
    sim.start_persistenced(777)  # /dev/nvidiactl and /dev/nvidia0: refcnt 2 (modules) + 2
    assert (s.root / "sys/module/nvidia/refcnt").read_text() == "4\n"
    async with simulated_switch(s, sim=sim) as (_w, _sim, engine, _ev):
        plan = await engine.plan(NV, "vfio")
        assert plan["refused"] is None
        assert plan["steps"][0] == {"kind": "command",
                                    "argv": ["systemctl", "stop", "nvidia-persistenced"],
                                    "on_error": "warn"}
        result = await engine.switch(NV, "vfio", timeout=20)
    assert result.changed
    assert sim.commands[0] == ("systemctl", "stop", "nvidia-persistenced")
    assert ("modprobe", "-r", "nvidia") in sim.commands


async def test_a_real_kernel_user_still_refuses(tmp_path: Path) -> None:
    s = single_gpu_desktop(tmp_path / "h", boot_vga=False)
    sim = SimKernel(s)
    sim.start_persistenced(777)
    refcnt = s.root / "sys/module/nvidia/refcnt"
    refcnt.write_text("5\n")  # one reference more than modules and persistenced's files
    async with simulated_switch(s, sim=sim) as (_w, _sim, engine, _ev):
        with pytest.raises(SwitchRefused, match="kernel user"):
            await engine.switch(NV, "vfio", timeout=20)
    assert sim.record == []  # refused by the plan: persistenced was not even stopped


async def test_a_card_with_virtual_functions_enabled_is_refused_until_they_are_off(
        tmp_path: Path) -> None:
    """Unbinding a physical function's driver disables SR-IOV: its VFs would vanish under
    whatever uses them. Refused, nothing run; once they are off, the same switch goes."""
    s = single_gpu_desktop(tmp_path / "h", boot_vga=False)
    s.enable_sriov(NV, 16, offset=4)  # VFs from 01:00.4, clear of the audio function
    vfs = s.add_vfs(NV, 2, driver="nvidia", first_group=40)
    sim = SimKernel(s)
    async with simulated_switch(s, sim=sim) as (_w, _sim, engine, _ev):
        with pytest.raises(SwitchRefused, match=f"{NV} has 2 SR-IOV virtual function"):
            await engine.switch(NV, "vfio", timeout=20)
    assert sim.record == []
    assert vfs[0] in (s.root / f"sys/bus/pci/devices/{NV}/virtfn0").resolve().name
    for vf in vfs:
        s.remove_function(vf)  # what writing 0 to sriov_numvfs makes the kernel do
    async with simulated_switch(s, sim=sim) as (_w, _sim, engine, _ev):
        result = await engine.switch(NV, "vfio", timeout=20)
    assert result.changed


async def test_vfs_a_copy_kept_without_the_pf_s_virtfn_links_still_refuse_the_switch(
        tmp_path: Path) -> None:
    """A copy that dropped the PF's ``virtfnN`` links but kept the VFs with their ``physfn``
    read ``numvfs`` 0: the switch went ahead and would have unbound the PF under its VFs."""
    s = single_gpu_desktop(tmp_path / "h", boot_vga=False)
    s.enable_sriov(NV, 16, offset=4)
    vfs = s.add_vfs(NV, 2, driver="nvidia", first_group=40)
    for i in range(2):
        (s.device_dir(NV) / f"virtfn{i}").unlink()
    sim = SimKernel(s)
    async with simulated_switch(s, sim=sim) as (_w, _sim, engine, _ev):
        with pytest.raises(SwitchRefused,
                           match=f"{NV} has 2 SR-IOV virtual function.*{vfs[0]}, {vfs[1]}"):
            await engine.switch(NV, "vfio", timeout=20)
    assert sim.record == []


# --------------------------------------------------------------------------- host left as found


async def test_failed_unload_restarts_persistenced_and_reloads_modules(tmp_path: Path) -> None:
    s = single_gpu_desktop(tmp_path / "h", boot_vga=False)

    class BusyNvidia(SimKernel):
        async def run(self, argv: Any, timeout: float) -> Any:
            if list(argv) == ["modprobe", "-r", "nvidia"]:
                self._set_refcnt("nvidia", 1)  # a kernel user appears meanwhile
            return await super().run(argv, timeout)

    sim = BusyNvidia(s)
    sim.start_persistenced(777)
    async with simulated_switch(s, sim=sim) as (w, _sim, engine, events):
        with pytest.raises(SwitchRefused) as info:
            await engine.switch(NV, "vfio", timeout=20)
        assert [m.driver for m in w.model.state.group_members(NV)] == ["nvidia",
                                                                       "snd_hda_intel"]
    restore = sim.commands[sim.commands.index(("modprobe", "-r", "nvidia")) + 1:]
    assert restore == [("modprobe", "nvidia_uvm"), ("modprobe", "nvidia_modeset"),
                       ("modprobe", "nvidia_drm"), ("systemctl", "start", "nvidia-persistenced")]
    assert info.value.restored == tuple(" ".join(a) for a in restore)
    assert "systemctl start nvidia-persistenced" in str(info.value)
    refused = [e for e in events if getattr(e, "type", "") == "switch-refused"]
    assert len(refused) == 1 and refused[0].restored == list(info.value.restored)  # type: ignore[attr-defined]
    for name in ("nvidia_drm", "nvidia_modeset", "nvidia_uvm"):
        assert (s.root / "sys/module" / name).is_dir()
    assert any("nvidia-persist" in (s.root / "proc" / p / "comm").read_text()
               for p in os.listdir(s.root / "proc") if p.isdigit())


async def test_a_refusal_before_anything_ran_restores_nothing(host: SysRoot) -> None:
    sim = SimKernel(host)
    sim.add_holder(4242, "python3", "/dev/nvidia0")
    async with simulated_switch(host, sim=sim) as (_w, _sim, engine, events):
        with pytest.raises(SwitchRefused) as info:
            await engine.switch(NV, "vfio", timeout=10)
    assert info.value.restored == () and sim.record == []
    refused = [e for e in events if getattr(e, "type", "") == "switch-refused"]
    assert refused[0].restored == []  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- bounded /proc reads


@pytest.fixture
def stuck_maps(host: SysRoot, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """Process 5150 whose ``maps`` read never returns, as when a task stuck in the kernel
    holds its mmap lock (a tmp dir cannot hold such a file: the read itself is made to
    wait); released at the end so the abandoned reader thread ends."""
    import threading

    from gpuwatch.hostfs import facts

    host.add_process(5150, "stuck-job", fds={3: "/dev/null"}, maps=["/usr/lib/libc.so.6"])
    release = threading.Event()
    real = facts.mapped_files

    def mapped_files(proc: str, pid: int,
                     within: Iterable[str] = ("/",)) -> Iterator[tuple[str, str]]:
        if pid == 5150:
            release.wait(60)
        return real(proc, pid, within)

    monkeypatch.setattr(facts, "mapped_files", mapped_files)
    yield 5150
    release.set()


def test_read_each_gives_up_on_a_stuck_read_and_goes_on() -> None:
    import threading

    release = threading.Event()

    def read(pid: int) -> int:
        if pid == 2:
            release.wait(30)
        return pid * 10

    started = time.monotonic()
    results, stuck = read_each([1, 2, 3, 4], read, deadline=0.4)
    release.set()
    assert time.monotonic() - started < 0.4 + 1
    assert results == {1: 10, 3: 30, 4: 40} and stuck == [2]


def test_holders_plan_and_mode_return_within_the_deadline(
        host: SysRoot, stuck_maps: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUWATCH_PROC_READ_TIMEOUT", "0.5")
    run, sim = runner(host, monkeypatch, capsys)
    for argv in (("holders", "--json"), ("plan", "vfio", "--json"), ("mode", "vfio", "--json")):
        started = time.monotonic()
        code, out, err = run(*argv, "--no-daemon")
        assert time.monotonic() - started < 0.5 + 1 + 1, argv  # deadline + 1 s (+ start-up)
        if argv[0] == "holders":
            assert code == 0
            held = json.loads(out)["holders"]
            assert {"pid": 5150, "comm": "stuck-job", "unreadable": True} in held
        elif argv[0] == "plan":
            plan = json.loads(out)
            assert code == 1 and {"pid": 5150, "comm": "stuck-job",
                                  "unreadable": True} in plan["refused"]["holders"]
        else:
            assert code == 1 and "stuck-job (pid 5150)" in one_line(err)
    code, out, _ = run("holders", "--no-daemon")  # the text form names it too
    assert code == 0
    assert "5150\tstuck-job\t(its open files could not be read: it may hold one)" in (
        out.splitlines())
    assert sim.record == []  # refused rather than guessed: nothing written


def test_nvidia_holders_probe_reports_the_unreadable(host: SysRoot,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from gpuwatch.hostfs import procfs

    host.add_process(5151, "cuda-app", fds={3: "/dev/nvidia0"})
    host.add_process(5152, "stuck-job", fds={3: "/dev/nvidia0"})
    release = threading.Event()
    real = procfs.open_files

    def open_files(proc: str, pid: int) -> Iterator[tuple[str, str]]:
        if pid == 5152:
            release.wait(60)  # listing its fds never returns
        return real(proc, pid)

    monkeypatch.setattr(procfs, "open_files", open_files)
    try:
        started = time.monotonic()
        found = nvidia_holders(str(host.root), deadline=0.4)
        assert time.monotonic() - started < 0.4 + 1
    finally:
        release.set()
    assert [h.model_dump() for h in found] == [
        {"pid": 5151, "comm": "cuda-app"},
        {"pid": 5152, "comm": "stuck-job", "unreadable": True},
    ]


# --------------------------------------------------------------------------- usage


@pytest.mark.parametrize("value", ["inf", "nan", "0", "-1", "-inf", "1e999"])
def test_timeout_must_be_finite_and_positive(host: SysRoot, value: str,
                                             capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    run, sim = runner(host, monkeypatch, capsys)
    for cmd in (("mode", "vfio"), ("recover",)):
        code, out, err = run(*cmd, "--timeout", value, "--no-daemon")
        assert (code, out) == (2, "") and "--timeout" in one_line(err), (cmd, value)
    assert sim.record == []


async def test_engine_rejects_an_infinite_timeout(host: SysRoot) -> None:
    from gpuwatch.errors import UsageError

    async with simulated_switch(host) as (_w, sim, engine, _ev):
        for value in (float("inf"), float("nan"), 0.0):
            with pytest.raises(UsageError):
                await engine.switch(NV, "vfio", timeout=value)
    assert sim.record == []


def test_each_refusal_is_printed_once(host: SysRoot, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    sim = SimKernel(host)
    sim.add_holder(4242, "python3", "/dev/nvidia0")
    run, _ = runner(host, monkeypatch, capsys, sim=sim)
    code, out, err = run("mode", "vfio", "--no-daemon")
    assert (code, out) == (1, "")
    assert "python3 (pid 4242) holds /dev/nvidia0" in one_line(err)


def test_a_process_stuck_in_the_kernel_costs_one_thread_not_one_per_scan() -> None:
    """A daemon's clients may ask for holders as often as they like; each scan used to leave
    one more thread blocked on the stuck process, for ever. While one is blocked there, the
    process is unreadable at once; once its read returns, it is read again."""
    import threading

    release = threading.Event()
    waiting: list[int] = []  # one entry per read blocked now

    def read(pid: int) -> int:
        if pid == 424242:
            waiting.append(pid)
            release.wait(60)
            waiting.remove(pid)
        return pid

    def readers() -> int:
        return sum(t.name == "gpuwatch /proc read" and t.is_alive()
                   for t in threading.enumerate())

    try:
        for _ in range(30):
            results, stuck = read_each([1, 424242, 3], read, deadline=0.2, scope="/a/proc")
            assert results == {1: 1, 3: 3} and stuck == [424242]
        assert len(waiting) == 1
        # The same pid under another /proc (another tree) is another process: read it.
        results, stuck = read_each([424242], lambda pid: pid * 2, deadline=5, scope="/b/proc")
        assert results == {424242: 848484} and stuck == []
    finally:
        release.set()
    deadline = time.monotonic() + 30  # the abandoned read returns when it returns
    while readers() and time.monotonic() < deadline:
        time.sleep(0.01)
    results, stuck = read_each([1, 424242, 3], read, deadline=5, scope="/a/proc")
    assert results == {1: 1, 424242: 424242, 3: 3} and stuck == []


@pytest.mark.parametrize("others_grouped", [True, False])
def test_a_card_without_a_group_is_refused_for_what_the_host_shows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], others_grouped: bool) -> None:
    """No group for the card: on a host with no IOMMU group at all the IOMMU is off (say how
    to turn it on); where other functions have groups it is on, and the card is its exception
    or the tree lost the card's link (a capture): telling the operator to turn it on would be
    wrong."""
    s = SysRoot(tmp_path / "h")
    s.add_function(NV, klass="0x030000", driver="nvidia", iommu_group=None)
    s.add_function("0000:02:00.0", vendor="0x8086", device="0x1533", klass="0x020000",
                   driver="igb", iommu_group=7 if others_grouped else None)
    s.add_module("nvidia")
    run, kernel = runner(s, monkeypatch, capsys)
    code, out, err = run("mode", "vfio", "--addr", NV)
    assert (code, out, kernel.record) == (1, "", [])
    line = one_line(err)
    assert line.startswith(f"gpuwatch: {NV} has no IOMMU group")
    if others_grouped:
        assert "though this host has IOMMU groups" in line and "intel_iommu=on" not in line
    else:
        assert "vfio-pci needs the IOMMU (intel_iommu=on" in line
