"""The records a switch keeps under the root (``run/gpuwatch/switch-<group>.json``, the poison
and stopped files), met as garbage or as another user's forgery.

Root acts on an abandoned switch's record: the next switch to vfio clears the
``driver_override`` of every function it names. So a record another user could have written
(one of theirs, one others may write, a link, one in a directory others control) is absent,
and a switch refuses a lock directory others control. A record of the wrong shape is
garbage, never an internal error that stops every switch of the host and the daemon's start.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from cli_helpers import simulated_cli
from daemon_helpers import Daemon, probe

from gpuwatch.hostfs.journal import LOCK_DIR, journal_keys
from gpuwatch.service.testing import short_socket_dir
from gpuwatch.testing import SysRoot
from gpuwatch.testing.simkernel import SimKernel
from gpuwatch.testing.sysroot import EXAMPLE_BOOT_ID
from gpuwatch.watch.eventlog import read_events

pytestmark = pytest.mark.timeout(120)

NV, AUDIO = "0000:01:00.0", "0000:01:00.1"
GROUP = 13
#: A pid no process has (above the kernel's PID_MAX_LIMIT): the record's switch is gone.
GONE = 4_194_305
#: The other user (``nobody``).
ATTACKER = 65534
OVR = "/sys/bus/pci/devices/{}/driver_override"


def record(**changes: object) -> str:
    """A switch record as `write_journal` writes one (killed half-way to vfio), changed."""
    data: dict[str, object] = {
        "boot_id": EXAMPLE_BOOT_ID, "addr": NV, "group": GROUP, "from_mode": "nvidia",
        "to_mode": "vfio", "members": [NV, AUDIO], "pid": GONE,
        "started": "2024-01-01T00:00:00.000Z", "reported": False}
    data.update(changes)
    return json.dumps(data)


def plant(host: SysRoot, name: str, text: str) -> Path:
    folder = host.root / LOCK_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------ garbage

GARBAGE = {
    "pid Infinity": record().replace(f'"pid": {GONE}', '"pid": Infinity'),
    "pid past a pid_t": record(pid=10**24),
    "group Infinity": record().replace(f'"group": {GROUP}', '"group": Infinity'),
    "group a bignum": record(group=10**30),
    "pid a bool": record(pid=True),
    "members no list": record(members="0000:01:00.0"),
    "a member no address": record(members=[{"addr": NV}]),
    "mode none": record(to_mode="bogus\nmode"),
}


@pytest.mark.parametrize("text", list(GARBAGE.values()), ids=list(GARBAGE))
@pytest.mark.parametrize("argv", [("mode", "vfio", "--no-daemon"), ("recover", "--no-daemon"),
                                  ("plan", "vfio")], ids=["mode", "recover", "plan"])
def test_a_garbage_record_is_no_record(host: SysRoot, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                       text: str, argv: tuple[str, ...]) -> None:
    """Before: ``internal error: OverflowError`` (exit 1) for every switch, ``recover`` and
    plan of the group; the others were published as an abandoned switch's end (one of a
    mode that is none, of a member ``{'addr': …}``)."""
    planted = plant(host, f"switch-{GROUP}.json", text)
    run, kernel = simulated_cli(host, monkeypatch, capsys)
    log = tmp_path / "events.jsonl"
    code, _, err = run(*argv, "--addr", NV, *(("--log", str(log)) if argv[0] != "plan" else ()))
    assert code == 0, err
    assert "internal error" not in err and "Traceback" not in err
    if argv[0] != "plan":
        assert [e["type"] for e in read_events(log) if e["type"].startswith("switch-")] == [
            "switch-started", "switch-completed"]  # no abandoned switch told of
        assert kernel.overrides == {}
        assert not planted.exists()  # garbage, dropped holding the lock


@pytest.mark.parametrize("name", ["switch-\u00b2.json", "switch-0013.json", "switch-x.json"])
def test_a_file_of_another_name_is_no_record(host: SysRoot, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str],
                                             name: str) -> None:
    """Before: ``switch-².json`` (``isdigit`` but no ``int``) stopped every switch of the
    host with ``internal error: ValueError``."""
    plant(host, name, record())
    assert journal_keys(str(host.root / LOCK_DIR)) == []
    run, _ = simulated_cli(host, monkeypatch, capsys)
    code, _, err = run("mode", "vfio", "--no-daemon", "--addr", NV)
    assert code == 0, err
    assert (host.root / LOCK_DIR / name).exists()  # not ours: left alone


def test_a_daemon_starts_and_serves_over_garbage_records(host: SysRoot, tmp_path: Path) -> None:
    """A real daemon: before, it logged ``ready``, then died (``internal error``) reporting
    the abandoned switches; systemd restarting it met the same files."""
    plant(host, f"switch-{GROUP}.json", GARBAGE["pid Infinity"])
    plant(host, "switch-\u00b2.json", record())
    with short_socket_dir("gw-rec-") as folder:
        daemon = Daemon(host.root, tmp_path, os.path.join(folder, "gw.sock")).start()
        try:
            assert "result" in probe(daemon.sock)
            assert daemon.proc is not None and daemon.proc.poll() is None
            assert not [e for e in daemon.events() if e["type"] == "switch-failed"]
        finally:
            code = daemon.stop()
        assert code == 0, daemon.stderr
        assert "internal error" not in daemon.stderr


# ------------------------------------------------------------------ another user's records

def in_vfio_with_a_pin(host: SysRoot, monkeypatch: pytest.MonkeyPatch,
                       capsys: pytest.CaptureFixture[str]) -> tuple[SimKernel, int]:
    """The group switched to vfio, then an administrator's own pin of the audio function
    (``driver_override``) that no switch of gpuwatch left; returns the kernel and the
    number of writes so far."""
    run, kernel = simulated_cli(host, monkeypatch, capsys)
    code, _, err = run("mode", "vfio", "--no-daemon", "--addr", NV)
    assert code == 0, err
    kernel._overrides[AUDIO] = "vfio-pci"
    host.set_attr(AUDIO, "driver_override", "vfio-pci\n")
    return kernel, len(kernel.writes)


def forged_by_owner(path: Path) -> None:
    os.chown(path, ATTACKER, ATTACKER)


def forged_writable(path: Path) -> None:
    os.chmod(path, 0o666)


def forged_in_open_folder(path: Path) -> None:
    os.chmod(path.parent, 0o777)


def forged_as_link(path: Path) -> None:
    aside = path.parent.parent / "elsewhere.json"
    path.rename(aside)
    path.symlink_to(aside)


FORGERIES = {"another user's": forged_by_owner, "others may write it": forged_writable,
             "a folder others write": forged_in_open_folder, "a link": forged_as_link}


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
@pytest.mark.parametrize("forge", list(FORGERIES.values()), ids=list(FORGERIES))
def test_a_record_another_user_could_write_makes_no_host_write(
        host: SysRoot, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        forge: object) -> None:
    """A record naming the group, its pid gone, as a killed switch would leave it, but one
    another user could have written: root's ``mode vfio`` on the group in vfio answers "in
    mode" and writes nothing. Before: it cleared the administrator's pin, on the strength of
    that record, and said an earlier switch was killed."""
    assert callable(forge)
    kernel, before = in_vfio_with_a_pin(host, monkeypatch, capsys)
    forge(plant(host, f"switch-{GROUP}.json", record()))
    run, _ = simulated_cli(host, monkeypatch, capsys, sim=kernel)
    code, out, err = run("mode", "vfio", "--no-daemon", "--addr", NV)
    assert code == 0, err
    assert kernel.writes[before:] == []
    assert kernel.overrides == {AUDIO: "vfio-pci"}
    assert "nothing to do" in out and "killed" not in out
    # Said as the command's other lines are: one line, prefixed, naming the file.
    warning = [line for line in err.splitlines() if f"switch-{GROUP}.json" in line]
    assert warning and warning[0].startswith("gpuwatch: warning: ignoring "), err


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_a_record_of_ours_still_clears_the_pin(host: SysRoot, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The same record, root's own: the killed switch's pin is cleared (the check above is
    no blanket refusal)."""
    kernel, before = in_vfio_with_a_pin(host, monkeypatch, capsys)
    plant(host, f"switch-{GROUP}.json", record())
    run, _ = simulated_cli(host, monkeypatch, capsys, sim=kernel)
    code, out, err = run("mode", "vfio", "--no-daemon", "--addr", NV)
    assert code == 0, err
    assert (OVR.format(AUDIO), "\n") in kernel.writes[before:]
    assert kernel.overrides == {}
    assert "vfio -> vfio" in out, out  # a switch, for the pin


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
@pytest.mark.parametrize("folder", ["world-writable", "another user's"])
def test_no_switch_with_its_lock_in_a_folder_others_control(
        host: SysRoot, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        folder: str) -> None:
    """Whoever may add names beside the lock may hold it, or plant the records a switch
    acts on: one line, exit 1, nothing written."""
    locks = host.root / LOCK_DIR
    locks.mkdir(parents=True)
    if folder == "world-writable":
        os.chmod(locks, 0o777)
    else:
        os.chown(locks, ATTACKER, ATTACKER)
    run, kernel = simulated_cli(host, monkeypatch, capsys)
    code, out, err = run("mode", "vfio", "--no-daemon", "--addr", NV)
    assert (code, out) == (1, "")
    assert len(err.strip().splitlines()) == 1, err
    assert "cannot take the switch lock" in err and "nothing was written" in err, err
    assert kernel.writes == [] and kernel.commands == []


def test_the_lock_folder_is_made_0755_whatever_the_umask(
        host: SysRoot, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: made 0777 under a umask of 0, where any user could plant records."""
    run, _ = simulated_cli(host, monkeypatch, capsys)
    old = os.umask(0)
    try:
        code, _, err = run("mode", "vfio", "--no-daemon", "--addr", NV)
    finally:
        os.umask(old)
    assert code == 0, err
    assert (host.root / LOCK_DIR).stat().st_mode & 0o777 == 0o755
