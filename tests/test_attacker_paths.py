"""Files root's gpuwatch writes or trusts at a path another user has a say in.

Run as root, the event log, the socket and the config file are written or read at a path
an administrator names: in /tmp, or by mistake in a user's directory. Whoever may add a name
there (a link to /etc/passwd, a hard link to a root file, a config file of their own) must
not get root to write or believe it. Each test plays the other user with files chowned to
``nobody`` and runs the attacked operation against temporary directories only.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.errors import ConfigError
from gpuwatch.ownership import others_control
from gpuwatch.service.server import SocketSetupError, bind_socket
from gpuwatch.service.testing import short_socket_dir
from gpuwatch.settings import read_config_file
from gpuwatch.watch.eventlog import EventLog, EventLogUnavailable

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid"),
]

#: The other user (``nobody``).
ATTACKER = 65534
VICTIM_TEXT = b"root:$6$secret-hash:19000:0:99999:7:::\n"


@pytest.fixture
def base() -> Iterator[Path]:
    """A short directory of root's in /tmp (socket paths stay under 107 bytes)."""
    with short_socket_dir("gw-fs-") as path:
        yield Path(path)


@pytest.fixture
def victim(base: Path) -> Path:
    """A root file no one else may write, as /etc/shadow is."""
    secret = base / "secret"
    secret.mkdir(mode=0o700)
    file = secret / "shadow"
    file.write_bytes(VICTIM_TEXT)
    os.chmod(file, 0o600)
    return file


def sticky(base: Path) -> Path:
    """A /tmp of our own: world-writable and sticky."""
    shared = base / "tmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    return shared


def theirs(base: Path, name: str = "home") -> Path:
    """A directory of the other user's."""
    folder = base / name
    folder.mkdir()
    os.chown(folder, ATTACKER, ATTACKER)
    return folder


def plant_link(at: Path, target: Path) -> None:
    at.symlink_to(target)
    os.lchown(at, ATTACKER, ATTACKER)


# ------------------------------------------------------------------ the event log


def test_the_event_log_follows_no_link_another_user_planted_in_tmp(
    base: Path, victim: Path
) -> None:
    """`gpuwatch watch --log /tmp/events.jsonl` as root, and the other user was first with a
    link of their own there: the events would be appended to the file it points at."""
    log = sticky(base) / "events.jsonl"
    plant_link(log, victim)
    with pytest.raises(EventLogUnavailable, match=r"a link of uid 65534 in a directory other"):
        EventLog(log).write_line('{"seq": 1}')
    assert victim.read_bytes() == VICTIM_TEXT


def test_the_event_log_writes_no_file_another_user_planted_in_tmp(base: Path) -> None:
    """A file of theirs planted at the name: root would fill a file they can read and
    rewrite (and hold its lock), so readers replaying it would take their lines for events."""
    log = sticky(base) / "events.jsonl"
    log.write_bytes(b"")
    os.chown(log, ATTACKER, ATTACKER)
    with pytest.raises(EventLogUnavailable, match="a file of uid 65534"):
        EventLog(log)
    assert log.read_bytes() == b""


def test_a_link_planted_after_the_log_was_removed_is_not_followed(
    base: Path, victim: Path
) -> None:
    """The writer reopens PATH when it goes away (logrotate): a link planted in /tmp in
    between is not written through either; the log degrades until a file of ours is back."""
    log = sticky(base) / "events.jsonl"
    writer = EventLog(log)
    try:
        writer.write_line('{"seq": 1}')
        log.unlink()
        plant_link(log, victim)
        with pytest.raises(OSError):
            writer.write_line('{"seq": 2}')
        assert victim.read_bytes() == VICTIM_TEXT
        log.unlink()
        writer.write_line('{"seq": 3}')
        assert log.read_bytes() == b'{"seq": 3}\n'
    finally:
        writer.close()


@pytest.mark.parametrize("kind", ["their-directory", "link-through-their-directory"])
def test_no_event_log_in_a_directory_another_user_controls(
    base: Path, victim: Path, kind: str
) -> None:
    """A log in another user's directory (a path given by mistake), or named through a link
    in one: they may put a link at the name whenever they like, even after the start."""
    home = theirs(base)
    if kind == "their-directory":
        log = home / "events.jsonl"
    else:
        ours = base / "logs"
        ours.mkdir()
        plant_link(home / "logs", ours)
        log = home / "logs" / "events.jsonl"
    with pytest.raises(EventLogUnavailable, match="belongs to uid 65534"):
        EventLog(log)
    assert not (base / "logs" / "events.jsonl").exists()
    assert victim.read_bytes() == VICTIM_TEXT


def test_the_event_log_lock_writes_into_no_hard_link(base: Path, victim: Path) -> None:
    """A hard link planted at ``PATH.lock`` (where ``protected_hardlinks`` is off): the
    writer's pid and seq records would overwrite the start of the file it links to."""
    log = sticky(base) / "events.jsonl"
    os.link(victim, str(log) + ".lock")
    with pytest.raises(EventLogUnavailable, match="lock"):
        EventLog(log)
    assert victim.read_bytes() == VICTIM_TEXT


def test_a_log_of_ours_in_tmp_still_works(base: Path) -> None:
    """/tmp itself is fine, as for the socket: others cannot rename what is ours there."""
    log = sticky(base) / "events.jsonl"
    writer = EventLog(log, max_bytes=20, keep=2)
    try:
        for seq in range(1, 5):
            writer.write_line(f'{{"seq": {seq}}}')
    finally:
        writer.close()
    assert log.exists() and Path(f"{log}.1").exists()
    assert stat.S_IMODE(log.stat().st_mode) == 0o644


def test_a_log_under_a_root_directory_a_group_may_write_still_works(base: Path) -> None:
    """Ubuntu's ``/var/log`` is ``root:syslog`` 0775: an administrator's arrangement, not
    another user's directory. The unit's log below it (``/var/log/gpuwatch``) is written;
    the same mode on a directory of another user's, or open to everyone, is not."""
    var_log = base / "var-log"
    var_log.mkdir()
    os.chown(var_log, 0, ATTACKER)  # a group of root's choosing (syslog's, say)
    os.chmod(var_log, 0o775)
    (var_log / "gpuwatch").mkdir(mode=0o755)
    log = var_log / "gpuwatch" / "events.jsonl"
    writer = EventLog(log)
    try:
        writer.write_line('{"seq": 1}')
    finally:
        writer.close()
    assert log.read_text() == '{"seq": 1}\n'
    os.chmod(var_log, 0o777)  # anyone may rename gpuwatch/ aside and make their own
    with pytest.raises(EventLogUnavailable, match="writable by other users"):
        EventLog(log)


# ------------------------------------------------------------------ the socket


def test_no_socket_named_through_a_link_in_another_users_directory(base: Path) -> None:
    """``--socket /home/them/run/gw.sock`` where their ``run`` links to a directory of
    root's: the directory the socket lands in is root's, but they may point the link
    elsewhere at any time, and clients (root's `gpuwatch mode`) would talk to their socket.
    socket.md promises every directory above the socket is root's."""
    ours = base / "run"
    ours.mkdir()
    plant_link(theirs(base) / "run", ours)
    with pytest.raises(SocketSetupError, match="belongs to uid 65534"):
        bind_socket(str(base / "home" / "run" / "gw.sock"), None).close()
    assert not (ours / "gw.sock").exists()


def test_no_socket_through_a_link_planted_in_tmp(base: Path) -> None:
    ours = base / "run"
    ours.mkdir()
    plant_link(sticky(base) / "run", ours)
    with pytest.raises(SocketSetupError, match="a link of uid 65534"):
        bind_socket(str(base / "tmp" / "run" / "gw.sock"), None).close()


def test_the_socket_lock_truncates_no_hard_link(base: Path, victim: Path) -> None:
    """``gw.sock.lock`` hard-linked to a root file in a sticky directory: the daemon would
    truncate it to write its pid there."""
    shared = sticky(base)
    os.link(victim, shared / "gw.sock.lock")
    with pytest.raises(SocketSetupError, match="lock"):
        bind_socket(str(shared / "gw.sock"), None).close()
    assert victim.read_bytes() == VICTIM_TEXT


def test_the_socket_lock_of_another_user_is_not_written(base: Path) -> None:
    shared = sticky(base)
    lock = shared / "gw.sock.lock"
    lock.write_bytes(b"theirs\n")
    os.chown(lock, ATTACKER, ATTACKER)
    with pytest.raises(SocketSetupError, match="lock"):
        bind_socket(str(shared / "gw.sock"), None).close()
    assert lock.read_bytes() == b"theirs\n"


# ------------------------------------------------------------------ the config file


def test_a_config_file_another_user_owns_is_refused(base: Path) -> None:
    """The config names the log path (root appends there), who may switch, the tables that
    keep a host's console GPU: one another user may write is theirs to decide."""
    config = base / "config.yaml"
    config.write_text("log_keep: 3\n")
    os.chown(config, ATTACKER, ATTACKER)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        read_config_file(str(config))


@pytest.mark.parametrize(("mode", "gid"), [(0o666, 0), (0o664, ATTACKER)])
def test_a_config_file_others_may_write_is_refused(base: Path, mode: int, gid: int) -> None:
    """World-writable, or writable by a group that is not root's: its members may write it."""
    config = base / "config.yaml"
    config.write_text("log_keep: 3\n")
    os.chown(config, 0, gid)
    os.chmod(config, mode)
    with pytest.raises(ConfigError, match="writable by other users"):
        read_config_file(str(config))


def test_a_config_file_in_another_users_directory_is_refused(base: Path) -> None:
    config = theirs(base) / "config.yaml"
    config.write_text("log_keep: 3\n")  # root's file, but they may rename it and put theirs
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        read_config_file(str(config))


def test_a_config_file_of_ours_is_read(base: Path) -> None:
    config = base / "config.yaml"
    config.write_text("log_keep: 3\n")
    assert read_config_file(str(config)) == {"log_keep": "3"}  # read as the flag reads it


# ------------------------------------------------------------------ the walk itself


def test_the_walk_reads_links_as_the_kernel_does(base: Path) -> None:
    ours = base / "a" / "b"
    ours.mkdir(parents=True)
    (base / "rel").symlink_to("a/b/..")  # ours, relative, with a `..` after a link
    assert others_control(str(base / "rel" / "b" / "x")) is None
    home = theirs(base)
    (home / "sub").mkdir()
    (base / "hop").symlink_to(home / "sub")  # root's link, into their directory
    assert others_control(str(base / "hop" / "x")) == f"{home} belongs to uid {ATTACKER}"
    (base / "loop").symlink_to("loop")
    with pytest.raises(OSError):
        others_control(str(base / "loop" / "x"))


# ------------------------------------------------------------------ record --out


def _record(base: Path, out: Path) -> tuple[int, str]:
    """``gpuwatch record --source file:… --out OUT`` as root, in process."""
    import argparse
    import contextlib
    import io

    from gpuwatch.cli import record_cmd

    source = base / "capture.jsonl"
    source.write_text('{"ACTION": "change", "DEVPATH": "/devices/x", "SUBSYSTEM": "pci"}\n')
    parser = argparse.ArgumentParser(prog="gpuwatch")
    record_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["record", "--root", str(base), "--source", f"file:{source}",
                              "--out", str(out)])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = args.func(args)
    return code, err.getvalue()


@pytest.mark.parametrize("plant", ["symlink", "hard-link", "their-file"])
def test_record_out_in_tmp_writes_through_nothing_another_user_planted(
        base: Path, victim: Path, plant: str) -> None:
    """``sudo gpuwatch record --out /tmp/capture.jsonl``, the other user first at that name:
    a link of theirs to a root file (a shell's ``>`` would truncate it), a hard link to one,
    or a file of theirs. Refused in one line, exit 2, nothing written anywhere."""
    out = sticky(base) / "capture.jsonl"
    if plant == "symlink":
        plant_link(out, victim)
    elif plant == "hard-link":
        os.link(victim, out)
    else:
        out.write_text("theirs\n")
        os.chown(out, ATTACKER, ATTACKER)
    code, err = _record(base, out)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert victim.read_bytes() == VICTIM_TEXT
    if plant == "their-file":
        assert out.read_text() == "theirs\n"


def test_record_out_in_another_users_directory_is_refused(
        base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = theirs(base)
    monkeypatch.delenv("SUDO_UID", raising=False)
    code, err = _record(base, home / "capture.jsonl")
    assert code == 2 and "belongs to uid 65534" in err, err
    assert not (home / "capture.jsonl").exists()
    # Another user's directory is not the sudo user's own.
    monkeypatch.setenv("SUDO_UID", "1000")
    code, err = _record(base, home / "capture.jsonl")
    assert code == 2 and "belongs to uid 65534" in err, err


def test_sudo_record_out_in_the_sudo_users_own_directory_works(
        base: Path, victim: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``sudo gpuwatch record --out capture.jsonl`` in the home of the user who ran sudo (the
    documented capture): theirs, and they chose the path anyway (``--out /etc/passwd`` is
    theirs to give too), so trusting it gives them nothing new."""
    home = theirs(base)
    monkeypatch.setenv("SUDO_UID", str(ATTACKER))
    code, err = _record(base, home / "capture.jsonl")
    assert code == 0, err
    assert (home / "capture.jsonl").read_text().count("\n") == 1


def test_record_out_of_ours_in_tmp_is_written_from_its_start(base: Path) -> None:
    out = sticky(base) / "capture.jsonl"
    out.write_text("an older, longer recording that must not show through\n" * 3)
    code, err = _record(base, out)
    assert code == 0, err
    assert out.read_text().count("\n") == 1 and '"ACTION":"change"' in out.read_text().replace(
        " ", "")
