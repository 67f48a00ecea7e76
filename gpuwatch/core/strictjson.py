"""Strict JSON decoding for lines that come from someone else: stdlib only.

The daemon decodes its clients' requests here, and its clients (`gpuwatch.Client` and the
stdlib-only fast CLI) decode its replies here: what one side refuses the other refuses
too. Python's ``json`` alone accepts ``NaN`` and ``Infinity``, keeps the last of two equal
keys, recurses in C until a deep document overflows the stack (a `RecursionError`, not a
`ValueError`), and returns lone surrogates that no UTF-8 stream can write. Each of those is
`UnsafeJson` here, a `ValueError`, so one ``except ValueError`` covers every bad line.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any, Final

from gpuwatch.errors import CallerError

#: JSON nested deeper than this is refused by default; no request needs more than 3 levels.
MAX_DEPTH: Final = 32


class UnsafeJson(CallerError, ValueError):
    """Well-formed JSON we still refuse: nesting too deep, a number no double holds, a
    duplicate key or a lone surrogate. Each would break a reader somewhere down the line."""


#: Every byte but quotes and brackets: the rest says nothing of how deep a text nests.
_NOT_MARKS = bytes(set(range(256)) - set(b'"[]{}'))
_LONE_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def json_depth(text: str) -> int:
    """How deep ``text``'s arrays and objects nest, in linear time and without recursion.

    Escapes are removed first (``\\\\`` before ``\\"``, the order a parser reads them), so
    splitting on the remaining quotes leaves string bodies at the odd positions; only the
    brackets outside strings count. Only quotes and brackets are kept for that, and where no
    string holds a bracket (every reply and request gpuwatch writes) each string is then a
    ``""`` that goes at once: once every pair of adjacent quotes is gone, a quote is left
    whenever a string held a bracket (or the quotes do not pair), and only then is the
    text split (a reply of a hundred GPUs has ten thousand strings).
    """
    if text.count("[") + text.count("{") <= 1:
        return text.count("[") + text.count("{")
    # As UTF-8 bytes (a lone surrogate passed through): no byte of a character beyond
    # ASCII is a quote, a bracket or a backslash, and bytes lose the others in C.
    raw = text.encode("utf-8", "surrogatepass")
    if b"\\" in raw:
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = raw.translate(None, _NOT_MARKS)
    outside = marks.replace(b'""', b"")
    if b'"' in outside:
        outside = b"".join(marks.split(b'"')[::2])
    if not outside:
        return 0
    return max(0, *accumulate(1 if c in b"[{" else -1 for c in outside))


def _no_constant(name: str) -> Any:
    raise UnsafeJson(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise UnsafeJson(f"number {text[:40]} is out of range")
    return value


#: Digits of the largest integer a double holds (1.8e308 has 309). A longer one is refused
#: before `int` sees it: CPython's own limit (4,300 digits) would refuse it in words about
#: its settings, and every integer this side reads ends up a double or an index anyway.
_MAX_INT_DIGITS: Final = 309


def _bounded_int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > _MAX_INT_DIGITS:
        raise UnsafeJson(f"integer of {digits} digits is out of range")
    value = int(text)
    if digits == _MAX_INT_DIGITS:
        try:
            float(value)
        except OverflowError:
            raise UnsafeJson(f"integer {text[:40]}… is out of range") from None
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise UnsafeJson(f"duplicate key {dup[:40]!r}")
    return obj


# One decoder for every line: ``json.loads`` with hooks would build a new one per call. The
# integer hook is a Python call per integer (two thirds more time on an event line), so it
# is used only for a text with a run of digits long enough to need it.
_STRICT = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite,
                           object_pairs_hook=_unique_keys)
_STRICT_INTS = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite,
                                parse_int=_bounded_int, object_pairs_hook=_unique_keys)
#: Every ASCII digit as ``0``: a run of `_MAX_INT_DIGITS` of them is then one substring
#: (a search in C, where a regular expression tried a match at every digit).
_DIGITS_AS_ZEROS = str.maketrans("123456789", "000000000")
_LONG_DIGITS = "0" * _MAX_INT_DIGITS


def has_long_digits(text: str) -> bool:
    """Whether ``text`` holds a run of `_MAX_INT_DIGITS` ASCII digits: only then may it hold
    an integer no double holds, and only then is it decoded with the integer hook."""
    return len(text) >= _MAX_INT_DIGITS and _LONG_DIGITS in text.translate(_DIGITS_AS_ZEROS)


def loads(text: str | bytes, *, max_depth: int = MAX_DEPTH) -> Any:
    """Strict JSON: `UnsafeJson` for what `UnsafeJson` lists, `ValueError` for not-JSON.

    The depth is decided before the parser runs, so a depth-1000 array is refused without
    the (recursive) C parser ever seeing it. Used for requests and, in the clients, replies.
    """
    if isinstance(text, bytes | bytearray):
        text = bytes(text).decode("utf-8")  # UnicodeDecodeError is a ValueError
    # Nesting cannot go deeper than there are brackets: a request (a handful) skips the scan.
    if text.count("[") + text.count("{") > max_depth:
        depth = json_depth(text)
        if depth > max_depth:
            raise UnsafeJson(f"JSON nested {depth} deep (at most {max_depth})")
    obj = (_STRICT_INTS if has_long_digits(text) else _STRICT).decode(text)
    if _LONE_SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise UnsafeJson("a string holds a lone UTF-16 surrogate") from None
    return obj


__all__ = ["MAX_DEPTH", "UnsafeJson", "json_depth", "loads"]
