"""`terminal_safe`: what reaches a terminal from names a host or a process chose."""

from __future__ import annotations

import ast

from hypothesis import given
from hypothesis import strategies as st

from gpuwatch.core.text import terminal_safe


@given(st.text())
def test_only_printable_characters_and_the_kept_newlines_come_out(text: str) -> None:
    out = terminal_safe(text)
    assert all(c.isprintable() or c == "\n" for c in out)
    assert out.count("\n") == text.count("\n")  # the lines stay the lines they were
    assert all(c.isprintable() for c in terminal_safe(text, keep=""))


@given(st.text())
def test_each_line_reads_back_as_what_it_was(text: str) -> None:
    """An escape is Python's own: nothing is lost, only made visible. (A printable
    backslash stays as it is, so only text without one reads back unambiguously.)"""
    if "\\" in text or "'" in text:
        return
    for line, safe in zip(text.split("\n"), terminal_safe(text).split("\n"), strict=True):
        assert ast.literal_eval(f"'{safe}'") == line


def test_printable_text_is_the_very_same_object() -> None:
    text = "0000:01:00.0  VGA  nvidia → vfio-pci"
    assert terminal_safe(text) is text


@given(st.text(alphabet=st.sampled_from("ab é\n\r\t\x1b\u202e\u2028")), st.sampled_from(
    ["\n", "", "\n\t", "\t"]))
def test_the_text_is_escaped_character_by_character_whatever_it_holds(text: str,
                                                                      keep: str) -> None:
    """However `terminal_safe` gets there (the whole text printable, each part between kept
    characters printable, or neither), the result is the escape of each character that is
    neither printable nor kept."""
    expected = "".join(c if c.isprintable() or c in keep else ascii(c)[1:-1] for c in text)
    assert terminal_safe(text, keep=keep) == expected


def test_a_report_of_printable_lines_comes_back_as_it_is() -> None:
    report = "\n".join(f"  0000:{i:02x}:00.0  VGA controller  nvidia" for i in range(200))
    assert terminal_safe(report) is report
