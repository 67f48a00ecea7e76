"""One framer for newline-delimited JSON: bytes in, complete lines out, bounded.

Every reader of JSON lines (the socket server and clients, the event log follower, the
recorded-uevent source, the stdlib-only fast CLI) cuts its bytes here, so they agree on
what a line is: the bytes before a ``\\n``, and at the end of the stream whatever is left.
A line longer than the cap is never held: once the partial line passes ``max_line`` bytes
its bytes are dropped, the line is reported as :data:`TOO_LONG` in its place in the output,
and everything up to its newline is skipped. Each reader decides what an over-long line
means (refuse the request, skip the record, drop the connection).

Stdlib only and import-free: the fast CLI imports it before anything heavy. Cutting runs
in C (``bytes.split``, ``max(map(len, …))``); the Python work per chunk is constant, none
per byte and none per line unless a line may be too long.
"""

from __future__ import annotations

from typing import Final

__all__ = ["TOO_LONG", "LineFramer"]

#: Stands in the output for a line longer than ``max_line``. A line never contains a
#: newline, so this marker cannot be mistaken for one; test with ``line is TOO_LONG``
#: (or ``==``). A reader that ignores it sees a blank line, which JSON readers skip.
TOO_LONG: Final = b"\n"


class LineFramer:
    """Incremental splitter: ``feed(chunk)`` returns the lines the chunk completed.

    At most ``max_line`` bytes of an unfinished line are held between calls; ``finish``
    returns the last line of a stream that did not end in a newline.
    """

    __slots__ = ("_discarding", "_held", "max_line")

    def __init__(self, max_line: int) -> None:
        if max_line <= 0:
            raise ValueError(f"max_line must be positive, got {max_line}")
        self.max_line = max_line
        # The unfinished line, in one growing buffer: its bytes cost what they are, however
        # they arrive (a list of the pieces cost ~50 bytes of objects per piece, so a peer
        # dripping a line a byte a read held ~80 times ``max_line``), and it grows in
        # amortised linear time (a long reply read in many chunks is copied about twice).
        self._held = bytearray()
        self._discarding = False  # inside an over-long line already reported

    @property
    def pending(self) -> int:
        """Bytes of an unfinished line held now (0 between lines or while skipping one)."""
        return len(self._held)

    @property
    def skipping(self) -> bool:
        """Inside an over-long line already reported: its bytes are dropped to its newline."""
        return self._discarding

    def feed(self, data: bytes) -> list[bytes]:
        """The complete lines ``data`` ends (without newlines), in order, with each line
        longer than ``max_line`` replaced by :data:`TOO_LONG` (reported as soon as it is
        known to be too long, even before its newline arrives)."""
        if self._discarding:
            cut = data.find(b"\n")
            if cut < 0:
                return []
            self._discarding = False
            data = data[cut + 1 :]
        cap = self.max_line
        first: list[bytes] = []
        held = self._held
        if held:
            cut = data.find(b"\n")
            if cut < 0:
                if len(held) + len(data) > cap:
                    self._drop()
                    return [TOO_LONG]
                held += data
                return []
            if len(held) + cut > cap:
                first.append(TOO_LONG)
            else:
                held += memoryview(data)[:cut]
                first.append(bytes(held))
            self._held = bytearray()  # hold no buffer past its line
            data = data[cut + 1 :]
        lines = data.split(b"\n")
        tail = lines.pop()
        if len(data) > cap and lines and max(map(len, lines)) > cap:
            lines = [TOO_LONG if len(line) > cap else line for line in lines]
        if len(tail) > cap:
            lines.append(TOO_LONG)
            self._discarding = True
        elif tail:
            self._held = bytearray(tail)
        return first + lines if first else lines

    def finish(self) -> list[bytes]:
        """At end of stream: the last line if it had no newline (``[]`` if none was
        pending). The framer is then empty and may read a new stream."""
        tail = bytes(self._held)
        self.reset()
        return [tail] if tail else []

    def reset(self) -> None:
        """Forget any unfinished line (the reader seeked, or the stream restarted)."""
        self._held = bytearray()
        self._discarding = False

    def _drop(self) -> None:
        self._held = bytearray()
        self._discarding = True
