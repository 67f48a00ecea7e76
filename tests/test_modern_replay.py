"""Recorded uevents of issue 15's cases replayed through ``--source file:PATH``: by the CLI
(``gpuwatch watch``), the library (``open_watcher``) and a socket subscriber."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from replay_scenarios import SCENARIOS, Events, Scenario, parse_lines

from gpuwatch.service.client import AsyncClient
from gpuwatch.service.testing import served_watcher, short_socket_dir
from gpuwatch.sources import open_source
from gpuwatch.watch.watcher import open_watcher

IDS = [s.name for s in SCENARIOS]


def after_ready(events: Events) -> Events:
    return [e for e in events if e["type"] != "ready"]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=IDS)
def test_replay_through_the_cli(scenario: Scenario, tmp_path: Path) -> None:
    host = scenario.build(tmp_path / "root")
    fifo, log = tmp_path / "uevents", tmp_path / "events.jsonl"
    os.mkfifo(fifo)
    recorded = scenario.recorded()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwatch", "watch", "--root", str(host.root), "--source",
         f"file:{fifo}", "--log", str(log), "--reconcile-interval", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)},
    )

    def events() -> Events:
        return parse_lines(log.read_text()) if log.exists() else []

    try:
        with open(fifo, "w") as writer:
            deadline = time.monotonic() + 30
            while not any(e["type"] == "ready" for e in events()):
                assert proc.poll() is None, proc.communicate()[1]
                assert time.monotonic() < deadline
                time.sleep(0.05)
            for phase in scenario.phases:
                phase.change(host)
                writer.write("".join(line + "\n" for line in recorded[phase.lines]))
                writer.flush()
                deadline = time.monotonic() + 20
                while not phase.done(after_ready(events())):
                    assert proc.poll() is None, proc.communicate()[1]
                    assert time.monotonic() < deadline, events()
                    time.sleep(0.05)
        _, stderr = proc.communicate(timeout=30)  # EOF of the FIFO ends the watch
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, stderr
    scenario.check(after_ready(events()))


async def _feed(scenario: Scenario, host: Any, fifo: Path, seen: Events) -> None:
    """Write each phase's recorded lines once the tree has changed, and wait for them."""
    recorded = scenario.recorded()
    with open(fifo, "w") as writer:  # the source holds the read end open already
        for phase in scenario.phases:
            phase.change(host)
            writer.write("".join(line + "\n" for line in recorded[phase.lines]))
            writer.flush()
            with anyio.fail_after(20):
                while not phase.done(after_ready(seen)):
                    await anyio.sleep(0.01)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=IDS)
async def test_replay_through_the_library(scenario: Scenario, tmp_path: Path) -> None:
    host = scenario.build(tmp_path / "root")
    fifo = tmp_path / "uevents"
    os.mkfifo(fifo)
    seen: Events = []
    async with open_watcher(host.root, f"file:{fifo}", reconcile_interval=0,
                            cdi_poll_interval=0) as w:
        w.listeners.append(lambda e: seen.append(e.model_dump(mode="json", by_alias=True)))
        await _feed(scenario, host, fifo, seen)
        with anyio.fail_after(10):
            await w.source_ended.wait()
    scenario.check(after_ready(seen))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=IDS)
async def test_replay_through_the_socket(scenario: Scenario, tmp_path: Path) -> None:
    host = scenario.build(tmp_path / "root")
    fifo = tmp_path / "uevents"
    os.mkfifo(fifo)
    seen: Events = []
    with short_socket_dir() as sockdir:
        path = f"{sockdir}/gw.sock"
        source = open_source(f"file:{fifo}", host.root)
        async with served_watcher(host.root, path, source=source) as served, \
                await AsyncClient.connect(path) as client, anyio.create_task_group() as tg:
            await client.subscribe()

            async def read() -> None:
                async for event in client.events():
                    seen.append(event)

            tg.start_soon(read)
            await _feed(scenario, host, fifo, seen)
            with anyio.fail_after(10):
                await served.watcher.source_ended.wait()
            await anyio.sleep(0.1)  # the last batch reaches the subscriber
            tg.cancel_scope.cancel()
    scenario.check(after_ready(seen))
