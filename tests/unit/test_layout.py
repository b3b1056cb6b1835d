"""The test layout (tests/conftest.py): the folder says what a test is. Every test under
tests/e2e carries the `e2e` marker, so `-m "not e2e"` is tests/unit; a test under tests/unit
that uses a server fixture or is marked slow is refused at collection, with the fix.

Each case collects a small tree that uses the real conftest, in this process (pytester)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

_UNIT = """
import pytest


@pytest.fixture
def fake_server():
    return None


def test_computes():
    pass
"""

_E2E = """
def test_runs():
    pass
"""


def _tree(pytester: pytest.Pytester, unit: str) -> None:
    """tests/conftest.py (the real one), a unit module and an end-to-end one."""
    tests = pytester.path / "tests"
    for folder, name, text in (("unit", "test_inner_unit.py", unit), ("e2e", "test_inner_e2e.py", _E2E)):
        (tests / folder).mkdir(parents=True, exist_ok=True)
        (tests / folder / name).write_text(text)
    shutil.copy(Path(__file__).parents[1] / "conftest.py", tests / "conftest.py")


def _collected(pytester: pytest.Pytester, *args: str) -> list[str]:
    done = pytester.runpytest_inprocess("--collect-only", "-q", "-p", "no:randomly", *args)
    return [line for line in done.outlines if "::" in line]


def test_the_e2e_folder_carries_the_marker_and_the_unit_folder_does_not(pytester: pytest.Pytester) -> None:
    _tree(pytester, _UNIT)
    assert _collected(pytester, "-m", "e2e") == ["tests/e2e/test_inner_e2e.py::test_runs"]
    assert _collected(pytester, "-m", "not e2e") == ["tests/unit/test_inner_unit.py::test_computes"]


@pytest.mark.parametrize(
    "test",
    [
        "def test_uses_a_server(fake_server):\n    pass\n",
        "@pytest.mark.slow\ndef test_takes_long():\n    pass\n",
        "@pytest.mark.e2e\ndef test_marked():\n    pass\n",
    ],
    ids=["server-fixture", "slow", "e2e-marker"],
)
def test_an_end_to_end_test_in_the_unit_folder_is_refused(pytester: pytest.Pytester, test: str) -> None:
    _tree(pytester, _UNIT + "\n\n" + test)
    done = pytester.runpytest_inprocess("--collect-only", "-q", "-p", "no:randomly")
    assert done.ret == pytest.ExitCode.USAGE_ERROR
    name = test.split("def ")[1].split("(")[0]
    assert f"tests/unit/test_inner_unit.py::{name} " in done.errlines[0], done.errlines
    assert "move it to tests/e2e" in done.errlines[0], done.errlines
