"""The lint rules the code's `noqa` comments assume (pyproject.toml's [tool.ruff]) hold."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_style import ROOT


@pytest.mark.e2e
def test_ruff_is_clean() -> None:
    pytest.importorskip("ruff", reason="ruff comes with the test extra: pip install -e '.[test]'")
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "src", "tests", "benchmarks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.e2e
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


def _mypy(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """mypy with pyproject.toml's [tool.mypy]; skipped where it is not installed, except in CI."""
    import importlib.util
    import os

    if importlib.util.find_spec("mypy") is None:
        if os.environ.get("CI"):
            pytest.fail("CI runs the type checker: pip install -e '.[test]' installs mypy")
        pytest.skip("mypy comes with the test extra: pip install -e '.[test]'")
    config = ["--config-file", str(ROOT / "pyproject.toml")]
    return subprocess.run(
        [sys.executable, "-m", "mypy", *config, *args], cwd=cwd, capture_output=True, text=True
    )


@pytest.mark.e2e
def test_mypy_is_clean() -> None:
    """`make lint`'s type check: src/stallfree with the settings in pyproject.toml."""
    result = _mypy()
    assert result.returncode == 0, "run `make lint`:\n" + result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.e2e
def test_mypy_refuses_a_schedule_where_a_side_is_expected(tmp_path: Path) -> None:
    """The settings are strict enough for what one name with two meanings did:
    an `int | list` schedule handed to an int side, and a function without annotations."""
    snippet = tmp_path / "snippet.py"
    snippet.write_text(
        "def crop(side: int) -> int:\n"
        "    return side // 2\n\n\n"
        "def epoch_side(image_size: int | list[list[int]]) -> int:\n"
        "    return crop(image_size)\n\n\n"
        "def untyped(x):\n"
        "    return x\n"
    )
    result = _mypy("--cache-dir", str(tmp_path / "cache"), str(snippet), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert '"crop" has incompatible type "int | list[list[int]]"' in result.stdout, result.stdout
    assert "[no-untyped-def]" in result.stdout, result.stdout
