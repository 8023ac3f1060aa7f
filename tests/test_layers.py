"""The package's layering (docs/architecture.md): the import-linter contract in pyproject.toml holds,
there is no import cycle between modules, and the contract does fail on an upward import."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` over the ``pask`` package found under ``root`` (its pyproject.toml)."""
    env = {"PATH": str(LINT.parent), "PYTHONPATH": str(root), "HOME": str(root)}
    return subprocess.run(
        [str(LINT), "--config", str(root / "pyproject.toml"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


@pytest.fixture(scope="module")
def copy_tree(tmp_path_factory) -> Path:
    """A copy of the package and its pyproject.toml, to break on purpose."""
    root = tmp_path_factory.mktemp("layers")
    shutil.copytree(ROOT / "pask", root / "pask", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def test_contract_holds() -> None:
    proc = lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def test_no_import_cycles() -> None:
    assert cycles(grimp.build_graph("pask", cache_dir=None)) == []


def test_cycle_finder_finds_a_cycle(copy_tree: Path, monkeypatch) -> None:
    """The cycle check is not vacuous: two modules importing each other are found."""
    pkg = copy_tree / "cyc_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyc_pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from cyc_pkg import a\n")
    monkeypatch.syspath_prepend(str(copy_tree))
    assert cycles(grimp.build_graph("cyc_pkg", cache_dir=None)) == [["cyc_pkg.a", "cyc_pkg.b"]]


@pytest.mark.parametrize(
    ("module", "line"),
    [
        ("kv/quant.py", "from pask.runtime import engine  # deliberately upward"),
        ("cpu/openmp.py", "def f():\n    from pask.cli import app  # deliberately upward, even if lazy"),
        ("calibration/solver.py", "from pask.serving import metrics  # siblings are independent"),
    ],
)
def test_contract_fails_on_an_upward_import(copy_tree: Path, module: str, line: str) -> None:
    target = copy_tree / "pask" / module
    original = target.read_text()
    target.write_text(original + "\n" + line + "\n")
    try:
        proc = lint(copy_tree)
    finally:
        target.write_text(original)
    assert proc.returncode != 0, proc.stdout
    assert "BROKEN" in proc.stdout
    assert "pask." + module.removesuffix(".py").replace("/", ".") in proc.stdout
