"""`stallfree doctor`: every check, as text and as JSON, and its exit code (in this process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from inprocess import Cli


def test_doctor_reports_every_check_in_seconds(
    tmp_path: Path, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "c"))
    done = cli("doctor", "--json")
    checks = {c["check"]: c for c in json.loads(done.out)}
    assert {"python", "torch", "precision auto", "dali", "/dev/shm", "cpu", "cache"} <= set(checks)
    assert all(c["status"] in ("OK", "WARN", "FAIL") for c in checks.values())
    if "gpu" in checks:  # this machine: no CUDA device is a warning, with the fix
        assert checks["gpu"]["status"] == "WARN" and "no CUDA device" in checks["gpu"]["detail"]
    assert done.code == (1 if any(c["status"] == "FAIL" for c in checks.values()) else 0)
    text = cli("doctor").out
    assert text.splitlines()[0].startswith("OK    python")
