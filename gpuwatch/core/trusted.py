"""Building frozen pydantic records from values the model already holds, without validating.

The per-event path builds a new function record and a change event for every uevent. Pydantic
validation costs about 1-2 µs per record and `BaseModel.model_construct` (plain Python) 5 µs;
these helpers do what ``model_construct``/``model_copy`` leave behind (the same ``__dict__``,
fields-set, extra and private slots) for a fraction of that. Only for values that are already
of the field's type: values from a validated record, or strings the edge has read. Tests check
that the result equals, dumps and hashes like the validated record.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)

_new = object.__new__
_set = object.__setattr__

#: One fields-set per combination of names (see `shared_fields_set`).
_FIELDS_SETS: dict[frozenset[str], set[str]] = {}


def shared_fields_set(names: Set[str]) -> set[str]:
    """The one ``__pydantic_fields_set__`` every record given ``names`` shares. A set of a
    dozen names takes 728 bytes, more than the rest of a function's record: one per record
    was a fifth of a watcher's memory on a large host. Sharing is safe for frozen records,
    which pydantic never changes in place (``model_copy`` and ``copy`` copy the set first);
    nothing may mutate a record's ``model_fields_set``. Keyed by content: a few dozen sets
    at most (the combinations of fields gpuwatch's records are built with)."""
    key = frozenset(names)
    shared = _FIELDS_SETS.get(key)
    if shared is None:
        shared = _FIELDS_SETS[key] = set(key)
    return shared


def evolve(model: M, update: Mapping[str, Any]) -> M:
    """``model.model_copy(update=update)`` (a shallow copy with ``update`` applied), in C-level
    dict operations. ``update`` must name fields and hold values of their types."""
    new = _new(type(model))
    fields = model.__dict__.copy()
    fields.update(update)
    _set(new, "__dict__", fields)
    fields_set = model.__pydantic_fields_set__
    _set(new, "__pydantic_fields_set__", fields_set if update.keys() <= fields_set
         else shared_fields_set(fields_set | update.keys()))
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


__all__ = ["build", "evolve", "shared_fields_set", "trusted_ok"]
