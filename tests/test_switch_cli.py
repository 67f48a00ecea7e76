"""The switch commands: mode, plan, recover, holders, ensure-cdi, and the new probe actions.

The CLI builds its host ops through `gpuwatch.switch.hostops.backend_factory`; these tests
plug in the simulated kernel there, so no command ever reaches the real host.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import gpuwatch
from gpuwatch.cli.main import main
from gpuwatch.switch import hostops
from gpuwatch.switch.hostops import Backend
from gpuwatch.switch.poison import PoisonEntry, PoisonStore
from gpuwatch.testing import SysRoot
from gpuwatch.testing.simkernel import SimKernel

NV, AUDIO = "0000:01:00.0", "0000:01:00.1"

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def sim(host: SysRoot) -> SimKernel:
    return SimKernel(host)


@pytest.fixture
def euid() -> list[int]:
    return [0]


@pytest.fixture
def cli(host: SysRoot, sim: SimKernel, euid: list[int], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> Run:
    def backend(root: str) -> Backend:
        assert Path(root).resolve() == host.root.resolve()  # never the real host
        return Backend(sim, sim.new_source(), lambda: euid[0])

    monkeypatch.setattr(hostops, "backend_factory", backend)

    def run(*argv: str, root: bool = True) -> tuple[int, str, str]:
        args = [*argv, "--root", str(host.root)] if root else list(argv)
        try:
            code = main(args)
        except SystemExit as exc:
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return code, out, err

    return run


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# --------------------------------------------------------------------------- mode


def test_mode_shows_the_group(cli: Run) -> None:
    code, out, err = cli("mode")
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == f"{NV} (IOMMU group 13): nvidia"
    code, out, _ = cli("mode", "--json", "--addr", AUDIO)
    data = json.loads(out)
    assert (code, data["addr"], data["group"], data["mode"], data["poisoned"]) == (
        0, NV, 13, "nvidia", None)
    assert data["members"][1] == {"addr": AUDIO, "class": "0x0403", "driver": "snd_hda_intel",
                                  "vfio": "vfio-pci", "nvidia": "snd_hda_intel",
                                  "health": "ok"}


def test_mode_switches_and_prints_the_result(cli: Run, sim: SimKernel, tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    code, out, err = cli("mode", "vfio", "--json", "--timeout", "5", "--log", str(log))
    assert (code, err) == (0, "")
    result = json.loads(out)
    assert (result["changed"], result["from_mode"], result["to_mode"]) == (True, "nvidia", "vfio")
    assert [m["driver"] for m in result["members"]] == ["vfio-pci", "vfio-pci"]
    assert sim.record
    types = [json.loads(line)["type"] for line in log.read_text().splitlines()]
    assert types[0] == "ready" and "switch-started" in types and types[-1] == "switch-completed"
    assert json.loads(cli("mode", "--json")[1])["mode"] == "vfio"
    code, out, _ = cli("mode", "nvidia", "--vendor", "0x10DE")
    assert code == 0 and "vfio -> nvidia" in out


def test_mode_already_in_mode_needs_no_root(cli: Run, sim: SimKernel, euid: list[int]) -> None:
    euid[0] = 1000
    code, out, err = cli("mode", "nvidia")
    assert (code, err) == (0, "") and "already nvidia" in out
    assert sim.record == []


def test_mode_as_non_root_is_one_line_and_exit_1(cli: Run, sim: SimKernel,
                                                 euid: list[int]) -> None:
    euid[0] = 1000
    code, out, err = cli("mode", "vfio")
    assert (code, out) == (1, "")
    assert "needs root" in one_line(err)
    assert sim.record == []


def test_mode_refused_names_the_holders(cli: Run, sim: SimKernel) -> None:
    sim.add_holder(4242, "python3", "/dev/nvidia0")
    code, out, err = cli("mode", "vfio")
    assert (code, out) == (1, "")
    assert "python3 (pid 4242) holds /dev/nvidia0" in one_line(err)
    assert sim.record == []


@pytest.mark.parametrize(("argv", "code", "message"), [
    (["mode", "vfio", "--vendor", "0x1002"], 1, "no card of vendor 0x1002"),
    (["mode", "vfio", "--addr", "0000:0a:00.0"], 1, "no PCI function"),
    (["mode", "vfio", "--addr", "01:00.0"], 2, "not a PCI address"),
    (["mode", "vfio", "--vendor", "nvidia"], 2, "not a PCI vendor id"),
    (["mode", "vfio", "--addr", NV, "--vendor", "0x10de"], 2, "not allowed with"),
    (["mode", "host"], 2, "invalid choice"),
    (["mode", "vfio", "--timeout", "0"], 2, "must be positive"),
    (["mode", "vfio", "--timeout", "1e300"], 2, "must be at most 604800 (a week)"),
    (["recover", "--timeout", "1e12"], 2, "must be at most 604800 (a week)"),
    (["plan", "vfio", "--addr", "0000:01:00.0;x"], 2, "not a PCI address"),
    (["recover", "--addr", "bad"], 2, "not a PCI address"),
    (["holders", "--vendor", "0x1002"], 1, "no card of vendor"),
    (["probe", "plan", "--mode", "vfio"], 2, "needs --addr or --vendor"),
    (["probe", "plan", "--vendor", "0x10de"], 2, "needs --mode"),
    (["probe", "plan", "--mode", "vfio", "--vendor", "x"], 2, "not a PCI vendor id"),
])
def test_errors_are_one_line_with_their_exit_code(cli: Run, sim: SimKernel, argv: list[str],
                                                  code: int, message: str) -> None:
    got, out, err = cli(*argv)
    assert (got, out) == (code, "")
    assert message in one_line(err)
    assert sim.record == []


@pytest.mark.parametrize("argv", [
    ["mode", "vfio"], ["mode", "nvidia"], ["plan", "vfio"], ["plan", "vfio", "--json"],
    ["recover"], ["probe", "plan", "--mode", "vfio", "--addr", NV],
])
def test_a_malformed_driver_name_in_the_tree_is_a_refusal_not_a_usage_error(
        host: SysRoot, cli: Run, sim: SimKernel, argv: list[str]) -> None:
    """The audio function's driver link names a driver no kernel could register (``snd
    hda;x``): nothing is written, and the answer is the host's refusal, exit 1 like every
    refusal in docs/switch.md, not exit 2 (the command line is fine; fixing it cannot help)."""
    (host.root / "sys/bus/pci/drivers/snd hda;x").mkdir()
    link = host.device_dir(AUDIO) / "driver"
    link.unlink()
    link.symlink_to("../../../../bus/pci/drivers/snd hda;x")
    got, out, err = cli(*argv)
    assert (got, out) == (1, "")
    assert "refusing to switch: driver name 'snd hda;x' of 0000:01:00.1" in one_line(err)
    assert sim.record == []


# --------------------------------------------------------------------------- plan


def test_plan_prints_the_steps_the_switch_then_takes(cli: Run, sim: SimKernel) -> None:
    code, out, err = cli("plan", "--json")
    plan = json.loads(out)
    assert (code, err, plan["to_mode"], plan["example"], plan["refused"]) == (
        0, "", "vfio", False, None)
    code, text, _ = cli("plan", "vfio")
    assert code == 0 and "1. run modprobe -r nvidia_drm nvidia_modeset nvidia_uvm" in text
    assert sim.record == []
    assert cli("mode", "vfio")[0] == 0
    assert [s["argv"] if s["kind"] == "command" else [s["path"], s["value"]]
            for s in plan["steps"]] == [list(r[1:]) for r in sim.record]


def test_plan_without_a_card_is_not_found_and_example_only_when_asked(cli: Run) -> None:
    code, out, err = cli("plan", "nvidia", "--vendor", "0x1002", "--json")
    assert (code, out) == (1, "") and "no card of vendor 0x1002" in one_line(err)
    code, out, err = cli("plan", "vfio", "--addr", "0000:42:00.0", "--json")
    assert (code, out) == (1, "") and "no PCI function 0000:42:00.0" in one_line(err)
    code, out, err = cli("plan", "nvidia", "--example", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["example"] is True
    assert [m["addr"] for m in plan["members"]] == [NV, AUDIO]
    assert "example card" in err
    assert {"kind": "write", "path": f"/sys/bus/pci/devices/{NV}/driver_override",
            "value": "nvidia"} in plan["steps"]


def test_plan_that_would_be_refused_exits_1_with_the_reason(cli: Run, sim: SimKernel) -> None:
    sim.add_holder(4242, "python3", "/dev/nvidia0")
    code, out, err = cli("plan", "vfio", "--json")
    plan = json.loads(out)
    assert code == 1 and plan["steps"] == []
    assert plan["refused"]["holders"] == [{"pid": 4242, "comm": "python3",
                                           "node": "/dev/nvidia0"}]
    assert "would be refused" in one_line(err)


# --------------------------------------------------------------------------- probes


def test_probe_plan_and_wedge_detected(cli: Run, host: SysRoot) -> None:
    code, out, _ = cli("probe", "plan", "--mode", "vfio", "--vendor", "0x10de")
    steps = json.loads(out)["result"]
    assert code == 0 and steps[1] == {"kind": "command", "argv": ["modprobe", "-r", "nvidia"],
                                      "on_error": "refuse"}
    assert json.loads(cli("probe", "wedge-detected")[1]) == {"action": "wedge-detected",
                                                             "result": False}
    host.add_process(31337, "python3", state="D",
                     stack="[<0>] os_delay+0x3c/0x60 [nvidia]\n[<0>] nv_pci_remove+0x1b4\n")
    assert json.loads(cli("probe", "wedge-detected", "--fresh")[1])["result"] is True


def test_wedge_detected_says_when_stacks_cannot_be_read(host: SysRoot) -> None:
    host.add_process(31338, "kworker", state="D")
    (host.root / "proc/31338/stack").unlink()
    # A separate process, so that stderr is what a user sees (not pytest's log capture).
    proc = subprocess.run([sys.executable, "-m", "gpuwatch", "probe", "wedge-detected",
                           "--root", str(host.root)], capture_output=True, text=True,
                          timeout=60, check=False,
                          env={**os.environ, "PYTHONPATH": str(Path(gpuwatch.__file__).parents[1])})
    assert proc.returncode == 0 and json.loads(proc.stdout)["result"] is False
    assert "cannot read /proc/<pid>/stack of 1 task(s) in D state" in proc.stderr


# --------------------------------------------------------------------------- holders


def test_holders_as_text_and_json(cli: Run, sim: SimKernel, euid: list[int]) -> None:
    assert cli("holders")[1].startswith("no process holds a node of 0000:01:00.0")
    sim.add_holder(4242, "python3", "/dev/nvidia0", via="maps")
    code, out, err = cli("holders")
    assert (code, out, err) == (0, "4242\tpython3\t/dev/nvidia0\n", "")
    euid[0] = 1000
    code, out, err = cli("holders", "--json")
    data = json.loads(out)
    assert code == 0 and data["holders"] == [{"pid": 4242, "comm": "python3",
                                              "node": "/dev/nvidia0"}]
    assert data["complete"] is False and "incomplete" in err


# --------------------------------------------------------------------------- recover


def test_recover_needs_root(cli: Run, sim: SimKernel, euid: list[int]) -> None:
    euid[0] = 1000
    code, _, err = cli("recover")
    assert code == 1 and "needs root" in one_line(err) and sim.record == []


def test_recover_with_a_stuck_task_touches_nothing(cli: Run, sim: SimKernel,
                                                   host: SysRoot) -> None:
    host.add_process(31337, "python3", state="D", stack="[<0>] nv_pci_remove+0x1b4\n")
    code, out, err = cli("recover")
    assert (code, out) == (1, "")
    assert "reboot is required" in one_line(err)
    assert sim.record == []


def test_recover_rebinds_to_vfio_and_clears_the_poison(cli: Run, sim: SimKernel,
                                                       host: SysRoot) -> None:
    store = PoisonStore(str(host.root))
    store.add(13, PoisonEntry(addr=NV, to_mode="vfio", error="wedged", time="t"))
    assert json.loads(cli("mode", "--json")[1])["poisoned"] == "wedged"
    code, _, err = cli("mode", "vfio")
    assert code == 1 and "poisoned" in one_line(err) and sim.record == []
    code, out, err = cli("recover", "--json")
    assert code == 0
    result = json.loads(out)
    assert [m["driver"] for m in result["members"]] == ["vfio-pci", "vfio-pci"]
    assert "poison of group 13 cleared" in err
    assert store.load() == {}


# --------------------------------------------------------------------------- ensure-cdi


def test_ensure_cdi(cli: Run, sim: SimKernel, host: SysRoot, euid: list[int]) -> None:
    code, out, _ = cli("ensure-cdi", "--json")
    assert code == 0 and json.loads(out) == {"ok": True, "generated": False,
                                             "spec": "/etc/cdi/nvidia.yaml",
                                             "message": "CDI spec present: /etc/cdi/nvidia.yaml"}
    host.remove_cdi_spec("etc")
    code, out, _ = cli("ensure-cdi")
    assert code == 0 and out.strip() == "CDI spec generated: /etc/cdi/nvidia.yaml"
    assert sim.record[-1][:4] == ("command", "nvidia-ctk", "cdi", "generate")
    host.remove_cdi_spec("etc")
    sim.tools.discard("nvidia-ctk")
    code, out, err = cli("ensure-cdi")
    assert (code, out) == (1, "") and "nvidia-ctk is not on PATH" in one_line(err)
    euid[0] = 1000
    code, _, err = cli("ensure-cdi")
    assert code == 1 and "needs root" in one_line(err)


def test_ensure_cdi_with_a_file_for_its_folder(cli: Run, sim: SimKernel, host: SysRoot) -> None:
    """``etc/cdi`` a file (or ``/etc`` read-only): the reason in one line, exit 1, as the
    docs say for no spec made (was: ``internal error: FileExistsError``)."""
    host.remove_cdi_spec("etc")
    os.rmdir(host.root / "etc/cdi")
    (host.root / "etc/cdi").write_text("")
    code, out, err = cli("ensure-cdi", "--json")
    message = "mkdir -p /etc/cdi failed: File exists: no CDI spec generated"
    assert code == 1 and json.loads(out) == {"ok": False, "generated": False, "spec": None,
                                             "message": message}
    assert one_line(err) == f"gpuwatch: {message}"
    assert not any(r[:2] == ("command", "nvidia-ctk") for r in sim.record)


def test_ensure_cdi_reads_var_run_in_the_tree(cli: Run, sim: SimKernel, host: SysRoot) -> None:
    """``var/run`` → ``/run`` (current distributions): the spec it finds is the tree's own."""
    host.remove_cdi_spec("etc")
    shutil.rmtree(host.root / "var/run")
    (host.root / "run/cdi").mkdir(parents=True)
    (host.root / "run/cdi/nvidia.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\n")
    os.symlink("/run", host.root / "var/run")
    code, out, _ = cli("ensure-cdi", "--json")
    assert code == 0 and json.loads(out)["spec"] == "/var/run/cdi/nvidia.yaml"
    assert not any(r[:2] == ("command", "nvidia-ctk") for r in sim.record)
