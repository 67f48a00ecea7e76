"""The README is the newcomer's first page: its test command is what CI runs, its commands use
a virtual environment (a bare system pip fails on Debian and Ubuntu), and its links resolve."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
CI = (REPO / ".ci/run").read_text()


def block_after(heading_text: str) -> str:
    """The first fenced block after the paragraph containing ``heading_text``."""
    start = README.index(heading_text)
    match = re.search(r"^```\w*\n(.*?)^```", README[start:], re.S | re.M)
    assert match, heading_text
    return match.group(1)


def test_ci_runs_the_readme_test_command_as_written() -> None:
    command = block_after("Run the whole test suite")
    assert "pytest" in command
    ci = CI.split("# --- the README's test command", 1)[1].split("\n", 1)[1]
    ci = ci.split("# ---", 1)[0]
    assert ci == command


def test_quick_start_uses_a_venv_and_installs_it_where_missing() -> None:
    for command in (block_after("Watch this host"), block_after("Run the whole test suite")):
        assert "python3 -m venv .venv" in command
        assert "python3-venv" in command  # Debian/Ubuntu ship venv without ensurepip
        assert not re.search(r"(^|&&|;)\s*(sudo\s+)?pip3?\s+install", command)  # no bare pip
    assert ".venv/bin/gpuwatch watch" in block_after("Watch this host")
    assert "pip install . &&\ngpuwatch watch" in README  # the one line for pip-allowed hosts


def test_service_section_says_how_to_run_and_reach_it() -> None:
    section = README.split("## Run it as a service", 1)[1].split("\n## ", 1)[0]
    for needle in ("gpuwatch service install --now", "systemctl status gpuwatch",
                   "gpuwatch status", "/var/log/gpuwatch/events.jsonl",
                   "/run/gpuwatch/gpuwatch.sock", "usermod -aG gpuwatch",
                   "gpuwatch service uninstall"):
        assert needle in section, needle


def test_relative_links_in_readme_and_docs_resolve() -> None:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert (page.parent / target).exists(), f"{page.name}: {target}"
