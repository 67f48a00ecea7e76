"""Passthrough candidates: the host's own console and management groups are never offered.

Trees laid out like a BMC server (ASPEED), an HPE ProLiant (iLO + Matrox), a single-GPU
desktop, a laptop with an iGPU and a VM; and the same trees as capture tools copy them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from cli_helpers import reports_every_way, run_main, simulated_cli
from watch_helpers import count_calls

import gpuwatch
from gpuwatch.cli.main import main
from gpuwatch.core.hostkeep import kept_for_host_reason, own_displays
from gpuwatch.core.plan import switch_guard
from gpuwatch.core.results import PciFunction
from gpuwatch.errors import SwitchRefused
from gpuwatch.hostfs import scan as scan_mod
from gpuwatch.report import passthrough_gpus, render_list
from gpuwatch.service.remote import RemoteModel
from gpuwatch.testing import SysRoot
from gpuwatch.testing.machines import (
    bmc_server_host,
    hpe_ilo_host,
    igpu_sriov_host,
    single_gpu_desktop,
    vm_guest_host,
)
from gpuwatch.testing.simkernel import simulated_switch

Run = Callable[..., tuple[int, str, str]]
ASPEED_VGA = "0000:03:00.0"
ASPEED_BOOT = (f"{ASPEED_VGA} is the host's boot display (boot_vga 1) and its only display "
               "function: passing it through leaves the host without a console")


runner = simulated_cli


def fn(addr: str, driver: str, klass: str = "0x0300", group: int = 1) -> PciFunction:
    return PciFunction(addr=addr, vendor_id="0x1a03", device_id="0x2000", class_=klass,
                       class_label="", driver=driver, iommu_group=group)


# ------------------------------------------------------------ the rule, pure


def test_rule_console_driver_and_only_boot_display() -> None:
    drivers = ("ast", "mgag200", "hpilo", "hpwdt")
    vga = fn("0000:03:00.0", "ast")
    assert "ast" in kept_for_host_reason([vga], console_drivers=drivers, boot_vga=(),
                                         host_displays=["0000:03:00.0", "0000:41:00.0"])
    # A member of the group on hpilo keeps the whole group, display or not.
    assert "hpilo" in kept_for_host_reason(
        [fn("0000:01:00.1", "vfio-pci"), fn("0000:01:00.2", "hpilo", "0x0880")],
        console_drivers=drivers, boot_vga=(), host_displays=["0000:01:00.1"])
    gpu = fn("0000:01:00.0", "nvidia")
    only = kept_for_host_reason([gpu], console_drivers=drivers, boot_vga={gpu.addr},
                                host_displays=[gpu.addr])
    assert "boot_vga" in only and "only display" in only
    assert kept_for_host_reason([gpu], console_drivers=drivers, boot_vga={gpu.addr},
                                host_displays=[gpu.addr, "0000:00:02.0"]) == ""
    assert kept_for_host_reason([gpu], console_drivers=drivers, boot_vga=(),
                                host_displays=[gpu.addr]) == ""
    assert kept_for_host_reason([gpu], console_drivers=(), boot_vga=(),
                                host_displays=[gpu.addr]) == ""


def test_default_table_names_the_bmc_drivers(tmp_path: Path) -> None:
    drivers = gpuwatch.scan(tmp_path).tables.host_console_drivers
    assert {"ast", "mgag200", "hpilo", "hpwdt"} <= set(drivers)


# ------------------------------------------------------------ list


@pytest.mark.parametrize("captured", [False, True])
def test_bmc_server_lists_the_aspeed_apart(tmp_path: Path, captured: bool,
                                           capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    s = bmc_server_host(tmp_path / "h")
    if captured:
        s.capture()
    run, _ = runner(s, monkeypatch, capsys)
    code, out, err = run("list", "--json", "--no-daemon")
    assert (code, err) == (0, "")
    gpus = {g["addr"]: g for g in json.loads(out)}
    aspeed = gpus[ASPEED_VGA]
    assert aspeed["kept_for_host"] is True and "ast" in aspeed["reason"]
    assert all(f["hostdev_xml"] is None for f in aspeed["functions"])
    for a100 in ("0000:41:00.0", "0000:c1:00.0"):
        assert gpus[a100]["kept_for_host"] is False and gpus[a100]["reason"] == ""
        assert "<hostdev" in gpus[a100]["functions"][0]["hostdev_xml"]
    code, out, _ = run("status", "--json", "--no-daemon")
    kept = {g["addr"]: g["kept_for_host"] for g in json.loads(out)["gpus"]}
    assert kept == {ASPEED_VGA: True, "0000:41:00.0": False, "0000:c1:00.0": False}
    code, out, _ = run("status", "--no-daemon")
    assert "kept for the host: 0000:03:00.0 (ast)" in out
    code, text, _ = run("list", "--no-daemon")
    head, _, blocks = text.partition("<!--")
    assert "kept for the host" in head and ASPEED_VGA in head
    assert "bus='0x41'" in blocks and "bus='0x03'" not in blocks  # no block for the ASPEED


def test_hpe_ilo_group_is_kept_by_its_management_functions(tmp_path: Path) -> None:
    s = hpe_ilo_host(tmp_path / "h")
    model = gpuwatch.scan(s.root)
    listed = {g.addr: g for g in passthrough_gpus(model)}
    assert listed["0000:01:00.1"].kept_for_host  # the Matrox VGA, with hpilo/hpwdt beside it
    assert all(d in listed["0000:01:00.1"].reason for d in ("mgag200", "hpilo", "hpwdt"))
    assert not listed["0000:08:00.0"].kept_for_host
    # Without mgag200 in the table the iLO functions still keep the group.
    s2 = hpe_ilo_host(tmp_path / "h2")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"host_console_drivers": ["hpilo"]}))
    model2 = gpuwatch.scan(s2.root, config)
    assert "hpilo" in model2.kept_for_host("0000:01:00.1")


@pytest.mark.parametrize(("boot_vga", "kept"), [(True, True), (False, False)])
def test_single_gpu_desktop_keeps_its_only_console(tmp_path: Path, boot_vga: bool,
                                                   kept: bool) -> None:
    s = single_gpu_desktop(tmp_path / "h", boot_vga=boot_vga)
    (gpu,) = [g for g in passthrough_gpus(gpuwatch.scan(s.root)) if g.addr == "0000:01:00.0"]
    assert gpu.kept_for_host is kept
    assert ("boot_vga" in gpu.reason) is kept
    text = render_list([gpu], True)
    assert ("<hostdev" in text) is (not kept)
    if kept:
        assert "no passthrough-capable GPU" in text and "kept for the host" in text


def test_laptop_and_vm_offer_their_dgpu(host: SysRoot, tmp_path: Path) -> None:
    # Laptop/workstation: the iGPU is the boot display but not the only display function.
    listed = {g.addr: g for g in passthrough_gpus(gpuwatch.scan(host.root))}
    assert not listed["0000:00:02.0"].kept_for_host
    assert not listed["0000:01:00.0"].kept_for_host
    vm = vm_guest_host(tmp_path / "vm")
    assert passthrough_gpus(gpuwatch.scan(vm.root)) == []  # no IOMMU groups in the guest


IGPU, IGPU_VFS = "0000:00:02.0", ("0000:00:02.1", "0000:00:02.2")


def test_rule_counts_no_virtual_function_as_a_display_of_the_host() -> None:
    igpu = fn(IGPU, "i915", group=0)
    assert list(own_displays([(IGPU, "", "0x0300"), (IGPU_VFS[0], IGPU, "0x0300"),
                              (IGPU_VFS[1], IGPU, "0x0300")])) == [IGPU]
    assert "only display" in kept_for_host_reason(
        [igpu], console_drivers=(), boot_vga={IGPU},
        host_displays=own_displays([(IGPU, "", "0x0300"), (IGPU_VFS[0], IGPU, "0x0300")]))


@pytest.mark.parametrize("captured", [False, True])
async def test_an_igpu_split_with_sriov_stays_the_hosts_console(
        tmp_path: Path, captured: bool, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A mini PC whose only display is its iGPU, split into VFs for VMs: the VFs are display
    functions with no output of their own, so the PF is still the host's only console. Kept
    by the model, by `list` and `status` with and without a daemon (the stdlib reports and
    the full ones), and by the switch; each VF on vfio-pci is offered."""
    s = igpu_sriov_host(tmp_path / "h", vfs=2)
    if captured:
        s.capture()
    model = gpuwatch.scan(s.root)
    assert model.function(IGPU).sriov is not None
    assert model.function(IGPU).sriov.vfs == IGPU_VFS  # type: ignore[union-attr]
    assert "only display function" in model.kept_for_host(IGPU)
    assert [model.kept_for_host(vf) for vf in IGPU_VFS] == ["", ""]
    root = str(s.root)

    def kept(listed: list[dict[str, object]]) -> dict[object, object]:
        return {g["addr"]: g["kept_for_host"] for g in listed}

    expected = {IGPU: True, **dict.fromkeys(IGPU_VFS, False)}
    for said in await reports_every_way(capsys, monkeypatch, root):
        where, full = said.where, said.full
        assert kept(said.listed) == expected, (where, full)
        pf = next(g for g in said.listed if g["addr"] == IGPU)
        assert "only display function" in pf["reason"]
        assert pf["functions"][0]["hostdev_xml"] is None
        assert kept(said.status["gpus"]) == expected, (where, full)
    run, sim = runner(s, monkeypatch, capsys)
    code, out, _err = run("plan", "vfio", "--addr", IGPU, "--json", "--no-daemon")
    assert code == 1 and "kept for the host" in json.loads(out)["refused"]["reason"]
    assert sim.record == []


@pytest.mark.parametrize("captured", [False, True])
def test_a_report_on_a_daemons_answers_reads_the_console_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, captured: bool) -> None:
    """`RemoteModel` (the full `list` and `status` on a daemon's answers) reads ``boot_vga``
    and the framebuffers once per report, not once per GPU, and answers as the model."""
    s = igpu_sriov_host(tmp_path / "h", vfs=2)
    if captured:
        s.capture()
    model = gpuwatch.scan(s.root)

    class Answers:  # what a daemon's client answers, from the same model
        def probe(self, action: str, **params: object) -> object:
            return model.probe(action, **params)  # type: ignore[arg-type]

    remote = RemoteModel(Answers(), model.tables, str(s.root))  # type: ignore[arg-type]
    reads = count_calls(monkeypatch, scan_mod, "read_console")
    gpus = [IGPU, *IGPU_VFS]
    assert [remote.kept_for_host(a) for a in gpus] == [model.kept_for_host(a) for a in gpus]
    assert "only display function" in remote.kept_for_host(IGPU)
    assert len(reads) == 1


def test_console_drivers_are_read_from_the_config(tmp_path: Path) -> None:
    s = bmc_server_host(tmp_path / "h")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"host_console_drivers": []}))
    # Still kept: the ASPEED's ids are in host_console_devices.
    assert "host_console_devices" in gpuwatch.scan(s.root, config).kept_for_host(ASPEED_VGA)
    config.write_text(yaml.safe_dump({"host_console_drivers": [], "host_console_devices": []}))
    # Both tables empty: the A100s are 3D controllers with no framebuffer, no screen, so the
    # ASPEED (boot_vga 1) is the host's only one and kept for that alone.
    assert gpuwatch.scan(s.root, config).kept_for_host(ASPEED_VGA) == ASPEED_BOOT
    config.write_text(yaml.safe_dump({"host_console_drivers": "ast"}))
    code = main(["probe", "detect-gpu", "--root", str(s.root), "--config", str(config)])
    assert code == 2  # a list is wanted: one line, exit 2


def test_an_unbound_bmc_vga_is_kept_by_its_ids(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`ast` blacklisted (or not loaded yet) on a GPU server: the BMC's VGA is on no driver.
    Its ids keep it (named before its boot_vga: it is the host's only screen too, the A100s
    beside it are 3D controllers with no framebuffer)."""
    s = bmc_server_host(tmp_path / "h")
    s.unbind(ASPEED_VGA)
    model = gpuwatch.scan(s.root)
    assert model.function(ASPEED_VGA).driver == ""
    reason = model.kept_for_host(ASPEED_VGA)
    assert reason == (f"{ASPEED_VGA} (1a03:2000) is a BMC/console device (host_console_devices): "
                      "this group is the host's console or management function")
    listed = {g.addr: g for g in passthrough_gpus(model)}
    assert listed[ASPEED_VGA].kept_for_host
    assert not any(g.kept_for_host for a, g in listed.items() if a != ASPEED_VGA)
    code, out, _ = run_main(capsys, "list", "--json", "--root", str(s.root), "--no-daemon")
    assert code == 0
    by_addr = {g["addr"]: g for g in json.loads(out)["gpus"]} if isinstance(
        json.loads(out), dict) else {g["addr"]: g for g in json.loads(out)}
    assert by_addr[ASPEED_VGA]["kept_for_host"] is True
    # Spelt any way the kernel or lspci spells ids; the table can also be emptied.
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"host_console_devices": ["1A03:2000"]}))
    assert "(1a03:2000)" in gpuwatch.scan(s.root, config).kept_for_host(ASPEED_VGA)
    config.write_text(yaml.safe_dump({"host_console_devices": []}))
    assert gpuwatch.scan(s.root, config).kept_for_host(ASPEED_VGA) == ASPEED_BOOT


@pytest.mark.parametrize("bad", ["1a03", "1a03:20000", "zz03:2000", "1a03-2000", 6659])
def test_a_bad_console_device_id_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: object) -> None:
    s = bmc_server_host(tmp_path / "h")
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"host_console_devices": [bad]}))
    code, out, err = run_main(capsys, "status", "--root", str(s.root), "--config", str(config),
                              "--no-daemon")
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "host_console_devices" in err
    assert "Traceback" not in err


# ------------------------------------------------------------ mode vfio / plan vfio


def test_mode_vfio_refuses_a_kept_group_unless_forced(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    s = bmc_server_host(tmp_path / "h")
    run, sim = runner(s, monkeypatch, capsys)
    code, out, err = run("mode", "vfio", "--addr", ASPEED_VGA, "--no-daemon")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "kept for the host" in err and "ast" in err
    assert sim.record == []  # nothing written, nothing run
    code, out, err = run("plan", "vfio", "--addr", ASPEED_VGA, "--json", "--no-daemon")
    assert code == 1 and "kept for the host" in json.loads(out)["refused"]["reason"]
    code, out, err = run("plan", "vfio", "--addr", ASPEED_VGA, "--json", "--no-daemon",
                         "--force")
    # Forced past the keep, the ASPEED may go; the BMC's bridge in its group stays put.
    plan = json.loads(out)
    assert code == 0 and plan["refused"] is None, out
    bridges = [m["addr"] for m in plan["members"] if m["target"] == "pcieport"]
    assert bridges and not [s for s in plan["steps"] if bridges[0] in json.dumps(s)]


def test_forced_switch_of_the_only_console(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    s = single_gpu_desktop(tmp_path / "h")
    run, sim = runner(s, monkeypatch, capsys)
    code, _, err = run("mode", "vfio", "--no-daemon")
    assert code == 1 and "boot_vga" in err and sim.record == []
    code, out, err = run("plan", "vfio", "--json", "--no-daemon", "--force")
    assert code == 0 and json.loads(out)["refused"] is None
    code, out, err = run("mode", "vfio", "--force", "--json", "--no-daemon", "--timeout", "20")
    assert code == 0, err
    assert json.loads(out)["changed"] is True
    assert ("write", "/sys/bus/pci/devices/0000:01:00.0/driver_override",
            "vfio-pci") in sim.record


def test_mode_vfio_offers_any_vendor_not_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    s = hpe_ilo_host(tmp_path / "h")
    run, _ = runner(s, monkeypatch, capsys)
    code, _, err = run("mode", "vfio", "--addr", "0000:01:00.1", "--no-daemon")
    assert code == 1 and "kept for the host" in err


async def test_engine_refuses_kept_group_with_an_event(tmp_path: Path) -> None:
    s = single_gpu_desktop(tmp_path / "h")
    async with simulated_switch(s) as (_w, sim, engine, events):
        with pytest.raises(SwitchRefused, match="kept for the host"):
            await engine.switch("0000:01:00.0", "vfio", timeout=20)
        assert sim.record == []
        refused = [e for e in events if getattr(e, "type", "") == "switch-refused"]
        assert len(refused) == 1 and "boot_vga" in refused[0].reason  # type: ignore[attr-defined]


def test_example_workstation_unchanged(host: SysRoot) -> None:
    assert gpuwatch.scan(host.root).kept_for_host("0000:01:00.0") == ""


@pytest.mark.parametrize(("group", "subject"), [
    (12, "IOMMU group 12 is kept for the host: "),
    # The IOMMU off (a capture of a PA-RISC host's boot display): no group to name.
    (-1, "0000:00:02.0 (no IOMMU group) is kept for the host: "),
])
def test_a_kept_refusal_names_the_group_or_the_card(group: int, subject: str) -> None:
    display = fn("0000:00:02.0", "cirrus", group=group)
    refusal = switch_guard(display, "vfio", kept_for_host="the host's only console")
    assert refusal is not None
    assert refusal.reason == subject + "the host's only console (--force passes it through anyway)"
    assert switch_guard(display, "vfio", kept_for_host="the host's only console",
                        force=True) is None
