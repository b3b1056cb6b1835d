"""The README's and the manual's commands work as a new user types them: set-up, PATH, and
example recipes that stallfree itself does not warn about."""

from __future__ import annotations

import subprocess

import pytest
from doc_pages import REPO


@pytest.mark.e2e
def test_make_says_how_to_put_stallfree_on_path() -> None:
    """What `make demo` and `make install` end with (`make -n`: printed, nothing run)."""
    for target in ("demo", "install"):
        done = subprocess.run(
            # --no-print-directory: under `make test` this make is a child, which would otherwise
            # end its output with "Leaving directory".
            ["make", "-n", "--no-print-directory", target],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        last = [line for line in done.stdout.splitlines() if line.strip()][-1]
        assert "source .venv/bin/activate" in last, (target, done.stdout)
