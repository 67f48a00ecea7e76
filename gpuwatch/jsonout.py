"""JSON for the outside world: pydantic models by alias (``class``), tuples as lists."""

from __future__ import annotations

from typing import Any

from pydantic_core import to_json, to_jsonable_python


def dumps(value: Any) -> str:
    """Compact JSON text of any answer or event (models serialised lazily, here at the edge)."""
    return to_json(value, by_alias=True).decode()


def jsonable(value: Any) -> Any:
    """Plain dicts/lists/scalars, for embedding in a larger document."""
    return to_jsonable_python(value, by_alias=True)
