"""The stdlib-only direct ``gpuwatch probe`` (no daemon): byte for byte the full command's
output, exit code and error line, for every probe action over hosts of many kinds, with
nothing heavy imported before the reply is printed; anything it does not answer goes to the
full command."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuwatch.cli import direct, fast_report
from gpuwatch.cli.direct import parse_direct, run_direct
from gpuwatch.cli.main import main
from gpuwatch.core.observations import PciSeen
from gpuwatch.core.probes import (
    ACTIONS,
    FRESH_ACTIONS,
    FUNCTION_KEYS,
    FreshHost,
    FunctionOutline,
    vfio_backend_fields,
)
from gpuwatch.core.results import PciFunction, VfioBackend
from gpuwatch.core.tabledata import table_data
from gpuwatch.hostfs.scan import (
    HostPaths,
    function_entries,
    outline_function,
    read_listed,
    scan,
    scan_host,
)
from gpuwatch.settings import default_tables, embedded_tables_raw
from gpuwatch.testing import SysRoot, example_gpu_host, synthetic_host
from gpuwatch.testing.machines import (
    bmc_server_host,
    hpe_ilo_host,
    instinct_host,
    single_gpu_desktop,
    vm_guest_host,
    vmd_host,
)
from gpuwatch.testing.modern import grace_hopper_host, sriov_gpu_host

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("pydantic", "pydantic_core", "yaml", "anyio", "pyudev")
NV = "0000:01:00.0"


def _workstation_in_use(root: Path) -> SysRoot:
    """The example workstation with everything the answers look at switched on: the nvidia
    module, a CDI spec, a vfio group node readable by nobody else, /dev/iommu, kvm."""
    s = example_gpu_host(root)
    s.add_module("nvidia")
    s.add_module("vfio_pci")
    s.add_cdi_spec()
    s.add_vfio_group(14, mode=0o600)
    s.add_dev_node("/dev/iommu")
    s.add_dev_node("/dev/kvm")
    return s


def _odd_bytes(root: Path) -> SysRoot:
    """Garbage where attributes should be: odd bytes, a FIFO, an empty class."""
    s = example_gpu_host(root)
    s.set_attr("0000:02:00.0", "vendor", b"\xff\xfe\x00garbage\x1f\n")
    s.set_attr("0000:00:1c.0", "class", "")
    fifo = s.device_dir("0000:00:02.0") / "device"
    fifo.unlink()
    os.mkfifo(fifo)
    return s


def _captured(root: Path) -> SysRoot:
    s = grace_hopper_host(root)
    s.capture()
    return s


def _without_links(root: Path, names: set[str] | None = None) -> SysRoot:
    """The SR-IOV host as a copier left it: every link of ``names`` under ``sys/`` removed;
    with no names, every link (the bus listing too) but the IOMMU group listings."""
    s = sriov_gpu_host(root, vfs=2)
    for link in [p for p in (root / "sys").rglob("*") if p.is_symlink()]:
        rel = str(link.relative_to(root))
        if (link.name in names) if names else not rel.startswith("sys/kernel/iommu_groups/"):
            link.unlink()
    return s


MACHINES: dict[str, Callable[[Path], SysRoot]] = {
    "workstation": example_gpu_host,
    "workstation-in-use": _workstation_in_use,
    "workstation-flat": lambda r: example_gpu_host(r, layout="flat"),
    "odd-bytes": _odd_bytes,
    "bmc-server": bmc_server_host,
    "hpe-ilo": hpe_ilo_host,
    "vmd": vmd_host,
    "instinct": instinct_host,
    "vm-guest": vm_guest_host,
    "desktop": single_gpu_desktop,
    "grace-hopper": grace_hopper_host,
    "grace-hopper-captured": _captured,
    "sriov-vgpu": lambda r: sriov_gpu_host(r, vfs=2, vgpu=True),
    "sriov-without-links": lambda r: _without_links(r, {"physfn", "virtfn0", "virtfn1"}),
    "no-link-at-all": _without_links,
    "synthetic-96": lambda r: synthetic_host(r, 96),
    "empty": SysRoot,
}


def request_lines(s: SysRoot) -> list[list[str]]:
    """Every probe action, with the parameters each takes: every function's address (some
    in capitals, one absent, one malformed), groups (absent, negative, not a number), modes."""
    present = sorted(s.functions)[:12]
    upper = [a.upper() for a in sorted(s.functions) if a != a.upper()][:2]
    addrs = [*present, *upper, "0000:7f:1f.7", "bogus"]
    groups = ["0", "13", "14", "30", "999", "-1", "x"]
    lines: list[list[str]] = []
    for action, needs in ACTIONS.items():
        if "addr" in needs:
            for addr in addrs:
                modes = ["vfio", "nvidia", "sideways"] if "mode" in needs else [None]
                for mode in modes:
                    lines.append(["probe", action, "--addr", addr]
                                 + ([] if mode is None else ["--mode", mode]))
        elif "group" in needs:
            lines.extend(["probe", action, "--group", g] for g in groups)
        elif action == "plan":
            lines.append(["probe", action, "--mode", "vfio", "--addr", NV])
        else:
            lines.append(["probe", action])
    lines.append(["probe", "detect-vfio", "--fresh"])
    lines.append(["probe", "no-such-action"])
    lines.append(["probe", "display-driver"])  # a required parameter missing
    return lines


def run_full(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
             argv: list[str]) -> tuple[int, str, str]:
    """The full command (argparse, the model, pydantic), the fast paths switched off."""
    with monkeypatch.context() as m:
        m.setattr(direct, "run_direct", lambda argv: None)
        return run_main(capsys, argv)


def run_here(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int | None, str, str]:
    code = run_direct(argv)
    out, err = capsys.readouterr()
    return code, out, err


def run_main(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_every_action_is_the_full_commands_bytes(
    machine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GPUWATCH_CONFIG", raising=False)
    monkeypatch.delenv("GPUWATCH_PROC_READ_TIMEOUT", raising=False)
    s = MACHINES[machine](tmp_path / "host")
    root = ["--root", str(s.root)]
    answered = 0
    for line in request_lines(s):
        argv = [*line, *root, "--no-daemon"]
        full = run_full(capsys, monkeypatch, argv)
        assert run_main(capsys, argv) == full, argv
        here = run_here(capsys, argv)
        if here[0] is not None:  # what the direct path answers, it answers as the full one
            answered += 1
            assert here == full, argv
            assert full[0] in (0, 1), argv
        elif line[1] in FRESH_ACTIONS and full[0] in (0, 1):
            pytest.fail(f"a valid request the direct path should have answered: {argv}")
    assert answered > len(FRESH_ACTIONS)


def test_it_answers_without_pydantic_and_says_the_same(tmp_path: Path) -> None:
    """In a fresh interpreter, as the installed script runs: nothing heavy is loaded when the
    reply is printed, and the reply is the full command's."""
    s = _workstation_in_use(tmp_path / "host")
    spy = ("import builtins, sys\nfrom gpuwatch.cli.main import main\nreal = builtins.print\n"
           "def spy(*a, **k):\n"
           f"    sys.stderr.write('HEAVY=' + ','.join(m for m in {HEAVY!r} if m in sys.modules)"
           " + '\\n')\n    real(*a, **k)\n"
           "builtins.print = spy\nsys.exit(main(sys.argv[1:]))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    env["PYTHONPATH"] = str(REPO)
    for line in (["probe", "detect-vfio", "--no-daemon"],
                 ["probe", "detect-host-devices", "--no-daemon"],
                 ["probe", "vfio-backend", "--addr", NV, "--no-daemon"],
                 ["probe", "detect-gpu", "--fresh"],
                 ["probe", "vfio-group-accessible", "--group=14"],
                 ["probe", "current-mode", "--addr", "0000:0a:00.0"],  # no such function
                 ["status"], ["list", "--json"]):
        argv = [*line, "--root", str(s.root)]
        done = subprocess.run([sys.executable, "-c", spy, *argv], capture_output=True,
                              env=env, timeout=60, text=True)
        assert done.stderr.startswith("HEAVY=\n"), (argv, done.stderr)
        args = [sys.executable, "-c", "import sys\nfrom gpuwatch.cli import direct, fast_report\n"
                "direct.run_direct = lambda argv: None\n"
                "fast_report.run_report = lambda argv: None\n"
                "from gpuwatch.cli.main import main\nsys.exit(main(sys.argv[1:]))", *argv]
        full = subprocess.run(args, capture_output=True, env=env, timeout=60, text=True)
        assert (done.returncode, done.stdout) == (full.returncode, full.stdout), argv
        assert done.stderr.removeprefix("HEAVY=\n") == full.stderr, argv


def test_a_config_file_or_a_daemon_sends_it_the_full_way(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    s = example_gpu_host(tmp_path / "host")
    root = str(s.root)
    argv = ["probe", "detect-vfio", "--root", root, "--no-daemon"]
    assert parse_direct(argv) == ("detect-vfio", {"group": None, "addr": None, "mode": None},
                                  root)
    # A config file's tables: the full command reads them (here, a label of its own).
    config = tmp_path / "config.yaml"
    config.write_text("pci_class_labels:\n  '0x0300': Own label\n")
    monkeypatch.setenv("GPUWATCH_CONFIG", str(config))
    assert parse_direct(argv) is None
    code, out, _ = run_main(capsys, argv)
    assert code == 0 and '"class_label":"Own label"' in out
    monkeypatch.delenv("GPUWATCH_CONFIG")
    # A setting the full command validates on the way.
    monkeypatch.setenv("GPUWATCH_PROC_READ_TIMEOUT", "soon")
    assert parse_direct(argv) is None
    code, _, err = run_main(capsys, argv)
    assert code == 2 and "GPUWATCH_PROC_READ_TIMEOUT" in err
    monkeypatch.delenv("GPUWATCH_PROC_READ_TIMEOUT")
    # A daemon socket for this root: asked first (here nothing listens, so the full command
    # falls back to its own scan), never skipped.
    sock = tmp_path / "gw.sock"
    sock.touch()
    assert parse_direct(["probe", "detect-vfio", "--root", root, "--socket", str(sock)]) is None
    assert parse_direct(["probe", "detect-vfio", "--root", root, "--socket",
                         str(tmp_path / "absent.sock")]) is not None
    # The root the daemon would watch when none is named.
    monkeypatch.setenv("GPUWATCH_ROOT", root)
    parsed = parse_direct(["probe", "detect-gpu", "--no-daemon"])
    assert parsed is not None and parsed[2] == root
    for line in (
        ["probe", "detect-vfio", "--root", str(tmp_path / "absent")],  # not a folder
        ["probe", "memlock", "--root", root],  # live answers: the full command's
        ["probe", "nvidia-holders", "--root", root],
        ["probe", "plan", "--mode", "vfio", "--addr", NV, "--root", root],
        ["probe", "detect-vfio", "--vendor", "0x10de", "--root", root],
        ["probe", "detect-vfio", "--config", str(config), "--root", root],
        ["probe", "detect-vfio", "--ro", root],  # abbreviations are argparse's
        ["probe", "display-driver", "--addr", "bogus", "--root", root],
        ["probe", "vfio-group-accessible", "--group", "x", "--root", root],
        ["probe", "detect-vfio", "extra", "--root", root],
        ["probe", "--help"],
    ):
        assert parse_direct(line) is None, line


def test_the_embedded_tables_as_plain_data_equal_the_validated_ones() -> None:
    plain = table_data(embedded_tables_raw())
    tables = default_tables()
    assert plain._asdict() == {k: getattr(tables, k) for k in plain._fields}


def test_the_plain_records_spell_the_models_fields_in_their_order() -> None:
    fn = PciFunction(addr=NV, vendor_id="0x10de", device_id="0x2204", class_="0x0300",
                     class_label="VGA", driver="vfio-pci", iommu_group=13, vfio_dev="vfio0",
                     vfio_cdev="/dev/vfio/devices/vfio0")
    assert tuple(fn.model_dump(by_alias=True)) == FUNCTION_KEYS
    fields = vfio_backend_fields(fn, {"/dev/vfio/13", "/dev/iommu"}, frozenset())
    assert fields["recommended"] == "iommufd"
    assert tuple(VfioBackend(**fields).model_dump()) == tuple(fields)


def test_a_closed_pipe_is_no_error(tmp_path: Path) -> None:
    s = synthetic_host(tmp_path / "host", 64)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run(
        f"{sys.executable} -m gpuwatch probe detect-vfio --no-daemon --root {s.root} | head -c1",
        shell=True, capture_output=True, env=env, timeout=60, text=True)
    assert done.stdout == "{" and done.stderr == ""


@pytest.mark.parametrize("machine", ["workstation-in-use", "grace-hopper-captured", "sriov-vgpu",
                                     "odd-bytes", "synthetic-96"])
def test_outlined_functions_read_in_full_answer_as_the_whole_scan(
    machine: str, tmp_path: Path
) -> None:
    """`FreshHost` on outlines completed on demand gives what it gives on the full scan, and
    reads in full only the functions its answers show."""
    s = MACHINES[machine](tmp_path / "host")
    paths = HostPaths(str(s.root))
    tables = table_data(embedded_tables_raw())
    whole = FreshHost(scan(paths, tables), tables, 1000, frozenset({1000}))
    outlines = [o for name, devpath in function_entries(paths)
                if (o := outline_function(paths, name, devpath)) is not None]
    full_reads: list[str] = []

    def read(o: FunctionOutline) -> PciSeen | None:
        full_reads.append(o.addr)
        return read_listed(paths, o.addr, o.devpath)

    lazy = FreshHost(scan_host(paths, tables, ()), tables, 1000, frozenset({1000}), outlines,
                     read)
    assert lazy.answer("detect-vfio") == whole.answer("detect-vfio")
    shown = {m["addr"] for gpu in whole.answer("detect-vfio")["gpus"]
             for m in gpu["group_members"]}
    assert set(full_reads) <= shown  # nothing read in full that the answer does not show
    for action in sorted(FRESH_ACTIONS):
        for addr in sorted(s.functions)[:8]:
            params = {"addr": addr, "group": 13, "mode": "vfio"}
            assert lazy.answer(action, **params) == whole.answer(action, **params), action


def test_a_function_gone_between_outline_and_read_sends_it_the_full_way(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    s = example_gpu_host(tmp_path / "host")
    monkeypatch.setattr(direct, "read_listed", lambda paths, name, devpath: None)
    assert run_direct(["probe", "detect-vfio", "--root", str(s.root), "--no-daemon"]) is None
    assert capsys.readouterr() == ("", "")
    code, out, _ = run_main(capsys, ["probe", "detect-vfio", "--root", str(s.root),
                                     "--no-daemon"])
    assert code == 0 and NV in out  # the full command's own scan


@pytest.mark.parametrize("machine", sorted(MACHINES))
def test_status_and_list_without_a_daemon_are_the_full_commands_bytes(
    machine: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``status`` and ``list`` on a root no daemon watches: built from the direct scan's
    answers with the stdlib (`Local`), and byte for byte what the full command prints."""
    monkeypatch.delenv("GPUWATCH_CONFIG", raising=False)
    monkeypatch.delenv("GPUWATCH_PROC_READ_TIMEOUT", raising=False)
    monkeypatch.delenv("GPUWATCH_ROOT", raising=False)
    s = MACHINES[machine](tmp_path / "host")
    root = ["--root", str(s.root)]
    for line in (["status"], ["status", "--json"], ["list"], ["list", "--json"],
                 ["list", "--managed", "no", "--json"], ["list", "--managed", "no"]):
        argv = [*line, *root]
        with monkeypatch.context() as m:
            m.setattr(fast_report, "run_report", lambda argv: None)
            full = run_main(capsys, argv)
        assert fast_report.run_report(argv) == 0, argv  # answered here
        here = capsys.readouterr()
        assert (0, here.out, here.err) == full, argv
