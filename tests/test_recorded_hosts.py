"""Trees of real machines, laid out from device recordings (`gpuwatch.testing.udevdb`).

The recordings under ``fixtures/hosts/*.udevdb*`` are ``udevadm info --export-db`` dumps of
real laptops, a desktop, a workstation and a GPU server (see the README there). Every answer
is checked against what the recording itself says of each display function (its ids, class
and driver from the kernel's uevent) and against what is known of the machine: which card is
the iGPU, which render node is the GPU's, which group the host keeps.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import reports_every_way, run_main

import gpuwatch
from gpuwatch.testing.udevdb import Record, RecordingError, lay_out, parse, read_recording

HOSTS = Path(__file__).parent / "fixtures" / "hosts"

#: Per recording: each display function → (vendor name, class, driver); the render node
#: ``detect-host-devices`` must name; the groups kept for the host. The two Optimus laptops
#: (an iGPU with the console, ``fb0``, beside an NVIDIA 3D controller) keep the iGPU: the 3D
#: controller has no outputs and no framebuffer, so it is no screen the host could fall back
#: on. An export-db records no ``boot_vga``: the iGPU's framebuffer is what tells.
MACHINES: dict[str, dict[str, Any]] = {
    "dell-inspiron-7737.udevdb": {
        "gpus": {"0000:00:02.0": ("Intel", "0x0300", "i915"),
                 "0000:04:00.0": ("NVIDIA", "0x0302", "")},
        "render_node": "", "kept": {"0000:00:02.0"}, "nvidia": "0000:04:00.0"},
    "dell-vostro-270.udevdb": {
        "gpus": {"0000:00:02.0": ("Intel", "0x0380", "i915"),
                 "0000:01:00.0": ("NVIDIA", "0x0300", "nouveau")},
        "render_node": "", "kept": set(), "nvidia": "0000:01:00.0"},
    "toshiba-nvme.udevdb": {
        "gpus": {"0000:00:02.0": ("Intel", "0x0300", "i915_bpo"),
                 "0000:01:00.0": ("NVIDIA", "0x0302", "")},
        "render_node": "/dev/dri/renderD129", "kept": {"0000:00:02.0"},
        "nvidia": "0000:01:00.0"},
    "hp-elitebook-835-g10.udevdb": {
        "gpus": {"0000:c4:00.0": ("AMD", "0x0300", "amdgpu")},
        # the APU carries the console (fb0) and is the only display: the host keeps it
        "render_node": "/dev/dri/renderD128", "kept": {"0000:c4:00.0"}, "nvidia": None},
    "nvidia-dgx-station.udevdb.gz": {
        "gpus": {a: ("NVIDIA", "0x0300", "nvidia")
                 for a in ("0000:07:00.0", "0000:08:00.0", "0000:0e:00.0", "0000:0f:00.0")},
        "render_node": "/dev/dri/renderD128", "kept": set(), "nvidia": "several"},
    "nvidia-dgx-a100.udevdb.gz": {
        "gpus": {**{a: ("NVIDIA", "0x0302", "")
                    for a in ("0000:07:00.0", "0000:0f:00.0", "0000:47:00.0", "0000:4e:00.0",
                              "0000:87:00.0", "0000:90:00.0", "0000:b7:00.0", "0000:bd:00.0")},
                 "0000:63:00.0": ("0x1a03", "0x0300", "ast")},  # the BMC's VGA
        "render_node": "", "kept": {"0000:63:00.0"}, "nvidia": "several"},
}


@pytest.fixture(scope="module", params=sorted(MACHINES))
def machine(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, list[Record]]:
    name: str = request.param
    records = read_recording(HOSTS / name)
    root = tmp_path_factory.mktemp(name.split(".")[0])
    lay_out(records, root)
    return name, root, records


def _json(capsys: pytest.CaptureFixture[str], root: Path, *argv: str) -> Any:
    code, out, err = run_main(capsys, *argv, "--root", str(root), "--no-daemon")
    assert code == 0, err
    return json.loads(out)


def _recorded_gpus(records: list[Record]) -> dict[str, tuple[str, str, str, str]]:
    """addr → (vendor id, device id, class, driver) as the recording's uevent says."""
    out = {}
    for r in records:
        klass = r.props.get("PCI_CLASS", "")
        if r.subsystem == "pci" and len(klass) == 5 and klass.startswith("3"):
            ven, dev = r.props["PCI_ID"].lower().split(":")
            out[r.props["PCI_SLOT_NAME"]] = (f"0x{ven}", f"0x{dev}", f"0x0{klass[:3].lower()}",
                                             r.props.get("DRIVER", ""))
    return out


def test_detect_vfio_lists_every_recorded_display_function_as_recorded(
        machine: tuple[str, Path, list[Record]], capsys: pytest.CaptureFixture[str]) -> None:
    name, root, records = machine
    recorded = _recorded_gpus(records)
    assert set(recorded) == set(MACHINES[name]["gpus"])  # the table names them all
    gpus = _json(capsys, root, "probe", "detect-vfio")["result"]["gpus"]
    seen = {g["addr"]: (g["vendor_id"], g["device_id"], g["class"], g["driver"]) for g in gpus}
    assert seen == recorded
    assert [g["addr"] for g in gpus] == sorted(recorded)


def test_status_names_each_card_its_vendor_class_and_driver(
        machine: tuple[str, Path, list[Record]], capsys: pytest.CaptureFixture[str]) -> None:
    name, root, _ = machine
    labels = {"0x0300": "VGA controller", "0x0302": "3D controller",
              "0x0380": "Display controller"}
    status = _json(capsys, root, "status", "--json")
    got = {g["addr"]: (g["vendor"], g["class_label"], g["driver"]) for g in status["gpus"]}
    want = {a: (v, labels[c], d) for a, (v, c, d) in MACHINES[name]["gpus"].items()}
    assert got == want
    assert {g["addr"] for g in status["gpus"] if g["kept_for_host"]} == MACHINES[name]["kept"]
    assert status["unhealthy"] == []


@pytest.mark.parametrize("name", ["dell-inspiron-7737.udevdb", "toshiba-nvme.udevdb"])
async def test_an_optimus_laptop_keeps_its_igpu_every_way(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The recording puts ``fb0`` beneath the iGPU and nothing beneath the NVIDIA 3D
    controller: the model, the stdlib reports and the full ones, with and without a daemon,
    all keep the iGPU for its framebuffer console, and not the NVIDIA card."""
    records = read_recording(HOSTS / name)
    fbs = [r.devpath for r in records if r.devpath.split("/")[-2:-1] == ["graphics"]
           and r.devpath.rsplit("/", 1)[1].startswith("fb") and "fbcon" not in r.devpath]
    assert fbs == ["/devices/pci0000:00/0000:00:02.0/graphics/fb0"]
    lay_out(records, tmp_path)
    igpu, nvidia = sorted(MACHINES[name]["gpus"])
    model = gpuwatch.scan(tmp_path)
    reason = model.kept_for_host(igpu)
    assert reason == (f"{igpu} carries the host's framebuffer console (a graphics fbN device) "
                      "and is its only display function: passing it through leaves the host "
                      "without a console")
    assert model.kept_for_host(nvidia) == ""
    for said in await reports_every_way(capsys, monkeypatch, str(tmp_path)):
        assert said.listed == []  # no IOMMU groups recorded: nothing to pass through
        got = {g["addr"]: (g["kept_for_host"], g["reason"]) for g in said.status["gpus"]}
        assert got == {igpu: (True, reason), nvidia: (False, "")}, (said.where, said.full)


def test_display_driver_answers_the_recorded_driver(
        machine: tuple[str, Path, list[Record]], capsys: pytest.CaptureFixture[str]) -> None:
    name, root, _ = machine
    for addr, (_, _, driver) in MACHINES[name]["gpus"].items():
        answer = _json(capsys, root, "probe", "display-driver", "--addr", addr)
        assert answer["result"] == driver, addr


def test_the_render_node_is_the_gpus(
        machine: tuple[str, Path, list[Record]], capsys: pytest.CaptureFixture[str]) -> None:
    """The render node named is one the recording has, beneath the GPU it says."""
    name, root, records = machine
    result = _json(capsys, root, "probe", "detect-host-devices")["result"]
    want = MACHINES[name]["render_node"]
    assert result["render_node"] == want
    assert result["amd_gpu"] == any(v == "AMD" for v, _, _ in MACHINES[name]["gpus"].values())
    if want:
        node = want.removeprefix("/dev/dri/")
        owner = next(r.devpath for r in records if r.devpath.endswith(f"/drm/{node}"))
        addr = owner.split("/drm/")[0].rsplit("/", 1)[1]
        assert addr in MACHINES[name]["gpus"]


def test_mode_and_plan_pick_the_nvidia_card_or_ask_which(
        machine: tuple[str, Path, list[Record]], capsys: pytest.CaptureFixture[str]) -> None:
    """Without ``--addr`` the NVIDIA card is found by vendor; with several the command asks
    which (exit 2), with none it says so (exit 1); never a traceback."""
    name, root, _ = machine
    nvidia = MACHINES[name]["nvidia"]
    for argv in (["mode"], ["plan"]):
        code, out, err = run_main(capsys, *argv, "--root", str(root), "--no-daemon")
        assert "Traceback" not in err
        if nvidia is None:
            assert code == 1 and "no card of vendor 0x10de" in err
        elif nvidia == "several":
            assert code == 2 and "choose one with --addr" in err
        else:
            assert code == 0 and out.startswith(f"{nvidia} " if argv == ["mode"]
                                                else f"plan: {nvidia} ")


def test_list_offers_nothing_without_iommu_groups(
        machine: tuple[str, Path, list[Record]], capsys: pytest.CaptureFixture[str]) -> None:
    """An export-db records no IOMMU groups: no group can be passed through."""
    _, root, _ = machine
    assert _json(capsys, root, "list", "--json") == []
    assert _json(capsys, root, "probe", "detect-vfio")["result"]["iommu_enabled"] is False


# --- the layout itself -----------------------------------------------------------------------

def test_the_layout_is_the_kernels(tmp_path: Path) -> None:
    """Bus entries, driver links both ways, class entries and a class device's ``device``
    link are relative links spelled as sysfs spells them; attributes come from the uevent."""
    lay_out(read_recording(HOSTS / "toshiba-nvme.udevdb"), tmp_path)
    bus = tmp_path / "sys/bus/pci/devices/0000:00:02.0"
    assert os.readlink(bus) == "../../../devices/pci0000:00/0000:00:02.0"
    fn = tmp_path / "sys/devices/pci0000:00/0000:00:02.0"
    assert os.readlink(fn / "driver") == "../../../bus/pci/drivers/i915_bpo"
    assert os.readlink(tmp_path / "sys/bus/pci/drivers/i915_bpo/0000:00:02.0") == (
        "../../../../devices/pci0000:00/0000:00:02.0")
    assert (fn / "class").read_text() == "0x030000\n"
    assert (fn / "vendor").read_text() == "0x8086\n"
    assert (fn / "subsystem_vendor").read_text() == "0x1028\n"  # PCI_SUBSYS_ID=1028:07D1
    assert (fn / "subsystem_device").read_text() == "0x07d1\n"
    render = tmp_path / "sys/class/drm/renderD129"
    assert os.readlink(render) == "../../devices/pci0000:00/0000:00:02.0/drm/renderD129"
    assert os.readlink(render / "device") == "../../../0000:00:02.0"
    assert (render / "dev").read_text() == "226:129\n"
    assert "DEVNAME=dri/renderD129\n" in (render / "uevent").read_text()
    assert "ID_PATH" not in (render / "uevent").read_text()  # udev's, not the kernel's
    assert (tmp_path / "dev/dri/renderD129").is_file()
    assert (tmp_path / "sys/devices/pci0000:00/uevent").read_text() == ""


UMOCKDEV = """\
P: /devices/pci0000:00/0000:00:02.0
E: DRIVER=i915
E: PCI_CLASS=30000
E: PCI_ID=8086:46A6
E: SUBSYSTEM=pci
A: boot_vga=1\\n
A: class=0x030000\\n
A: label=Onboard\\x20IGD\\n
H: config=8680A646
L: driver=../../../bus/pci/drivers/i915
L: iommu_group=../../../kernel/iommu_groups/0
L: subsystem=../../../bus/pci
"""


def test_a_umockdev_recording_keeps_its_attributes_and_links(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``A:`` values are unescaped, ``H:`` is hex, ``L:`` links are made as recorded (the
    IOMMU group with its link back); an attribute recorded wins over one from the uevent."""
    lay_out(parse(UMOCKDEV), tmp_path)
    fn = tmp_path / "sys/devices/pci0000:00/0000:00:02.0"
    assert (fn / "boot_vga").read_text() == "1\n"
    assert (fn / "label").read_text() == "Onboard IGD\n"
    assert (fn / "config").read_bytes() == b"\x86\x80\xa6\x46"
    assert os.readlink(fn / "iommu_group") == "../../../kernel/iommu_groups/0"
    assert os.readlink(tmp_path / "sys/kernel/iommu_groups/0/devices/0000:00:02.0") == (
        "../../../../devices/pci0000:00/0000:00:02.0")
    gpus = _json(capsys, tmp_path, "probe", "detect-vfio")["result"]["gpus"]
    assert [(g["addr"], g["driver"], g["iommu_group"]) for g in gpus] == [
        ("0000:00:02.0", "i915", 0)]
    status = _json(capsys, tmp_path, "status", "--json")
    assert status["gpus"][0]["kept_for_host"] is True  # boot_vga 1, the only display
    assert "boot_vga 1" in status["gpus"][0]["reason"]


@pytest.mark.parametrize("text", [
    "P: /devices/../../etc\nE: SUBSYSTEM=pci\n",
    "P: /sys/devices/pci0000:00\n",
    "E: SUBSYSTEM=pci\n",
    "P: /devices/pci0000:00/0000:00:02.0\nL: driver=../../../../../../etc\n",
    "P: /devices/pci0000:00/0000:00:02.0\nA: ../x=1\n",
    "P: /devices/pci0000:00/0000:00:02.0\nH: config=zz\n",
    # A subsystem or driver names one folder of sys/bus or sys/class, never a path.
    "P: /devices/pci0000:00/0000:00:02.0\nE: SUBSYSTEM=../../../x\n",
    "P: /devices/pci0000:00/0000:00:02.0\nE: SUBSYSTEM=..\n",
    "P: /devices/pci0000:00/0000:00:02.0\nL: subsystem=../../../bus/..\n",
    "P: /devices/pci0000:00/0000:00:02.0\nE: SUBSYSTEM=pci\nE: DRIVER=..\n",
])
def test_a_recording_that_reaches_outside_is_refused(text: str, tmp_path: Path) -> None:
    with pytest.raises(RecordingError):
        lay_out(parse(text), tmp_path / "root")
    assert sorted(os.listdir(tmp_path)) in ([], ["root"])
