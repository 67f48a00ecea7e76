"""The command line: JSON shapes, one-line errors and documented exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run_main as run_cli

from gpuwatch.testing import SysRoot

NV, NV_AUDIO = "0000:01:00.0", "0000:01:00.1"




def test_probe_prints_action_and_result(host: SysRoot, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capsys, "probe", "group-in-mode", "--root", str(host.root), "--addr", NV, "--mode", "nvidia"
    )
    assert (code, err) == (0, "")
    assert json.loads(out) == {"action": "group-in-mode", "result": True}


def test_probe_fresh_gives_the_same_json(host: SysRoot, capsys: pytest.CaptureFixture[str]) -> None:
    _, cached, _ = run_cli(capsys, "probe", "detect-vfio", "--root", str(host.root))
    _, fresh, _ = run_cli(capsys, "probe", "detect-vfio", "--root", str(host.root), "--fresh")
    assert json.loads(cached) == json.loads(fresh)
    assert json.loads(cached)["result"]["gpus"][1]["class"] == "0x0300"


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["probe", "detect-everything"], 2, "unknown action"),
        (["probe", "display-driver", "--addr", "1:0.0"], 2, "not a PCI address"),
        (["probe", "display-driver", "--addr", "0000:01:00.8"], 2, "not a PCI address"),
        (["probe", "group-in-mode", "--addr", NV, "--mode", "host"], 2, "vfio or nvidia"),
        (["probe", "group-in-mode", "--addr", NV], 2, "needs --mode"),
        (["probe", "display-driver"], 2, "needs --addr"),
        (["probe", "vfio-group-accessible"], 2, "needs --group"),
        (["probe", "vfio-group-accessible", "--group", "x"], 2, "invalid int value"),
        (["probe", "display-driver", "--addr", "0000:0a:00.0"], 1, "no PCI function"),
        (["probe"], 2, "required"),
        (["nonsense"], 2, "invalid choice"),
    ],
)
def test_errors_are_one_line_with_exit_code(
    host: SysRoot, capsys: pytest.CaptureFixture[str], argv: list[str], code: int, message: str
) -> None:
    if argv[0] == "probe" and len(argv) > 1:
        argv = [*argv, "--root", str(host.root)]
    got, out, err = run_cli(capsys, *argv)
    assert got == code
    assert out == ""
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_missing_root_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "status", "--root", str(tmp_path / "nope"))
    assert code == 2
    assert "not a directory" in err
    # `record` too, even with a file source that reads nothing of the root.
    events = tmp_path / "events.jsonl"
    events.write_text("")
    code, _, err = run_cli(capsys, "record", "--root", str(events), "--source", f"file:{events}")
    assert (code, err) == (2, f"gpuwatch: --root {str(events)!r} is not a directory\n")


def test_config_overrides_tables(
    host: SysRoot, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("pci_class_labels:\n  0x0300: Graphics\ndevice_patterns: [/dev/kvm]\n")
    _, out, _ = run_cli(
        capsys, "probe", "detect-host-devices", "--root", str(host.root), "--config", str(cfg)
    )
    assert json.loads(out)["result"]["devices"] == ["/dev/kvm"]
    _, out, _ = run_cli(
        capsys, "probe", "detect-vfio", "--root", str(host.root), "--config", str(cfg)
    )
    gpu = json.loads(out)["result"]["gpus"][1]
    assert gpu["class_label"] == "Graphics"
    # The key given replaced the embedded table whole: the audio label is gone.
    assert gpu["group_members"][1]["class_label"] == "0x0403"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpu_vendors: [\n", "not valid YAML"),
        ("- a\n- b\n", "mapping"),
        ("gpu_vendor: {}\n", "unknown key 'gpu_vendor'"),
        ("device_patterns: [kvm]\n", "must start with /dev/"),
        ("gpu_vendors: 3\n", "gpu_vendors"),
    ],
)
def test_malformed_config_exits_2(
    host: SysRoot, tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    code, out, err = run_cli(
        capsys, "probe", "detect-gpu", "--root", str(host.root), "--config", str(cfg)
    )
    assert (code, out) == (2, "")
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_an_error_naming_odd_bytes_stays_one_line(
    host: SysRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    # The refusal names the vendor file as read: its newline and terminal escape are escaped.
    host.set_attr(NV, "vendor", b"0x10\nde\x1b[2J\n")
    code, _, err = run_cli(capsys, "plan", "nvidia", "--addr", NV, "--root", str(host.root))
    assert code == 1
    assert len(err.splitlines()) == 1 and "\x1b" not in err
    assert "(vendor 0x10\\nde\\x1b[2J)" in err
    code, _, err = run_cli(capsys, "events", str(host.root / "no\nlog"))
    assert code == 1
    assert err == f"gpuwatch: events: no event log at {host.root}/no\\nlog\n"


ESCAPES = "\x1b]0;owned\x07\x1b[2J"  # set the terminal's title, clear the screen


def test_a_process_name_cannot_write_to_the_terminal(
    host: SysRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    # Any local user names its own process (prctl PR_SET_NAME): `holders` prints it escaped.
    host.add_process(4242, "vm" + ESCAPES, fds={3: "/dev/nvidia0"})
    code, out, _ = run_cli(capsys, "holders", "--addr", NV, "--root", str(host.root))
    assert code == 0 and "\x1b" not in out and "\x07" not in out
    assert "4242\tvm\\x1b]0;owned\\x07\\x1b[2J\t/dev/nvidia0" in out.splitlines()
    code, out, _ = run_cli(capsys, "holders", "--addr", NV, "--root", str(host.root), "--json")
    assert [h["comm"] for h in json.loads(out)["holders"]] == ["vm" + ESCAPES]  # as it is


def test_a_driver_name_from_a_hostile_tree_cannot_write_to_the_terminal(
    host: SysRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    name = "nv" + ESCAPES
    (host.root / "sys/bus/pci/drivers" / name).mkdir()
    link = host.device_dir(NV) / "driver"
    link.unlink()
    link.symlink_to(f"../../../bus/pci/drivers/{name}")
    for command in (["status"], ["list", "--managed", "no"], ["mode", "--addr", NV]):
        code, out, err = run_cli(capsys, *command, "--root", str(host.root))
        assert code == 0, err
        assert "\x1b" not in out and "\x07" not in out, command
        if command[0] != "list":  # (list's blocks name no driver)
            assert "nv\\x1b]0;owned\\x07\\x1b[2J" in out, command
    code, out, _ = run_cli(capsys, "probe", "display-driver", "--addr", NV, "--root",
                           str(host.root))
    assert json.loads(out)["result"] == name  # JSON carries the name itself, escaped as JSON


def test_overlong_numbers_in_the_files_a_plan_reads_are_garbage(
    host: SysRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    # int() refuses more than 4300 digits: such a refcnt or minor is unreadable, not a crash.
    (host.root / "sys/module/nvidia/refcnt").write_text("9" * 5000 + "\n")
    info = host.root / "proc/driver/nvidia/gpus" / NV / "information"
    info.parent.mkdir(parents=True)
    info.write_text(f"Model: \t RTX\nDevice Minor: \t {'7' * 5000}\n")
    code, out, err = run_cli(capsys, "plan", "vfio", "--addr", NV, "--root", str(host.root),
                             "--json")
    assert (code, err) == (0, ""), err
    assert json.loads(out)["addr"] == NV


def test_status_text_and_json(host: SysRoot, capsys: pytest.CaptureFixture[str]) -> None:
    host.add_vfio_group(13)
    code, out, _ = run_cli(capsys, "status", "--root", str(host.root))
    assert code == 0
    assert "IOMMU:    enabled (intel)" in out
    assert "vfio-pci: loaded" in out
    assert f"GPU {NV}" in out and "mode: nvidia" in out
    assert "mode: host driver" in out  # the iGPU on i915
    assert "/dev/vfio/13:" in out
    code, out, _ = run_cli(capsys, "status", "--root", str(host.root), "--json")
    report = json.loads(out)
    assert report["iommu"] == {"enabled": True, "kind": "intel", "hint": ""}
    nv = next(g for g in report["gpus"] if g["addr"] == NV)
    assert [m["addr"] for m in nv["members"]] == [NV, NV_AUDIO]
    assert [m["driver"] for m in nv["members"]] == ["nvidia", "snd_hda_intel"]
    assert nv["mode"] == "nvidia" and nv["vfio_node"] == "/dev/vfio/13"
    assert report["memlock"]["verdict"] in {"unlimited", "enough", "too low"}


def test_status_modes_and_iommu_hint(
    empty_host: SysRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    empty_host.add_function("0000:01:00.0", driver="vfio-pci", iommu_group=None)
    empty_host.add_function("0000:02:00.0", driver="nvidia", iommu_group=None)
    empty_host.add_function("0000:02:00.1", klass="0x040300", driver="vfio-pci", iommu_group=None)
    _, out, _ = run_cli(capsys, "status", "--root", str(empty_host.root), "--json")
    report = json.loads(out)
    assert report["iommu"]["enabled"] is False
    assert "intel_iommu=on" in report["iommu"]["hint"]
    assert report["vfio_pci_loaded"] is False
    assert [g["mode"] for g in report["gpus"]] == ["vfio", "nvidia"]


def test_list_gives_hostdev_blocks_for_the_whole_group(
    host: SysRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    host.set_iommu_group("0000:00:01.0", 13)  # a bridge sharing the group stays with the host
    code, out, _ = run_cli(capsys, "list", "--root", str(host.root))
    assert code == 0
    assert "<address domain='0x0000' bus='0x01' slot='0x00' function='0x0'/>" in out
    assert "<address domain='0x0000' bus='0x01' slot='0x00' function='0x1'/>" in out
    assert "bus='0x00' slot='0x01'" not in out
    assert out.count("<hostdev mode='subsystem' type='pci' managed='yes'>") == 3  # iGPU + 2
    _, out, _ = run_cli(capsys, "list", "--root", str(host.root), "--json")
    gpus = json.loads(out)
    assert [g["addr"] for g in gpus] == ["0000:00:02.0", NV]
    assert [f["addr"] for f in gpus[1]["functions"]] == [NV, NV_AUDIO]


def test_list_without_iommu(empty_host: SysRoot, capsys: pytest.CaptureFixture[str]) -> None:
    empty_host.add_function("0000:01:00.0", driver="nvidia", iommu_group=None)
    code, out, _ = run_cli(capsys, "list", "--root", str(empty_host.root))
    assert code == 0
    assert "no passthrough-capable GPU" in out and "IOMMU is off" in out


def test_python_dash_m_entry_point(host: SysRoot) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuwatch",
            "probe",
            "display-driver",
            "--root",
            str(host.root),
            "--addr",
            NV,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"action": "display-driver", "result": "nvidia"}


def _with_stderr_gone(*argv: str) -> subprocess.CompletedProcess[bytes]:
    """``gpuwatch ARGV 2>&1 | head -0``, as a shell leaves it: stderr a pipe nobody reads."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "gpuwatch", *argv], stdout=subprocess.PIPE,
                              stderr=write_end, timeout=60, check=False)
    finally:
        os.close(write_end)


@pytest.mark.timeout(120)
def test_a_failure_nobody_reads_still_fails(tmp_path: Path) -> None:
    """The error line lost with its reader (``2>&1 | head``) is no success: the status
    stays the error's (was 0, the lost line's BrokenPipeError taken for a reader of stdout
    that left)."""
    assert _with_stderr_gone("probe", "bogus-action", "--no-daemon").returncode == 2
    assert _with_stderr_gone("probe", "detect-vfio", "--root",
                             str(tmp_path / "missing")).returncode == 2


@pytest.mark.timeout(120)
def test_a_note_nobody_reads_does_not_end_the_command() -> None:
    """A note to stderr that cannot be said leaves the output and the status as they were."""
    done = _with_stderr_gone("udev-rules", "--group", "no-such-group-gw")
    assert done.returncode == 0
    assert b'SUBSYSTEM=="vfio"' in done.stdout and b"no-such-group-gw" in done.stdout
