"""One event record: frozen, stamped once, serialised once, the same object for everyone."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from pydantic import BaseModel, ValidationError

from gpuwatch.core.events import DriverChanged, NodeAdded, stamp
from gpuwatch.errors import InternalError
from gpuwatch.host import open_host
from gpuwatch.sources.memory import MemorySource
from gpuwatch.testing import SysRoot

NV = "0000:01:00.0"


def test_an_event_cannot_be_changed_once_made() -> None:
    event = DriverChanged(addr=NV, old="nvidia", new="vfio-pci")
    with pytest.raises(ValidationError):
        event.new = "nouveau"  # type: ignore[misc]
    assert event.new == "vfio-pci"


def test_stamp_gives_seq_and_time_once() -> None:
    events = [NodeAdded(path="/dev/vfio/1"), NodeAdded(path="/dev/vfio/2")]
    stamp(events, 41, "2026-12-02T17:20:41.123456Z")
    assert [e.seq for e in events] == [41, 42]
    assert {e.time for e in events} == {"2026-12-02T17:20:41.123456Z"}
    with pytest.raises(InternalError, match="published twice"):
        stamp(events[:1], 99, "later")
    assert events[0].seq == 41  # unchanged by the refused second stamp


async def test_everyone_shares_one_object_and_one_line(host: SysRoot, tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    source = MemorySource()
    listened: list[Any] = []
    batches: list[tuple[Sequence[BaseModel], Sequence[str]]] = []
    async with open_host(host.root, source=source, log=str(log), reconcile_interval=0,
                         cdi_poll_interval=0) as gpu_host:
        gpu_host.listeners.append(listened.append)
        gpu_host.batch_listeners.append(lambda events, lines: batches.append((events, lines)))
        async with gpu_host.subscribe(types={"driver-changed"}) as sub:
            host.unbind(NV)
            source.push(host.uevent_props("unbind", NV))
            with anyio.fail_after(5):
                got = await sub.receive()
    assert got.type == "driver-changed" and got.addr == NV
    assert any(e is got for e in listened)  # the listener saw this very object
    ((events, lines),) = [b for b in batches if any(e is got for e in b[0])]
    line = lines[next(i for i, e in enumerate(events) if e is got)]
    assert line == got.model_dump_json()
    stored = [raw for raw in log.read_text().splitlines() if json.loads(raw)["seq"] == got.seq]
    assert stored == [line]  # the log holds the very characters the socket sends
    with pytest.raises(InternalError):
        gpu_host.publish([got])  # published once, never again
