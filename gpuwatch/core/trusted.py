"""Building frozen pydantic records from values the model already holds, without validating.

The per-event path builds a new function record and a change event for every uevent. Pydantic
validation costs about 1-2 µs per record and `BaseModel.model_construct` (plain Python) 5 µs;
these helpers do what ``model_construct``/``model_copy`` leave behind (the same ``__dict__``,
fields-set, extra and private slots) for a fraction of that. Only for values that are already
of the field's type: values from a validated record, or strings the edge has read. Tests check
that the result equals, dumps and hashes like the validated record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)

_new = object.__new__
_set = object.__setattr__


def evolve(model: M, update: Mapping[str, Any]) -> M:
    """``model.model_copy(update=update)`` (a shallow copy with ``update`` applied), in C-level
    dict operations. ``update`` must name fields and hold values of their types."""
    new = _new(type(model))
    fields = model.__dict__.copy()
    fields.update(update)
    _set(new, "__dict__", fields)
    _set(new, "__pydantic_fields_set__", model.__pydantic_fields_set__ | update.keys())
    _set(new, "__pydantic_extra__", None)
    _set(new, "__pydantic_private__", None)
    return new


def build(cls: type[M], fields: dict[str, Any], fields_set: set[str]) -> M:
    """``cls(**given)`` for values already of their fields' types: ``fields`` holds every field
    in declaration order (defaults included), ``fields_set`` the names the caller gave. The
    dict is taken over, not copied."""
    new = _new(cls)
    _set(new, "__dict__", fields)
    _set(new, "__pydantic_fields_set__", fields_set)
    _set(new, "__pydantic_extra__", None)
    _set(new, "__pydantic_private__", None)
    return new


def trusted_ok(cls: type[BaseModel]) -> bool:
    """Whether `build`/`evolve` may stand in for validation on ``cls``: no extra fields, no
    private attributes, no post-init hook (none of gpuwatch's records has them)."""
    return (
        cls.model_config.get("extra") in (None, "ignore")
        and not cls.__private_attributes__
        and cls.__pydantic_post_init__ is None
        and not cls.__pydantic_root_model__
    )


__all__ = ["build", "evolve", "trusted_ok"]
