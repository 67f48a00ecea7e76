"""Change events: what the model, the watcher and the switch publish (docs/events.md).

Each event is one immutable record. The model creates it with ``seq=0`` and ``time=""``;
the publisher stamps both exactly once (`stamp`) before anyone sees it, so the pure core
needs no clock and numbering is the log's business. From then on nothing changes it: every
in-process subscriber gets this same frozen object, and its JSON line is serialised once
per publication and shared by the log, every socket client and ``--json`` output.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    model_serializer,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticSerializationError

from gpuwatch.core.results import GpuInfo, Health, Holding, PciFunction, Vgpu
from gpuwatch.core.trusted import build, shared_fields_set
from gpuwatch.errors import InternalError


def format_event_time(when: datetime | None = None) -> str:
    """RFC 3339 UTC with microseconds (``2026-12-02T17:20:41.123456Z``): fixed width, sortable,
    and what every log tool parses. The one clock format of events, logs and poison records;
    the core never calls it without ``when`` (the publisher does)."""
    moment = datetime.now(UTC) if when is None else when.astimezone(UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True, serialize_by_alias=True, validate_by_name=True)

    seq: int = 0
    time: str = ""


def stamp(events: Sequence[BaseModel], first_seq: int, time: str) -> None:
    """Give fresh events their ``seq`` (from ``first_seq`` up) and ``time``: the one write a
    frozen event ever takes, made by the publisher before the event is shared.

    Straight into the instance dict: pydantic's ``__setattr__`` would refuse (frozen) and
    costs a tenth of an event anyway. An event published twice would be two log lines
    with one identity; that is a bug, so it raises instead.
    """
    seq = first_seq
    for event in events:
        fields = event.__dict__
        if fields["seq"]:
            raise InternalError(f"event {fields['seq']} ({fields.get('type')}) published twice")
        fields["seq"] = seq
        fields["time"] = time
        seq += 1


class Ready(_Event):
    type: Literal["ready"] = "ready"
    devices: int
    source: str


class DeviceAdded(_Event):
    type: Literal["device-added"] = "device-added"
    addr: str
    device: PciFunction


class DeviceRemoved(_Event):
    type: Literal["device-removed"] = "device-removed"
    addr: str
    device: PciFunction


class DriverChanged(_Event):
    type: Literal["driver-changed"] = "driver-changed"
    addr: str
    old: str
    new: str


_DRIVER_CHANGED_SET = shared_fields_set({"addr", "old", "new"})


def driver_changed(addr: str, old: str, new: str) -> DriverChanged:
    """``DriverChanged(addr=addr, old=old, new=new)`` without validation (the model's strings
    are already strings): one is built per bind or unbind, the hottest event there is."""
    return build(DriverChanged, {"seq": 0, "time": "", "type": "driver-changed", "addr": addr,
                                 "old": old, "new": new}, _DRIVER_CHANGED_SET)


class IommuGroupChanged(_Event):
    type: Literal["iommu-group-changed"] = "iommu-group-changed"
    addr: str
    old: int
    new: int


class DeviceChanged(_Event):
    """A function's other fields changed (``vfio_dev``, ``vfio_cdev``, ``sriov``, ``physfn``,
    or ``health`` cleared by a rebind): ``changed`` names them, ``device`` is the new record.
    A driver, group, vGPU or error change has its own event instead."""

    type: Literal["device-changed"] = "device-changed"
    addr: str
    changed: list[str]
    device: PciFunction


class VgpuChanged(_Event):
    """An NVIDIA vGPU VF's current or creatable vGPU types changed (no uevent says so)."""

    type: Literal["vgpu-changed"] = "vgpu-changed"
    addr: str
    vgpu: Vgpu | None


class DeviceError(_Event):
    """A PCI error-recovery uevent: ``error_event`` as the kernel sent it (``BEGIN_RECOVERY``,
    ``SUCCESSFUL_RECOVERY``, ``FAILED_RECOVERY``), ``online`` from ``DEVICE_ONLINE``."""

    type: Literal["device-error"] = "device-error"
    addr: str
    error_event: str
    online: bool | None
    health: Health


class GpuWedged(_Event):
    """A DRM driver declared the GPU wedged; ``recovery`` lists what the kernel says to do."""

    type: Literal["gpu-wedged"] = "gpu-wedged"
    addr: str
    card: str
    recovery: list[str]
    pid: int | None
    task: str | None


class NodeAdded(_Event):
    type: Literal["node-added"] = "node-added"
    path: str


class NodeRemoved(_Event):
    type: Literal["node-removed"] = "node-removed"
    path: str


class ProbeChanged(_Event):
    """A watched answer changed. Plain answers carry whole ``old``/``new`` values; object
    answers only the fields that changed, and ``detect-vfio`` only the GPU entries that
    changed (docs/events.md): an event's size never grows with the host."""

    type: Literal["probe-changed"] = "probe-changed"
    action: str
    old: Any
    new: Any


class Resync(_Event):
    type: Literal["resync"] = "resync"
    reason: Literal["overflow", "reconcile"]
    changes: int


class Stopped(_Event):
    """The last record of a run: the watcher stops here (signal, end of a file source)."""

    type: Literal["stopped"] = "stopped"
    reason: str


class LogDegraded(_Event):
    """Writing the event log failed (ENOSPC, EIO, …): events go on to subscribers, the log
    is retried with backoff and resumes with a ``log-gap`` record. Never in the log itself."""

    type: Literal["log-degraded"] = "log-degraded"
    path: str
    error: str


class LogGap(_Event):
    """Written to the log when it resumes: the events ``first_seq..last_seq`` were published
    but could not be written. It takes ``last_seq`` as its own ``seq``, so seqs in the file
    stay increasing and a reader sees exactly which ones it cannot replay."""

    type: Literal["log-gap"] = "log-gap"
    first_seq: int
    last_seq: int
    error: str


class SwitchMember(BaseModel):
    addr: str
    driver: str


class SwitchStarted(_Event):
    type: Literal["switch-started"] = "switch-started"
    addr: str
    group: int
    from_mode: str
    to_mode: str
    members: list[str]


#: Serialisation context asking a `SwitchCompleted` for its result view (`as_result`).
_RESULT_VIEW: Final = {"view": "switch-result"}
_EVENT_ONLY: Final = ("seq", "time", "type")
_RESULT_ONLY: Final = ("changed", "notes")


# What a switch did: one record that is both the ``switch-completed`` event and the result
# ``Host.switch``/``recover`` return (``SwitchResult`` is this class). One field order serves
# both views, so neither reorders: the event's JSON (what the log, sockets and subscribers
# get; the default) leaves out ``changed`` and ``notes``, the result's (`as_result`: the
# socket's ``switch`` reply, ``gpuwatch mode --json``) leaves out ``seq``, ``time`` and
# ``type``. A published switch returns the very record its subscribers got, stamped; one
# that changed nothing (already in mode, no such card) is never published. (A comment,
# not a docstring: the event schema carries docstrings, and this one is not about events.)
class SwitchCompleted(_Event):
    type: Literal["switch-completed"] = "switch-completed"
    addr: str
    group: int
    from_mode: str
    to_mode: str
    members: list[SwitchMember]
    duration_ms: float
    # Result only: a logged event reads back as a switch that changed the group.
    changed: SkipJsonSchema[bool] = True
    notes: SkipJsonSchema[list[str]] = []

    @model_serializer(mode="wrap")
    def _view(self, handler: SerializerFunctionWrapHandler,
              info: SerializationInfo) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        for name in _EVENT_ONLY if info.context == _RESULT_VIEW else _RESULT_ONLY:
            data.pop(name, None)
        return data

    def as_result(self) -> dict[str, Any]:
        """The result view as plain JSON values: ``addr``, ``group``, ``from_mode``,
        ``to_mode``, ``members``, ``duration_ms``, ``changed``, ``notes`` (docs/socket.md)."""
        return self.model_dump(mode="json", by_alias=True, context=_RESULT_VIEW)


class SwitchRefused(_Event):
    type: Literal["switch-refused"] = "switch-refused"
    addr: str
    group: int
    to_mode: str
    reason: str
    holders: list[Holding]
    #: What a switch that had begun put back before giving up (``systemctl start …``,
    #: ``modprobe …``); empty when it had changed nothing.
    restored: list[str] = []


class SwitchFailed(_Event):
    type: Literal["switch-failed"] = "switch-failed"
    addr: str
    group: int
    to_mode: str
    error: str
    wedged: bool
    #: As in switch-refused; always empty after a wedge (nothing is touched then).
    restored: list[str] = []


Event = Annotated[
    Ready
    | DeviceAdded
    | DeviceRemoved
    | DeviceChanged
    | DriverChanged
    | IommuGroupChanged
    | VgpuChanged
    | DeviceError
    | GpuWedged
    | NodeAdded
    | NodeRemoved
    | ProbeChanged
    | Resync
    | SwitchStarted
    | SwitchCompleted
    | SwitchRefused
    | SwitchFailed
    | Stopped
    | LogDegraded
    | LogGap,
    Field(discriminator="type"),
]

EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)
EVENT_TYPES: frozenset[str] = frozenset(
    m.model_fields["type"].default
    for m in (
        Ready, DeviceAdded, DeviceRemoved, DeviceChanged, DriverChanged, IommuGroupChanged,
        VgpuChanged, DeviceError, GpuWedged, NodeAdded,
        NodeRemoved, ProbeChanged, Resync, SwitchStarted, SwitchCompleted, SwitchRefused,
        SwitchFailed, Stopped, LogDegraded, LogGap,
    )
)


#: A string JSON spells as itself between quotes: printable ASCII except ``"`` and ``\\``.
_PLAIN_RE = re.compile(r'[ !#-\[\]-~]*')
#: Strings already known to be plain, quoted (addresses, driver names, times: few and reused).
_QUOTED: dict[str, str] = {}
_QUOTED_MAX = 4096
#: The last stamp seen and its quoted form ("" when it is not plain).
_LAST_TIME: tuple[str, str] = ("", "")


def _quoted(text: str) -> str | None:
    quoted = _QUOTED.get(text)
    if quoted is None:
        if _PLAIN_RE.fullmatch(text) is None:
            return None
        if len(_QUOTED) >= _QUOTED_MAX:
            _QUOTED.clear()
        quoted = _QUOTED[text] = f'"{text}"'
    return quoted


#: A driver-changed line after its stamp, per (addr, old, new): a storm toggles the same
#: few hundred functions between the same two drivers.
_DRIVER_TAILS: dict[tuple[str, str, str], str] = {}


def event_json(event: BaseModel) -> str:
    """The event's JSON line (no newline): ``event.model_dump_json()``, byte for byte.

    A ``driver-changed`` whose strings are plain (see `_PLAIN_RE`) is formatted directly, a
    fifth of the cost: a storm publishes one per uevent. Anything else goes to pydantic.
    """
    if type(event) is DriverChanged:
        global _LAST_TIME
        fields = event.__dict__
        seq, time = fields["seq"], fields["time"]
        last = _LAST_TIME  # one read: the pair stays a pair whoever swaps it meanwhile
        if time is last[0]:  # a batch shares one stamp: checked once
            time = last[1]
        else:
            quoted = f'"{time}"' if _PLAIN_RE.fullmatch(time) is not None else ""
            _LAST_TIME = (time, quoted)
            time = quoted
        key = (fields["addr"], fields["old"], fields["new"])
        tail = _DRIVER_TAILS.get(key)
        if tail is None:
            addr, old, new = _quoted(key[0]), _quoted(key[1]), _quoted(key[2])
            if addr and old and new:
                if len(_DRIVER_TAILS) >= _QUOTED_MAX:
                    _DRIVER_TAILS.clear()
                tail = _DRIVER_TAILS[key] = (f',"type":"driver-changed","addr":{addr},'
                                             f'"old":{old},"new":{new}}}')
        if tail is not None and type(seq) is int and time:
            return f'{{"seq":{seq},"time":{time}{tail}'
    elif type(event) is ProbeChanged:
        try:
            line = _gpus_changed_json(event.__dict__)
        except PydanticSerializationError:
            line = None  # bytes that are not UTF-8 in an entry: the general path scrubs them
        if line is not None:
            return line
    try:
        return event.model_dump_json()
    except PydanticSerializationError:
        return _scrubbed_json(event)


#: A lone surrogate: how Python holds a byte that is not UTF-8 (``surrogateescape``).
_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def scrub_surrogates(value: Any) -> Any:
    """Plain JSON data with each lone surrogate (a byte that was not UTF-8) as U+FFFD: what
    the log and the socket write where a host's bytes cannot be carried by JSON."""
    if isinstance(value, str):
        return _SURROGATE_RE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {scrub_surrogates(k): scrub_surrogates(v) for k, v in value.items()}
    if isinstance(value, list):
        return [scrub_surrogates(v) for v in value]
    return value


def _scrubbed_json(event: BaseModel) -> str:
    """The line of an event holding bytes that are not UTF-8, each as U+FFFD.

    A uevent's ``TASK=`` is a process name, which any process sets to any bytes, and a
    DEVPATH keeps its raw bytes (surrogate escapes) to name the same sysfs path: JSON
    cannot carry those, and an event must never fail to be written. Same fields, same
    order and the same compact form as pydantic's line.
    """
    data = scrub_surrogates(event.model_dump(mode="json"))
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


#: id(GpuInfo) → (the record, its JSON): a record is immutable, and a GPU entry published as a
#: probe-changed's ``new`` is the next one's ``old``. The record is held so its id stays its.
#: An entry leaves as it is used on an ``old`` side (superseded: the model never publishes
#: that record again), so what stays is one entry per GPU as last published, not every
#: state each GPU ever went through (each holding its group's records) up to the bound.
_GPU_JSON: dict[int, tuple[BaseModel, str]] = {}
_GPU_JSON_MAX = 4096


def _gpu_json(gpu: BaseModel, *, superseded: bool = False) -> str:
    """``gpu``'s JSON, made once; ``superseded``: the entry is an ``old`` side's, dropped."""
    key = id(gpu)
    cached = _GPU_JSON.pop(key, None) if superseded else _GPU_JSON.get(key)
    if cached is not None and cached[0] is gpu:
        return cached[1]
    text = gpu.model_dump_json()
    if not superseded:
        if len(_GPU_JSON) >= _GPU_JSON_MAX:
            _GPU_JSON.clear()
        _GPU_JSON[key] = (gpu, text)
    return text


def _old_gpu_json(gpu: BaseModel) -> str:
    """`_gpu_json` of an entry on a probe-changed's ``old`` side."""
    return _gpu_json(gpu, superseded=True)


def _gpus_changed_json(fields: dict[str, Any]) -> str | None:
    """A ``detect-vfio`` probe-changed whose sides hold only GPU entries, with each entry's JSON
    made once (pydantic's bytes: the whole line is what ``model_dump_json`` gives, a test
    holds it to that); None for anything else."""
    old, new, time, seq = fields["old"], fields["new"], fields["time"], fields["seq"]
    if not (fields["action"] == "detect-vfio" and type(old) is dict and type(new) is dict
            and type(seq) is int and _PLAIN_RE.fullmatch(time) is not None):
        return None
    sides = []
    for side, dump in ((old, _old_gpu_json), (new, _gpu_json)):
        if not side:
            sides.append("{}")
            continue
        gpus = side.get("gpus")
        if len(side) != 1 or type(gpus) is not list:
            return None
        for gpu in gpus:
            if type(gpu) is not GpuInfo:
                return None
        sides.append('{"gpus":[' + ",".join(map(dump, gpus)) + "]}")
    return (f'{{"seq":{seq},"time":"{time}","type":"probe-changed","action":"detect-vfio",'
            f'"old":{sides[0]},"new":{sides[1]}}}')


def parse_event(data: str | bytes | dict[str, Any]) -> Event:
    """A log line or decoded object back into its typed event (validates at the edge)."""
    if isinstance(data, dict):
        return EVENT_ADAPTER.validate_python(data)
    return EVENT_ADAPTER.validate_json(data)


def json_schema() -> dict[str, Any]:
    """The JSON Schema of one log line (docs/events.schema.json is generated from this)."""
    schema = EVENT_ADAPTER.json_schema(by_alias=True)
    schema["title"] = "gpuwatch event"
    for definition in schema.get("$defs", {}).values():
        props = definition.get("properties", {})
        if "seq" in props and "type" in props:
            # Defaults exist for the pure core; every line of the log carries all three.
            required = definition.setdefault("required", [])
            definition["required"] = ["seq", "time", "type", *[r for r in required if r not in
                                                              ("seq", "time", "type")]]
        elif props:
            # Every field is serialised, defaults included (the PCI function's newer fields).
            definition["required"] = list(props)
    return schema
