"""``gpuwatch list``: the note on libvirt's managed attribute and ``--managed no``, in text and
JSON, scanned directly and answered by a daemon."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Iterator

import pytest
from cli_helpers import run_cli as run_cli_async
from cli_helpers import run_main as run_cli

from gpuwatch.service.testing import served_watcher, short_socket_dir
from gpuwatch.testing import SysRoot

NV, NV_AUDIO, IGPU = "0000:01:00.0", "0000:01:00.1", "0000:00:02.0"




def xml_part(text: str) -> ET.Element:
    """Everything but the prose notes must paste into a domain as XML."""
    body = "\n".join(line for line in text.splitlines() if not line.startswith("note: "))
    return ET.fromstring(f"<devices>{body}</devices>")


def notes(text: str) -> list[str]:
    return [line.removeprefix("note: ") for line in text.splitlines() if line.startswith("note: ")]


def test_default_blocks_are_managed_and_say_what_that_skips(
    host: SysRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "list", "--root", str(host.root))
    assert (code, err) == (0, "")
    devices = xml_part(out)
    assert [h.get("managed") for h in devices.iter("hostdev")] == ["yes", "yes", "yes"]
    said = notes(out)
    assert len(said) == 2  # one per GPU (iGPU, NVIDIA)
    for note in said:
        assert "managed='yes'" in note and "libvirt" in note and "holder" in note
        assert "gpuwatch list --managed no" in note

    code, out, _ = run_cli(capsys, "list", "--root", str(host.root), "--json")
    gpus = json.loads(out)
    assert [g["managed"] for g in gpus] == ["yes", "yes"]
    assert all("does not" in g["note"] or "without" in g["note"] for g in gpus)
    assert all("holder" in g["note"] for g in gpus)


def test_managed_no_gives_unmanaged_blocks_and_the_switch_commands(
    host: SysRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "list", "--root", str(host.root), "--managed", "no")
    assert code == 0
    devices = xml_part(out)
    addrs = [
        (a.get("bus"), a.get("slot"), a.get("function")) for a in devices.iter("address")
    ]
    assert addrs == [("0x00", "0x02", "0x0"), ("0x01", "0x00", "0x0"), ("0x01", "0x00", "0x1")]
    assert {h.get("managed") for h in devices.iter("hostdev")} == {"no"}
    assert "managed='yes'" not in out

    code, out, _ = run_cli(capsys, "list", "--root", str(host.root), "--managed", "no", "--json")
    gpus = {g["addr"]: g for g in json.loads(out)}
    nv = gpus[NV]
    assert nv["managed"] == "no"
    assert f"gpuwatch mode vfio --addr {NV}" in nv["note"]
    assert f"gpuwatch mode nvidia --addr {NV}" in nv["note"]
    assert all("managed='no'" in f["hostdev_xml"] for f in nv["functions"])
    # Intel's host driver is not a gpuwatch mode: no "back to nvidia" advice for it.
    assert f"gpuwatch mode vfio --addr {IGPU}" in gpus[IGPU]["note"]
    assert "mode nvidia" not in gpus[IGPU]["note"]


def test_bad_managed_value_is_a_usage_error(
    host: SysRoot, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_cli(capsys, "list", "--root", str(host.root), "--managed", "maybe")
    assert code == 2
    assert "invalid choice" in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def sockdir() -> Iterator[str]:
    with short_socket_dir() as path:
        yield path


async def test_daemon_answer_gives_the_same_blocks_and_notes(
    host: SysRoot, sockdir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = f"{sockdir}/gw.sock"
    direct = {}
    for managed in ("yes", "no"):
        _, direct[managed], _ = await run_cli_async(
            capsys, "list", "--root", str(host.root), "--no-daemon", "--json", "--managed", managed
        )
    async with served_watcher(host.root, path):
        for managed in ("yes", "no"):
            code, out, _ = await run_cli_async(
                capsys, "list", "--root", str(host.root), "--socket", path, "--json",
                "--managed", managed,
            )
            assert code == 0
            assert json.loads(out) == json.loads(direct[managed])
            assert {g["managed"] for g in json.loads(out)} == {managed}
