"""The house rules that keep the structure: layers that only point down, no import circles,
and a lean ``import gpuwatch``.

The layers are declared once, in pyproject.toml's import-linter contract; this test reads
that declaration and checks it against an import graph built from the source (every import,
at module level, inside a function or under TYPE_CHECKING), and runs import-linter itself.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "gpuwatch"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the gpuwatch modules it imports (resolved to the defining file)."""
    files = {module_name(p): p for p in PKG.rglob("*.py")}

    def owner(name: str) -> str | None:
        while name:
            if name in files:
                return name
            name = name.rpartition(".")[0]
        return None

    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        out = graph.setdefault(mod, set())
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    stem = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    stem = node.module or ""
                targets = [f"{stem}.{a.name}" for a in node.names] + [stem]
            else:
                continue
            for target in targets:
                found = owner(target)
                if found is not None and found != mod:
                    out.add(found)
                    break
    return graph


def declared_layers() -> list[list[tuple[str, bool]]]:
    """The contract's layers, top first; each a list of (container, independent)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    layers = []
    for text in contract["layers"]:
        independent = "|" in text
        names = [n.strip() for n in text.replace("|", ":").split(":")]
        layers.append([(f"gpuwatch.{n}", independent) for n in names])
    return layers


def place(mod: str, layers: list[list[tuple[str, bool]]]) -> tuple[int, str] | None:
    for index, layer in enumerate(layers):
        for container, _ in layer:
            if mod == container or mod.startswith(container + "."):
                return index, container
    return None


def test_every_module_has_a_layer() -> None:
    layers = declared_layers()
    outside = sorted(m for m in import_graph()
                     if m not in ("gpuwatch", "gpuwatch.__main__") and place(m, layers) is None)
    assert outside == [], f"modules in no layer of pyproject's contract: {outside}"


def violations(graph: dict[str, set[str]], layers: list[list[tuple[str, bool]]]) -> list[str]:
    """Every import that climbs a layer or crosses between independent siblings."""
    independent = {c for layer in layers for c, ind in layer if ind}
    found = []
    for mod, targets in graph.items():
        here = place(mod, layers)
        if here is None:
            continue
        for target in targets:
            there = place(target, layers)
            if there is None:
                continue
            if there[0] < here[0]:
                found.append(f"{mod} -> {target} (up)")
            elif there[0] == here[0] and there[1] != here[1] and here[1] in independent:
                found.append(f"{mod} -> {target} (sideways between independent siblings)")
    return sorted(found)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of two or more modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_only_point_down() -> None:
    assert violations(import_graph(), declared_layers()) == []


def test_no_import_circles() -> None:
    graph = import_graph()
    # Package __init__ files re-export what their children define; a child importing a
    # sibling through its package is not a knot, so packages are left out as nodes.
    packages = {module_name(p) for p in PKG.rglob("__init__.py")}
    graph = {m: {t for t in ts if t not in packages} for m, ts in graph.items()
             if m not in packages}
    assert circles(graph) == []


def test_the_checks_see_what_they_forbid() -> None:
    """The checkers themselves, on a graph with each fault once."""
    layers = declared_layers()
    bad = {
        "gpuwatch.core.state": {"gpuwatch.watch.watcher"},  # up
        "gpuwatch.switch.engine": {"gpuwatch.watch.subscription"},  # sideways
        "gpuwatch.watch.watcher": {"gpuwatch.core.state"},  # fine: down
        "gpuwatch.model": {"gpuwatch.report"},  # fine: a sibling it may use
    }
    assert violations(bad, layers) == [
        "gpuwatch.core.state -> gpuwatch.watch.watcher (up)",
        "gpuwatch.switch.engine -> gpuwatch.watch.subscription "
        "(sideways between independent siblings)",
    ]
    loop = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(loop) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_import_linter_contract_is_kept() -> None:
    """The same contract through import-linter, the tool CI and developers run."""
    pytest.importorskip("importlinter.cli")
    # In a child: import-linter configures logging process-wide, which would blind caplog.
    run = (f"from importlinter.cli import lint_imports; raise SystemExit(lint_imports("
           f"config_filename={str(REPO / 'pyproject.toml')!r}, no_cache=True, no_logo=True))")
    done = subprocess.run([sys.executable, "-c", run], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 kept, 0 broken" in done.stdout


HEAVY = ("pydantic", "yaml", "anyio", "pyudev")


def loaded_after(code: str) -> list[str]:
    """Which heavy libraries a fresh interpreter has loaded after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {HEAVY!r} " \
            "if m in sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=60, check=True)
    loaded: list[str] = json.loads(out.stdout.strip().splitlines()[-1])
    return loaded


def test_import_gpuwatch_is_lean() -> None:
    assert loaded_after("import gpuwatch") == []


def test_public_names_load_on_first_use() -> None:
    import gpuwatch

    for name in gpuwatch.__all__:
        assert getattr(gpuwatch, name) is not None
    assert loaded_after("import gpuwatch\ngpuwatch.UsageError") == []
    assert "pydantic" in loaded_after("import gpuwatch\ngpuwatch.PciFunction")
    with pytest.raises(AttributeError):
        _ = gpuwatch.no_such_name  # type: ignore[attr-defined]


def test_gpuwatch_help_is_lean() -> None:
    code = ("import contextlib, io\nfrom gpuwatch.cli.main import main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out, "
            "contextlib.suppress(SystemExit):\n    main(['--help'])\n"
            "assert 'udev-rules' in out.getvalue() and 'ensure-cdi' in out.getvalue()")
    assert loaded_after(code) == []


def test_every_subcommand_is_listed_without_loading_it() -> None:
    from gpuwatch.cli.main import SUBCOMMANDS, SUMMARIES, build_parser

    assert set(SUMMARIES) == set(SUBCOMMANDS)
    listing = build_parser(()).format_help()
    full = build_parser().format_help()
    assert listing == full  # the lean listing says exactly what the full parser says
    for module in SUBCOMMANDS:
        assert SUMMARIES[module].split()[0] in listing
