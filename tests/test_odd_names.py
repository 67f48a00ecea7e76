"""A name taken from a link's target holds whatever bytes the link was made with: a crafted
or corrupted tree can name a function's driver in bytes that are not UTF-8, or in escape
codes. Each such byte reads as U+FFFD (as in an attribute's text), so every JSON answer
(status, list, the probes, direct or not) is written, and is UTF-8; nothing crashes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from cli_helpers import run_main as cli
from daemon_helpers import env, gpuwatch_cmd

import gpuwatch
from gpuwatch.testing import SysRoot, example_gpu_host

pytestmark = pytest.mark.timeout(120)

NV = "0000:01:00.0"
ODD = "nv\ufffd\x1b[31mX"  # what b"nv\xff\x1b[31mX" reads as


def odd_driver_host(root: Path) -> SysRoot:
    s = example_gpu_host(root)
    link = s.device_dir(NV) / "driver"
    link.unlink()
    os.symlink(b"../../../../bus/pci/drivers/nv\xff\x1b[31mX", bytes(link))
    return s


def test_a_driver_named_in_odd_bytes_reads_with_replacement(tmp_path: Path) -> None:
    s = odd_driver_host(tmp_path / "h")
    assert gpuwatch.scan(s.root).function(NV).driver == ODD


@pytest.mark.parametrize("command", [["status", "--json"], ["list", "--json"]])
def test_status_and_list_write_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                  command: list[str]) -> None:
    s = odd_driver_host(tmp_path / "h")
    code, out, err = cli(capsys, *command, "--no-daemon", "--root", str(s.root))
    assert (code, err) == (0, "")
    got = json.loads(out)
    gpus = got["gpus"] if command[0] == "status" else got
    drivers = {f["addr"]: f["driver"]
               for g in gpus for f in g["members" if command[0] == "status" else "functions"]}
    assert drivers[NV] == ODD


@pytest.mark.parametrize("action", ["detect-vfio", "display-driver"])
def test_the_probe_writes_utf8(tmp_path: Path, action: str) -> None:
    """The probe as the installed script runs it (the direct path, no daemon): its bytes
    are UTF-8 JSON naming the driver with U+FFFD."""
    s = odd_driver_host(tmp_path / "h")
    argv = ["probe", action, "--root", str(s.root)] + (["--addr", NV] if action != "detect-vfio"
                                                       else [])
    done = subprocess.run(gpuwatch_cmd(*argv), env=env(), capture_output=True, timeout=60,
                          check=False)
    assert (done.returncode, done.stderr) == (0, b"")
    result = json.loads(done.stdout.decode("utf-8"))["result"]
    if action == "display-driver":
        assert result == ODD
    else:
        assert {g["addr"]: g["driver"] for g in result["gpus"]}[NV] == ODD
