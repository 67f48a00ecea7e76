"""``gpuwatch service install|uninstall`` against fixture roots: every file written is checked,
the unit is verified by systemd's own tool where it exists, and nothing outside the root moves.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gpuwatch.cli.main import build_parser, main
from gpuwatch.service.install import (
    CONFIG_FILE,
    UNIT_FILE,
    Facts,
    InstallError,
    Keep,
    Remove,
    Run,
    Write,
    check_program,
    describe,
    plan_install,
    plan_uninstall,
    render_unit,
    shipped_config,
    shipped_unit,
    systemd_quote,
)
from gpuwatch.service.udev_rules import RULES_FILE, render_rules
from gpuwatch.settings import load_settings

REPO = Path(__file__).resolve().parent.parent
CONSOLE_SCRIPT = Path(sys.executable).parent / "gpuwatch"
GROUPS = "root:x:0:\nkvm:x:999:\nsystemd-journal:x:998:\nusers:x:100:\nalice:x:1000:\n"


def gpuwatch_cmd() -> list[str]:
    """The console script of this environment when there is one (what users run)."""
    if CONSOLE_SCRIPT.is_file() and os.access(CONSOLE_SCRIPT, os.X_OK):
        return [str(CONSOLE_SCRIPT)]
    return [sys.executable, "-m", "gpuwatch"]


def expected_exec() -> tuple[list[str], list[str]]:
    cmd = gpuwatch_cmd()
    argv = [str(Path(cmd[0]).absolute())] + ([] if len(cmd) == 1 else ["-m", "gpuwatch"])
    seen = [os.path.realpath(cmd[0]), os.path.realpath(sys.executable),
            str(REPO / "gpuwatch")]  # run(): PYTHONPATH=REPO
    return argv, seen


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([*gpuwatch_cmd(), *args], capture_output=True, text=True, env=env,
                          timeout=120, check=False, cwd="/")


def tree(root: Path) -> dict[str, str]:
    """Every file and link under root: its text, or where a link points."""
    out: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        rel = "/" + str(path.relative_to(root))
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            out[rel] = path.read_text()
    return out


def exec_words(unit: str) -> list[str]:
    joined = unit.replace("\\\n", " ")
    line = next(ln for ln in joined.splitlines() if ln.startswith("ExecStart="))
    return shlex.split(line.removeprefix("ExecStart="))


@pytest.fixture
def fixture_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/group").write_text(GROUPS)
    (root / "etc/gshadow").write_text("root:*::\nkvm:!::\n")
    return root


def test_install_writes_each_file_and_says_so(fixture_root: Path) -> None:
    proc = run("service", "install", "--root", str(fixture_root))
    assert proc.returncode == 0, proc.stderr
    files = tree(fixture_root)
    argv, seen = expected_exec()

    unit = files["/etc/systemd/system/gpuwatch.service"]
    assert unit == render_unit(argv, seen)
    words = exec_words(unit)
    assert words[: len(argv)] == argv
    assert os.path.isabs(words[0]) and os.access(words[0], os.X_OK)
    # The flags the unit passes are real `gpuwatch watch` flags.
    args = build_parser().parse_args(words[len(argv):])
    assert (args.command, args.socket, args.log) == (
        "watch", "/run/gpuwatch/gpuwatch.sock", "/var/log/gpuwatch/events.jsonl")
    home = any(p.startswith(("/home/", "/root/", "/run/user/")) for p in [argv[0], *seen])
    assert ("ProtectHome=read-only" in unit) == home
    assert ("ProtectHome=yes" in unit) == (not home)

    assert files[RULES_FILE] == render_rules("kvm")
    config = files[CONFIG_FILE]
    assert config == shipped_config() == (REPO / "contrib/config.yaml").read_text()
    loaded = load_settings({}, config=str(fixture_root / CONFIG_FILE.lstrip("/")), env={})
    assert loaded.log_keep == 5

    assert files["/etc/group"] == GROUPS + "gpuwatch:x:997:\n"  # highest free system gid
    assert files["/etc/gshadow"] == "root:*::\nkvm:!::\ngpuwatch:!::\n"
    assert set(files) == {"/etc/systemd/system/gpuwatch.service", RULES_FILE, CONFIG_FILE,
                          "/etc/group", "/etc/gshadow"}
    for rel in ("/etc/systemd/system/gpuwatch.service", RULES_FILE, CONFIG_FILE):
        assert (fixture_root / rel.lstrip("/")).stat().st_mode & 0o777 == 0o644

    said = proc.stdout.splitlines()
    for rel in files:
        assert any(line.startswith(f"wrote {fixture_root}{rel}") for line in said), rel
    assert not any("ran " in line for line in said)  # no --now: no command


def test_config_is_never_overwritten_and_groups_are_kept(fixture_root: Path) -> None:
    config = fixture_root / "etc/gpuwatch/config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("log_keep: 2\n")
    (fixture_root / "etc/group").write_text(GROUPS + "gpuwatch:x:990:vmm\n")
    proc = run("service", "install", "--root", str(fixture_root))
    assert proc.returncode == 0, proc.stderr
    assert config.read_text() == "log_keep: 2\n"
    assert (fixture_root / "etc/group").read_text() == GROUPS + "gpuwatch:x:990:vmm\n"
    assert f"kept {config} (exists; never overwritten)" in proc.stdout
    assert "kept group gpuwatch (exists)" in proc.stdout


def test_dry_run_changes_nothing(fixture_root: Path) -> None:
    before = tree(fixture_root)
    proc = run("service", "install", "--root", str(fixture_root), "--dry-run", "--now")
    assert proc.returncode == 0, proc.stderr
    assert tree(fixture_root) == before
    assert f"would write {fixture_root}/etc/systemd/system/gpuwatch.service" in proc.stdout
    assert f"would write {fixture_root}/etc/group" in proc.stdout
    assert "would write" in proc.stdout and "wrote" not in proc.stdout


def test_now_enables_it_inside_the_root_only(fixture_root: Path) -> None:
    proc = run("service", "install", "--root", str(fixture_root), "--now")
    assert proc.returncode == 0, proc.stderr
    assert "daemon-reload" not in proc.stdout.replace("skipped systemctl daemon-reload", "")
    link = fixture_root / "etc/systemd/system/multi-user.target.wants/gpuwatch.service"
    if shutil.which("systemctl") is None:
        assert "skipped systemctl" in proc.stdout
        return
    assert link.is_symlink() and os.readlink(link) == "/etc/systemd/system/gpuwatch.service"
    assert f"ran systemctl --root={fixture_root} enable gpuwatch.service" in proc.stdout


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed on this machine")
def test_unit_passes_systemd_analyze_verify(fixture_root: Path, tmp_path: Path) -> None:
    assert run("service", "install", "--root", str(fixture_root)).returncode == 0
    unit = fixture_root / "etc/systemd/system/gpuwatch.service"
    ok = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                        text=True, timeout=60, check=False)
    assert ok.returncode == 0, ok.stderr
    assert "\nRestartPreventExitStatus=2\n" in unit.read_text()  # installed as shipped
    # The check can fail: the same unit with a program that does not exist does.
    bad = tmp_path / "bad" / "gpuwatch.service"
    bad.parent.mkdir()
    bad.write_text(render_unit(["/nonexistent/bin/gpuwatch"]))
    no = subprocess.run(["systemd-analyze", "verify", str(bad)], capture_output=True,
                        text=True, timeout=60, check=False)
    assert no.returncode != 0
    assert "/nonexistent/bin/gpuwatch" in no.stderr


def test_uninstall_reverses_install_and_keeps_log_state_and_edits(fixture_root: Path) -> None:
    assert run("service", "install", "--root", str(fixture_root), "--now").returncode == 0
    for kept in ("var/log/gpuwatch/events.jsonl", "var/lib/gpuwatch/poison.json"):
        (fixture_root / kept).parent.mkdir(parents=True)
        (fixture_root / kept).write_text("{}\n")
    proc = run("service", "uninstall", "--root", str(fixture_root))
    assert proc.returncode == 0, proc.stderr
    files = tree(fixture_root)
    assert set(files) == {"/etc/group", "/etc/gshadow", "/var/log/gpuwatch/events.jsonl",
                          "/var/lib/gpuwatch/poison.json"}  # the unchanged config went too
    assert f"removed {fixture_root}/etc/systemd/system/gpuwatch.service" in proc.stdout
    assert f"removed {fixture_root}{RULES_FILE}" in proc.stdout
    assert f"kept {fixture_root}/var/log/gpuwatch" in proc.stdout
    assert f"kept {fixture_root}/var/lib/gpuwatch" in proc.stdout

    # An edited config stays, and a second uninstall finds nothing to do.
    assert run("service", "install", "--root", str(fixture_root)).returncode == 0
    config = fixture_root / "etc/gpuwatch/config.yaml"
    config.write_text(config.read_text() + "log_keep: 9\n")
    proc = run("service", "uninstall", "--root", str(fixture_root))
    assert proc.returncode == 0 and config.exists()
    assert f"kept {config} (edited since install)" in proc.stdout
    again = run("service", "uninstall", "--root", str(fixture_root))
    assert again.returncode == 0 and "removed" not in again.stdout


def test_the_running_host_needs_root_unless_dry_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # As a user (made one for the check when the suite runs as root): refused before any
    # file is read or written, in one line, exit 1; --dry-run only reads.
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["service", "install"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "run it as root" in err and len(err.strip().splitlines()) == 1
    assert main(["service", "uninstall"]) == 1
    capsys.readouterr()
    assert main(["service", "install", "--dry-run"]) == 0
    out, _ = capsys.readouterr()
    assert "would write /etc/systemd/system/gpuwatch.service" in out
    assert "wrote" not in out


def test_bad_root_is_a_usage_error(tmp_path: Path) -> None:
    proc = run("service", "install", "--root", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "is not a directory" in proc.stderr


# --------------------------------------------------------------------------- pure planning


def test_plan_for_the_running_host_runs_groupadd_and_systemctl() -> None:
    facts = Facts(root="/", exec_argv=("/opt/gpuwatch/bin/gpuwatch",), have_systemctl=True,
                  systemd_running=True, have_udevadm=True)
    steps = plan_install(facts, now=True)
    commands = [s.argv for s in steps if isinstance(s, Run)]
    assert commands[:3] == [("groupadd", "--system", "gpuwatch"),
                            ("systemctl", "daemon-reload"),
                            ("systemctl", "enable", "--now", "gpuwatch")]
    assert ("udevadm", "control", "--reload") in commands
    writes = {s.path for s in steps if isinstance(s, Write)}
    assert writes == {UNIT_FILE, RULES_FILE, CONFIG_FILE}  # never /etc/group on a real host
    with pytest.raises(InstallError, match="systemd running"):
        plan_install(Facts(root="/", exec_argv=("/usr/bin/gpuwatch",)), now=True)


def test_plan_uninstall_stops_before_removing() -> None:
    facts = Facts(root="/", existing={UNIT_FILE: shipped_unit(), RULES_FILE: render_rules(),
                                      CONFIG_FILE: shipped_config()},
                  group_exists=True, have_systemctl=True, systemd_running=True)
    steps = plan_uninstall(facts)
    first, last = steps[0], steps[-1]
    assert isinstance(first, Run) and first.argv == ("systemctl", "disable", "--now", "gpuwatch")
    assert isinstance(last, Run) and last.argv == ("systemctl", "daemon-reload")


def test_exec_start_quoting_and_where_the_program_lives() -> None:
    assert systemd_quote("/opt/gpu watch/bin/gpuwatch") == '"/opt/gpu watch/bin/gpuwatch"'
    assert systemd_quote("/opt/100%/gpuwatch") == "/opt/100%%/gpuwatch"
    unit = render_unit(["/opt/gpu watch/bin/gpuwatch"])
    assert exec_words(unit)[:2] == ["/opt/gpu watch/bin/gpuwatch", "watch"]
    assert "ProtectHome=yes" in unit
    pipx = render_unit(["/usr/local/bin/gpuwatch"],
                       ["/home/ann/.local/pipx/venvs/gpuwatch/bin/python3"])
    assert "ProtectHome=read-only" in pipx and "ProtectHome=yes" not in pipx
    with pytest.raises(InstallError, match="absolute"):
        render_unit(["gpuwatch"])
    with pytest.raises(InstallError, match="PrivateTmp"):
        check_program(["/tmp/venv/bin/gpuwatch"])
    check_program(["/opt/venv/bin/gpuwatch"])


def test_an_editable_install_in_a_home_directory_stays_visible_to_the_service(
        fixture_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pip install -e ~/src/gpuwatch``: the script and the interpreter are outside any home
    directory, the package is in one. With ``ProtectHome=yes`` the service found no gpuwatch
    to import and failed at every start; the package's own place counts as the program's."""
    import gpuwatch
    from gpuwatch.cli.service_cmd import running_gpuwatch

    checkout = "/home/ann/src/gpuwatch/gpuwatch"
    monkeypatch.setattr(gpuwatch, "__file__", f"{checkout}/__init__.py")
    monkeypatch.setattr(sys, "executable", "/usr/bin/python3")  # outside any home here
    monkeypatch.setattr(sys, "argv", ["/usr/bin/python3"])
    assert checkout in running_gpuwatch()[1]
    assert main(["service", "install", "--root", str(fixture_root)]) == 0
    unit = (fixture_root / UNIT_FILE.lstrip("/")).read_text()
    assert "ProtectHome=read-only" in unit and "ProtectHome=yes" not in unit


def test_an_editable_install_under_tmp_is_refused(tmp_path: Path) -> None:
    """A checkout under /tmp (``pip install -e /tmp/gpuwatch``) is not there for a service
    with ``PrivateTmp=yes``: refused like a program there (a warning under --dry-run)."""
    copy = tmp_path / "checkout"
    shutil.copytree(REPO / "gpuwatch", copy / "gpuwatch", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(copy))
    proc = subprocess.run([sys.executable, "-m", "gpuwatch", "service", "install", "--dry-run"],
                          capture_output=True, text=True, env=env, timeout=120, check=False,
                          cwd="/")
    assert proc.returncode == 0, proc.stderr
    # (The interpreter may be under /tmp too, a CI's clone there: it is named beside it.)
    warning = next(line for line in proc.stderr.splitlines() if "temporary directory" in line)
    assert os.path.realpath(copy / "gpuwatch") in warning.split(" under a temporary")[0]
    assert "PrivateTmp" in proc.stderr


def test_contrib_files_are_the_shipped_ones() -> None:
    assert (REPO / "contrib/systemd/gpuwatch.service").read_text() == shipped_unit()
    assert "ExecStart=/usr/bin/gpuwatch watch" in shipped_unit()


def test_the_unit_and_config_ship_in_the_wheel() -> None:
    """`service install` from a pip or pipx install reads them from the package."""
    import fnmatch
    import tomllib

    globs = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"]["gpuwatch"]
    for name in ("data/gpuwatch.service", "data/config.yaml"):
        assert (REPO / "gpuwatch" / name).is_file()
        assert any(fnmatch.fnmatch(name, g) for g in globs), name


# --------------------------------------------------------------------------- odd roots


def test_a_fifo_where_a_file_goes_never_hangs(fixture_root: Path) -> None:
    """Planning reads the unit, rules and config without blocking: a FIFO there used to
    wait for a writer forever. At the unit (gpuwatch's own) it is replaced; at the config
    (never overwritten, and the daemon would refuse it) the install stops before writing."""
    system = fixture_root / "etc/systemd/system"
    system.mkdir(parents=True)
    os.mkfifo(system / "gpuwatch.service")
    assert run("service", "uninstall", "--root", str(fixture_root)).returncode == 0
    assert stat.S_ISFIFO((system / "gpuwatch.service").lstat().st_mode)  # not ours: kept
    proc = run("service", "install", "--root", str(fixture_root))
    assert proc.returncode == 0, proc.stderr
    assert (system / "gpuwatch.service").read_text().startswith("# gpuwatch")

    other = fixture_root.parent / "other"
    (other / "etc/gpuwatch").mkdir(parents=True)
    os.mkfifo(other / "etc/gpuwatch/config.yaml")
    before = tree(other)
    proc = run("service", "install", "--root", str(other))
    assert proc.returncode == 1 and proc.stdout == ""
    lines = [ln for ln in proc.stderr.splitlines() if "PYTHONPATH" not in ln]
    assert len(lines) == 1 and "config.yaml is a FIFO" in lines[0]
    assert tree(other) == before


def test_a_dangling_config_link_is_never_replaced(fixture_root: Path) -> None:
    config = fixture_root / "etc/gpuwatch/config.yaml"
    config.parent.mkdir(parents=True)
    config.symlink_to("/nonexistent/gpuwatch.yaml")
    proc = run("service", "install", "--root", str(fixture_root))
    assert proc.returncode == 1 and "a link to /nonexistent/gpuwatch.yaml" in proc.stderr
    assert config.is_symlink() and not (fixture_root / "etc/systemd").exists()


def test_a_masked_unit_is_refused_and_kept(fixture_root: Path) -> None:
    unit = fixture_root / "etc/systemd/system/gpuwatch.service"
    unit.parent.mkdir(parents=True)
    unit.symlink_to("/dev/null")  # what `systemctl mask gpuwatch` makes
    before = tree(fixture_root)
    proc = run("service", "install", "--root", str(fixture_root), "--now")
    assert proc.returncode == 1 and "masked" in proc.stderr and "unmask" in proc.stderr
    assert tree(fixture_root) == before
    proc = run("service", "uninstall", "--root", str(fixture_root))
    assert proc.returncode == 0 and f"kept {unit} (masked" in proc.stdout
    assert os.readlink(unit) == "/dev/null"


def test_a_failed_install_is_rolled_back(fixture_root: Path) -> None:
    """The rules cannot be written (rules.d is a file): the unit written just before is put
    back as it was, the directories made for it go, and the group file is untouched."""
    unit = fixture_root / "etc/systemd/system/gpuwatch.service"
    unit.parent.mkdir(parents=True)
    unit.write_text("# an older gpuwatch unit\n")
    unit.chmod(0o600)
    (fixture_root / "etc/udev").mkdir()
    (fixture_root / "etc/udev/rules.d").write_text("not a directory\n")
    before = tree(fixture_root)
    proc = run("service", "install", "--root", str(fixture_root))
    assert proc.returncode == 1
    assert "cannot write" in proc.stderr and "Not a directory" in proc.stderr
    assert f"rolled back {unit} (restored)" in proc.stdout
    assert tree(fixture_root) == before
    assert unit.stat().st_mode & 0o777 == 0o600
    assert not (fixture_root / "etc/gpuwatch").exists()
    assert not (fixture_root / "etc/cdi").exists()


def test_a_link_out_of_the_root_is_never_followed(fixture_root: Path, tmp_path: Path) -> None:
    """``etc/udev`` in a tree being built is an absolute link (to the builder's own
    /etc/udev): install must not write the host's rules, uninstall must not remove them."""
    outside = tmp_path / "outside"
    (outside / "rules.d").mkdir(parents=True)
    hosts_rules = outside / "rules.d/70-gpuwatch-vfio.rules"
    hosts_rules.write_text(render_rules())
    (fixture_root / "etc/udev").symlink_to(outside)
    for verb in ("install", "uninstall"):
        proc = run("service", verb, "--root", str(fixture_root))
        assert proc.returncode == 1 and "leads outside" in proc.stderr, proc.stderr
    assert [p.name for p in outside.rglob("*")] == ["rules.d", hosts_rules.name]
    assert hosts_rules.read_text() == render_rules()
    assert not (fixture_root / "etc/systemd").exists()


@pytest.mark.parametrize("name", ["etc/group", "etc/gshadow"])
def test_a_group_file_that_is_a_link_out_of_the_root_is_refused(
        fixture_root: Path, tmp_path: Path, name: str) -> None:
    """``etc/group -> /etc/group`` in a tree being built: its text was read from the host
    and written, with the new group, into the tree. Now the link is what it is: refused."""
    outside = tmp_path / "outside-group"
    outside.write_text("root:x:0:\nbuilder:x:4242:\n")
    target = fixture_root / name
    target.unlink(missing_ok=True)
    target.symlink_to(outside)
    before = sorted((p.relative_to(fixture_root), p.is_symlink())
                    for p in fixture_root.rglob("*"))
    proc = run("service", "install", "--root", str(fixture_root))
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.endswith(f"{target} is a link out of {fixture_root} (to {outside}): "
                                "cannot add the group to it\n"), proc.stderr
    assert target.is_symlink() and outside.read_text() == "root:x:0:\nbuilder:x:4242:\n"
    assert sorted((p.relative_to(fixture_root), p.is_symlink())
                  for p in fixture_root.rglob("*")) == before


def test_group_files_keep_their_mode_and_owner(fixture_root: Path) -> None:
    gshadow = fixture_root / "etc/gshadow"
    gshadow.write_text("root:*::\nkvm:!::\ngpuwatch:!::\n")  # left by an earlier groupdel
    gshadow.chmod(0o640)
    group = fixture_root / "etc/group"
    group.chmod(0o644)
    shadow_gid = 42 if os.geteuid() == 0 else os.getegid()  # Debian's "shadow"
    os.chown(gshadow, -1, shadow_gid)
    proc = run("service", "install", "--root", str(fixture_root))
    assert proc.returncode == 0, proc.stderr
    assert group.read_text().endswith("gpuwatch:x:997:\n")
    assert gshadow.read_text() == "root:*::\nkvm:!::\ngpuwatch:!::\n"  # not a second line
    assert (gshadow.stat().st_mode & 0o777, gshadow.stat().st_gid) == (0o640, shadow_gid)

    fresh = fixture_root.parent / "fresh"
    (fresh / "etc").mkdir(parents=True)
    (fresh / "etc/group").write_text(GROUPS)
    (fresh / "etc/gshadow").write_text("root:*::\n")
    (fresh / "etc/gshadow").chmod(0o640)
    os.chown(fresh / "etc/gshadow", -1, shadow_gid)
    assert run("service", "install", "--root", str(fresh)).returncode == 0
    st = (fresh / "etc/gshadow").stat()
    assert (st.st_mode & 0o777, st.st_gid) == (0o640, shadow_gid)
    assert (fresh / "etc/gshadow").read_text() == "root:*::\ngpuwatch:!::\n"


def test_a_group_file_too_large_to_read_whole_is_never_rewritten(fixture_root: Path) -> None:
    group = fixture_root / "etc/group"
    big = GROUPS + "".join(f"g{i}:x:{20000 + i}:{'u' * 200}\n" for i in range(6000))
    group.write_text(big)
    proc = run("service", "install", "--root", str(fixture_root))
    assert proc.returncode == 1 and "cannot add the group" in proc.stderr
    assert group.read_text() == big


def test_new_directories_are_0755_whatever_the_umask(fixture_root: Path) -> None:
    """A hardened umask (077) must not make /etc/gpuwatch unreadable to the users whose
    commands read the daemon's config too; /etc/cdi is made for the unit's ReadWritePaths."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([*gpuwatch_cmd(), "service", "install", "--root", str(fixture_root)],
                          capture_output=True, text=True, env=env, timeout=120, check=False,
                          cwd="/", preexec_fn=lambda: os.umask(0o077))
    assert proc.returncode == 0, proc.stderr
    for folder in ("etc/gpuwatch", "etc/cdi", "etc/systemd", "etc/systemd/system",
                   "etc/udev/rules.d"):
        assert (fixture_root / folder).stat().st_mode & 0o777 == 0o755, folder
    assert f"created {fixture_root}/etc/cdi/" in proc.stdout
    again = run("service", "install", "--root", str(fixture_root))
    assert again.returncode == 0 and "etc/cdi" not in again.stdout  # there now: left alone


def test_installing_again_changes_no_file(fixture_root: Path) -> None:
    assert run("service", "install", "--root", str(fixture_root)).returncode == 0
    files = [p for p in fixture_root.rglob("*") if p.is_file()]
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in files}
    proc = run("service", "install", "--root", str(fixture_root))
    assert proc.returncode == 0, proc.stderr
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes()) for p in files} == before
    assert "wrote" not in proc.stdout and "created" not in proc.stdout
    assert f"kept {fixture_root}/etc/systemd/system/gpuwatch.service (unchanged)" in proc.stdout
    assert f"kept {fixture_root}{RULES_FILE} (unchanged)" in proc.stdout


def test_a_directory_where_a_file_goes(fixture_root: Path) -> None:
    """At the config: refused (never replaced, unreadable to the daemon). At the unit:
    not ours to remove, and install's write fails in one line, rolled back."""
    config = fixture_root / "etc/gpuwatch/config.yaml"
    config.mkdir(parents=True)
    proc = run("service", "install", "--root", str(fixture_root))
    assert proc.returncode == 1 and "config.yaml is a directory" in proc.stderr
    config.rmdir()
    unit = fixture_root / "etc/systemd/system/gpuwatch.service"
    unit.mkdir(parents=True)
    proc = run("service", "uninstall", "--root", str(fixture_root))
    assert proc.returncode == 0 and unit.is_dir()
    before = tree(fixture_root)
    proc = run("service", "install", "--root", str(fixture_root))
    assert proc.returncode == 1 and "internal error" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == f"gpuwatch: cannot write {unit}: Is a directory"
    assert tree(fixture_root) == before and not config.exists()


def test_a_replaced_fifo_is_put_back_by_a_roll_back(fixture_root: Path) -> None:
    unit = fixture_root / "etc/systemd/system/gpuwatch.service"
    unit.parent.mkdir(parents=True)
    os.mkfifo(unit, 0o640)
    (fixture_root / "etc/udev").mkdir()
    (fixture_root / "etc/udev/rules.d").write_text("not a directory\n")
    proc = run("service", "install", "--root", str(fixture_root))
    assert proc.returncode == 1 and f"wrote {unit}" in proc.stdout
    assert f"rolled back {unit} (restored)" in proc.stdout
    st = unit.lstat()
    assert stat.S_ISFIFO(st.st_mode) and st.st_mode & 0o777 == 0o640


# --------------------------------------------------------------------------- output that fails


def run_into_closed_pipe(*args: str, unbuffered: bool = True) -> subprocess.CompletedProcess[str]:
    """The command with a stdout whose reader has left (``| head -1`` once head is done):
    unbuffered, its first line fails; buffered, its flush at exit."""
    read, write = os.pipe()
    os.close(read)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    try:
        return subprocess.run([*gpuwatch_cmd(), *args], stdout=write, stderr=subprocess.PIPE,
                              text=True, env=env, timeout=120, check=False, cwd="/")
    finally:
        os.close(write)


@pytest.mark.timeout(240)
def test_a_reader_that_leaves_never_stops_an_install_half_way(
        fixture_root: Path, tmp_path: Path) -> None:
    """``service install | head -1`` used to stop at its second line, exit 0, with the unit
    and rules written and no config, /etc/cdi or group, and nothing rolled back."""
    whole = tmp_path / "whole"
    shutil.copytree(fixture_root, whole)
    assert run("service", "install", "--root", str(whole)).returncode == 0
    proc = run_into_closed_pipe("service", "install", "--root", str(fixture_root))
    assert proc.returncode == 0, proc.stderr
    assert "Exception ignored" not in proc.stderr and "warning" not in proc.stderr
    assert tree(fixture_root) == tree(whole)  # every file, as a full install writes it
    assert (fixture_root / "etc/cdi").is_dir()
    assert (fixture_root / "etc/group").read_text().endswith("gpuwatch:x:997:\n")

    proc = run_into_closed_pipe("service", "uninstall", "--root", str(fixture_root))
    assert proc.returncode == 0, proc.stderr
    assert set(tree(fixture_root)) == {"/etc/group", "/etc/gshadow"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("unbuffered", [True, False])
def test_a_reader_that_leaves_never_hides_a_failed_install(
        fixture_root: Path, unbuffered: bool) -> None:
    """The install that fails is rolled back and exits 1 with its error whether its lines
    failed as they went (unbuffered) or at exit (buffered, where the exit was 0)."""
    (fixture_root / "etc/udev").mkdir()
    (fixture_root / "etc/udev/rules.d").write_text("not a directory\n")
    before = tree(fixture_root)
    proc = run_into_closed_pipe("service", "install", "--root", str(fixture_root),
                                unbuffered=unbuffered)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("gpuwatch: cannot write"), proc.stderr
    assert tree(fixture_root) == before
    assert not (fixture_root / "etc/systemd").exists()


def test_a_stdout_that_fails_never_stops_an_install(fixture_root: Path) -> None:
    """A full disk under stdout: the install runs to its end, exit 0, and says once on
    stderr that its lines were lost."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this machine")
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    with open("/dev/full", "w") as full:
        proc = subprocess.run([*gpuwatch_cmd(), "service", "install", "--root",
                               str(fixture_root)], stdout=full, stderr=subprocess.PIPE,
                              text=True, env=env, timeout=120, check=False, cwd="/")
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if "cannot write stdout" in ln]
    assert len(warnings) == 1 and warnings[0].startswith("gpuwatch: warning:"), proc.stderr
    assert (fixture_root / "etc/gpuwatch/config.yaml").is_file()
    assert (fixture_root / "etc/group").read_text().endswith("gpuwatch:x:997:\n")


def test_a_roll_back_names_only_what_it_put_back(
        fixture_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules' write fails before the file exists (a read-only rules.d): the unit written
    before it is removed and said so; the rules file, never made, is not "removed"."""
    import gpuwatch.service.install as install

    real = install.write_atomic

    def refuse_rules(path: str, *args: object, **kwargs: object) -> None:
        if path.endswith(RULES_FILE):
            raise OSError(30, "Read-only file system")
        real(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(install, "write_atomic", refuse_rules)
    (fixture_root / "etc/udev/rules.d").mkdir(parents=True)
    steps = plan_install(install.gather_facts(str(fixture_root), ("/usr/bin/gpuwatch",)),
                         now=False)
    said: list[str] = []
    with pytest.raises(InstallError, match="Read-only file system"):
        install.execute(steps, str(fixture_root), dry_run=False, say=said.append)
    unit = fixture_root / "etc/systemd/system/gpuwatch.service"
    assert said == [f"wrote {unit} (the systemd unit)", f"rolled back {unit} (removed)"]
    assert not unit.exists() and not (fixture_root / "etc/systemd").exists()
    assert list((fixture_root / "etc/udev/rules.d").iterdir()) == []


@pytest.mark.parametrize("there", [True, False], ids=["there", "dangling"])
@pytest.mark.parametrize("absolute", [True, False], ids=["absolute", "relative"])
@pytest.mark.parametrize("name", [UNIT_FILE, RULES_FILE], ids=["unit", "rules"])
def test_a_link_out_of_the_root_where_a_file_goes_is_refused(
        fixture_root: Path, tmp_path: Path, name: str, absolute: bool, there: bool) -> None:
    """As at config.yaml and at a parent directory: refused in one line, nothing changed.
    The link at the unit or the rules used to be replaced in silence (``wrote …``)."""
    outside = tmp_path / "outside" / "file"
    outside.parent.mkdir()
    if there:
        outside.write_text("the builder's own\n")
    link = fixture_root / name.lstrip("/")
    link.parent.mkdir(parents=True)
    target = str(outside) if absolute else os.path.relpath(outside, link.parent)
    link.symlink_to(target)
    before = tree(fixture_root)
    proc = run("service", "install", "--root", str(fixture_root), "--now")
    assert proc.returncode == 1, proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if "PYTHONPATH" not in ln]
    assert lines == [f"gpuwatch: {link} is a link out of {fixture_root} (to {target}), never "
                     "followed nor replaced: remove it, then run this again"]
    assert proc.stdout == "" and tree(fixture_root) == before
    assert [p.name for p in outside.parent.iterdir()] == (["file"] if there else [])
    assert not there or outside.read_text() == "the builder's own\n"

    proc = run("service", "uninstall", "--root", str(fixture_root))
    assert proc.returncode == 0, proc.stderr
    assert f"kept {link} (a link out of {fixture_root} (to {target}): never followed nor " \
           "removed)" in proc.stdout
    assert tree(fixture_root) == before


def test_the_right_text_with_the_wrong_mode_or_owner_is_rewritten(fixture_root: Path) -> None:
    """A rerun used to keep a unit made world-writable, or rules given to another user, as
    "unchanged": the text alone was compared. Now mode and owner are too, and a file that
    differs is rewritten as install writes it, saying why."""
    assert run("service", "install", "--root", str(fixture_root)).returncode == 0
    unit = fixture_root / UNIT_FILE.lstrip("/")
    rules = fixture_root / RULES_FILE.lstrip("/")
    unit.chmod(0o666)
    me = os.geteuid()
    other = 65534 if me == 0 else None  # nobody; a user cannot give a file away
    if other is not None:
        os.chown(rules, other, -1)
    else:
        rules.chmod(0o4644)
    rules_why = f"owner uid {other}, not {me}" if other is not None else "mode 4644, not 0644"
    before = tree(fixture_root)
    proc = run("service", "install", "--root", str(fixture_root), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert f"would rewrite {unit} (mode 0666, not 0644)" in proc.stdout.splitlines()
    assert f"would rewrite {rules} ({rules_why})" in proc.stdout.splitlines()
    assert unit.stat().st_mode & 0o7777 == 0o666 and tree(fixture_root) == before

    proc = run("service", "install", "--root", str(fixture_root))
    assert proc.returncode == 0, proc.stderr
    assert f"rewrote {unit} (mode 0666, not 0644)" in proc.stdout.splitlines()
    assert f"rewrote {rules} ({rules_why})" in proc.stdout.splitlines()
    for path in (unit, rules):
        st = path.lstat()
        assert (stat.S_ISREG(st.st_mode), st.st_mode & 0o7777, st.st_uid) == (True, 0o644, me)
    assert tree(fixture_root) == before  # the same text

    # A link (inside the tree) to the right text is no file of install's either.
    moved = fixture_root / "usr/lib/gpuwatch.service"
    moved.parent.mkdir(parents=True)
    unit.rename(moved)
    unit.symlink_to(os.path.relpath(moved, unit.parent))
    proc = run("service", "install", "--root", str(fixture_root))
    assert proc.returncode == 0, proc.stderr
    assert f"rewrote {unit} (a link, not a regular file)" in proc.stdout.splitlines()
    assert not unit.is_symlink() and unit.read_text() == moved.read_text()

    again = run("service", "install", "--root", str(fixture_root))
    assert again.returncode == 0 and "wrote" not in again.stdout
    assert f"kept {unit} (unchanged)" in again.stdout
    assert f"kept {rules} (unchanged)" in again.stdout


def test_on_the_running_host_what_install_writes_is_roots() -> None:
    unit = render_unit(["/opt/gpuwatch/bin/gpuwatch"])
    facts = Facts(root="/", exec_argv=("/opt/gpuwatch/bin/gpuwatch",),
                  existing={UNIT_FILE: unit, RULES_FILE: render_rules()},
                  attrs={UNIT_FILE: (stat.S_IFREG | 0o644, 1000),
                         RULES_FILE: (stat.S_IFREG | 0o644, 0)})
    steps = plan_install(facts, now=False)
    first = steps[0]
    assert isinstance(first, Write) and first.rewrite
    assert (first.path, first.content, first.mode, first.why) == (
        UNIT_FILE, unit, 0o644, "owner uid 1000, not 0")
    assert describe(first, "/", dry_run=False) == f"rewrote {UNIT_FILE} (owner uid 1000, not 0)"
    assert steps[1] == Keep(RULES_FILE, "unchanged")


# --------------------------------------------------------------------------- odd program paths


def linked_gpuwatch(folder: Path) -> list[str]:
    """This environment's gpuwatch, started as ``folder/bin/gpuwatch`` (a link to the console
    script, or to the interpreter with ``-m``): what install sees when gpuwatch lives there."""
    (folder / "bin").mkdir(parents=True)
    cmd = gpuwatch_cmd()
    if len(cmd) == 1:
        (folder / "bin/gpuwatch").symlink_to(cmd[0])
        return [str(folder / "bin/gpuwatch")]
    (folder / "bin/python3").symlink_to(sys.executable)
    return [str(folder / "bin/python3"), "-m", "gpuwatch"]


@pytest.mark.parametrize("name", ['we"ird', "it's", "back\\slash", "tab\there", "new\nline",
                                  "cost$HOME"])
def test_a_program_path_systemd_cannot_run_is_refused(
        fixture_root: Path, tmp_path: Path, name: str) -> None:
    """systemd will not start an executable named with a quote, a backslash or a control
    character ("Executable name contains special characters": the unit has a fatal error),
    and takes a ``$`` in it literally (``$$`` would name another file) while it expands the
    ``$`` in the argv[0] it passes. A newline also ended the ExecStart= line, so the rest of
    the path became a directive of its own. Refused before anything is written, one line."""
    program = linked_gpuwatch(tmp_path / name)
    before = tree(fixture_root)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([*program, "service", "install", "--root", str(fixture_root)],
                          capture_output=True, text=True, env=env, timeout=120, check=False,
                          cwd="/")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "PYTHONPATH" not in ln]
    assert len(lines) == 1 and "systemd cannot start" in lines[0], proc.stderr
    assert proc.stdout == "" and tree(fixture_root) == before
    with pytest.raises(InstallError, match="systemd cannot start"):
        render_unit([program[0]])


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is not installed on this machine")
@pytest.mark.parametrize("name", ["gpu watch", "100%", "semi;colon", "gr\u00fcn"])
def test_a_program_path_systemd_can_run_passes_verify(
        fixture_root: Path, tmp_path: Path, name: str) -> None:
    """Spaces, ``%`` and ``;`` are quoted or escaped in ExecStart=, and systemd finds the
    program there (verify fails on a program path it cannot find, see above)."""
    program = linked_gpuwatch(tmp_path / name)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([*program, "service", "install", "--root", str(fixture_root)],
                          capture_output=True, text=True, env=env, timeout=120, check=False,
                          cwd="/")
    assert proc.returncode == 0, proc.stderr
    unit = fixture_root / "etc/systemd/system/gpuwatch.service"
    assert exec_words(unit.read_text().replace("%%", "%"))[: len(program)] == program
    ok = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                        text=True, timeout=60, check=False)
    assert ok.returncode == 0, ok.stderr


def test_now_over_an_older_unit_restarts_the_daemon_running_it() -> None:
    """``enable --now`` starts a stopped service but leaves a running one alone: installing
    over an older unit (gpuwatch moved to another venv, an upgrade that changed the unit)
    kept the old daemon running the old program until the next reboot. A changed unit is
    now followed by ``try-restart`` (which starts nothing that was stopped); an unchanged
    one restarts nothing."""
    new = render_unit(["/opt/new/bin/gpuwatch"])
    old = render_unit(["/opt/old/bin/gpuwatch"])
    def commands(existing: str | None) -> list[tuple[str, ...]]:
        facts = Facts(root="/", exec_argv=("/opt/new/bin/gpuwatch",), have_systemctl=True,
                      systemd_running=True, group_exists=True, existing={UNIT_FILE: existing})
        return [s.argv for s in plan_install(facts, now=True) if isinstance(s, Run)]

    assert commands(old)[:3] == [("systemctl", "daemon-reload"),
                                 ("systemctl", "try-restart", "gpuwatch"),
                                 ("systemctl", "enable", "--now", "gpuwatch")]
    assert ("systemctl", "try-restart", "gpuwatch") not in commands(new)
    assert commands(None)[:2] == [("systemctl", "daemon-reload"),
                                  ("systemctl", "enable", "--now", "gpuwatch")]


def test_without_now_the_hint_says_a_running_daemon_needs_a_restart(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --now, the hint after writing over an older unit names the restart: its old
    advice (run this again with --now) found the unit already so the second time, and
    restarted nothing. A dry run on the running host, its facts made up: nothing is read."""
    import gpuwatch.service.install as install

    def facts_with(old: str | None) -> None:
        def fake(root: str, exec_argv: tuple[str, ...] = (),
                 program_paths: tuple[str, ...] = ()) -> Facts:
            return Facts(root=root, exec_argv=tuple(exec_argv),
                         program_paths=tuple(program_paths), group_exists=True,
                         existing={UNIT_FILE: old})
        monkeypatch.setattr(install, "gather_facts", fake)

    facts_with("# an older gpuwatch unit\n")
    assert main(["service", "install", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "systemctl try-restart gpuwatch" in out.splitlines()[-1]
    facts_with(None)
    assert main(["service", "install", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "try-restart" not in out and "run this again with --now" in out.splitlines()[-1]


def test_uninstall_without_systemd_running_removes_the_enablement_links() -> None:
    """On a host where systemd is not running (a container, an image being built in one),
    the unit enabled offline (``systemctl enable`` works there) was removed but its
    ``multi-user.target.wants`` link was left behind, dangling. With systemd running, the
    ``disable --now`` removes the links; a link left by a unit already gone is removed too."""
    link = "/etc/systemd/system/multi-user.target.wants/gpuwatch.service"
    for running, unit in ((False, shipped_unit()), (True, None)):
        facts = Facts(root="/", existing={UNIT_FILE: unit}, wants_links=(link,),
                      have_systemctl=True, systemd_running=running, have_udevadm=True)
        steps = plan_uninstall(facts)
        assert Remove(link, "enablement link") in steps, (running, steps)
        assert not any(isinstance(s, Run) and "disable" in s.argv for s in steps)
    facts = Facts(root="/", existing={UNIT_FILE: shipped_unit()}, wants_links=(link,),
                  have_systemctl=True, systemd_running=True)
    steps = plan_uninstall(facts)
    assert steps[0] == Run(("systemctl", "disable", "--now", "gpuwatch"))
    assert not any(isinstance(s, Remove) and s.path == link for s in steps)


def test_the_rules_group_is_added_when_missing(fixture_root: Path) -> None:
    """The rules give /dev/vfio nodes to group kvm; where it does not exist (a minimal image,
    a container), udev ignores GROUP= ("Unknown group") and the nodes stay root's, while
    install said "group kvm may use /dev/vfio nodes". It is added like gpuwatch's own group,
    only when missing, in the same write of the group files."""
    group = fixture_root / "etc/group"
    group.write_text("root:x:0:\nusers:x:100:\n")
    (fixture_root / "etc/gshadow").write_text("root:*::\n")
    proc = run("service", "install", "--root", str(fixture_root))
    assert proc.returncode == 0, proc.stderr
    assert group.read_text() == "root:x:0:\nusers:x:100:\ngpuwatch:x:999:\nkvm:x:998:\n"
    assert (fixture_root / "etc/gshadow").read_text() == "root:*::\ngpuwatch:!::\nkvm:!::\n"
    assert f"wrote {group} (group gpuwatch added, gid 999; group kvm added, gid 998)" \
        in proc.stdout.splitlines()
    again = run("service", "install", "--root", str(fixture_root))
    assert again.returncode == 0 and "kept group kvm (exists)" in again.stdout
    assert "wrote" not in again.stdout

    host = Facts(root="/", exec_argv=("/opt/gpuwatch/bin/gpuwatch",), group_exists=True,
                 vfio_group_exists=False)
    commands = [s.argv for s in plan_install(host, now=False) if isinstance(s, Run)]
    assert commands == [("groupadd", "--system", "kvm")]
