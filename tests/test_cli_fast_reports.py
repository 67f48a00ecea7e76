"""The stdlib-only ``gpuwatch status`` and ``gpuwatch list`` path: nothing heavy imported
before the reply is printed, and byte for byte the full command's output on hosts of many
kinds; anything it cannot answer exactly goes to the full command."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anyio
import pytest
import yaml

from gpuwatch.cli.fast import CONFIG_ENV, DEFAULT_CONFIG_PATH, ROOT_ENV
from gpuwatch.cli.fast_report import embedded_tables, parse_list, parse_status
from gpuwatch.service.daemon import served_config
from gpuwatch.service.testing import served_watcher, short_socket_dir
from gpuwatch.settings import CONFIG_ENV as SETTINGS_CONFIG_ENV
from gpuwatch.settings import DEFAULT_CONFIG_PATH as SETTINGS_CONFIG_PATH
from gpuwatch.settings import ROOT_ENV as SETTINGS_ROOT_ENV
from gpuwatch.settings import default_tables, load_settings
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.testing.machines import (
    ampere_altra_host,
    bmc_server_host,
    hgx_h100_host,
    hpe_ilo_host,
    hyperv_gpu_guest,
    single_gpu_desktop,
    vfio_noiommu_host,
    virtio_gpu_guest,
    vm_guest_host,
    vmd_host,
)
from gpuwatch.testing.modern import (
    VGPU_TYPES,
    grace_hopper_host,
    iommufd_only_host,
    sriov_gpu_host,
)
from tests.test_cli_fast import EDITED, daemon_with, run_full, run_full_both, run_spied
from tests.test_list_hostdev import hyphen_host, rcec_host, two_gpu_host

HOSTS: dict[str, Callable[[Path], object]] = {
    "example": example_gpu_host,
    "bmc": bmc_server_host,
    "bmc-unbound": lambda root: bmc_server_host(root).unbind("0000:03:00.0"),  # ast blacklisted
    "ilo": hpe_ilo_host,
    "hgx-noacs": lambda root: hgx_h100_host(root, gpus=2, acs=False),
    "desktop": single_gpu_desktop,
    "vmd": vmd_host,
    "vmd-shared": lambda root: vmd_host(root, shared=True),  # addresses of two widths
    "altra-smmu-unit": lambda root: ampere_altra_host(root, smmu="unit"),
    "altra-no-smmu": lambda root: ampere_altra_host(root, smmu="none"),
    "hyperv": hyperv_gpu_guest,
    "kvm-guest": virtio_gpu_guest,
    "guest": vm_guest_host,
    "grace": grace_hopper_host,
    "iommufd": iommufd_only_host,
    "sriov": lambda root: sriov_gpu_host(root, vfs=2),
    "vgpu": lambda root: sriov_gpu_host(root, vfs=2, vgpu=True),
    "vgpu-chosen": lambda root: sriov_gpu_host(root, vfs=2, vgpu=True).set_vgpu(
        "0000:41:00.5", 1156, VGPU_TYPES),
    "noiommu": vfio_noiommu_host,
    "iommu-off": lambda root: _iommu_off_host(root),
    "rcec": rcec_host,  # a function on pcieport that is no bridge: no block
    "two-gpus-one-group": two_gpu_host,  # the group's blocks once
    "hyphen-ids": hyphen_host,  # "--" in ids the comments name
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
    # A config file in force is decided with the daemon's answer (`ask_proven`), not here.
    monkeypatch.setenv(CONFIG_ENV, "/etc/x.yaml")
    assert parse_status(["status", "--root", "/r"]) == (False, "/r", None)


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


# ---------------------------------------------------------------- a daemon that read the file

#: Every status and list command line the report path takes.
REPORT_ARGVS = (["status"], ["status", "--json"], ["list"], ["list", "--json"],
                ["list", "--managed", "no"], ["list", "--managed=no", "--json"])
#: The A100 bound to a vfio-pci variant only the config file names.
VARIANT_ADDR = "0000:c1:00.0"
#: An edited config file that changes every table the reports show or apply: a vendor name
#: and a class label, no console kept for the host (the BMC's ASPEED VGA is offered) and a
#: vfio-pci variant (the A100 on it is in vfio mode).
TABLES = EDITED + (
    'gpu_vendors:\n  "0x10de": Team Green\n  "0x1a03": ASPEED\n'
    'pci_class_labels:\n  "0x0302": Compute card\n  "0x0300": VGA controller\n'
    "host_console_drivers: []\nhost_console_devices: []\nvfio_variant_drivers: [foo_vfio]\n")


def tables_host(root: Path) -> SysRoot:
    """The BMC server, one A100 on the variant `TABLES` names."""
    host = bmc_server_host(root)
    host.bind(VARIANT_ADDR, "foo_vfio")
    return host


def assert_report(argv: list[str], config: Path, fast: bool,
                  monkeypatch: pytest.MonkeyPatch) -> bytes:
    """``argv`` with ``config`` in force answers as the full command does, both through the
    daemon and with ``--no-daemon`` (the file's tables, read in full), nothing heavy imported
    when ``fast``; its output."""
    code, out, err = run_spied(argv, {CONFIG_ENV: str(config)})
    assert code == 0, (argv, err)
    assert ("HEAVY=\n" in err) == fast, (argv, err)
    with monkeypatch.context() as m:
        m.setenv(CONFIG_ENV, str(config))
        assert out == run_full(argv), argv
        assert out == run_full([*argv, "--no-daemon"]), argv
    return out


def test_status_and_list_with_the_config_file_the_daemon_read_are_answered_the_fast_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An operator's edit of the config file sent every `status` and `list` the full way
    (about 4 times slower), though the daemon had read and checked that very file. The
    daemon's answers carry its class labels; the tables the reports apply themselves (vendor
    names, the host's console, vfio-pci variants) come in its ``config`` answer, built from
    that file: the same bytes as the full command, which reads the file."""
    host = tables_host(tmp_path / "host")
    config = tmp_path / "config.yaml"
    config.write_text(TABLES)
    with daemon_with(host, tmp_path, config) as sock:
        where = ["--socket", sock, "--root", str(host.root)]
        for argv in REPORT_ARGVS:
            assert_report([*argv, *where], config, True, monkeypatch)
        status = json.loads(assert_report(["status", "--json", *where], config, True,
                                          monkeypatch))
        gpus = {g["addr"]: g for g in status["gpus"]}
        assert {g["vendor"] for g in gpus.values()} == {"Team Green", "ASPEED"}
        assert gpus[VARIANT_ADDR]["class_label"] == "Compute card"
        assert (gpus[VARIANT_ADDR]["mode"], gpus[VARIANT_ADDR]["vfio_variant"]) == (
            "vfio", "foo_vfio")
        listed = json.loads(assert_report(["list", "--json", *where], config, True,
                                          monkeypatch))
        by_addr = {g["addr"]: g for g in listed}
        # The file emptied the console tables: the ASPEED is kept by its boot_vga alone (the
        # A100s are 3D controllers with no framebuffer, no screens), not as the BMC's.
        assert by_addr["0000:03:00.0"]["reason"].startswith(
            "0000:03:00.0 is the host's boot display (boot_vga 1)")
        assert not any(g["kept_for_host"] for a, g in by_addr.items() if a != "0000:03:00.0")


def test_the_reports_take_the_root_the_daemon_took_from_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``--root`` the config file's ``root`` is the command's: the daemon that took
    its root from that file answers for it, the fast way, with the file's tables."""
    host = tables_host(tmp_path / "host")
    config = tmp_path / "config.yaml"
    config.write_text(TABLES + f"root: {host.root}\n")
    with daemon_with(host, tmp_path, config, root_flag=False) as sock:
        for argv in REPORT_ARGVS:
            code, out, err = run_spied([*argv, "--socket", sock], {CONFIG_ENV: str(config)})
            assert code == 0 and "HEAVY=\n" in err, (argv, err)
            with monkeypatch.context() as m:
                m.setenv(CONFIG_ENV, str(config))
                assert out == run_full([*argv, "--socket", sock, "--root", str(host.root)])


def test_a_config_file_the_daemon_did_not_read_as_it_is_gives_the_full_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy of the daemon's file, or its file edited since the daemon started, may hold
    other tables: the full command reads it. One it refuses is refused, exit 2, one line."""
    host = tables_host(tmp_path / "host")
    config, copy = tmp_path / "config.yaml", tmp_path / "copy.yaml"
    config.write_text(TABLES)
    copy.write_text(TABLES.replace("Team Green", "Team Copy"))
    with daemon_with(host, tmp_path, config) as sock:
        where = ["--socket", sock, "--root", str(host.root)]
        for argv in REPORT_ARGVS:
            out = assert_report([*argv, *where], copy, False, monkeypatch)
            assert b"Team Green" not in out, argv
        time.sleep(0.01)  # past the file system's clock tick: the edit moves the times
        config.write_text(TABLES.replace("Team Green", "Team Later"))
        for argv in REPORT_ARGVS:
            out = assert_report([*argv, *where], config, False, monkeypatch)
            assert b"Team Green" not in out, argv
        config.write_text(TABLES.replace("Team Green", "[Team, Green]"))
        for argv in REPORT_ARGVS:
            code, out, err = run_spied([*argv, *where], {CONFIG_ENV: str(config)})
            lines = [ln for ln in err.splitlines() if not ln.startswith("HEAVY=")]
            assert (code, out, len(lines)) == (2, b"", 1), (argv, err)
            assert lines[0].startswith(f"gpuwatch: {config}: gpu_vendors"), (argv, err)


async def test_a_daemon_that_names_no_tables_gives_the_full_report(
    sockdir: str, tmp_path: Path
) -> None:
    """A daemon whose ``config`` answer proves the file but carries no tables (a release
    before them) leaves the reports without the file's tables: the full command runs. (This
    in-process daemon says it read the file, to show that the tables alone make the
    difference.)"""
    host = tables_host(tmp_path / "host")
    config = tmp_path / "config.yaml"
    config.write_text(TABLES)
    root = str(host.root)
    said = served_config(load_settings(config=str(config), env={}, resolve_groups=False))
    for tables, fast in ((True, True), (False, False)):
        answer = said if tables else {k: v for k, v in said.items() if k != "tables"}
        async with served_watcher(root, f"{sockdir}/gw.sock", config=answer) as served:
            argv = ["status", "--socket", served.path, "--root", root]
            code, out, err = await anyio.to_thread.run_sync(
                run_spied, argv, {CONFIG_ENV: str(config)})
            assert code == 0 and ("HEAVY=\n" in err) == fast, (tables, err)
            assert b"Team Green" in out


def test_the_daemons_tables_read_back_as_it_built_them(tmp_path: Path) -> None:
    """What the daemon's ``config`` answer carries of its tables (`tables_json`) is what the
    report path reads back (`served_tables`), every key in the model's spelling, whether
    the file spelt its ids so or not."""
    from gpuwatch.cli.fast_report import served_tables
    from gpuwatch.core.tabledata import tables_json
    from gpuwatch.settings import load_tables

    config = tmp_path / "config.yaml"
    config.write_text(TABLES.replace('"0x1a03"', '"1A03"'))
    for tables in (default_tables(), load_tables(str(config))):
        back = served_tables({"tables": json.loads(json.dumps(tables_json(tables)))})
        assert tables_json(back) == tables_json(tables)
        assert dict(back.gpu_vendors) == dict(tables.gpu_vendors)
    assert dict(load_tables(str(config)).gpu_vendors)["0x1a03"] == "ASPEED"
    shipped = tables_json(default_tables())
    # One list of the tables (`TABLE_KEYS`) for the answer, the stdlib form and the model.
    from gpuwatch.core.tabledata import TABLE_KEYS, TableData
    from gpuwatch.core.tables import Tables

    assert tuple(shipped) == TABLE_KEYS == TableData._fields == tuple(Tables.model_fields)
    for bad in ({}, {"tables": None}, {"tables": {**shipped, "gpu_vendors": [1]}},
                {"tables": {**shipped, "host_console_drivers": [1]}},
                {"tables": {**shipped, "pci_class_labels": ["0x03"]}},
                {"tables": {k: v for k, v in shipped.items() if k != "host_console_devices"}}):
        with pytest.raises(ValueError):
            served_tables(bad)
