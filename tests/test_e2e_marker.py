"""`pytest -m "not e2e"` is a unit suite by construction: a test not marked e2e that starts a
process fails with the fix, even where it swallows the error; one using a server fixture is
marked at collection. A library's first use that starts a process of its own (matplotlib's font
cache, built by `fc-list` where no cache exists) is no such test, on a machine without caches."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import PYTHON

_TESTS = """
import subprocess

import pytest


@pytest.fixture
def fake_server():
    return None


def test_starts_a_process():
    subprocess.run(["true"])


def test_swallows_the_refusal():
    try:
        subprocess.run(["true"])
    except Exception:
        pass


def test_uses_a_server(fake_server):
    subprocess.run(["true"], check=True)


def test_draws_a_chart():
    pytest.importorskip("matplotlib")
    import matplotlib.font_manager  # noqa: F401 - the first import builds the font cache


@pytest.mark.e2e
def test_marked():
    subprocess.run(["true"], check=True)
"""


@pytest.mark.e2e
def test_an_unmarked_test_that_starts_a_process_fails(tmp_path: Path) -> None:
    for name in ("conftest.py", "zygote.py"):
        shutil.copy(Path(__file__).with_name(name), tmp_path / name)
    (tmp_path / "test_inner.py").write_text(_TESTS)
    # Marked at collection, the test using a server may start one; the marked one may too.
    # An empty HOME and no cache variables: a new machine's, where no font cache exists yet.
    env = {
        k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "XDG_CONFIG_HOME", "MPLCONFIGDIR")
    }
    (home := tmp_path / "home").mkdir()
    done = subprocess.run(
        [PYTHON, "-m", "pytest", "-q", "-rf", "-p", "no:randomly", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env={**env, "HOME": str(home)},
        capture_output=True,
        text=True,
    )
    assert "2 failed, 3 passed" in done.stdout, done.stdout[-3000:]
    lines = done.stdout.splitlines()
    failed = {line.split("::")[1].split()[0] for line in lines if line.startswith("FAILED")}
    assert failed == {"test_starts_a_process", "test_swallows_the_refusal"}, done.stdout
    assert "starts a process or a run: mark it @pytest.mark.e2e" in done.stdout, done.stdout
