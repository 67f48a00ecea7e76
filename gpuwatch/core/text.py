"""Text for a terminal, from names a host (or a hostile process) chose.

A driver name in a captured tree's ``uevent``, a process's ``comm`` (any local user sets its
own with ``prctl``), a vendor file's bytes: printed as they are, a control character in one
would move the cursor, clear the screen or hide the lines around it.
"""

from __future__ import annotations


def terminal_safe(text: str, *, keep: str = "\n") -> str:
    """``text`` with each character that is not printable written as its Python escape
    (``\\x1b``, ``\\n``, ``\\u202e``), except those in ``keep`` (by default the newlines
    between lines)."""
    if text.isprintable():
        return text
    parts = [text]
    for kept in keep:
        parts = [piece for part in parts for piece in part.split(kept)]
    if all(part.isprintable() for part in parts):
        return text  # only kept characters (a report's newlines): no walk over every one
    return "".join(c if c.isprintable() or c in keep else ascii(c)[1:-1] for c in text)
