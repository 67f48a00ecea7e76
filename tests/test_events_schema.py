"""The published event schema matches the models, and real log lines validate against it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuwatch.core.events import EVENT_TYPES, DriverChanged, Resync, json_schema, parse_event

SCHEMA = Path(__file__).parent.parent / "docs" / "events.schema.json"


def test_schema_file_is_current() -> None:
    assert json.loads(SCHEMA.read_text()) == json_schema(), (
        'regenerate: python -c "import json,gpuwatch.core.events as e; '
        'print(json.dumps(e.json_schema(), indent=2, sort_keys=True))" > docs/events.schema.json'
    )


def test_every_event_type_is_in_the_schema_and_the_docs() -> None:
    schema = json_schema()
    consts = {
        d["properties"]["type"]["const"]
        for d in schema["$defs"].values()
        if "const" in d.get("properties", {}).get("type", {})  # Vgpu's `type` is a number
    }
    assert consts == EVENT_TYPES
    docs = (SCHEMA.parent / "events.md").read_text()
    for event_type in EVENT_TYPES:
        assert f"`{event_type}`" in docs


def test_log_line_round_trip() -> None:
    event = DriverChanged(
        addr="0000:01:00.0", old="nvidia", new="vfio-pci", seq=7, time="2026-12-02T17:00:00.000000Z"
    )
    line = event.model_dump_json()
    assert json.loads(line) == {
        "seq": 7,
        "time": "2026-12-02T17:00:00.000000Z",
        "type": "driver-changed",
        "addr": "0000:01:00.0",
        "old": "nvidia",
        "new": "vfio-pci",
    }
    assert parse_event(line) == event
    assert isinstance(parse_event({"type": "resync", "reason": "overflow", "changes": 2}), Resync)
    with pytest.raises(ValueError):
        parse_event({"type": "resync", "reason": "boredom", "changes": 2})
