"""The lint rules the code's `noqa` comments assume (pyproject.toml's [tool.ruff]) hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_is_clean() -> None:
    pytest.importorskip("ruff", reason="ruff comes with the test extra: pip install -e '.[test]'")
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "src", "tests", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean() -> None:
    """One format for every file (`ruff format`), so a diff shows changes, not styles."""
    pytest.importorskip("ruff", reason="ruff comes with the test extra: pip install -e '.[test]'")
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "src", "tests", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, "run `ruff format src tests benchmarks`:\n" + result.stdout


def _imports(path: Path) -> set[str]:
    """The stallfree modules `path` imports, at its top or inside functions (not the ones
    under `if TYPE_CHECKING:`, which are for annotations and never run)."""
    import ast

    tree = ast.parse(path.read_text())
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and getattr(block.test, "id", None) == "TYPE_CHECKING"
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stallfree"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("stallfree"))
    return found


def test_no_import_cycles() -> None:
    """Each layer imports downwards only: a cycle, even through an import inside a function,
    means two modules share one job."""
    package = ROOT / "src" / "stallfree"
    modules = {
        ".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in package.rglob("*.py")
    }
    graph = {
        name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()
    }
    cycles = []

    def visit(name: str, stack: list[str]) -> None:
        for nxt in graph[name]:
            if nxt in stack:
                cycles.append(" -> ".join(stack[stack.index(nxt) :] + [nxt]))
            elif len(stack) < 12:
                visit(nxt, stack + [nxt])

    for name in graph:
        visit(name, [name])
    assert not cycles, sorted(set(cycles))[:10]
