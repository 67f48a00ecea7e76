"""The library, the CLI and the daemon read the same config file and environment.

A probe run directly must answer with the tables (and look at the root) the daemon uses:
``$GPUWATCH_CONFIG``, else ``/etc/gpuwatch/config.yaml``; ``$GPUWATCH_ROOT``, else the
file's ``root``. Otherwise ``gpuwatch list`` and the daemon disagree about the same host.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cli_helpers import run_main as cli

import gpuwatch
from gpuwatch.settings import config_file_path, load_settings, root_in_force, tables_in_force
from gpuwatch.testing.machines import bmc_server_host

ASPEED_VGA = "0000:03:00.0"
#: The file empties the ASPEED out of the console tables: it is kept for its boot_vga alone
#: (the A100s beside it are 3D controllers with no framebuffer, no screens), not as the BMC's.
ASPEED_BOOT = (f"{ASPEED_VGA} is the host's boot display (boot_vga 1) and its only display "
               "function: passing it through leaves the host without a console")




@pytest.fixture
def server(tmp_path: Path) -> Path:
    return bmc_server_host(tmp_path / "host").root


@pytest.fixture
def config(tmp_path: Path, server: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "root": str(server),
        "host_console_drivers": ["hpilo"],  # the ASPEED is no longer the host's
        "host_console_devices": ["0x103c:0x3307"],  # nor by its ids (only an iLO's listed)
        "gpu_vendors": {"0x10de": "Team Green", "0x1a03": "ASPEED"},
        "log_keep": 3,  # a daemon option: the probe reads the file, and ignores it
    }))
    return path


def test_library_reads_the_daemons_file(config: Path, server: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUWATCH_CONFIG", str(config))
    monkeypatch.delenv("GPUWATCH_ROOT", raising=False)
    daemon = load_settings(resolve_groups=False)
    assert daemon.config_path == str(config) and daemon.root == str(server)
    model = gpuwatch.scan()  # no root, no config: the daemon's
    assert model.root == str(server)
    assert model.tables == daemon.tables() == tables_in_force()
    assert model.kept_for_host(ASPEED_VGA) == ASPEED_BOOT  # the file's tables, no "ast"
    assert gpuwatch.probe("detect-gpu") is True  # the fixture's answer, not this machine's


def test_env_root_wins_over_the_file(config: Path, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    other = bmc_server_host(tmp_path / "other").root
    monkeypatch.setenv("GPUWATCH_CONFIG", str(config))
    monkeypatch.setenv("GPUWATCH_ROOT", str(other))
    assert load_settings(resolve_groups=False).root == str(other) == root_in_force()
    assert gpuwatch.scan().root == str(other)
    assert root_in_force("/x") == "/x"  # given wins


def test_cli_without_flags_answers_like_the_daemon(config: Path, server: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("GPUWATCH_CONFIG", str(config))
    monkeypatch.delenv("GPUWATCH_ROOT", raising=False)
    code, out, err = cli(capsys, "list", "--json", "--no-daemon")
    assert (code, err) == (0, "")
    gpus = {g["addr"]: g for g in json.loads(out)}
    assert gpus[ASPEED_VGA]["reason"] == ASPEED_BOOT  # the file's table, not the embedded
    assert gpus["0000:41:00.0"]["vendor"] == "Team Green"
    code, out, _ = cli(capsys, "status", "--json", "--no-daemon")
    assert code == 0 and {g["vendor"] for g in json.loads(out)["gpus"]} == {"ASPEED",
                                                                            "Team Green"}
    code, out, _ = cli(capsys, "probe", "detect-vfio", "--no-daemon")
    assert code == 0 and len(json.loads(out)["result"]["gpus"]) == 3


def test_bad_file_named_by_the_environment_is_exit_2(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("host_console_drivers: [ast\n")
    monkeypatch.setenv("GPUWATCH_CONFIG", str(bad))
    code, out, err = cli(capsys, "probe", "detect-gpu", "--root", str(tmp_path))
    assert code == 2 and out == "" and err.count("\n") == 1 and "not valid YAML" in err
    assert config_file_path(None, {}, default=str(tmp_path / "absent.yaml")) is None
    assert config_file_path(None, {"GPUWATCH_CONFIG": str(bad)}) == str(bad)
