"""One record for what a switch did: ``SwitchResult`` is the ``switch-completed`` event.

Its two JSON views are compared byte for byte with lines recorded before the two classes
were merged (tests/fixtures/golden/switch_records.jsonl): the event line, the result as
``gpuwatch mode --json`` prints it (a switch and a no-op) and the socket's ``switch`` reply.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from gpuwatch.core import events as ev
from gpuwatch.jsonout import dumps
from gpuwatch.service import protocol as P
from gpuwatch.switch.engine import SwitchResult
from gpuwatch.testing import SysRoot
from gpuwatch.testing.simkernel import simulated_switch

GOLDEN = Path(__file__).parent / "fixtures" / "golden" / "switch_records.jsonl"
EVENT, RESULT, NOOP, REPLY = GOLDEN.read_text(encoding="utf-8").splitlines()
NV, AUDIO = "0000:01:00.0", "0000:01:00.1"


def keys(line: str) -> list[str]:
    return list(json.loads(line))


def test_one_class_under_both_names() -> None:
    assert SwitchResult is ev.SwitchCompleted


def test_the_event_line_is_byte_for_byte_the_recorded_one() -> None:
    members = [ev.SwitchMember(addr=NV, driver="vfio-pci"),
               ev.SwitchMember(addr=AUDIO, driver="vfio-pci")]
    record = SwitchResult(addr=NV, group=13, from_mode="nvidia", to_mode="vfio",
                          members=members, duration_ms=1234.567, changed=True,
                          notes=["a note ü"])
    ev.stamp([record], 42, "2026-12-02T17:20:41.123456Z")
    assert record.model_dump_json() == EVENT
    assert dumps(record) == EVENT  # what --json event output and the log share
    # ... and the result view of the very same record, as the CLI and the socket send it.
    assert dumps(record.as_result()) == RESULT
    assert P.encode_result(3, record.as_result()) == (REPLY + "\n").encode()


def test_a_no_op_result_is_byte_for_byte_the_recorded_one() -> None:
    noop = SwitchResult(addr="", group=-1, from_mode="", to_mode="vfio", members=[],
                        duration_ms=0.0, changed=False,
                        notes=["no such card: nothing to switch"])
    assert dumps(noop.as_result()) == NOOP


def test_recorded_lines_read_back_to_the_same_bytes() -> None:
    event = ev.parse_event(EVENT)
    assert isinstance(event, SwitchResult)
    assert event.model_dump_json() == EVENT
    assert event.changed and event.notes == []  # a logged switch-completed changed the group
    # A daemon's reply, read by the CLI (mode/recover through the socket), prints unchanged.
    for line in (RESULT, NOOP):
        assert dumps(SwitchResult.model_validate(json.loads(line)).as_result()) == line


def test_the_event_schema_has_no_result_fields() -> None:
    schema = ev.json_schema()
    defs = schema.get("$defs", {})
    (completed,) = [d for d in defs.values()
                    if d.get("properties", {}).get("type", {}).get("const") == "switch-completed"]
    assert list(completed["properties"]) == keys(EVENT)


async def test_a_real_switch_publishes_the_record_it_returns(host: SysRoot) -> None:
    """Through the engine on a simulated kernel: the published line has the event's fields
    in the recorded order, the returned result is that same frozen record, and its result
    view has the recorded reply's fields in order."""
    lines: list[str] = []

    def keep(events: Sequence[BaseModel], batch: Sequence[str]) -> None:
        lines.extend(batch)

    async with simulated_switch(host) as (gpu, _sim, _engine, events):
        gpu.watcher.batch_listeners.append(keep)
        result = await gpu.switch("0x10de", "vfio", timeout=5)
    (completed,) = [e for e in events if getattr(e, "type", None) == "switch-completed"]
    assert completed is result
    assert result.seq > 0 and result.time  # stamped once, when published
    (line,) = [x for x in lines if '"type":"switch-completed"' in x]
    assert keys(line) == keys(EVENT)
    assert line == result.model_dump_json()
    view: dict[str, Any] = result.as_result()
    assert list(view) == keys(RESULT)
    assert view["changed"] is True and view["members"] == [
        {"addr": NV, "driver": "vfio-pci"}, {"addr": AUDIO, "driver": "vfio-pci"}]
