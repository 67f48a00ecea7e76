"""``gpuwatch udev-rules``: the rules text, its group check, and what it grants."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest

from gpuwatch.cli.main import main
from gpuwatch.core.observations import NodeStat
from gpuwatch.model import may_read_write
from gpuwatch.service.udev_rules import InvalidGroupName, render_rules

REPO = Path(__file__).resolve().parent.parent
RULE_RE = re.compile(r'^SUBSYSTEM=="([^"]+)", KERNEL=="([^"]+)", GROUP="([^"]+)", MODE="([0-7]+)"$')


def rules(text: str) -> list[tuple[str, ...]]:
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    parsed = [RULE_RE.match(line) for line in lines]
    assert all(parsed), lines  # every non-comment line is one well-formed rule
    return [m.groups() for m in parsed if m]


def test_rules_grant_the_group_read_write_on_vfio_nodes() -> None:
    assert rules(render_rules("vmusers")) == [
        ("vfio", "[0-9]*", "vmusers", "0660"),
        ("vfio-dev", "vfio[0-9]*", "vmusers", "0660"),
    ]


def test_what_the_rule_sets_is_what_vfio_group_accessible_accepts() -> None:
    gid, member, other = 4321, 1000, 1001
    (_, _, _, mode), *_ = rules(render_rules("kvm"))
    after_udev = NodeStat(mode=stat.S_IFCHR | int(mode, 8), uid=0, gid=gid)
    kernel_default = NodeStat(mode=stat.S_IFCHR | 0o600, uid=0, gid=0)
    assert may_read_write(after_udev, member, frozenset({member, gid}))
    assert not may_read_write(after_udev, other, frozenset({other}))
    assert not may_read_write(kernel_default, member, frozenset({member, gid}))


def test_the_shipped_example_is_the_generators_output() -> None:
    assert (REPO / "contrib/udev/70-gpuwatch-vfio.rules").read_text() == render_rules("kvm")
    assert "gpuwatch udev-rules --group" in (REPO / "contrib/udev/README.md").read_text()


@pytest.mark.parametrize("name", ['kvm", MODE="0666', "a b", "", "-x", "x" * 40, "grp\n",
                                  "x" * 32 + "$"])  # 33 characters: groupadd refuses it
def test_group_names_cannot_inject(name: str) -> None:
    with pytest.raises(InvalidGroupName):
        render_rules(name)


def test_cli_prints_the_rules(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["udev-rules", "--group", "root"]) == 0
    out, err = capsys.readouterr()
    assert out == render_rules("root") and err == ""
    assert main(["udev-rules"]) == 0
    assert capsys.readouterr().out == render_rules("kvm")  # the default group


def test_cli_refuses_a_bad_group_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["udev-rules", "--group", 'x"y']) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "not a valid group name" in err


def test_cli_notes_a_group_missing_here(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["udev-rules", "--group", "no-such-group-gw"]) == 0
    out, err = capsys.readouterr()
    assert out == render_rules("no-such-group-gw") and "does not exist" in err


def udev_value(text: str) -> str:
    """What udev makes of a GROUP= value: ``$$`` is a ``$``, a lone ``$`` starts a
    substitution (``$kernel``, ``$env{…}``), which no group name may contain."""
    assert re.fullmatch(r"([^$%]|\$\$|%%)*", text), f"{text!r} has a substitution"
    return text.replace("$$", "$").replace("%%", "%")


@pytest.mark.parametrize("name", ["kvm", "vm_users", "libvirt-qemu", "host$", "x" * 32,
                                  "x" * 31 + "$"])
def test_the_rules_give_udev_the_exact_group_name(name: str) -> None:
    assert [udev_value(group) for _, _, group, _ in rules(render_rules(name))] == [name, name]
