"""Trees captured from real hosts with `gpuwatch.testing.capture`, and the capture itself.

Each archive under ``fixtures/hosts`` was taken of a real machine, with what gpuwatch answered
there beside it (``*.answers.json``): the capture must answer the same, so a change that
reads a real kernel's tree differently shows here. The capture is also checked on trees
built here: links kept as links, identifiers replaced, no file opened that could block or
that names the machine.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import run_main

from gpuwatch.testing import SysRoot
from gpuwatch.testing.capture import CONFIG_BYTES, capture, extract
from gpuwatch.testing.sysroot import example_gpu_host

HOSTS = Path(__file__).parent / "fixtures" / "hosts"
H100 = HOSTS / "h100-firecracker"
_H100_ANSWERS: dict[str, dict[str, Any]] = json.loads(
    (HOSTS / "h100-firecracker.answers.json").read_text())["answers"]


@pytest.fixture(scope="module")
def h100_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("h100")
    extract(str(H100) + ".tar.gz", str(root))
    return root


def _without_memlock(text: str) -> dict[str, Any]:
    answer: dict[str, Any] = json.loads(text)
    answer.pop("memlock")  # this process's limit, not the host's
    return answer


@pytest.mark.parametrize("command", sorted(_H100_ANSWERS))
def test_the_h100_capture_answers_as_the_real_host_did(
        command: str, h100_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    want = _H100_ANSWERS[command]
    code, out, _ = run_main(capsys, *command.split(), "--root", str(h100_root), "--no-daemon")
    assert code == want["rc"]
    if command.startswith("status --json"):
        assert _without_memlock(out) == want["stdout"]
    else:
        assert out == want["stdout"]


def test_the_h100_capture_keeps_the_kernel_layout(h100_root: Path) -> None:
    """Links stayed links (a copy that follows them would have made folders), the GPU's node
    numbers are in the manifest, and no UUID of the machine survived."""
    bus = h100_root / "sys/bus/pci/devices/0000:00:06.0"
    assert bus.is_symlink()
    assert os.readlink(bus) == "../../../devices/pci0000:00/0000:00:06.0"
    assert (bus / "driver").is_symlink() and os.readlink(bus / "driver").endswith("/nvidia")
    manifest = json.loads((h100_root / "capture.json").read_text())
    nodes = {d["path"]: d for d in manifest["dev"]}
    assert nodes["/dev/nvidia0"]["rdev"] == "195:0" and nodes["/dev/nvidia0"]["type"] == "char"
    info = next((h100_root / "proc/driver/nvidia/gpus").iterdir()) / "information"
    assert "GPU UUID: \t GPU-00000000-0000-4000-8000-" in info.read_text()


# --- the capture on trees built here ---------------------------------------------------------

def _answers(root: Path, capsys: pytest.CaptureFixture[str]) -> list[tuple[int, str]]:
    out = []
    for argv in (["status", "--json"], ["probe", "detect-vfio"], ["list", "--json"],
                 ["probe", "detect-host-devices"], ["probe", "amd-gfx-version"]):
        code, text, _ = run_main(capsys, *argv, "--root", str(root), "--no-daemon")
        out.append((code, text.replace(str(root), "ROOT")))
    return out


def test_a_capture_answers_as_the_tree_it_was_taken_of(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    host = example_gpu_host(tmp_path / "host")
    data, manifest = capture(str(host.root))
    (tmp_path / "host.tar.gz").write_bytes(data)
    assert extract(str(tmp_path / "host.tar.gz"), str(tmp_path / "copy")) == manifest
    assert _answers(tmp_path / "copy", capsys) == _answers(host.root, capsys)
    assert json.loads(_answers(tmp_path / "copy", capsys)[2][1])  # it has GPUs to list


def test_identifiers_are_replaced_alike_everywhere_and_the_command_line_trimmed(
        tmp_path: Path) -> None:
    host = example_gpu_host(tmp_path / "host")
    real = "0fb3c8a2-9d41-4c55-b1e0-5a7d2e6c9f13"
    host.set_boot_id(real)
    gpus = host.root / "proc/driver/nvidia/gpus/0000:01:00.0"
    gpus.mkdir(parents=True)
    (gpus / "information").write_text(f"Model: \t\t NVIDIA A100\nGPU UUID: \t GPU-{real}\n")
    host.set_cmdline("BOOT_IMAGE=/vmlinuz root=UUID=1234 ip=10.1.2.3 token=s3cret "
                     "intel_iommu=on iommu=pt vfio-pci.ids=10de:20b2 modprobe.blacklist=nouveau\n")
    data, manifest = capture(str(host.root))
    plain = gzip.decompress(data)
    assert b"0fb3c8a2" not in plain and b"s3cret" not in plain and b"10.1.2.3" not in plain
    assert manifest["uuids_replaced"] >= 1
    extract_to = tmp_path / "copy"
    (tmp_path / "host.tar.gz").write_bytes(data)
    extract(str(tmp_path / "host.tar.gz"), str(extract_to))
    stand_in = (extract_to / "proc/sys/kernel/random/boot_id").read_text().strip()
    assert stand_in != real
    information = extract_to / gpus.relative_to(host.root) / "information"
    assert f"GPU-{stand_in}" in information.read_text()
    assert (extract_to / "proc/cmdline").read_text() == (
        "intel_iommu=on iommu=pt vfio-pci.ids=10de:20b2 modprobe.blacklist=nouveau\n")


@pytest.mark.timeout(20)
def test_files_that_block_or_name_the_machine_are_never_opened(tmp_path: Path) -> None:
    """A FIFO where an attribute should be would block a plain read; ``vpd`` and ``address``
    name the hardware; config space is cut where serial numbers begin."""
    host = example_gpu_host(tmp_path / "host")
    fn = host.device_dir("0000:01:00.0")
    os.mkfifo(fn / "numa_node.fifo")
    (fn / "vpd").write_bytes(b"SN:XYZ123")
    (fn / "config").write_bytes(b"\x01" * 4096)
    data, _ = capture(str(host.root))
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        names = {m.name: m for m in tar.getmembers()}
        rel = str(fn.relative_to(host.root))
        assert f"{rel}/vendor" in names
        assert f"{rel}/vpd" not in names and f"{rel}/numa_node.fifo" not in names
        assert names[f"{rel}/config"].size == CONFIG_BYTES
    assert b"XYZ123" not in gzip.decompress(data)


def test_extract_refuses_an_archive_that_reaches_outside(tmp_path: Path) -> None:
    """An archive is input: a link out of the folder it is laid out in is refused."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        link = tarfile.TarInfo("sys/bus/pci/devices/0000:00:01.0")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc"
        tar.addfile(link)
    (tmp_path / "evil.tar.gz").write_bytes(out.getvalue())
    with pytest.raises(tarfile.FilterError):
        extract(str(tmp_path / "evil.tar.gz"), str(tmp_path / "dest"))
    assert not (tmp_path / "dest/sys/bus/pci/devices/0000:00:01.0").is_symlink()


def test_the_capture_command_writes_an_archive(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from gpuwatch.testing.capture import main

    SysRoot(tmp_path / "host").add_function("0000:00:02.0", vendor="0x8086", device="0x46a6",
                                            klass="0x030000", driver="i915")
    assert main([str(tmp_path / "out.tar.gz"), "--root", str(tmp_path / "host")]) == 0
    assert "entries" in capsys.readouterr().err
    with tarfile.open(tmp_path / "out.tar.gz") as tar:
        assert "sys/bus/pci/devices/0000:00:02.0" in tar.getnames()


def test_odd_bytes_in_names_and_link_targets_survive_the_capture(tmp_path: Path) -> None:
    """Names are bytes on Linux: a DRM connector or a link target that is no UTF-8 is kept as
    it was, not a crash of the capture."""
    host = example_gpu_host(tmp_path / "host")
    drm = host.root / "sys/class/drm"
    odd = os.fsdecode(b"card9-\xff\xfe")
    os.symlink(os.fsdecode(b"../../devices/\xffodd"), drm / odd)
    data, _ = capture(str(host.root))
    (tmp_path / "host.tar.gz").write_bytes(data)
    extract(str(tmp_path / "host.tar.gz"), str(tmp_path / "copy"))
    assert os.readlink(tmp_path / "copy/sys/class/drm" / odd) == os.fsdecode(
        b"../../devices/\xffodd")


def test_a_mediated_devices_uuid_is_replaced_in_its_names_too(tmp_path: Path) -> None:
    """An mdev (a vGPU, a GVT-g instance) is named by its UUID: the folder under its parent
    function and the links to it (its IOMMU group's member) are named alike in the capture,
    by the stand-in, so the links still lead to it and the UUID is nowhere."""
    host = example_gpu_host(tmp_path / "host")
    real = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"
    mdev = host.device_dir("0000:01:00.0") / real
    mdev.mkdir()
    (mdev / "uevent").write_text(f"MDEV_TYPE=nvidia-63\nDEVNAME={real}\n")
    group = host.root / "sys/kernel/iommu_groups/42/devices"
    group.mkdir(parents=True)
    (group.parent / "name").write_text("vfio-noiommu\n")
    os.symlink(os.path.relpath(mdev, group), group / real)
    os.symlink("../../../../kernel/iommu_groups/42", mdev / "iommu_group")
    data, _ = capture(str(host.root))
    assert real.encode() not in gzip.decompress(data)
    (tmp_path / "host.tar.gz").write_bytes(data)
    copy = tmp_path / "copy"
    extract(str(tmp_path / "host.tar.gz"), str(copy))
    (member,) = (copy / "sys/kernel/iommu_groups/42/devices").iterdir()
    assert member.name != real
    assert (member / "uevent").read_text() == f"MDEV_TYPE=nvidia-63\nDEVNAME={member.name}\n"
