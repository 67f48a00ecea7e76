"""``gpuwatch udev-rules``: the rules text, its group check, and what it grants."""

from __future__ import annotations

import fnmatch
import re
import stat
from pathlib import Path
from typing import Any

import pytest

import gpuwatch
from gpuwatch.cli.main import main
from gpuwatch.core.observations import NodeStat
from gpuwatch.core.results import MemlockResult
from gpuwatch.model import may_read_write
from gpuwatch.report import build_status
from gpuwatch.service.install import Facts, Run, plan_install
from gpuwatch.service.udev_rules import TRIGGERS, InvalidGroupName, render_rules
from gpuwatch.testing.modern import grace_hopper_host, iommufd_only_host

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
        ("misc", "iommu", "vmusers", "0660"),
    ]


#: udev(7): the keys these rules may use, and the operators each kind takes.
MATCH_KEYS = {"ACTION", "SUBSYSTEM", "KERNEL", "DEVPATH", "DRIVER", "TAG"}
ASSIGN_KEYS = {"GROUP", "MODE", "OWNER", "TAG"}
PAIR_RE = re.compile(r'([A-Z]+)(==|!=|=|\+=|-=|:=)"((?:[^"\\]|\\.)*)"')


def udev_pairs(line: str) -> list[tuple[str, str, str]]:
    """One rule line as udev reads it: ``KEY op "value"`` pairs separated by commas (and
    blanks), each key known, each match key compared (``==``/``!=``), each other key
    assigned (``=``/``+=``/``-=``/``:=``), every value in double quotes."""
    pairs, pos = [], 0
    while pos < len(line):
        m = PAIR_RE.match(line, pos)
        assert m, f"not KEY op \"value\" at {line[pos:]!r}"
        key, op, value = m.groups()
        if op in ("==", "!="):
            assert key in MATCH_KEYS, (key, line)
        else:
            assert key in ASSIGN_KEYS, (key, line)
        pairs.append((key, op, value))
        pos = m.end()
        sep = re.compile(r",\s*").match(line, pos)
        if pos < len(line):
            assert sep and sep.end() < len(line), f"no comma before {line[pos:]!r}"
            pos = sep.end()
    return pairs


@pytest.mark.parametrize("group", ["kvm", "host$"])
def test_every_rule_line_is_udev_syntax(group: str) -> None:
    lines = [line for line in render_rules(group).splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    assert lines
    for line in lines:
        assert line == line.strip() and not line.endswith("\\"), line  # no continuation
        pairs = udev_pairs(line)
        assert [k for k, op, _ in pairs if op == "=="] == ["SUBSYSTEM", "KERNEL"], line
        assert {k for k, op, _ in pairs if op == "="} == {"GROUP", "MODE"}, line


#: What the kernel names each node a VM manager opens that the fixtures have no class
#: device for: /dev/iommu is iommufd's misc device "iommu" (drivers/iommu/iommufd/main.c,
#: ``iommu_misc_dev``, mode 0660, root's).
KERNEL_NAMES = {"/dev/iommu": ("misc", "iommu")}


def kernel_name(root: Path, node: str) -> tuple[str, str]:
    """``(SUBSYSTEM, KERNEL)`` of ``node`` as udev matches it: the class device in the
    fixture's sysfs whose uevent names that ``DEVNAME``."""
    for uevent in sorted(root.glob("sys/class/*/*/uevent")):
        if f"DEVNAME={node.removeprefix('/dev/')}\n" in uevent.read_text():
            return uevent.parent.parent.name, uevent.parent.name
    return KERNEL_NAMES[node]


def granted(text: str, subsystem: str, kernel: str) -> tuple[str, str] | None:
    """The GROUP and MODE the rules leave on a device (the last assignment wins, as in
    udev), or None when no rule matches it. KERNEL globs are fnmatch's."""
    result = None
    for sub, glob, group, mode in rules(text):
        if fnmatch.fnmatchcase(subsystem, sub) and fnmatch.fnmatchcase(kernel, glob):
            result = (group, mode)
    return result


@pytest.mark.parametrize("machine", [grace_hopper_host, iommufd_only_host],
                         ids=["group-node", "iommufd-only"])
def test_the_rules_open_every_node_status_says_a_vm_manager_opens(
        tmp_path: Path, machine: Any) -> None:
    """``status`` (its ``vfio_open``) names what a VM manager opens: the group node, or on an
    iommufd-only kernel /dev/iommu and each cdev. The rules gave the cdevs the group but not
    /dev/iommu (0660 root:root), so a VMM in the group opened its cdev and could not use it."""
    machine(tmp_path)
    report = build_status(gpuwatch.scan(tmp_path), MemlockResult(soft=None, hard=None))
    opens = [node for gpu in report.gpus for node in gpu.vfio_open]
    assert opens, "the fixture passes a GPU through"
    gid, member = 4321, 1000
    text = render_rules("kvm")
    for node in opens:
        subsystem, kernel = kernel_name(tmp_path, node)
        got = granted(text, subsystem, kernel)
        assert got is not None, f"no rule for {node} ({subsystem}, {kernel})"
        group, mode = got
        assert group == "kvm"
        after_udev = NodeStat(mode=stat.S_IFCHR | int(mode, 8), uid=0, gid=gid)
        assert may_read_write(after_udev, member, frozenset({member, gid})), node


@pytest.mark.parametrize(("subsystem", "kernel"), [
    ("vfio", "noiommu-13"), ("vfio-dev", "noiommu-vfio0"),  # no DMA isolation: no VM
    ("misc", "vfio"),  # /dev/vfio/vfio: already 0666
    ("misc", "kvm"), ("misc", "iommufd"), ("vfio", "vfio")])
def test_the_rules_leave_other_nodes_alone(subsystem: str, kernel: str) -> None:
    assert granted(render_rules("kvm"), subsystem, kernel) is None


def test_the_install_steps_trigger_every_node_the_rules_match() -> None:
    """The `udevadm trigger` lines (in the file, its README, the installer) reach each rule's
    subsystem and name; udevadm ANDs --sysname-match with the subsystems, so a rule with a
    fixed name gets a run of its own."""
    text = render_rules("kvm")
    said = [line.removeprefix("#").replace("Install:", "").strip()
            for line in text.splitlines() if "udevadm trigger" in line]
    assert said == [" ".join(t) for t in TRIGGERS]
    readme = (REPO / "contrib/udev/README.md").read_text()
    assert all(" ".join(t) in readme for t in TRIGGERS)
    for subsystem, kernel, _, _ in rules(text):
        runs = [t for t in TRIGGERS if f"--subsystem-match={subsystem}" in t]
        assert len(runs) == 1, subsystem
        names = [a.split("=", 1)[1] for a in runs[0] if a.startswith("--sysname-match=")]
        assert not names or any(fnmatch.fnmatchcase(kernel, n) for n in names), subsystem
        # A run naming a device picks only that device of every subsystem it lists.
        assert not names or all(fnmatch.fnmatchcase(k, n) for s, k, _, _ in rules(text)
                                for n in names if f"--subsystem-match={s}" in runs[0])
    facts = Facts(root="/", exec_argv=("/usr/bin/gpuwatch",), have_systemctl=True,
                  systemd_running=True, have_udevadm=True)
    commands = [s.argv for s in plan_install(facts, now=True) if isinstance(s, Run)]
    assert all(t in commands for t in TRIGGERS)


def test_the_readme_names_every_rule() -> None:
    readme = (REPO / "contrib/udev/README.md").read_text()
    for subsystem, kernel, _, _ in rules(render_rules("kvm")):
        assert f'`SUBSYSTEM=="{subsystem}", KERNEL=="{kernel}"`' in readme


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
    assert [udev_value(group) for _, _, group, _ in rules(render_rules(name))] == [name] * 3
