"""``host_namespaces`` and the CDI fact behind ``detect-gpu``: with the setting on (the
Kubernetes switching overlay) ``nvidia-ctk`` runs on the host, through nsenter, so whether it
can make a spec is whether the host's PATH has it (under ``<root>/proc/1/root``), as the
switch and ``ensure-cdi`` find it; the image has none. Before, the model asked the daemon's
own PATH: on a node with the NVIDIA Container Toolkit but no spec yet, detect-gpu, status
and metrics said NVIDIA was not usable ("install the NVIDIA Container Toolkit") although
``ensure-cdi`` in the pod would make the spec. With the setting off, our PATH, as before.

Each host: the nvidia module, a GPU on nvidia, no spec, an empty PATH, and an executable
``nvidia-ctk`` only in the host's ``/usr/bin``."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import anyio
import pytest

import gpuwatch
from gpuwatch.cli import direct, fast_report
from gpuwatch.cli.main import main
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot
from gpuwatch.watch.watcher import open_watcher

ENV = "GPUWATCH_HOST_NAMESPACES"
GPU = "0000:01:00.0"


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SysRoot:
    """The node: toolkit installed on the host, no spec yet, nothing on our PATH."""
    s = SysRoot(tmp_path / "host")
    s.add_module("nvidia")
    s.add_function(GPU, driver="nvidia", iommu_group=1)
    tool = s.root / "proc/1/root/usr/bin/nvidia-ctk"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\nexit 99\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    empty = tmp_path / "image-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    for name in (ENV, "GPUWATCH_CONFIG", "GPUWATCH_ROOT", "GPUWATCH_PROC_READ_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    return s


@pytest.fixture(params=[True, False], ids=["on", "off"])
def setting(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """``$GPUWATCH_HOST_NAMESPACES`` on or unset: detect-gpu follows it."""
    on = bool(request.param)
    if on:
        monkeypatch.setenv(ENV, "1")
    return on


def run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    assert err == ""
    return code, out


# --------------------------------------------------------------------------- the model


def test_the_scan_asks_the_hosts_path(node: SysRoot, setting: bool) -> None:
    assert gpuwatch.scan(node.root).probe("detect-gpu") is setting


def test_the_config_files_setting_counts_too(node: SysRoot, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("host_namespaces: true\n")
    assert gpuwatch.scan(node.root, str(config)).probe("detect-gpu") is True
    monkeypatch.setenv(ENV, "0")  # the environment wins, as the daemon reads it
    assert gpuwatch.scan(node.root, str(config)).probe("detect-gpu") is False


async def test_the_watchers_scan_and_cdi_poll_ask_the_hosts_path(
        node: SysRoot, setting: bool) -> None:
    """The first scan, then the CDI poll after the spec goes: with the setting on the
    toolkit on the host still makes NVIDIA usable."""
    async with open_watcher(node.root, MemorySource(), reconcile_interval=0,
                            cdi_poll_interval=0.02) as watcher:
        assert watcher.model.probe("detect-gpu") is setting
        node.add_cdi_spec("etc")
        with anyio.fail_after(10):
            while not watcher.model.state.cdi.etc_spec:
                await anyio.sleep(0.02)
        assert watcher.model.probe("detect-gpu") is True
        node.remove_cdi_spec("etc")
        with anyio.fail_after(10):
            while watcher.model.state.cdi.etc_spec:
                await anyio.sleep(0.02)
        assert watcher.model.probe("detect-gpu") is setting


@pytest.mark.parametrize("on", [True, False])
async def test_the_daemons_flag_reaches_the_watcher(node: SysRoot, on: bool) -> None:
    """``watch --host-namespaces`` hands its setting over (the daemon passes its tables,
    not a file, so the watcher cannot read it there): it wins over the environment."""
    async with open_watcher(node.root, MemorySource(), reconcile_interval=0,
                            cdi_poll_interval=0, host_namespaces=on) as watcher:
        assert watcher.model.probe("detect-gpu") is on


# --------------------------------------------------------------------------- the CLI


def test_a_direct_probe_asks_the_hosts_path(
        node: SysRoot, setting: bool, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The stdlib scan (`run_direct`) and the full command say the same."""
    argv = ["probe", "detect-gpu", "--root", str(node.root), "--no-daemon"]
    assert direct.run_direct(argv) == 0
    fast = capsys.readouterr().out
    assert json.loads(fast)["result"] is setting
    with monkeypatch.context() as m:
        m.setattr(direct, "run_direct", lambda argv: None)
        assert run(capsys, argv) == (0, fast)


def test_status_says_nvidia_is_usable_where_the_host_has_the_toolkit(
        node: SysRoot, setting: bool, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``status --json``'s nvidia_usable, from the stdlib report and the full command."""
    argv = ["status", "--json", "--root", str(node.root)]
    assert fast_report.run_report(argv) == 0
    fast = capsys.readouterr().out
    assert json.loads(fast)["nvidia_usable"] is setting
    with monkeypatch.context() as m:
        m.setattr(fast_report, "run_report", lambda argv: None)
        code, full = run(capsys, [*argv, "--no-daemon"])
    assert code == 0 and json.loads(full)["nvidia_usable"] is setting
    text_code, text = run(capsys, ["status", "--root", str(node.root), "--no-daemon"])
    assert text_code == 0
    assert ("install the NVIDIA Container Toolkit" in text) is not setting


def test_a_bad_setting_is_the_full_commands_error(
        node: SysRoot, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The stdlib paths leave a value they cannot read to the full command: exit 2, one
    line naming the variable."""
    monkeypatch.setenv(ENV, "maybe")
    argv = ["probe", "detect-gpu", "--root", str(node.root), "--no-daemon"]
    assert direct.run_direct(argv) is None
    for line in (argv, ["status", "--json", "--root", str(node.root)]):
        try:
            code = main(line)
        except SystemExit as exc:
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        assert (code, out) == (2, "")
        assert ENV in err and len(err.strip().splitlines()) == 1
