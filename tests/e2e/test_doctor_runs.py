"""`stallfree doctor`, and the diagnoses a bare GPU machine would meet, built here on the CPU:
no tomli-w, DALI without one of its Python dependencies, a DALI that cannot load nvImageCodec,
and a bench run that "worked" while warning about nvjpeg."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers import PYTHON, small_recipe

from stallfree.recipe import dump_toml

pytestmark = pytest.mark.e2e  # every test here trains a run or starts a process


def _blocked(tmp_path: Path, *modules: str) -> dict[str, str]:
    """An environment where importing `modules` fails as if they were not installed."""
    stubs = tmp_path / "blocked"
    stubs.mkdir(exist_ok=True)
    for name in modules:
        (stubs / f"{name}.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n"
        )
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(stubs), os.environ.get("PYTHONPATH", "")]),
        "STALLFREE_CACHE": str(tmp_path / "cache"),
    }


def _stallfree(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PYTHON, "-m", "stallfree", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


def test_without_tomli_w_doctor_warns_and_training_still_writes_its_recipe(
    image_root: Path, tmp_path: Path
) -> None:
    env = _blocked(tmp_path, "tomli_w")
    # doctor runs beside the training (each with its own cache): two processes, one wait.
    doctor = subprocess.Popen(
        [PYTHON, "-m", "stallfree", "doctor"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**env, "STALLFREE_CACHE": str(tmp_path / "doctor-cache")},
    )
    recipe = tmp_path / "r.toml"
    recipe.write_text(dump_toml(small_recipe(image_root, train={"batch_size": 8})))
    done = _stallfree(env, "train", str(recipe), "--out", str(tmp_path / "run"), "--no-progress")
    assert "WARN  tomli-w" in doctor.communicate(timeout=300)[0]
    assert done.returncode == 0, done.stderr[-2000:]
    assert "[train]" in (tmp_path / "run" / "recipe.toml").read_text()


@pytest.mark.dali
def test_dali_without_optree_is_named_by_doctor_and_by_train(image_root: Path, tmp_path: Path) -> None:
    env = _blocked(tmp_path, "optree")
    doctor = _stallfree(env, "doctor")
    assert doctor.returncode == 1
    assert (
        "FAIL  dali            installed but cannot import: missing module 'optree'" in doctor.stdout
        and "pip install optree" in doctor.stdout
    )
    recipe = tmp_path / "r.toml"
    recipe.write_text(dump_toml(small_recipe(image_root, loader={"backend": "dali"})))
    done = _stallfree(env, "train", str(recipe), "--out", str(tmp_path / "run"), "--no-progress")
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 2 and len(errors) == 1 and "missing module 'optree'" in errors[0]
    assert "Traceback" not in done.stderr


@pytest.mark.dali
def test_a_library_dali_cannot_load_is_not_blamed_on_an_image(
    image_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What DALI says when nvImageCodec is missing from its tree: every pipeline fails to build.
    The first, perfectly good JPEG was named as a bad file before."""
    import stallfree.data.backends.dali_probe as probe
    from stallfree.data.backends.dali_probe import DaliEnvironmentError, first_undecodable

    message = (
        "Critical error when building pipeline:\nError in CPU operator "
        "`nvidia.dali.fn.decoders.image`: dlopen libnvimgcodec.so.0 failed!"
    )

    class Unbuildable:
        def build(self) -> None:
            raise RuntimeError(message)

    monkeypatch.setattr(probe, "_probe_pipeline", lambda paths: Unbuildable())
    good = str(next(image_root.rglob("*.jpg")))
    with pytest.raises(DaliEnvironmentError, match="install nvidia-nvimgcodec"):
        first_undecodable([good])
    assert "nvjpeg" in str(probe.environment_problem("Failed to load nvjpeg library"))
    assert probe.environment_problem("Premature end of JPEG file") is None  # a file's fault


def test_a_bench_run_that_warned_is_shown_even_when_it_finished(tmp_path: Path) -> None:
    from stallfree.bench.report import markdown, summarise

    record = {
        "backend": "dali",
        "mode": "loader",
        "knob": 2,
        "repeat": 0,
        "images_per_s": 900.0,
        "cpu_cores": 1.0,
        "peak_pss_mb": 500.0,
        "stderr": "[/opt/dali/nvjpeg.cc:12] Warning: Failed to load nvjpeg, falling back to the CPU decoder",
    }
    result = {
        "machine": {
            "cpu": "x",
            "cores_available": 2,
            "gpu": None,
            "torch": "t",
            "dali": "d",
            "python": "p",
            "cpu_native_bf16": False,
        },
        "limit": None,
        "records": [record],
        "config": {
            "repeats": 1,
            "warmup": 1,
            "batches": 1,
            "batch_size": 8,
            "model": "small_cnn",
            "image_size": 32,
            "precision": "fp32",
            "data_root": "d",
        },
    }
    text = markdown(result, summarise(result), "stallfree bench")
    assert "Warnings from runs that finished" in text and "Failed to load nvjpeg" in text
