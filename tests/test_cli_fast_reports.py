"""The stdlib-only ``gpuwatch status`` and ``gpuwatch list`` path: nothing heavy imported
before the reply is printed, and byte for byte the full command's output on hosts of many
kinds; anything it cannot answer exactly goes to the full command."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
import yaml

from gpuwatch.cli.fast_report import (
    CONFIG_ENV,
    DEFAULT_CONFIG_PATH,
    ROOT_ENV,
    embedded_tables,
    parse_list,
    parse_status,
)
from gpuwatch.service.testing import served_watcher, short_socket_dir
from gpuwatch.settings import CONFIG_ENV as SETTINGS_CONFIG_ENV
from gpuwatch.settings import DEFAULT_CONFIG_PATH as SETTINGS_CONFIG_PATH
from gpuwatch.settings import ROOT_ENV as SETTINGS_ROOT_ENV
from gpuwatch.settings import default_tables
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.testing.machines import (
    bmc_server_host,
    hgx_h100_host,
    hpe_ilo_host,
    single_gpu_desktop,
    vfio_noiommu_host,
    vm_guest_host,
    vmd_host,
)
from gpuwatch.testing.modern import (
    VGPU_TYPES,
    grace_hopper_host,
    iommufd_only_host,
    sriov_gpu_host,
)
from tests.test_cli_fast import run_full_both, run_spied

HOSTS: dict[str, Callable[[Path], object]] = {
    "example": example_gpu_host,
    "bmc": bmc_server_host,
    "bmc-unbound": lambda root: bmc_server_host(root).unbind("0000:03:00.0"),  # ast blacklisted
    "ilo": hpe_ilo_host,
    "hgx-noacs": lambda root: hgx_h100_host(root, gpus=2, acs=False),
    "desktop": single_gpu_desktop,
    "vmd": vmd_host,
    "guest": vm_guest_host,
    "grace": grace_hopper_host,
    "iommufd": iommufd_only_host,
    "sriov": lambda root: sriov_gpu_host(root, vfs=2),
    "vgpu": lambda root: sriov_gpu_host(root, vfs=2, vgpu=True),
    "vgpu-chosen": lambda root: sriov_gpu_host(root, vfs=2, vgpu=True).set_vgpu(
        "0000:41:00.5", 1156, VGPU_TYPES),
    "noiommu": vfio_noiommu_host,
    "iommu-off": lambda root: _iommu_off_host(root),
}


def _iommu_off_host(root: Path) -> SysRoot:
    """A workstation booted with ``intel_iommu=on iommu=off``: no group (x86's no_iommu),
    whose `status` hint names the parameter."""
    s = SysRoot(root)
    s.add_function("0000:01:00.0", device="0x2204", driver="nvidia", iommu_group=None)
    s.set_cmdline("BOOT_IMAGE=/vmlinuz ro intel_iommu=on iommu=off")
    return s


@pytest.fixture
def sockdir() -> Iterator[str]:
    with short_socket_dir() as path:
        yield path


@pytest.mark.parametrize("kind", sorted(HOSTS))
async def test_status_and_list_the_daemon_answers_are_the_full_commands_bytes(
    kind: str, tmp_path: Path, sockdir: str
) -> None:
    root = tmp_path / "host"
    HOSTS[kind](root)
    async with served_watcher(str(root), f"{sockdir}/gw.sock") as served:
        sock = ["--socket", served.path, "--root", str(root)]
        for argv in (
            ["status", *sock],
            ["status", "--json", *sock],
            ["list", *sock],
            ["list", "--json", *sock],
            ["list", "--managed", "no", *sock],
            ["list", *sock, "--managed=no", "--json"],
        ):
            code, out, err = await anyio.to_thread.run_sync(run_spied, argv)
            assert code == 0, (argv, err)
            assert "HEAVY=\n" in err, (kind, argv, err)  # nothing heavy when printed
            full_out, _ = await anyio.to_thread.run_sync(run_full_both, argv)
            assert out == full_out, (kind, argv)
            if "--json" in argv:
                json.loads(out)


async def test_what_the_report_path_cannot_answer_goes_to_the_full_command(
    host: SysRoot, sockdir: str, tmp_path: Path
) -> None:
    root = str(host.root)
    config = tmp_path / "config.yaml"
    config.write_text('gpu_vendors:\n  "0x10de": Team Green\n')
    async with served_watcher(root, f"{sockdir}/gw.sock") as served:
        # A config file changes the tables: the full command reads it (and says so in its words).
        argv = ["status", "--config", str(config), "--socket", served.path, "--root", root]
        code, out, err = await anyio.to_thread.run_sync(run_spied, argv)
        assert code == 0 and "Team Green" in out.decode() and "HEAVY=\n" not in err
        # A bad --managed value is argparse's error, exit 2.
        code, out, err = await anyio.to_thread.run_sync(
            run_spied, ["list", "--managed", "maybe", "--socket", served.path, "--root", root])
        assert code == 2 and out == b"" and "invalid choice" in err


def test_only_plain_status_and_list_command_lines_are_taken(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    monkeypatch.delenv(ROOT_ENV, raising=False)
    if Path(DEFAULT_CONFIG_PATH).is_file():
        pytest.skip("this host has a config file: every report goes to the full command")
    assert parse_status(["status"]) == (False, "/", None)
    assert parse_status(["status", "--json", "--root", "/r", "--socket=/s"]) == (
        True, "/r", "/s")
    assert parse_list(["list", "--managed", "no"]) == (False, "no", "/", None)
    for argv in (
        ["status", "--config", "x.yaml"],
        ["status", "--no-daemon"],
        ["status", "extra"],
        ["status", "--json", "--json"],
        ["status", "--managed", "no"],
        ["list", "--managed", "maybe"],
        ["list", "--man", "no"],
        ["probe", "detect-vfio"],
    ):
        assert (parse_list(argv) if argv[0] == "list" else parse_status(argv)) is None, argv
    monkeypatch.setenv(ROOT_ENV, "/elsewhere")  # the full command's root, not /
    assert parse_status(["status"]) is None
    monkeypatch.setenv(ROOT_ENV, "  ")  # blank: the full command refuses it, as the daemon does
    assert parse_status(["status"]) is None
    assert parse_status(["status", "--root", "/r"]) == (False, "/r", None)
    monkeypatch.setenv(CONFIG_ENV, "/etc/x.yaml")  # its tables: the full command's business
    assert parse_status(["status", "--root", "/r"]) is None


def test_the_report_path_reads_the_settings_the_full_command_reads() -> None:
    assert (CONFIG_ENV, ROOT_ENV, DEFAULT_CONFIG_PATH) == (
        SETTINGS_CONFIG_ENV, SETTINGS_ROOT_ENV, SETTINGS_CONFIG_PATH)


def test_the_shipped_json_tables_equal_the_embedded_yaml() -> None:
    shipped = embedded_tables()
    source = Path(__file__).resolve().parents[1] / "gpuwatch" / "data" / "tables.yaml"
    assert shipped == yaml.safe_load(source.read_text())
    tables = default_tables()
    assert shipped["gpu_vendors"] == dict(tables.gpu_vendors)
    assert tuple(shipped["host_console_drivers"]) == tables.host_console_drivers
    assert tuple(shipped["host_console_devices"]) == tables.host_console_devices


@pytest.mark.parametrize("boot_vga", [True, False])
async def test_the_daemon_list_reads_boot_vga_inside_a_tree_with_absolute_links(
    boot_vga: bool, tmp_path: Path, sockdir: str
) -> None:
    """A captured tree may spell its bus entries absolute (``/sys/devices/…``): the fast
    report's own ``boot_vga`` read leads under the root, as the model's does, never to the
    host running the test (one of the two cases differs from whatever that host holds)."""
    from tests.test_real_hosts_capture import _absolute_links

    live = tmp_path / "live"
    single_gpu_desktop(live, boot_vga=boot_vga)
    copied = tmp_path / "copied"
    single_gpu_desktop(copied, boot_vga=boot_vga)
    assert _absolute_links(copied) > 5
    async with served_watcher(str(copied), f"{sockdir}/gw.sock") as served:
        for argv in (["list", "--json"], ["status"]):
            code, out, err = await anyio.to_thread.run_sync(
                run_spied, [*argv, "--socket", served.path, "--root", str(copied)])
            assert code == 0, err
            assert "HEAVY=\n" in err  # the fast path answered
            live_out, _ = await anyio.to_thread.run_sync(run_full_both,
                                                         [*argv, "--root", str(live)])
            assert out == live_out, argv
