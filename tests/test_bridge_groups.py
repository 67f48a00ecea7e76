"""A PCI bridge that shares its IOMMU group with a GPU (a root or downstream port ACS does not
split off) stays on ``pcieport`` in both modes: the kernel's VFIO lets such a group be used
with the bridge where it is (``pcieport`` sets ``driver_managed_dma``; vfio-pci never binds a
bridge). So the bridge makes no group ``mixed``: ``status``, ``mode``, ``group-in-mode`` and
the metrics read the group by its endpoints."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from cli_helpers import Run, simulated_cli
from cli_helpers import run_main as cli

import gpuwatch
from gpuwatch.core.observations import PciErrorSeen
from gpuwatch.testing import SysRoot
from gpuwatch.testing.simkernel import SimKernel

pytestmark = pytest.mark.timeout(60)

PORT, GPU, AUDIO = "0000:00:01.0", "0000:01:00.0", "0000:01:00.1"


def bridge_host(root: Path, *, gpu: str | None, audio: str | None,
                port: str | None = "pcieport") -> SysRoot:
    """A root port and the card behind it, all three in IOMMU group 1."""
    s = SysRoot(root)
    s.add_iommu_unit("dmar0")
    s.add_bridge(PORT, iommu_group=1, driver=port)
    s.add_function(GPU, parent=PORT, klass="0x030000", driver=gpu, iommu_group=1)
    s.add_function(AUDIO, parent=PORT, device="0x22ba", klass="0x040300", driver=audio,
                   iommu_group=1)
    return s


def answers(s: SysRoot, capsys: pytest.CaptureFixture[str]) -> tuple[object, ...]:
    """(status's mode, `mode`'s mode, group-in-mode vfio, group-in-mode nvidia)."""
    root = ["--root", str(s.root)]
    code, out, err = cli(capsys, "status", "--json", "--no-daemon", *root)
    assert (code, err) == (0, "")
    status = {g["addr"]: g for g in json.loads(out)["gpus"]}[GPU]
    assert [m["addr"] for m in status["members"]] == [PORT, GPU, AUDIO]
    code, out, err = cli(capsys, "mode", "--addr", GPU, "--json", "--no-daemon", *root)
    assert (code, err) == (0, ""), err
    shown = json.loads(out)["mode"]
    model = gpuwatch.scan(s.root)
    return (status["mode"], shown,
            model.probe("group-in-mode", addr=GPU, mode="vfio"),
            model.probe("group-in-mode", addr=GPU, mode="nvidia"))


@pytest.mark.parametrize(("gpu", "audio", "want"), [
    ("vfio-pci", "vfio-pci", ("vfio", "vfio", True, False)),
    ("nvidia", "snd_hda_intel", ("nvidia", "nvidia", False, True)),
    (None, None, ("unbound", "unbound", False, False)),
    ("nvidia", "vfio-pci", ("mixed", "mixed", False, False)),
])
def test_a_port_on_pcieport_makes_no_group_mixed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], gpu: str | None, audio: str | None,
        want: tuple[object, ...]) -> None:
    assert answers(bridge_host(tmp_path / "h", gpu=gpu, audio=audio), capsys) == want


def test_a_port_on_no_driver_is_left_out_too(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    s = bridge_host(tmp_path / "h", gpu="vfio-pci", audio="vfio-pci", port=None)
    assert answers(s, capsys) == ("vfio", "vfio", True, False)


def test_a_bridge_on_another_driver_still_counts(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Only pcieport's bridges are left where they are: a bridge some other driver holds
    (one without ``driver_managed_dma``) keeps the group from VFIO."""
    s = bridge_host(tmp_path / "h", gpu="vfio-pci", audio="vfio-pci", port="shpchp")
    assert answers(s, capsys) == ("mixed", "mixed", False, False)



def test_plan_and_mode_agree_the_group_is_in_mode(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``mode vfio`` and ``plan vfio`` on a group already on vfio-pci with its port on
    pcieport: both say nothing is to be done, and the port's target is pcieport (no
    driver_override is written for a bridge)."""
    s = bridge_host(tmp_path / "h", gpu="vfio-pci", audio="vfio-pci")
    root = ["--root", str(s.root), "--no-daemon"]
    code, out, err = cli(capsys, "plan", "vfio", "--addr", GPU, "--json", *root)
    assert (code, err) == (0, "gpuwatch: note: already in mode vfio: nothing to write\n")
    plan = json.loads(out)
    assert plan["refused"] is None and plan["steps"] == []
    assert {m["addr"]: m["target"] for m in plan["members"]}[PORT] == "pcieport"
    code, out, err = cli(capsys, "mode", "vfio", "--addr", GPU, *root)
    assert (code, err) == (0, "") and "nothing to do" in out


@pytest.fixture
def switch_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
               ) -> Callable[[SysRoot], tuple[SimKernel, Run]]:
    """`gpuwatch` commands against a host whose kernel is simulated (never the real one)."""

    def make(s: SysRoot) -> tuple[SimKernel, Run]:
        run, sim = simulated_cli(s, monkeypatch, capsys)
        return sim, lambda *argv: run(*argv, "--no-daemon")

    return make


@pytest.mark.parametrize("port", ["pcieport", None])
def test_a_group_with_its_port_switches_both_ways_leaving_the_port(
        tmp_path: Path, port: str | None,
        switch_cli: Callable[[SysRoot], tuple[SimKernel, Run]]
) -> None:
    """The group a consumer board gives its GPU (root port, display, audio): `mode` brings
    the card to vfio-pci and back, completes, and never writes a thing for the port, which
    stays where it was."""
    s = bridge_host(tmp_path / "h", gpu="nvidia", audio="snd_hda_intel", port=port)
    s.add_module("nvidia")
    s.add_module("snd_hda_intel")
    sim, run = switch_cli(s)
    code, out, err = run("plan", "vfio", "--addr", GPU, "--json")
    assert (code, err) == (0, "")
    plan = json.loads(out)
    assert plan["refused"] is None and plan["steps"]
    assert {m["addr"]: m["target"] for m in plan["members"]}[PORT] == "pcieport"
    for direction, drivers in (("vfio", ["vfio-pci", "vfio-pci"]),
                               ("nvidia", ["nvidia", "snd_hda_intel"])):
        code, out, err = run("mode", direction, "--addr", GPU, "--json", "--timeout", "5")
        assert (code, err) == (0, ""), err
        result = json.loads(out)
        assert result["changed"] is True and result["to_mode"] == direction
        members = {m["addr"]: m["driver"] for m in result["members"]}
        assert [members[GPU], members[AUDIO]] == drivers
        assert members[PORT] == (port or "")
    assert sim.writes and not [w for w in sim.writes if PORT in w[0] or w[1] == PORT]


def test_a_group_whose_bridge_is_on_another_driver_is_refused_naming_it(
        tmp_path: Path,
        switch_cli: Callable[[SysRoot], tuple[SimKernel, Run]]
) -> None:
    s = bridge_host(tmp_path / "h", gpu="nvidia", audio="snd_hda_intel", port="shpchp")
    s.add_module("nvidia")
    sim, run = switch_cli(s)
    code, out, err = run("mode", "vfio", "--addr", GPU)
    assert (code, out) == (1, "")
    assert err.startswith(f"gpuwatch: IOMMU group 1 also holds PCI bridge {PORT} (on shpchp): ")
    assert "bind it to pcieport first" in err and len(err.splitlines()) == 1
    assert sim.record == []


async def _health(w: object, addr: str, health: str) -> None:
    import anyio

    with anyio.fail_after(5):
        while w.model.function(addr).health != health:  # type: ignore[attr-defined]
            await anyio.sleep(0.01)


@pytest.mark.timeout(60)
async def test_a_failed_port_of_the_group_refuses_switch_and_recover_naming_it(
        tmp_path: Path) -> None:
    """The group's own root port failed its PCI error recovery: no switch and no `recover`
    helps (gpuwatch rebinds no bridge), so each refuses, nothing written, and says what does
    (was: the refusal offered `recover`, which rebound the card, said done, and left the
    group refused for ever)."""
    from gpuwatch.errors import SwitchRefused
    from gpuwatch.testing.simkernel import simulated_switch

    s = bridge_host(tmp_path / "h", gpu="nvidia", audio="snd_hda_intel")
    s.add_module("nvidia")
    s.add_module("snd_hda_intel")
    async with simulated_switch(s) as (w, sim, _engine, _events):
        w.source.push(s.uevent_props("change", PORT, ERROR_EVENT="FAILED_RECOVERY",
                                     DEVICE_ONLINE="0"))
        await _health(w, PORT, "failed")
        for attempt in (lambda: w.switch(GPU, "vfio", timeout=5),
                        lambda: w.switch(GPU, "nvidia", timeout=5),
                        lambda: w.recover(GPU, timeout=5)):
            with pytest.raises(SwitchRefused) as refused:
                await attempt()
            reason = str(refused.value)
            assert f"{PORT} is failed: it is the group's own bridge" in reason
            assert "remove and rescan it" in reason and "gpuwatch recover" not in reason
        assert sim.writes == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("newcomer", ["shpchp", None])
@pytest.mark.parametrize("direction", ["vfio", "nvidia"])
async def test_a_port_taken_by_another_driver_mid_switch_fails_it_at_once(
        tmp_path: Path, direction: str, newcomer: str | None) -> None:
    """The plan leaves the port on pcieport; another driver taking it meanwhile will not
    give it back, so the switch fails at once, naming it (was: a wait for the whole
    --timeout). A port that merely loses its driver is still where both modes want it."""
    import time

    import anyio

    from gpuwatch.errors import SwitchFailed
    from gpuwatch.testing.simkernel import simulated_switch

    start = ("nvidia", "snd_hda_intel") if direction == "vfio" else ("vfio-pci", "vfio-pci")
    s = bridge_host(tmp_path / "h", gpu=start[0], audio=start[1])
    s.add_module("nvidia")
    s.add_module("snd_hda_intel")
    outcome: list[object] = []
    async with simulated_switch(s) as (w, sim, _engine, _events):
        sim.step_delay = 0.3

        async def switch() -> None:
            began = time.monotonic()
            try:
                outcome.append(await w.switch(GPU, direction, timeout=30))
            except SwitchFailed as exc:
                outcome.append(exc)
            outcome.append(time.monotonic() - began)

        async with anyio.create_task_group() as tg:
            tg.start_soon(switch)
            with anyio.fail_after(10):
                while not sim.record:
                    await anyio.sleep(0.01)
            s.unbind(PORT)
            w.source.push(s.uevent_props("unbind", PORT))
            if newcomer:
                s.bind(PORT, newcomer)
                w.source.push(s.uevent_props("bind", PORT))
            sim.step_delay = 0.0
    result, took = outcome
    assert isinstance(took, float) and took < 15  # far from the 30 s timeout
    if newcomer:
        assert isinstance(result, SwitchFailed)
        assert f"PCI bridge {PORT} (now on shpchp) left pcieport" in str(result)
    else:
        assert not isinstance(result, SwitchFailed), result
    assert not [w for w in sim.writes if PORT in w[0] or w[1] == PORT]


@pytest.mark.parametrize(("klass", "driver", "refused"), [
    ("0x060900", None, False),       # semi-transparent PCI-to-PCI bridge, no driver
    ("0x060400", None, False),
    ("0x080700", "pcieport", False),  # a root complex event collector: pcieport drives it
    ("0x060700", "yenta_cardbus", True),  # CardBus: vfio-pci takes no bridge header
    ("0x060900", "shpchp", True),
])
def test_every_kind_of_bridge_is_left_or_refused_never_rebound(
        tmp_path: Path, switch_cli: Callable[[SysRoot], tuple[SimKernel, Run]],
        klass: str, driver: str | None, refused: bool) -> None:
    s = SysRoot(tmp_path / "h")
    s.add_iommu_unit("dmar0")
    s.add_bridge(PORT, iommu_group=1, driver="pcieport")
    s.add_function("0000:00:01.1", klass=klass, driver=driver, iommu_group=1,
                   vendor="0x8086", device="0x1234")
    s.add_function(GPU, parent=PORT, klass="0x030000", driver="nvidia", iommu_group=1)
    s.add_module("nvidia")
    sim, run = switch_cli(s)
    code, out, err = run("mode", "vfio", "--addr", GPU, "--json", "--timeout", "5")
    if refused:
        assert code == 1 and "also holds PCI bridge 0000:00:01.1" in err, err
        assert sim.record == []
    else:
        assert (code, err) == (0, ""), err
        assert json.loads(out)["changed"] is True
    assert not [w for w in sim.writes if "0000:00:01.1" in w[0] or w[1] == "0000:00:01.1"]


def test_list_names_a_failed_port_though_it_gets_no_hostdev_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bridge has no <hostdev> line, but its failure still leaves the group unusable:
    `list`'s note says so, as `status` does."""
    import gpuwatch.report as report

    s = bridge_host(tmp_path / "h", gpu="vfio-pci", audio="vfio-pci")
    model = gpuwatch.scan(s.root)
    model.state.apply([PciErrorSeen(PORT, "FAILED_RECOVERY", False)])
    listed = {g.addr: g for g in report.passthrough_gpus(model)}[GPU]
    assert [f.addr for f in listed.functions] == [GPU, AUDIO]
    assert f"{PORT} is failed" in listed.note or PORT in listed.note, listed.note


NEW_PORT = "0000:00:01.1"  # a bridge hot-added into the group mid-switch


class HotAddsABridge(SimKernel):
    """After the switch's first ``drivers_probe``, a bridge joins IOMMU group 1 as a
    hot-add does: on no driver (``add``), then bound by ``driver`` (``bind``), if any."""

    newcomer: str | None = None

    async def write(self, path: str, value: str, timeout: float) -> None:
        await super().write(path, value, timeout)
        if path == "/sys/bus/pci/drivers_probe" and NEW_PORT not in self.sys.functions:
            devpath = self.sys.add_bridge(NEW_PORT, iommu_group=1, driver=None)
            self.source.push(self.sys.uevent_props("add", devpath))
            if self.newcomer:
                self.sys.bind(NEW_PORT, self.newcomer)
                self.source.push(self.sys.uevent_props("bind", NEW_PORT))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("newcomer", ["pcieport", None, "shpchp"])
@pytest.mark.parametrize("direction", ["vfio", "nvidia"])
async def test_a_bridge_hot_added_mid_switch_follows_the_rules_of_one_there_at_the_start(
        tmp_path: Path, direction: str, newcomer: str | None) -> None:
    """A bridge that joins the group during the switch is judged as the plan judges one
    present from the start: on pcieport or on no driver it is left where it is and the
    switch completes; on another driver the switch fails naming it with what the plan's
    refusal says (was: "switch again to include it", and every switch after it refused),
    wedges nothing, and once the bridge is on pcieport the group is in mode. Nothing is
    ever written for the bridge."""
    import anyio

    from gpuwatch.errors import SwitchFailed, SwitchRefused
    from gpuwatch.testing.simkernel import simulated_switch

    start = ("nvidia", "snd_hda_intel") if direction == "vfio" else ("vfio-pci", "vfio-pci")
    s = bridge_host(tmp_path / "h", gpu=start[0], audio=start[1])
    s.add_module("nvidia")
    s.add_module("snd_hda_intel")
    sim = HotAddsABridge(s)
    sim.newcomer = newcomer
    async with simulated_switch(s, sim=sim) as (w, _sim, _engine, events):
        if newcomer != "shpchp":
            done = await w.switch(GPU, direction, timeout=5)
            assert done.changed
            assert {m.addr: m.driver for m in done.members}[NEW_PORT] == (newcomer or "")
        else:
            with pytest.raises(SwitchFailed) as failed:
                await w.switch(GPU, direction, timeout=5)
            reason = str(failed.value)
            assert reason.startswith(
                f"IOMMU group 1 gained PCI bridge {NEW_PORT} (on shpchp) during the switch: "
                "a bridge in a group VFIO takes must be on pcieport or on no driver, and "
                "gpuwatch does not move bridges; bind it to pcieport, then switch again;")
            assert "include it" not in reason
            assert [e.wedged for e in events  # type: ignore[attr-defined]
                    if getattr(e, "type", "") == "switch-failed"] == [False]
            assert w.probe("wedge-detected") is False
            with pytest.raises(SwitchRefused, match=rf"also holds PCI bridge {NEW_PORT} "
                               r"\(on shpchp\): .*; bind it to pcieport first$"):
                await w.switch(GPU, direction, timeout=5)
            s.unbind(NEW_PORT)  # what the operator is told to do
            w.source.push(s.uevent_props("unbind", NEW_PORT))
            s.bind(NEW_PORT, "pcieport")
            w.source.push(s.uevent_props("bind", NEW_PORT))
            with anyio.fail_after(5):
                while w.model.function(NEW_PORT).driver != "pcieport":
                    await anyio.sleep(0.01)
            await w.switch(GPU, direction, timeout=5)
        assert w.probe("group-in-mode", addr=GPU, mode=direction) is True
    assert not [x for x in sim.writes if NEW_PORT in x[0] or x[1] == NEW_PORT]


@pytest.mark.timeout(60)
async def test_a_bridge_and_an_endpoint_hot_added_together_are_both_named(
        tmp_path: Path) -> None:
    """With a USB controller joining beside the bridge, the failure names both: the bridge
    by the bridge rule, the controller as not switched nor checked for holders."""
    from gpuwatch.errors import SwitchFailed
    from gpuwatch.testing.simkernel import simulated_switch

    usb = "0000:01:00.2"

    class AlsoAddsUsb(HotAddsABridge):
        async def write(self, path: str, value: str, timeout: float) -> None:
            await super().write(path, value, timeout)
            if path == "/sys/bus/pci/drivers_probe" and usb not in self.sys.functions:
                devpath = self.sys.add_function(usb, parent=PORT, device="0x1ad6",
                                                klass="0x0c0330", driver="xhci_hcd",
                                                iommu_group=1)
                self.source.push(self.sys.uevent_props("add", devpath))

    s = bridge_host(tmp_path / "h", gpu="nvidia", audio="snd_hda_intel")
    s.add_module("nvidia")
    sim = AlsoAddsUsb(s)
    sim.newcomer = "shpchp"
    async with simulated_switch(s, sim=sim) as (w, _sim, _engine, _events):
        with pytest.raises(SwitchFailed) as failed:
            await w.switch(GPU, "vfio", timeout=5)
    assert (f"gained PCI bridge {NEW_PORT} (on shpchp) during the switch: " in str(failed.value))
    assert (f"bind it to pcieport, then switch again; it also gained {usb} (on xhci_hcd), not "
            "switched (nor checked for holders);" in str(failed.value))
