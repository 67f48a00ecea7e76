"""Issue 15's switch: vfio-pci variants, the modules.alias driver choice, --vfio-driver, and
refusing a wedged or failed group — through the library, the CLI and the socket."""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import pytest
from cli_helpers import run_cli

import gpuwatch
from gpuwatch.core.events import format_event_time
from gpuwatch.core.health import RECOVERY_STALE_AFTER
from gpuwatch.core.modalias import VfioAlias, best_vfio_alias, parse_vfio_aliases
from gpuwatch.core.modes import group_mode, is_vfio_driver, same_driver
from gpuwatch.core.observations import PciErrorSeen
from gpuwatch.core.plan import HostFacts, unhealthy_reason
from gpuwatch.errors import SwitchFailed, SwitchRefused, UsageError
from gpuwatch.hostfs.facts import RecoveryFacts, recovery_facts
from gpuwatch.service.server import SocketServer
from gpuwatch.service.testing import short_socket_dir
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.testing.modern import GH_ADDR, MODULES_ALIAS, grace_hopper_host
from gpuwatch.testing.simkernel import SimKernel, simulated_switch

GH_MODALIAS = "pci:v000010DEd00002342sv000010DEsd000016EBbc03sc02i00"
NV, AUDIO = "0000:01:00.0", "0000:01:00.1"
CARD1 = "/devices/pci0000:00/0000:00:01.0/0000:01:00.0/drm/card1"


# --------------------------------------------------------------------------- pure rules


def test_driver_names_compare_with_dash_and_underscore_equal() -> None:
    assert same_driver("vfio-pci", "vfio_pci")
    assert same_driver("snd-hda-intel", "snd_hda_intel")
    assert not same_driver("vfio-pci", "vfio-pci-core")
    for name in ("vfio-pci", "vfio_pci", "nvgrace_gpu_vfio_pci", "mlx5-vfio-pci"):
        assert is_vfio_driver(name)
    for name in ("nvidia", "vfio", "vfio_pci_core", "xvfio_pci", ""):
        assert not is_vfio_driver(name)
    assert is_vfio_driver("acme-passthru", frozenset({"acme_passthru"}))


def test_most_specific_alias_wins_and_the_generic_loses() -> None:
    aliases = parse_vfio_aliases(MODULES_ALIAS.splitlines())
    assert all(a.pattern.startswith("vfio_pci:") for a in aliases)
    assert len(aliases) == 7  # the pci: lines are not vfio_pci aliases
    best = best_vfio_alias(aliases, GH_MODALIAS)
    assert best == VfioAlias("vfio_pci:v000010DEd00002342sv*sd*bc*sc*i*", "nvgrace_gpu_vfio_pci")
    rtx = best_vfio_alias(aliases, "pci:v000010DEd00002204sv00001458sd0000403Bbc03sc00i00")
    assert rtx is not None and rtx.module == "vfio_pci"
    assert best_vfio_alias(parse_vfio_aliases(["alias pci:v* foo"]), GH_MODALIAS) is None
    assert best_vfio_alias(aliases, "") is None


def test_class_alias_loses_to_device_alias_whatever_the_order() -> None:
    lines = [
        "alias vfio_pci:v000010DEd*sv*sd*bc03sc02i* acme_class_vfio_pci",
        "alias vfio_pci:v000010DEd00002342sv*sd*bc*sc*i* nvgrace_gpu_vfio_pci",
        "alias vfio_pci:v*d*sv*sd*bc*sc*i* vfio_pci",
        "garbage line with vfio_pci: in it",
        "alias vfio_pci:" + "x" * 1000 + " toolong",
    ]
    for order in (lines, list(reversed(lines))):
        best = best_vfio_alias(parse_vfio_aliases(order), GH_MODALIAS)
        assert best is not None and best.module == "nvgrace_gpu_vfio_pci"


def test_group_mode_accepts_variants_and_vfio_dev() -> None:
    fn = gpuwatch.PciFunction(addr=GH_ADDR, vendor_id="0x10de", device_id="0x2342",
                              class_="0x0302", class_label="3D", driver="nvgrace_gpu_vfio_pci",
                              iommu_group=19)
    assert group_mode([fn]) == "vfio"
    assert group_mode([fn.model_copy(update={"driver": "acme"})]) == "host driver"
    assert group_mode([fn.model_copy(update={"driver": "acme"})], frozenset({"acme"})) == "vfio"
    vgpu_vf = fn.model_copy(update={"driver": "nvidia", "vfio_dev": "vfio4"})
    assert group_mode([vgpu_vf]) == "vfio"


# --------------------------------------------------------------------------- plans


def test_plan_picks_the_variant_from_modules_alias(tmp_path: Path) -> None:
    host = grace_hopper_host(tmp_path, bound=False)
    host.remove_module("nvgrace_gpu_vfio_pci")
    plan = gpuwatch.scan(tmp_path).plan("vfio", addr=GH_ADDR)
    assert {"kind": "command", "argv": ["modprobe", "nvgrace_gpu_vfio_pci"],
            "on_error": "fail"} in plan
    override = f"/sys/bus/pci/devices/{GH_ADDR}/driver_override"
    assert {"kind": "write", "path": override, "value": "nvgrace_gpu_vfio_pci"} in plan


def test_plan_members_carry_target_and_alias_through_the_cli(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    grace_hopper_host(tmp_path, bound=False)
    code, out, err = anyio.run(run_cli, capsys, "plan", "vfio", "--addr", GH_ADDR, "--json",
                               "--root", str(tmp_path), "--no-daemon")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["members"] == [{"addr": GH_ADDR, "driver": "nvidia",
                                "target": "nvgrace_gpu_vfio_pci",
                                "alias": "vfio_pci:v000010DEd00002342sv*sd*bc*sc*i*"}]
    code, out, _ = anyio.run(run_cli, capsys, "plan", "vfio", "--addr", GH_ADDR,
                             "--root", str(tmp_path), "--no-daemon")
    assert "nvgrace_gpu_vfio_pci (modules.alias vfio_pci:v000010DEd00002342" in out


def test_vfio_driver_overrides_and_spells_the_kernel_name(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    grace_hopper_host(tmp_path, bound=False)
    code, out, err = anyio.run(run_cli, capsys, "plan", "vfio", "--addr", GH_ADDR, "--json",
                               "--vfio-driver", "vfio_pci", "--root", str(tmp_path),
                               "--no-daemon")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["members"][0]["target"] == "vfio-pci"  # the driver's name, not the module's
    assert plan["members"][0]["alias"] == ""
    assert {"kind": "write", "path": f"/sys/bus/pci/devices/{GH_ADDR}/driver_override",
            "value": "vfio-pci"} in plan["steps"]


@pytest.mark.parametrize("argv", [
    ["plan", "vfio", "--vfio-driver", "nvidia"],
    ["plan", "nvidia", "--vfio-driver", "vfio-pci"],
    ["plan", "vfio", "--vfio-driver", "../x_vfio_pci"],
    ["mode", "--vfio-driver", "vfio-pci"],
])
def test_bad_vfio_driver_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    grace_hopper_host(tmp_path, bound=False)
    code, _, err = anyio.run(run_cli, capsys, *argv, "--addr", GH_ADDR, "--root",
                             str(tmp_path), "--no-daemon")
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_no_modules_alias_means_vfio_pci(tmp_path: Path) -> None:
    host = grace_hopper_host(tmp_path, bound=False)
    (host.root / "proc/sys/kernel/osrelease").write_text("6.99.0-other\n")
    plan = gpuwatch.scan(tmp_path).plan("vfio", addr=GH_ADDR)
    assert {"kind": "write", "path": f"/sys/bus/pci/devices/{GH_ADDR}/driver_override",
            "value": "vfio-pci"} in plan


def test_generic_alias_chooses_vfio_pci_and_is_named(tmp_path: Path) -> None:
    host = example_gpu_host(tmp_path)
    host.add_modules_alias("6.8.0-45-generic", MODULES_ALIAS)
    model = gpuwatch.scan(tmp_path)
    from gpuwatch.model import plan_for_host

    plan = plan_for_host(model, "vfio", addr=NV, euid=0).to_json()
    assert [(m["target"], m["alias"]) for m in plan["members"]] == [
        ("vfio-pci", "vfio_pci:v*d*sv*sd*bc*sc*i*")] * 2


def test_already_on_a_variant_is_in_mode(tmp_path: Path) -> None:
    grace_hopper_host(tmp_path)
    model = gpuwatch.scan(tmp_path)
    from gpuwatch.model import plan_for_host

    plan = plan_for_host(model, "vfio", addr=GH_ADDR, euid=0)
    assert plan.steps == () and "already in mode vfio" in plan.notes[-1]
    explicit = plan_for_host(model, "vfio", addr=GH_ADDR, euid=0, vfio_driver="vfio-pci")
    assert [s.value for s in explicit.steps if getattr(s, "path", "").endswith("unbind")] == [
        GH_ADDR]


# --------------------------------------------------------------------------- switching


async def test_switch_to_vfio_binds_the_variant_and_verifies(tmp_path: Path) -> None:
    host = grace_hopper_host(tmp_path, bound=False)
    async with simulated_switch(host) as (w, sim, _engine, events):
        result = await w.switch(GH_ADDR, "vfio", timeout=10)
        assert result.changed
        assert [m.driver for m in result.members] == ["nvgrace_gpu_vfio_pci"]
        assert ("write", f"/sys/bus/pci/devices/{GH_ADDR}/driver_override",
                "nvgrace_gpu_vfio_pci") in sim.record
        with anyio.fail_after(5):
            while w.probe("vfio-backend", addr=GH_ADDR).recommended != "iommufd":
                await anyio.sleep(0.01)
        fn = w.model.function(GH_ADDR)
        assert fn.vfio_dev and fn.vfio_cdev.startswith("/dev/vfio/devices/vfio")
        assert w.probe("group-in-mode", addr=GH_ADDR, mode="vfio") is True
        # ... and back: the variant is unbound by its own name.
        await w.switch(GH_ADDR, "nvidia", timeout=10)
        assert ("write", "/sys/bus/pci/drivers/nvgrace_gpu_vfio_pci/unbind", GH_ADDR) in \
            sim.record
        assert w.model.function(GH_ADDR).vfio_dev == ""
    assert [e.type for e in events if e.type.startswith("switch-")] == [  # type: ignore[attr-defined]
        "switch-started", "switch-completed", "switch-started", "switch-completed"]


async def test_switch_on_a_kernel_without_the_cdev(tmp_path: Path) -> None:
    host = grace_hopper_host(tmp_path, bound=False)
    sim = SimKernel(host)
    sim.vfio_cdev = False
    async with simulated_switch(host, sim=sim) as (w, _sim, _engine, _events):
        await w.switch(GH_ADDR, "vfio", timeout=10)
        backend = w.probe("vfio-backend", addr=GH_ADDR)
        assert (backend.cdev_node, backend.recommended) == ("", "group")
        assert w.model.function(GH_ADDR).vfio_dev.startswith("vfio")


async def test_wedged_or_failed_group_is_refused(host: SysRoot) -> None:
    async with simulated_switch(host) as (w, sim, _engine, events):
        w.source.push(host.uevent_props("change", CARD1, WEDGED="bus-reset"))
        with anyio.fail_after(5):
            while w.model.function(NV).health != "wedged":
                await anyio.sleep(0.01)
        with pytest.raises(SwitchRefused, match=r"wedged.*reset it"):
            await w.switch(NV, "vfio", timeout=5)
        with pytest.raises(SwitchRefused, match="wedged"):  # even when already in mode
            await w.switch(NV, "nvidia", timeout=5)
        plan = await w.plan(NV, "vfio")
        assert plan["refused"] is not None and "bus-reset" not in plan["refused"]["reason"]
        assert "/reset" in plan["refused"]["reason"]
        assert not sim.writes
        refused = [e for e in events if e.type == "switch-refused"]  # type: ignore[attr-defined]
        assert len(refused) == 2


async def test_a_wedge_its_driver_recovered_refuses_nothing(host: SysRoot) -> None:
    """``WEDGED=none`` (the driver reset the GPU and it works again) asks for no recovery:
    the switch goes ahead, as it would without the uevent."""
    async with simulated_switch(host) as (w, _sim, _engine, events):
        w.source.push(host.uevent_props("change", CARD1, WEDGED="none"))
        with anyio.fail_after(5):
            while not any(e.type == "gpu-wedged" for e in events):  # type: ignore[attr-defined]
                await anyio.sleep(0.01)
        plan = await w.plan(NV, "vfio")
        assert plan["refused"] is None
        await w.switch(NV, "vfio", timeout=10)
        assert w.model.function(NV).driver == "vfio-pci"


async def test_failed_recovery_refuses_until_successful(host: SysRoot) -> None:
    async with simulated_switch(host) as (w, _sim, _engine, _events):
        w.source.push(host.uevent_props("change", NV, ERROR_EVENT="FAILED_RECOVERY"))
        with anyio.fail_after(5):
            while w.model.function(NV).health != "failed":
                await anyio.sleep(0.01)
        with pytest.raises(SwitchRefused, match="PCI error recovery failed"):
            await w.switch(NV, "vfio", timeout=5)
        w.source.push(host.uevent_props("change", NV, ERROR_EVENT="SUCCESSFUL_RECOVERY",
                                        DEVICE_ONLINE="1"))
        with anyio.fail_after(5):
            while w.model.function(NV).health != "ok":
                await anyio.sleep(0.01)
        result = await w.switch(NV, "vfio", timeout=10)
        assert result.changed


async def test_vfio_driver_through_the_socket(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host = grace_hopper_host(tmp_path, bound=False)
    root = str(host.root)
    with short_socket_dir() as sockdir:
        async with (
            simulated_switch(host) as (watcher, sim, _engine, _events),
            anyio.create_task_group() as tg,
        ):
            server = SocketServer(watcher, f"{sockdir}/gw.sock")
            await tg.start(server.serve)
            sock = ["--root", root, "--socket", f"{sockdir}/gw.sock"]
            code, out, err = await run_cli(capsys, "plan", "vfio", "--addr", GH_ADDR, "--json",
                                           "--vfio-driver", "vfio-pci", *sock)
            assert code == 0, err
            assert json.loads(out)["members"][0]["target"] == "vfio-pci"
            code, out, err = await run_cli(capsys, "plan", "vfio", "--addr", GH_ADDR, "--json",
                                           *sock)
            assert json.loads(out)["members"][0]["target"] == "nvgrace_gpu_vfio_pci"
            code, _, err = await run_cli(capsys, "plan", "vfio", "--addr", GH_ADDR,
                                         "--vfio-driver", "nvidia", *sock)
            assert code == 2 and "vfio-pci variant" in err
            code, out, err = await run_cli(capsys, "mode", "vfio", "--addr", GH_ADDR, "--json",
                                           "--vfio-driver", "vfio-pci", *sock)
            assert code == 0, err
            assert [m["driver"] for m in json.loads(out)["members"]] == ["vfio-pci"]
            assert ("write", f"/sys/bus/pci/devices/{GH_ADDR}/driver_override", "vfio-pci") \
                in sim.record
            code, out, err = await run_cli(capsys, "probe", "vfio-backend", "--addr", GH_ADDR,
                                           *sock)
            assert code == 0, err
            assert json.loads(out)["result"]["on_vfio"] is True
            tg.cancel_scope.cancel()


def test_usage_error_for_vfio_driver_in_library(tmp_path: Path) -> None:
    grace_hopper_host(tmp_path, bound=False)
    with pytest.raises(UsageError):
        gpuwatch.scan(tmp_path).plan("nvidia", addr=GH_ADDR, vfio_driver="vfio-pci")


@pytest.mark.parametrize("kind", ["fifo", "garbage", "release-escape", "huge-line"])
def test_hostile_modules_alias_never_blocks_or_crashes(tmp_path: Path, kind: str) -> None:
    import os

    host = grace_hopper_host(tmp_path, bound=False)
    alias = host.root / "lib/modules/6.8.0-1013-nvidia-64k/modules.alias"
    if kind == "fifo":
        alias.unlink()
        os.mkfifo(alias)  # opening it for reading would wait for a writer forever
    elif kind == "garbage":
        alias.write_bytes(b"\xff\xfe\x00alias vfio_pci:\x00 \n" * 1000)
    elif kind == "release-escape":
        (host.root / "proc/sys/kernel/osrelease").write_text("../../../etc\n")
    else:
        alias.write_text("alias vfio_pci:" + "v*" * 100000 + " evil_vfio_pci\n")
    plan = gpuwatch.scan(tmp_path).plan("vfio", addr=GH_ADDR)
    assert {"kind": "write", "path": f"/sys/bus/pci/devices/{GH_ADDR}/driver_override",
            "value": "vfio-pci"} in plan


def test_an_unhealthy_refusal_names_recover_only_where_it_works() -> None:
    """`gpuwatch recover` acts on NVIDIA cards only (it refuses any other): the refusal of a
    wedged AMD card must not send the operator there."""
    from gpuwatch.core.plan import HostFacts, unhealthy_reason
    from gpuwatch.core.results import PciFunction

    def card(vendor: str, health: str) -> PciFunction:
        return PciFunction(addr="0000:03:00.0", vendor_id=vendor, device_id="0x744c",
                           class_="0x0300", class_label="VGA controller", driver="amdgpu",
                           iommu_group=5, health=health)

    facts = HostFacts(wedge_recovery={"0000:03:00.0": ("rebind",)})
    amd = unhealthy_reason([card("0x1002", "wedged")], facts)
    nvidia = unhealthy_reason([card("0x10de", "wedged")], facts)
    assert amd is not None and "rebind its driver" in amd and "gpuwatch recover" not in amd
    assert nvidia is not None and "`gpuwatch recover` rebinds it to vfio-pci" in nvidia
    stale = HostFacts(recovery_age={"0000:03:00.0": RECOVERY_STALE_AFTER})
    assert unhealthy_reason([card("0x1002", "recovering")], stale) is None


# --------------------------------------------------------------------------- recovering

ROOT_PORT = "0000:00:01.0"  # the bridge above the example card


async def begin_recovery(w: Any, host: SysRoot, *, ago: float | None = None) -> None:
    """The kernel began PCI error recovery of the card (``BEGIN_RECOVERY``); ``ago``: that
    was so many seconds before now (on the monotonic clock the model stamped it with)."""
    w.source.push(host.uevent_props("change", NV, ERROR_EVENT="BEGIN_RECOVERY",
                                    DEVICE_ONLINE="0"))
    with anyio.fail_after(5):
        while w.model.function(NV).health != "recovering":
            await anyio.sleep(0.01)
    if ago is not None:
        backdate(w, ago)


def backdate(w: Any, ago: float, addr: str = NV) -> None:
    """``addr``'s recovery began ``ago`` seconds before now, as its monotonic stamp says."""
    state = w.model.state
    mark = state.recovery_marks[addr]
    assert mark.at is not None  # stamped as it was applied
    state.recovery_marks[addr] = dataclasses.replace(mark, at=time.monotonic() - ago)


def wall_step(events: list[Any], addr: str, seconds: float) -> None:
    """The wall clock is stepped ``seconds`` forward (negative: back) after ``addr``'s last
    ``device-error`` was published: its time now reads that much further in the past."""
    event = next(e for e in reversed(events) if e.type == "device-error" and e.addr == addr)
    assert event.time  # published, so stamped with the wall clock
    when = datetime.strptime(event.time, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)
    event.__dict__["time"] = format_event_time(when - timedelta(seconds=seconds))


async def test_a_switch_waits_for_a_pci_error_recovery_under_way(host: SysRoot) -> None:
    """Rebinding a device the kernel is resetting can wedge the host: refused in either
    direction, in mode or not, `recover` too, with nothing written; once the recovery ends
    (``SUCCESSFUL_RECOVERY``) the switch runs."""
    async with simulated_switch(host) as (w, sim, _engine, events):
        await begin_recovery(w, host)
        for mode in ("vfio", "nvidia"):
            with pytest.raises(SwitchRefused, match=rf"{NV} is recovering: PCI error recovery "
                                                     r"began [0-9]+ s ago"):
                await w.switch(NV, mode, timeout=5)
        with pytest.raises(SwitchRefused, match="is recovering"):
            await w.recover(NV, timeout=5)
        assert (await w.engine.plan(NV, "vfio"))["refused"]["reason"].startswith(
            f"{NV} is recovering")
        assert sim.record == []
        assert [e.type for e in events if e.type.startswith("switch-")] == \
            ["switch-refused"] * 3
        w.source.push(host.uevent_props("change", NV, ERROR_EVENT="SUCCESSFUL_RECOVERY",
                                        DEVICE_ONLINE="1"))
        with anyio.fail_after(5):
            while w.model.function(NV).health != "ok":
                await anyio.sleep(0.01)
        assert (await w.switch(NV, "vfio", timeout=10)).changed


async def test_a_recovery_whose_end_was_lost_does_not_refuse_for_ever(host: SysRoot) -> None:
    """No end seen RECOVERY_STALE_AFTER seconds after it began: the last uevent was lost.
    The switch goes ahead and says so in its notes (and the plan's)."""
    async with simulated_switch(host) as (w, _sim, _engine, _events):
        await begin_recovery(w, host, ago=RECOVERY_STALE_AFTER - 30)
        with pytest.raises(SwitchRefused, match="is recovering"):
            await w.switch(NV, "vfio", timeout=5)
        backdate(w, RECOVERY_STALE_AFTER + 30)
        plan = await w.engine.plan(NV, "vfio")
        assert plan["refused"] is None and any("taken as over" in n for n in plan["notes"])
        result = await w.switch(NV, "vfio", timeout=10)
        assert result.changed
        assert any(f"{NV}: PCI error recovery began" in n and "taken as over" in n
                   for n in result.notes), result.notes


async def test_a_recovery_that_failed_at_the_bridge_refuses_the_card(host: SysRoot) -> None:
    """A failed recovery is reported on the bridge alone (the card stays "recovering" in the
    model): however old, the card is failed. `recover` (a rebind) is its way out."""
    async with simulated_switch(host) as (w, sim, _engine, _events):
        await begin_recovery(w, host, ago=RECOVERY_STALE_AFTER * 4)
        w.source.push(host.uevent_props("change", ROOT_PORT, ERROR_EVENT="FAILED_RECOVERY",
                                        DEVICE_ONLINE="0"))
        with anyio.fail_after(5):
            while w.model.function(ROOT_PORT).health != "failed":
                await anyio.sleep(0.01)
        with pytest.raises(SwitchRefused, match=rf"{NV} is failed: PCI error recovery failed "
                                                 rf"at bridge {ROOT_PORT}"):
            await w.switch(NV, "nvidia", timeout=5)
        assert sim.record == []
        result = await w.recover(NV, timeout=10)
        assert result.changed and w.model.function(NV).health == "ok"


async def test_a_wall_clock_step_forward_does_not_end_a_recovery_early(host: SysRoot) -> None:
    """NTP steps the wall clock 400 s forward just after BEGIN_RECOVERY: the event's time
    now reads 400 s old, but the recovery began a moment ago (the monotonic clock says so),
    so the switch still waits for it."""
    async with simulated_switch(host) as (w, sim, _engine, events):
        await begin_recovery(w, host)
        wall_step(events, NV, RECOVERY_STALE_AFTER + 100)
        with pytest.raises(SwitchRefused, match=rf"{NV} is recovering: PCI error recovery "
                                                 r"began [0-9] s ago"):
            await w.switch(NV, "vfio", timeout=5)
        assert (await w.engine.plan(NV, "vfio"))["refused"] is not None
        assert sim.record == []


async def test_a_wall_clock_step_back_does_not_hold_a_lost_recovery_for_ever(
        host: SysRoot) -> None:
    """The wall clock stepped back an hour during a recovery whose end was lost: the
    event's time reads as in the future, yet RECOVERY_STALE_AFTER seconds have passed on
    the monotonic clock, so the recovery is taken as over."""
    async with simulated_switch(host) as (w, _sim, _engine, events):
        await begin_recovery(w, host)
        wall_step(events, NV, -3600)
        state = w.model.state
        began = state.recovery_marks[NV].at
        assert began is not None
        state.clock = lambda: began + RECOVERY_STALE_AFTER + 30
        result = await w.switch(NV, "vfio", timeout=10)
        assert result.changed
        assert any(f"{NV}: PCI error recovery began {RECOVERY_STALE_AFTER + 30:.0f} s ago" in n
                   for n in result.notes), result.notes


async def test_an_old_bridge_failure_does_not_end_a_new_recovery(host: SysRoot) -> None:
    """The root port's recovery failed long ago (its health stays ``failed``); now a NEW
    recovery of the card begins. That old failure is not this recovery's outcome: `recover`
    and a switch wait for the new recovery like any other (not "failed", not let through),
    until its end or RECOVERY_STALE_AFTER."""
    async with simulated_switch(host) as (w, sim, _engine, _events):
        w.source.push(host.uevent_props("change", ROOT_PORT, ERROR_EVENT="FAILED_RECOVERY",
                                        DEVICE_ONLINE="0"))
        with anyio.fail_after(5):
            while w.model.function(ROOT_PORT).health != "failed":
                await anyio.sleep(0.01)
        await begin_recovery(w, host)
        with pytest.raises(SwitchRefused, match=rf"{NV} is recovering: PCI error recovery"):
            await w.recover(NV, timeout=5)
        with pytest.raises(SwitchRefused, match=rf"{NV} is recovering: PCI error recovery"):
            await w.switch(NV, "vfio", timeout=5)
        assert sim.record == []
        # Stale: taken as over, like any recovery whose end was lost (not "failed" for ever).
        backdate(w, RECOVERY_STALE_AFTER + 30)
        result = await w.switch(NV, "vfio", timeout=10)
        assert result.changed
        assert any("taken as over" in n for n in result.notes), result.notes


def test_only_a_bridge_failure_after_the_begin_counts(host: SysRoot) -> None:
    """The pure inputs: the bridge's FAILED_RECOVERY is the outcome of the card's recovery
    only when it came after the card's BEGIN_RECOVERY (by the order they were applied)."""
    state = gpuwatch.scan(host.root).state
    state.apply(PciErrorSeen(ROOT_PORT, "FAILED_RECOVERY", False))
    state.apply(PciErrorSeen(NV, "BEGIN_RECOVERY", False))
    assert recovery_facts(state, [NV]).failed_above == {}
    state.apply(PciErrorSeen(ROOT_PORT, "FAILED_RECOVERY", False))
    assert recovery_facts(state, [NV]).failed_above == {NV: ROOT_PORT}


def test_recovery_facts_read_the_age_and_the_failed_bridge(host: SysRoot) -> None:
    """The pure rule's inputs, from a model fed the uevents (no watcher, no clock but the
    one given)."""
    model = gpuwatch.scan(host.root)
    state = model.state
    state.clock = None  # a bare state: nothing stamps its recoveries
    state.apply(PciErrorSeen(NV, "BEGIN_RECOVERY", False))
    assert recovery_facts(state, [NV, AUDIO], 1000.0) == RecoveryFacts()  # no stamp: no age
    state.clock = lambda: 1000.0
    state.apply(PciErrorSeen(NV, "BEGIN_RECOVERY", False))
    assert recovery_facts(state, [NV, AUDIO], 1042.0) == RecoveryFacts(age={NV: 42.0})
    state.clock = lambda: 1100.0  # read when no `now` is given
    assert recovery_facts(state, [NV]).age == {NV: 100.0}
    state.apply(PciErrorSeen(ROOT_PORT, "FAILED_RECOVERY", False))
    assert recovery_facts(state, [NV], 1000.0).failed_above == {NV: ROOT_PORT}
    facts = HostFacts(recovery_age={NV: 42.0})
    fn = state.functions[NV]
    assert "began 42 s ago" in (unhealthy_reason([fn], facts) or "")
    assert unhealthy_reason([fn], HostFacts(recovery_age={NV: RECOVERY_STALE_AFTER})) is None
    assert unhealthy_reason([fn], HostFacts()) is not None  # unknown: taken as just begun
    # A SUCCESSFUL_RECOVERY ends it: nothing remembered.
    state.apply(PciErrorSeen(NV, "SUCCESSFUL_RECOVERY", True))
    assert NV not in state.recovery_marks and state.functions[NV].health == "ok"


async def test_a_recovery_of_the_bridge_above_holds_the_whole_group(host: SysRoot) -> None:
    """The root port above the card is being recovered (its BEGIN_RECOVERY came; the card's
    own driver may have no error handler, so no uevent of the card says so): the kernel is
    resetting the link below it, so the card's group waits too, and not for ever."""
    async with simulated_switch(host) as (w, sim, _engine, _events):
        w.source.push(host.uevent_props("change", ROOT_PORT, ERROR_EVENT="BEGIN_RECOVERY",
                                        DEVICE_ONLINE="0"))
        with anyio.fail_after(5):
            while w.model.function(ROOT_PORT).health != "recovering":
                await anyio.sleep(0.01)
        assert w.model.function(NV).health == "ok"
        with pytest.raises(SwitchRefused, match=rf"{NV} is behind bridge {ROOT_PORT}, whose PCI "
                                                 r"error recovery began [0-9]+ s ago"):
            await w.switch(NV, "vfio", timeout=5)
        with pytest.raises(SwitchRefused, match=f"behind bridge {ROOT_PORT}"):
            await w.recover(NV, timeout=5)
        assert sim.record == []
        backdate(w, RECOVERY_STALE_AFTER + 1, ROOT_PORT)
        result = await w.switch(NV, "vfio", timeout=10)
        assert result.changed
        assert any(n.startswith(f"{ROOT_PORT}: PCI error recovery began") for n in result.notes)


async def test_recover_rebinds_a_failed_card_already_on_vfio(host: SysRoot) -> None:
    """The card is on vfio-pci when its PCI error recovery fails: a switch is refused and
    names `gpuwatch recover`, so recover must rebind it (its recovery), not answer "already
    in mode" with nothing written and leave it failed, refused for ever."""
    async with simulated_switch(host) as (w, sim, _engine, _events):
        assert (await w.switch(NV, "vfio", timeout=10)).changed
        w.source.push(host.uevent_props("change", NV, ERROR_EVENT="FAILED_RECOVERY",
                                        DEVICE_ONLINE="0"))
        with anyio.fail_after(5):
            while w.model.function(NV).health != "failed":
                await anyio.sleep(0.01)
        with pytest.raises(SwitchRefused, match=r"is failed.*`gpuwatch recover` rebinds it"):
            await w.switch(NV, "nvidia", timeout=5)
        before = len(sim.record)
        result = await w.recover(NV, timeout=10)
        assert result.changed
        assert ("write", "/sys/bus/pci/drivers/vfio-pci/unbind", NV) in sim.record[before:]
        assert sim.overrides.get(NV, "") == ""  # the rebind's override cleared
        fn = w.model.function(NV)
        assert (fn.driver, fn.health) == ("vfio-pci", "ok")
        assert (await w.switch(NV, "nvidia", timeout=10)).changed


@pytest.mark.parametrize("lost", ["bind", "unbind and bind"])
async def test_recover_of_a_failed_card_whose_bind_event_was_lost(host: SysRoot,
                                                                  lost: str) -> None:
    """The rebind's uevents are lost: the tree shows the card back on vfio-pci, so the
    rebind happened and its health is cleared (recover does not wait out its timeout),
    even when the model never saw it leave vfio-pci (both its uevents lost)."""
    async with simulated_switch(host, tree_check_after=0.2) as (w, sim, _engine, _events):
        assert (await w.switch(NV, "vfio", timeout=10)).changed
        w.source.push(host.uevent_props("change", NV, ERROR_EVENT="FAILED_RECOVERY"))
        with anyio.fail_after(5):
            while w.model.function(NV).health != "failed":
                await anyio.sleep(0.01)
        sim.lose_bind_events = True
        sim.lose_unbind_events = lost == "unbind and bind"
        result = await w.recover(NV, timeout=30)
        assert result.changed and any("bind events were lost" in n for n in result.notes)
        assert w.model.function(NV).health == "ok"


def test_recover_plans_a_rebind_for_a_failed_function_on_its_target(host: SysRoot) -> None:
    """The pure plan: `recover` (recovering=True) rebinds a failed function on vfio-pci;
    a switch to vfio of a healthy group there has nothing to do."""
    from gpuwatch.core.plan import CLEAR_OVERRIDE, WriteStep, plan_switch

    model = gpuwatch.scan(host.root)
    members = [fn.model_copy(update={"driver": "vfio-pci"})
               for fn in model.state.group_members(NV)]
    assert plan_switch(members, "vfio", HostFacts()).steps == ()
    failed = [fn.model_copy(update={"health": "failed"}) if fn.addr == NV else fn
              for fn in members]
    plan = plan_switch(failed, "vfio", HostFacts(modules=frozenset({"vfio_pci"})),
                       recovering=True)
    assert plan.rebinds == (NV,) and plan.refusal is None
    override = f"/sys/bus/pci/devices/{NV}/driver_override"
    assert [(s.path, s.value) for s in plan.steps if isinstance(s, WriteStep)] == [
        ("/sys/bus/pci/drivers/vfio-pci/unbind", NV), (override, "vfio-pci"),
        ("/sys/bus/pci/drivers_probe", NV), (override, CLEAR_OVERRIDE)]
    assert len(plan.steps) == 4


async def test_an_interrupted_recover_does_not_rebind_again_to_roll_back(
        host: SysRoot) -> None:
    """recover's rebind of a failed card on vfio-pci is written, its uevents lost, and the
    recover is cancelled while it waits: the roll-back puts the drivers back (they are back
    already) and writes nothing more; a second recovery rebind is no roll-back."""
    async with simulated_switch(host, tree_check_after=60) as (w, sim, _engine, events):
        assert (await w.switch(NV, "vfio", timeout=10)).changed
        w.source.push(host.uevent_props("change", NV, ERROR_EVENT="FAILED_RECOVERY"))
        with anyio.fail_after(5):
            while w.model.function(NV).health != "failed":
                await anyio.sleep(0.01)
        sim.lose_bind_events = sim.lose_unbind_events = True
        clear = ("write", f"/sys/bus/pci/devices/{NV}/driver_override", "\n")
        before = len(sim.record)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lambda: w.recover(NV, timeout=120))
                # Returned, not just begun: the override is gone (a write cut off may not
                # have landed, and the roll-back would clear it again, rightly).
                while clear not in sim.record[before:] or NV in sim.overrides:
                    await anyio.sleep(0.01)
                done = len(sim.record)
                tg.cancel_scope.cancel()
        assert sim.record[done:] == []
        failed = [e for e in events if e.type == "switch-failed"]
        assert [e.error for e in failed] == ["interrupted"]  # type: ignore[attr-defined]


async def test_a_recovery_that_begins_during_a_switch_holds_its_next_step(
        host: SysRoot, caplog: pytest.LogCaptureFixture) -> None:
    """BEGIN_RECOVERY arrives while the switch runs its first step: no further step is
    written while the kernel resets the card; once the recovery ends, the switch goes on
    and says it waited."""
    caplog.set_level("INFO", logger="gpuwatch.switch")
    async with simulated_switch(host) as (w, sim, _engine, _events):
        sim.step_delay = 2.0  # the first step lasts long enough for the uevent to land
        results: list[Any] = []

        async def switch() -> None:
            results.append(await w.switch(NV, "vfio", timeout=60))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(switch)
                while not sim.record:
                    await anyio.sleep(0.01)
                await begin_recovery(w, host)
                sim.step_delay = 0.0
                while "waiting before" not in caplog.text:
                    await anyio.sleep(0.01)
                assert len(sim.record) == 1
                w.source.push(host.uevent_props("change", NV,
                                                ERROR_EVENT="SUCCESSFUL_RECOVERY",
                                                DEVICE_ONLINE="1"))
        assert results[0].changed
        assert any(n.startswith("a PCI error recovery began during the switch: waited")
                   for n in results[0].notes), results[0].notes
        assert {fn.driver for fn in w.model.state.group_members(NV)} == {"vfio-pci"}


async def test_a_recovery_during_a_switch_that_does_not_end_in_time_fails_it(
        host: SysRoot, caplog: pytest.LogCaptureFixture) -> None:
    """The recovery outlasts the switch's --timeout: the switch fails saying why, with no
    step of its own written meanwhile, and puts back what it had changed."""
    caplog.set_level("INFO", logger="gpuwatch.switch")
    async with simulated_switch(host) as (w, sim, _engine, events):
        sim.step_delay = 2.0
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:

                async def switch() -> None:
                    with pytest.raises(SwitchFailed, match=rf"{NV} is recovering: PCI error "
                                                           r"recovery began .* ran out of time"):
                        await w.switch(NV, "vfio", timeout=4)

                tg.start_soon(switch)
                while not sim.record:
                    await anyio.sleep(0.01)
                first = sim.record[0]
                await begin_recovery(w, host)
                sim.step_delay = 0.0
        assert sim.record[0] == first
        assert not [r for r in sim.record if r[0] == "write"]  # only modules put back
        failed = [e for e in events if e.type == "switch-failed"]
        assert len(failed) == 1 and "ran out of time" in failed[0].error  # type: ignore[attr-defined]


async def test_a_failed_switch_loads_no_module_back_during_a_recovery(
        host: SysRoot) -> None:
    """The switch unloaded nvidia, then a recovery of the card began and outlasted the
    switch: putting nvidia back would probe the card (a bind) while the kernel resets it,
    so the module is not loaded again, and the failure says what is left to run."""
    async with simulated_switch(host) as (w, sim, _engine, events):
        unload = ("command", "modprobe", "-r", "nvidia")
        sim.step_delay = 0.5
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:

                async def switch() -> None:
                    with pytest.raises(SwitchFailed, match=r"not run while .* is recovering: "
                                                           r".*modprobe nvidia.*once it ends"):
                        await w.switch(NV, "vfio", timeout=6)

                tg.start_soon(switch)
                while unload not in sim.record:
                    await anyio.sleep(0.01)
                await begin_recovery(w, host)
                sim.step_delay = 0.0
        loads = [r for r in sim.record[sim.record.index(unload):]
                 if r[:2] == ("command", "modprobe") and r[2] != "-r"]
        assert loads == []
        assert not [r for r in sim.record if r[0] == "write"]
        failed = [e for e in events if e.type == "switch-failed"]
        assert any("modprobe nvidia" in r for r in failed[0].restored)  # type: ignore[attr-defined]
