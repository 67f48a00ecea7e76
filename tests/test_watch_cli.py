"""``gpuwatch watch`` as a process: a burst through a FIFO, rotation, SIGTERM, usage errors."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.cli import watch_cmd
from gpuwatch.core.uevent import parse_kernel_uevent
from gpuwatch.sources.jsonl import uevent_to_json
from gpuwatch.testing import SysRoot
from gpuwatch.watch.eventlog import read_events


def start_watch(host: SysRoot, fifo: Path, log: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuwatch",
            "watch",
            "--root",
            str(host.root),
            "--source",
            f"file:{fifo}",
            "--log",
            str(log),
            "--reconcile-interval",
            "0",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_ready(log: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while not (log.exists() and '"ready"' in log.read_text()):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_burst_through_a_fifo_rotates_without_losing_an_event(
    host: SysRoot, tmp_path: Path
) -> None:
    fifo, log = tmp_path / "uevents", tmp_path / "events.jsonl"
    os.mkfifo(fifo)
    proc = start_watch(host, fifo, log, "--log-max-bytes", "600", "--log-keep", "50")
    try:
        with open(fifo, "w") as writer:  # the watcher opened it: ready comes after its scan
            wait_for_ready(log, proc)
            addrs = list(host.functions)
            had_driver = {a for a in addrs if (host.device_dir(a) / "driver").is_symlink()}
            for addr in addrs:
                host.unbind(addr)
            for addr in addrs:
                writer.write(json.dumps(host.uevent_props("unbind", addr)) + "\n")
        _, stderr = proc.communicate(timeout=30)  # EOF ends the watch
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    events = list(read_events(log))
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    changed = [e["addr"] for e in events if e["type"] == "driver-changed"]
    assert sorted(changed) == sorted(had_driver)  # one each, none lost, none invented
    assert len(had_driver) >= 5
    assert sorted(p.name for p in tmp_path.glob("events.jsonl.*"))  # it did rotate
    for path in [log, *tmp_path.glob("events.jsonl.*")]:
        assert path.read_bytes().endswith(b"\n")


def test_sigterm_while_watching_exits_0_with_whole_lines(host: SysRoot, tmp_path: Path) -> None:
    fifo, log = tmp_path / "uevents", tmp_path / "events.jsonl"
    os.mkfifo(fifo)
    proc = start_watch(host, fifo, log)
    try:
        with open(fifo, "w") as writer:
            wait_for_ready(log, proc)
            host.unbind("0000:02:00.0")
            writer.write(json.dumps(host.uevent_props("unbind", "0000:02:00.0")) + "\n")
            writer.flush()
            deadline = time.monotonic() + 10
            while '"driver-changed"' not in log.read_text():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            sent = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=5)
            assert time.monotonic() - sent < 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    assert [e["type"] for e in read_events(log)] == ["ready", "driver-changed", "stopped"]


def test_unusable_source_is_a_usage_error(host: SysRoot, tmp_path: Path) -> None:
    for source in ("udev", "bogus", f"file:{tmp_path / 'missing'}"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "gpuwatch",
                "watch",
                "--root",
                str(host.root),
                "--source",
                source,
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode == 2, (source, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1
        assert "Traceback" not in proc.stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_failing_stdout_log_degrades_and_a_closed_one_is_refused(
    host: SysRoot, tmp_path: Path
) -> None:
    """The default log is stdout: a full disk behind it degrades the log as for a file
    (the watch runs to its end), and a closed stdout is refused at once, in one line."""
    src = tmp_path / "uevents.jsonl"
    src.write_text("".join(json.dumps(host.uevent_props("change", addr)) + "\n"
                           for addr in host.functions))
    command = [sys.executable, "-m", "gpuwatch", "watch", "--root", str(host.root),
               "--source", f"file:{src}", "--reconcile-interval", "0"]
    with open("/dev/full", "w") as full:
        proc = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "ENOSPC" in proc.stderr and "internal error" not in proc.stderr
    closed = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, timeout=60, preexec_fn=lambda: os.close(1))
    assert closed.returncode == 2
    assert closed.stderr.count("\n") == 1 and "stdout is closed" in closed.stderr


def test_a_wedge_whose_task_name_is_not_utf8_is_logged_not_fatal(
    host: SysRoot, tmp_path: Path
) -> None:
    """The kernel's ``TASK=`` is the hung process's name, which any process sets to any
    bytes: the event is written (the bytes as U+FFFD) and the watch goes on."""
    card = host.devpath("0000:00:02.0") + "/drm/card0"
    raw = (f"change@{card}\0ACTION=change\0DEVPATH={card}\0SUBSYSTEM=drm\0WEDGED=rebind\0"
           "PID=7\0").encode() + b"TASK=a\xff\x1bb\0"
    event = parse_kernel_uevent(raw)
    assert event is not None
    src = tmp_path / "uevents.jsonl"  # as `gpuwatch record` writes what the kernel sent
    src.write_text(uevent_to_json(event) + "\n"
                   + json.dumps(host.uevent_props("change", "0000:00:02.0")) + "\n")
    log = tmp_path / "events.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "watch", "--root", str(host.root), "--source",
         f"file:{src}", "--log", str(log), "--reconcile-interval", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    events = list(read_events(log))
    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))
    wedged = [e for e in events if e["type"] == "gpu-wedged"]
    assert [(e["card"], e["task"]) for e in wedged] == [("card0", "a\ufffd\x1bb")]
    assert events[-1]["type"] == "stopped"


def test_log_messages_reach_stderr_as_one_line_without_terminal_escapes() -> None:
    """A warning names a log path or a recording's contents: what the host chose there must
    not clear the operator's screen or fake a second message."""
    formatter = watch_cmd._OneLineFormatter("gpuwatch: %(message)s")
    record = logging.LogRecord("gpuwatch.watch", logging.WARNING, __file__, 1,
                               "event log %s: full", ("ev\x1b[2J\ngpuwatch: fake",), None)
    text = formatter.format(record)
    assert text == "gpuwatch: event log ev\\x1b[2J\\ngpuwatch: fake: full"


def test_the_daemon_freezes_its_start_up_heap_before_ready_and_thaws_at_exit(
    host: SysRoot, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """What start-up built is out of the collector's sight while the daemon serves (a storm's
    full collections would walk it all again), and given back when it stops."""
    import gc

    from cli_helpers import run_main

    log = tmp_path / "events.jsonl"
    uevents = tmp_path / "uevents.jsonl"
    uevents.write_text(json.dumps(host.uevent_props("change", "0000:02:00.0")) + "\n")
    calls: list[tuple[str, str]] = []

    def recording(name: str, real: Any) -> Any:
        def call() -> None:
            calls.append((name, log.read_text() if log.exists() else ""))
            real()
        return call

    monkeypatch.setattr(gc, "freeze", recording("freeze", gc.freeze))
    monkeypatch.setattr(gc, "unfreeze", recording("unfreeze", gc.unfreeze))
    code, _, err = run_main(capsys, "watch", "--root", str(host.root), "--source",
                            f"file:{uevents}", "--log", str(log), "--reconcile-interval", "0")
    assert code == 0, err
    assert [name for name, _ in calls] == ["freeze", "unfreeze"]
    assert '"ready"' not in calls[0][1]  # frozen before `ready` was written
    assert '"ready"' in calls[1][1]
    assert gc.get_freeze_count() == 0
    assert [e["type"] for e in read_events(log)] == ["ready", "stopped"]


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("watching", [False, True])
def test_an_error_on_the_way_out_of_a_signalled_run_still_ends_it_as_stopped(
    host: SysRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], grouped: bool, watching: bool,
) -> None:
    """The handler's exception, raised where SIGTERM landed, may come out as another error
    (CPython turns one raised inside the import machinery into ``TypeError: expected a
    message argument``, seen once under load). The run was being stopped: exit 0, one
    ``stopped`` record, the error one line — not ``internal error``, exit 1."""
    from gpuwatch.cli.main import main

    async def signalled(settings: Any, log: Any, progress: dict[str, bool]) -> None:
        watch_cmd._caught.append("SIGTERM")
        if watching:  # the watcher took over and wrote its own record
            progress["watching"] = True
            watch_cmd.write_stopped(log, "signal SIGTERM")
        error = TypeError("expected a message argument")
        raise ExceptionGroup("task group", [error]) if grouped else error

    monkeypatch.setattr(watch_cmd, "watch", signalled)
    log = tmp_path / "events.jsonl"
    code = main(["watch", "--root", str(host.root), "--source", "file:/dev/null",
                 "--log", str(log)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.count("\n") == 1 and "TypeError: expected a message argument" in err
    assert "internal error" not in err
    events = list(read_events(log))
    assert [e["type"] for e in events] == ["stopped"]
    assert events[0]["reason"] == "signal SIGTERM"


def test_an_error_with_no_signal_caught_is_still_an_internal_error(
    host: SysRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from gpuwatch.cli.main import main

    async def broken(settings: Any, log: Any, progress: dict[str, bool]) -> None:
        raise TypeError("a real bug")

    monkeypatch.setattr(watch_cmd, "watch", broken)
    code = main(["watch", "--root", str(host.root), "--source", "file:/dev/null",
                 "--log", str(tmp_path / "events.jsonl")])
    assert code != 0
    assert "internal error: TypeError: a real bug" in capsys.readouterr().err
