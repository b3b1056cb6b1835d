"""bench: the measurements on tiny data, the interleaved runner, and the report writer."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import PYTHON, small_recipe

from stallfree.bench.runner import (
    BenchConfig,
    run_bench,
)


@pytest.mark.slow
def test_run_bench_interleaves_in_fresh_processes(image_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", PYTHON)  # its children from the fork server: ~5 s each less
    config = BenchConfig(
        backends=["torch"],  # two knobs of one backend: 4 processes show the interleaving
        modes=["loader"],
        repeats=2,
        warmup=1,
        batches=2,
        workers=[0, 1],
        limit_files=30,
        limit_passes=2,
    )
    strict = small_recipe(image_root, loader={"torch": {"exact_decode": True}})
    result = run_bench(strict, config, progress=False)
    assert result["config"]["exact_decode"] is True
    order = [(r["repeat"], r["backend"], r["knob"]) for r in result["records"]]
    assert order == [
        (0, "torch", "0"),
        (0, "torch", "1"),
        (1, "torch", "0"),
        (1, "torch", "1"),
    ]
    assert all("error" not in r for r in result["records"]), result["records"]
    limit = result["limit"]
    assert limit["images_per_s"] > 0 and limit["runs"] == 2
    # Every path the machine has, several passes each, and the spread of the fastest.
    assert {"pil", "fast", "dali"} <= set(limit["single_thread"])
    assert len(limit["passes"]["pil"]) == 2 * 2
    low, high = limit["spread"]
    assert low <= limit["images_per_s"] <= high


@pytest.mark.e2e
def test_profile_writes_a_trace(image_root: Path, tmp_path: Path) -> None:
    from stallfree.train.run import train

    recipe = small_recipe(image_root, train={"epochs": 2, "batch_size": 4})
    train(recipe, tmp_path, progress=False, profile_steps=2)
    assert (tmp_path / "profile" / "trace.json").stat().st_size > 1000
    assert "Name" in (tmp_path / "profile" / "top_ops.txt").read_text()


def _gpu_check(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """Run gpu_check.sh in its own process group, killed whole if it overruns: a check that
    failed to stop early must not leave a benchmark running after the test."""
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"
    proc = subprocess.Popen(
        ["bash", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHON": PYTHON, **env},
    )
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"gpu_check.sh did not stop within 120 s: {err[-2000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.e2e
def test_gpu_check_fails_loudly_when_dali_is_required_but_missing(tmp_path: Path) -> None:
    # A regular package named `nvidia` first on the path hides the installed nvidia.dali.
    (tmp_path / "nodali" / "nvidia").mkdir(parents=True)
    (tmp_path / "nodali" / "nvidia" / "__init__.py").write_text("")
    result = _gpu_check(
        tmp_path,
        DEVICE="cpu",
        REQUIRE_DALI="1",
        PYTHONPATH=str(tmp_path / "nodali"),
        OUT_DIR=str(tmp_path / "out"),
    )
    assert result.returncode == 1
    assert "REQUIRE_DALI=1 but nvidia.dali does not import" in result.stderr
    assert "No module named 'nvidia.dali'" in result.stderr  # the import error, not hidden
    assert "dali" in (tmp_path / "out" / "doctor.txt").read_text()  # doctor ran first...
    assert not (tmp_path / "out" / "loader").exists()  # ...and nothing was measured


@pytest.mark.e2e
def test_gpu_check_refuses_an_empty_wheelhouse(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    result = _gpu_check(
        tmp_path, DEVICE="cpu", WHEELHOUSE=str(tmp_path / "wheels"), OUT_DIR=str(tmp_path / "out")
    )
    assert result.returncode == 1 and "holds no .whl files" in result.stderr
