"""The public API as a program embedding gpuwatch sees it: what each name's types promise."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

import pytest

import gpuwatch
from gpuwatch.core.probes import ACTIONS
from gpuwatch.host import Host
from gpuwatch.model import HostModel
from gpuwatch.testing import SysRoot
from gpuwatch.watch.watcher import Watcher

REPO = Path(__file__).resolve().parent.parent
NV = "0000:01:00.0"


def _overloads(fn: Any, skip: int) -> list[tuple[Any, str]]:
    """Each overload of ``fn`` as (the actions it names, its return annotation); ``skip``
    leading parameters (``self``) left out of the comparison."""
    out = []
    for ov in typing.get_overloads(fn):
        ann = dict(ov.__annotations__)
        out.append((ann.pop("action"), ann.pop("return")))
        assert list(ann) == list(ov.__code__.co_varnames[skip:ov.__code__.co_argcount
                                                         + ov.__code__.co_kwonlyargcount])[1:]
    return out


def _declared(action: str) -> Any:
    """The type `HostModel.probe`'s first matching overload declares for ``action``."""
    for ov in typing.get_overloads(HostModel.probe):
        hints = typing.get_type_hints(ov)
        if action in typing.get_args(hints["action"]) or hints["action"] is str:
            return hints["return"]
    raise AssertionError(f"no overload of HostModel.probe takes {action!r}")


def test_every_probe_answer_is_what_its_type_says(host: SysRoot) -> None:
    """A strictly type-checked caller is told each action's answer (``probe("detect-vfio")``
    is a `DetectVfioResult`, ``group-in-mode`` a bool), not Any; the answer must be that."""
    model = gpuwatch.scan(root=host.root)
    group = model.function(NV).iommu_group
    params = {"group": group, "addr": NV, "mode": "vfio"}
    for action, needs in ACTIONS.items():
        declared = _declared(action)
        assert declared is not Any, f"{action}: typed Any"
        kwargs = {k: params[k] for k in ("addr", *needs) if k in needs or "mode" in needs}
        answer = model.probe(action, **kwargs)
        origin = typing.get_origin(declared) or declared
        assert isinstance(answer, origin), (action, declared, answer)
        if origin in (tuple, list):
            item = typing.get_args(declared)[0]
            item = typing.get_origin(item) or item
            assert all(isinstance(x, item) for x in answer), (action, declared, answer)


def test_every_probe_entry_point_is_typed_alike() -> None:
    """`HostModel.probe`, ``Host.probe`` (what ``open_host`` yields), `Watcher.probe` and
    `gpuwatch.probe` promise the same answer for each action."""
    first = _overloads(HostModel.probe, 1)
    assert len(first) > 1
    assert first[-1] == ("str", "Any")  # an action computed at run time
    assert _overloads(Host.probe, 1) == first
    assert _overloads(Watcher.probe, 1) == first
    assert _overloads(gpuwatch.probe, 0) == first


# ------------------------------------------------------------------ as strict mypy sees it

_USER_PROGRAM = '''
import anyio
import gpuwatch


def ready(addr: str) -> bool:
    model = gpuwatch.scan(root="/")
    return model.probe("group-in-mode", addr=addr, mode="vfio")


def vfio_on() -> bool:
    return gpuwatch.probe("detect-vfio", root="/").iommu_enabled


def render_node(host: gpuwatch.Host) -> str:
    return host.probe("detect-host-devices").render_node


async def main() -> int:
    try:
        async with gpuwatch.open_host(root="/", reconcile_interval=60, log_keep=3) as host:
            print(render_node(host), ready("0000:01:00.0"), vfio_on())
    except gpuwatch.DeviceNotFound as exc:
        return exc.exit_status
    except gpuwatch.GpuwatchError as exc:
        print(exc.code, exc.blame)
        return exc.exit_status
    return 0


anyio.run(main)
'''

#: A watcher option misspelt: a type error, as an unknown keyword of any typed call is.
_MISSPELT_OPTION = '''
import gpuwatch


async def main() -> None:
    async with gpuwatch.open_host(root="/", reconcile_intervall=60) as host:
        print(host)
'''


def _examples() -> list[tuple[str, str]]:
    """The Python examples of README.md and docs/, each a module mypy can read (one shown
    as a coroutine's body inside ``async def``)."""
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        import doc_examples as D
    finally:
        sys.path.pop(0)
    out = []
    for ex in D.collect():
        if ex.lang != "python":
            continue
        code = ex.code
        try:
            compile(code, ex.id, "exec")
        except SyntaxError:  # top-level await: a snippet of a coroutine's body
            code = "import gpuwatch\n\n\nasync def _example() -> None:\n" + textwrap.indent(
                code, "    ")
        out.append((ex.id, code))
    return out


@pytest.mark.timeout(240)
@pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                    reason="mypy is not installed for this Python (the test extra has it)")
def test_a_strict_user_program_and_the_doc_examples_type_check(tmp_path: Path) -> None:
    """``mypy --strict`` over a program written the way the docs show, gpuwatch read as an
    installed typed package is (its own errors silent): no cast, no ``Any`` returned."""
    files = [tmp_path / "user_program.py", tmp_path / "misspelt.py"]
    files[0].write_text(_USER_PROGRAM)
    files[1].write_text(_MISSPELT_OPTION)
    for n, (where, code) in enumerate(_examples()):
        path = tmp_path / f"example_{n}.py"
        path.write_text(f"# {where}\n{code}")
        files.append(path)
    assert len(files) > 3
    env = {**os.environ, "MYPYPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
         "--no-error-summary", "--cache-dir", str(tmp_path / "cache"),
         *(str(f) for f in files)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=220)
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith("misspelt.py:6: error: "), (
        proc.stdout + proc.stderr)
    assert 'Unexpected keyword argument "reconcile_intervall"' in errors[0]


def test_the_version_is_the_package_version() -> None:
    """``gpuwatch.__version__`` (what ``--version`` and a bug report say) is the one the
    package is built with: a release that bumps one bumps both."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert gpuwatch.__version__ == project["version"]
