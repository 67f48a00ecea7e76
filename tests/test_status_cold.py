"""What a cold ``gpuwatch status`` (and ``list``) does on a daemon's answers: the same bytes
as the full command, for less. No parser nor package-resource machinery imported, two
connections to the daemon, no ``boot_vga`` read where the rule cannot use one, and the
shared readers it leans on (`TreePlaces`, `json_depth`) answering exactly as before."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from itertools import accumulate
from pathlib import Path

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from watch_helpers import count_calls

from gpuwatch.cli import fast_report
from gpuwatch.core import strictjson
from gpuwatch.hostfs.files import TreePlaces, tree_dir
from gpuwatch.service.testing import served_watcher, short_socket_dir
from gpuwatch.testing import example_gpu_host
from gpuwatch.testing.machines import hybrid_laptop_host
from tests.test_cli_fast import SPY, run_full_both

REPO = Path(__file__).resolve().parents[1]
#: What a cold report once imported and needs not: argparse (and its gettext) for a parser it
#: never builds, `importlib.resources` (pathlib, zipfile, tempfile) for one JSON file beside
#: the package, tempfile (shutil, random) for a write it never makes. A site-packages ``.pth``
#: may import some of them at start, so the command runs without ``site`` (``-S``): what is
#: loaded then is the command's own doing.
NOT_COLD = ("argparse", "gettext", "importlib.resources", "tempfile", "shutil", "zipfile",
            "pathlib", "dataclasses", "pydantic", "yaml", "anyio")


@pytest.fixture
def sockdir() -> Iterator[str]:
    with short_socket_dir() as path:
        yield path


def run_bare(argv: list[str]) -> tuple[int, bytes, str]:
    """``argv`` in a process started without ``site``, reporting what of `NOT_COLD` was
    loaded when the answer was printed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, "-S", "-c", SPY.format(heavy=NOT_COLD), *argv],
                          capture_output=True, env=env, timeout=60)
    return done.returncode, done.stdout, done.stderr.decode()


async def test_a_cold_report_on_a_daemons_answers_imports_only_what_it_uses(
        tmp_path: Path, sockdir: str) -> None:
    root = str(example_gpu_host(tmp_path / "h").root)
    async with served_watcher(root, f"{sockdir}/gw.sock") as served:
        for argv in (["status"], ["status", "--json"], ["list"], ["list", "--json"]):
            argv = [*argv, "--socket", served.path, "--root", root]
            code, out, err = await anyio.to_thread.run_sync(run_bare, argv)
            assert code == 0, (argv, err)
            assert "HEAVY=\n" in err, (argv, err)
            full, _ = await anyio.to_thread.run_sync(run_full_both, argv)
            assert out == full, argv


async def test_status_asks_the_daemon_on_two_connections(
        tmp_path: Path, sockdir: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``detect-gpu`` goes with ``detect-vfio``; then every GPU's group in one exchange. It
    was asked alone, on a connection of its own, after them."""
    monkeypatch.delenv("GPUWATCH_CONFIG", raising=False)
    root = str(example_gpu_host(tmp_path / "h").root)
    async with served_watcher(root, f"{sockdir}/gw.sock") as served:
        argv = ["status", "--socket", served.path, "--root", root]
        full, _ = await anyio.to_thread.run_sync(run_full_both, argv)
        capsys.readouterr()
        connects = count_calls(monkeypatch, socket.socket, "connect")
        code = await anyio.to_thread.run_sync(fast_report.run_report, argv)
    assert code == 0
    assert capsys.readouterr().out.encode() == full
    assert len(connects) == 2


@pytest.mark.parametrize("command", ["status", "list"])
def test_a_host_of_two_displays_reads_no_console_for_a_report(
        tmp_path: Path, command: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A laptop whose dGPU is a VGA GeForce: the iGPU has ``boot_vga`` 1, but with a second
    screen beside it it is not the host's only display, so the rule keeps neither for it by
    ``boot_vga`` or a framebuffer. The report reads neither (a big host read one
    ``boot_vga`` per GPU), and says what the full command says."""
    monkeypatch.delenv("GPUWATCH_CONFIG", raising=False)
    root = str(hybrid_laptop_host(tmp_path / "h", dgpu_class="0x030000").root)
    argv = [command, "--json", "--root", root]
    full, _ = run_full_both([*argv, "--no-daemon"])
    reads = count_calls(monkeypatch, fast_report, "listed_console")
    assert fast_report.run_report(argv) == 0  # no daemon for a fixture root: one stdlib scan
    assert capsys.readouterr().out.encode() == full
    assert reads == []


@pytest.mark.parametrize("command", ["status", "list"])
def test_an_optimus_laptop_reads_its_console(
        tmp_path: Path, command: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An Optimus laptop: the dGPU is a 3D controller, a screen only with a framebuffer
    beneath it. The report reads the console once (the 3D controller's framebuffer, the
    iGPU's ``boot_vga``), keeps the iGPU, and says what the full command says."""
    monkeypatch.delenv("GPUWATCH_CONFIG", raising=False)
    root = str(hybrid_laptop_host(tmp_path / "h").root)
    argv = [command, "--json", "--root", root]
    full, _ = run_full_both([*argv, "--no-daemon"])
    reads = count_calls(monkeypatch, fast_report, "listed_console")
    assert fast_report.run_report(argv) == 0
    out = capsys.readouterr().out
    assert out.encode() == full and '"kept_for_host":true' in out
    assert len(reads) == 1


def test_a_host_of_one_display_still_reads_its_console(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from gpuwatch.testing.machines import single_gpu_desktop

    monkeypatch.delenv("GPUWATCH_CONFIG", raising=False)
    root = str(single_gpu_desktop(tmp_path / "h").root)
    reads = count_calls(monkeypatch, fast_report, "listed_console")
    assert fast_report.run_report(["status", "--json", "--root", root]) == 0
    assert '"kept_for_host":true' in capsys.readouterr().out
    assert len(reads) == 1


# ---------------------------------------------------------- nodes found where tree_dir finds them

def _linked_tree(root: Path) -> list[str]:
    """A tree whose ``dev/vfio`` is a link spelled absolute (as a capture keeps the kernel's),
    with a node that is a link itself, one that loops, one absent, and a folder that loops:
    the nodes to look up."""
    real = root / "devreal" / "vfio"
    real.mkdir(parents=True)
    (root / "dev").mkdir()
    (root / "dev" / "vfio").symlink_to("/devreal/vfio")
    (real / "5").write_text("")
    (real / "noiommu-3").write_text("")
    (real / "7").symlink_to("/devreal/vfio/5")
    (real / "8").symlink_to("../../devreal/vfio/5")
    (real / "9").symlink_to("../../../../outside")  # past the root: in a chroot, under it
    (real / "loop").symlink_to("loop")
    (root / "dev" / "iommu").write_text("")
    (root / "round").symlink_to("round")
    return ["/dev/vfio/5", "/dev/vfio/noiommu-3", "/dev/vfio/7", "/dev/vfio/8", "/dev/vfio/9",
            "/dev/vfio/loop", "/dev/vfio/6", "/dev/iommu", "/round/x", "/dev/vfio/",
            "/dev/vfio/.", "/dev/vfio/..", "/dev/vfio/../vfio/5", "dev/vfio/5", "vfio5", "",
            "/dev//vfio/5", "/dev/vfio/5/", "/dev/nothing/5", "/iommu"]


def test_tree_places_find_every_node_where_tree_dir_does(tmp_path: Path) -> None:
    nodes = _linked_tree(tmp_path / "root")
    for root in (str(tmp_path / "root"), str(tmp_path / "root") + "/"):
        places = TreePlaces(root)
        for _ in range(2):  # the second time from what the first resolved
            assert [places(n) for n in nodes] == [tree_dir(root, n) for n in nodes]
    assert TreePlaces(str(tmp_path / "root"))("/dev/vfio/7") == str(
        tmp_path / "root" / "devreal" / "vfio" / "5")


# ---------------------------------------------------------------- strict JSON, as it was measured

def _depth_as_written(text: str) -> int:
    """`strictjson.json_depth` as first written: every string dropped by splitting the text
    on its quotes, then a running count of the brackets left."""
    if text.count("[") + text.count("{") <= 1:
        return text.count("[") + text.count("{")
    bare = text.replace("\\\\", "").replace('\\"', "")
    outside = re.sub(r"[^\[\]{}]+", "", "".join(bare.split('"')[::2]))
    if not outside:
        return 0
    return max(0, *accumulate(1 if c in "[{" else -1 for c in outside))


#: Texts of what decides a depth (quotes, brackets, escapes) among other characters, those
#: beyond ASCII and a lone surrogate included.
_TEXTS = st.text(alphabet=st.sampled_from('[]{}""\\\\ab:,0é\u2028\U0001f600\ud800'),
                 max_size=60)


@settings(max_examples=600, deadline=None)
@given(_TEXTS)
def test_json_depth_is_measured_as_it_was(text: str) -> None:
    assert strictjson.json_depth(text) == _depth_as_written(text)


def test_json_depth_of_strings_holding_brackets_beside_strings_that_do_not() -> None:
    """Only quotes and brackets are kept; a string that holds a bracket is what sends the
    measure the long way (its quotes cannot pair away)."""
    for text in ('["a", "[", "b"]', '[["]", ""], [""]]', '{"k": "}}}", "l": [[["x"]]]}',
                 '["", "[[[[", ""]', '[""' + ',""' * 50 + "]", '"[[["' + "[" * 40,
                 '[["\\"", "\\\\"], "["]', "[" * 70 + '"' + "]" * 70):
        assert strictjson.json_depth(text) == _depth_as_written(text), text


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["7", "0", "12", "9" * 150, "-", ".", "a", "٣", '"']),
                max_size=12))
def test_integers_too_long_for_a_double_are_found_as_before(parts: list[str]) -> None:
    """`loads` takes the bounded integer parser exactly where a run of 309 ASCII digits is
    (as the regular expression it replaces found it): an integer that long is refused."""
    text = "".join(parts)
    long_run = re.search("[0-9]{309}", text) is not None
    assert strictjson.has_long_digits(text) == long_run


@pytest.mark.parametrize(("text", "long_run"), [
    ("1" * 308, False), ("1" * 309, True), ("x" + "5" * 308 + "y" + "5" * 308, False),
    ("[" + "0" * 200 + "9" * 109 + "]", True), ("\u0660" * 400, False), ("٣" * 400, False),
    ("1" * 154 + "." + "1" * 154, False), ("-" + "9" * 309 + "e0", True),
], ids=["308", "309", "308-twice", "309-of-two-digits", "escaped-arabic-indic", "arabic-indic",
        "a-point-between", "a-float"])
def test_a_run_of_309_digits_and_no_shorter_is_long(text: str, long_run: bool) -> None:
    assert strictjson.has_long_digits(text) == long_run == (
        re.search("[0-9]{309}", text) is not None)
