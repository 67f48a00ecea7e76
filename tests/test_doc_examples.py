"""Every shell and Python example in README.md, docs/ and contrib/ runs against a fixture root,
or is marked as needing a real host; a renamed flag or field breaks a test, not a reader.

How each example runs, and the marker convention: tests/doc_examples.py.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import doc_examples as D
import pytest

import gpuwatch
from gpuwatch.cli.main import build_parser
from gpuwatch.host import open_host
from gpuwatch.service.server import SocketServer
from gpuwatch.testing import SysRoot, example_gpu_host
from gpuwatch.testing.simkernel import SimKernel

EXAMPLES = D.collect()
NIC = "0000:02:00.0"


def test_examples_are_found_and_every_page_has_them() -> None:
    pages = {e.page.name for e in EXAMPLES}
    assert {"README.md", "socket.md", "service.md", "kubernetes.md"} <= pages
    assert any(e.lang == "python" for e in EXAMPLES)
    assert any("host" not in e.markers for e in EXAMPLES)


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e.lang == "sh"], ids=lambda e: e.id)
def test_gpuwatch_command_lines_parse(example: D.Example) -> None:
    """Run or not, every ``gpuwatch`` line of a shell example uses real subcommands and flags."""
    parser = build_parser()
    for argv in D.gpuwatch_commands(example.code):
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            if exc.code not in (0, None):  # --help / --version exit 0
                pytest.fail(f"{example.id}: `gpuwatch {' '.join(argv)}` does not parse")


def test_the_parse_check_catches_a_renamed_flag() -> None:
    code = "gpuwatch list --managed no\nsudo gpuwatch watch --sokcet /run/x.sock | jq .\n"
    commands = D.gpuwatch_commands(code)
    assert commands == [["list", "--managed", "no"], ["watch", "--sokcet", "/run/x.sock"]]
    with pytest.raises(SystemExit):
        build_parser().parse_args(commands[1])


@pytest.mark.parametrize("example", [e for e in EXAMPLES if e.lang == "python"],
                         ids=lambda e: e.id)
def test_python_examples_compile_and_name_real_gpuwatch_names(example: D.Example) -> None:
    """Run or not (a host example is not), every Python example compiles and each
    ``gpuwatch.NAME`` it uses is one the package exports: a renamed class breaks a test."""
    for name in D.gpuwatch_names(example.code, example.id):
        assert name in gpuwatch.__all__ or importlib.util.find_spec(f"gpuwatch.{name}"), \
            f"{example.id}: gpuwatch.{name} does not exist"


def test_the_python_check_catches_a_renamed_name_and_a_syntax_error() -> None:
    code = "async with gpuwatch.open_host('/') as h:\n    await gpuwatch.Clinet(h)\n"
    assert D.gpuwatch_names(code, "x") == ["open_host", "Clinet"]
    assert "Clinet" not in gpuwatch.__all__
    with pytest.raises(SyntaxError):
        D.gpuwatch_names("with gpuwatch.Client() as c\n    pass\n", "x")


def test_markers_are_checked(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("<!-- doc-test: hots -->\n```sh\ngpuwatch status\n```\n")
    with pytest.raises(D.BadMarker, match="unknown doc-test word"):
        D.collect((page,))
    page.write_text("<!-- doc-test: host each-line (why) -->\n```sh\ngpuwatch status\n```\n"
                    "```python\nprint(1)\n```\n```json\n{}\n```\n")
    first, second = D.collect((page,))
    assert (first.markers, first.reason) == (frozenset({"host", "each-line"}), "why")
    assert (second.lang, second.markers) == ("python", frozenset())


@contextlib.contextmanager
def place_for() -> Iterator[tuple[D.Place, SysRoot]]:
    folder = Path(tempfile.mkdtemp(prefix="gwdoc-", dir="/tmp"))  # short: socket paths
    try:
        host = example_gpu_host(folder / "host")
        place = D.Place(folder, host.root, socket=str(folder / "run/gpuwatch/gpuwatch.sock"),
                        log=str(folder / "var/log/gpuwatch/events.jsonl"))
        yield place, host
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@asynccontextmanager
async def daemon(place: D.Place, host: SysRoot, burst: int = 0) -> AsyncIterator[None]:
    """The host's daemon over the fixture: socket, log, a simulated kernel, steady events
    (``burst``: that many more queued at once, every round)."""
    sim = SimKernel(host)
    async with open_host(host.root, source=sim.source, ops=sim, geteuid=lambda: 0,
                         log=place.log, reconcile_interval=0, cdi_poll_interval=0) as served, \
            anyio.create_task_group() as tg:
        server = SocketServer(served, place.socket, log_path=place.log)
        await tg.start(server.serve)

        async def churn() -> None:
            while True:
                await anyio.sleep(0.1)
                host.unbind(NIC)
                sim.source.push(host.uevent_props("unbind", NIC))
                await anyio.sleep(0.1)
                host.bind(NIC, "igb")
                sim.source.push(host.uevent_props("bind", NIC))
                for _ in range(burst // 2):  # no change in the tree: work, few events
                    sim.source.push(host.uevent_props("change", NIC))
                    sim.source.push(host.uevent_props("change", "0000:01:00.1"))

        tg.start_soon(churn)
        try:
            yield
        finally:
            tg.cancel_scope.cancel()


async def run_example(example: D.Example, burst: int = 0) -> list[tuple[str, D.Outcome]]:
    until_stopped = "until-stopped" in example.markers
    results: list[tuple[str, D.Outcome]] = []
    with place_for() as (place, host):
        async with contextlib.AsyncExitStack() as stack:
            if "daemon" in example.markers:
                await stack.enter_async_context(daemon(place, host, burst))
            for script in D.scripts(example, place):
                outcome = await anyio.to_thread.run_sync(
                    lambda s=script: D.run_script(place, example, s,
                                                  until_stopped=until_stopped))
                results.append((script, outcome))
                why = D.failure(outcome, until_stopped=until_stopped)
                if why is not None:
                    pytest.fail(f"{example.id}: {script.strip()[:300]}\n{why}")
    return results


RUNNABLE = [e for e in EXAMPLES if "host" not in e.markers]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", RUNNABLE, ids=lambda e: e.id)
async def test_example_runs_against_a_fixture(example: D.Example) -> None:
    if example.lang == "sh" and "socat" in example.code and shutil.which("socat") is None:
        pytest.skip("socat is not installed (apt-get install socat; .ci/run installs it)")
    if example.lang == "sh" and "jq" in example.code and shutil.which("jq") is None:
        pytest.skip("jq is not installed (apt-get install jq)")
    await run_example(example)


def test_the_shim_keeps_examples_off_the_real_host() -> None:
    from doc_shim import rewrite

    assert rewrite(["status"], "/fx", "/s") == ["status", "--root", "/fx"]
    assert rewrite(["service", "install", "--now"], "/fx", "/s") == [
        "service", "install", "--root", "/fx", "--now"]
    assert rewrite(["watch", "--socket", "--log", "x"], "/fx", "/s")[:5] == [
        "watch", "--root", "/fx", "--socket", "/s"]
    assert rewrite(["udev-rules", "--group", "kvm"], "/fx", "/s") == [
        "udev-rules", "--group", "kvm"]  # takes no --root: nothing to add
    with pytest.raises(SystemExit, match="real host"):
        rewrite(["mode", "vfio", "--root", "/"], "/fx", "/s")
    assert isinstance(build_parser(), argparse.ArgumentParser)
    assert os.path.isfile(D.TESTS / "doc_python.py")


@pytest.mark.timeout(300)
async def test_socket_shell_lines_get_their_replies_while_events_pour_in() -> None:
    """docs/socket.md's socat lines, exactly, against a daemon kept busy with uevents: every
    request gets its reply, and the subscribe line streams the reply, then events."""
    if shutil.which("socat") is None or shutil.which("jq") is None:
        pytest.skip("socat and jq are needed (apt-get install socat jq; .ci/run installs socat)")
    (example,) = [e for e in EXAMPLES if e.page.name == "socket.md" and "socat" in e.code]
    assert {"daemon", "each-line", "until-stopped"} <= example.markers
    results = await run_example(example, burst=400)
    assert len(results) == 3
    (_, probe), (_, in_mode), (_, follow) = results
    reply = json.loads(probe.stdout)
    assert reply["id"] == 1 and reply["result"]["iommu_enabled"] is True
    assert in_mode.stdout.strip() == "false"  # the fixture's NVIDIA GPU is on nvidia
    lines = [json.loads(line) for line in follow.stdout.splitlines()]
    assert follow.code is None  # still following when stopped
    assert lines[0]["id"] == 1 and lines[0]["result"]["complete"] is True
    assert lines[1:] and all(e["type"] == "driver-changed" and "id" not in e for e in lines[1:])
