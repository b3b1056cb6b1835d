"""The CLI's answers to a user: help, version and one-line errors, run in this process (`cli`).

tests/e2e/test_cli_runner.py checks that a command ends here as it does in a process of its own.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import small_recipe
from inprocess import Cli

from stallfree.data.tools.demo import write_demo
from stallfree.recipe import dump_toml


def test_cli_errors_name_the_problem(tmp_path: Path, cli: Cli) -> None:
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text('[data]\nroot = "/nonexistent/demo"\n')
    done = cli("train", recipe_path, "--no-progress")
    assert done.code == 2
    assert "data.root /nonexistent/demo does not exist" in done.err and "stallfree data demo" in done.err
    done = cli("train", recipe_path, "--set", "train.epoch=2")
    assert done.code == 2
    assert "unknown key 'train.epoch'" in done.err


def _cli_case(root: Path, tmp_path: Path, case: str) -> tuple[list[str], str]:
    """(extra CLI arguments, a piece of the one-line error) for a user mistake."""
    if case == "empty_class":
        (root / "train" / "zz_empty").mkdir()
        return [], "zz_empty has no images"
    if case == "out_is_a_file":
        (tmp_path / "afile").write_text("x")
        return ["--out", str(tmp_path / "afile")], "is a file"
    cases = {
        "cuda_without_gpu": (["--device", "cuda"], "CUDA is not available"),
        "misspelt_loader": (["--loader", "dalli"], "unknown loader backend 'dalli'"),
        "missing_resume_file": (["--resume", str(tmp_path / "nope.pt")], "does not exist"),
        "resume_a_directory": (["--resume", str(tmp_path)], "is a directory"),
        "batch_over_split": (
            ["--set", "train.batch_size=1000"],
            "more than the 20 images of the training split",
        ),
        "moved_key": (["--set", "loader.workers=2"], "moved to 'loader.torch.workers'"),
        "across_keys": (
            ["--set", 'augment.auto_augment="randaugment"', "--set", "augment.magnitude_bins=5"],
            "r.toml with its flags and --set overrides: augment.randaugment_m = 9",
        ),
        "unwritable_out": (["--out", "/proc/stallfree-run"], "cannot write"),
    }
    return cases[case]


@pytest.fixture(scope="module")
def tiny_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A demo ImageFolder of 2 train and 1 val images a class, drawn once for the module."""
    return write_demo(tmp_path_factory.mktemp("tiny"), train_per_class=2, val_per_class=1, progress=False)


@pytest.mark.parametrize(
    "case",
    [
        "cuda_without_gpu",
        "misspelt_loader",
        "missing_resume_file",
        "resume_a_directory",
        "batch_over_split",
        "moved_key",
        "across_keys",
        "unwritable_out",
        "out_is_a_file",
        "empty_class",
    ],
)
def test_user_errors_end_in_one_line_and_write_nothing(
    tmp_path: Path, tiny_demo: Path, case: str, cli: Cli
) -> None:
    if case == "cuda_without_gpu" and __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    root = Path(shutil.copytree(tiny_demo, tmp_path / "data"))  # a case may change its copy
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text(dump_toml(small_recipe(root)))
    extra, needle = _cli_case(root, tmp_path, case)
    out = ["--out", str(tmp_path / "run")] if "--out" not in extra else []
    # In-process: an escaping exception fails the test as a traceback would.
    done = cli("train", recipe_path, "--no-progress", *out, *extra)
    assert done.code == 2, done.err[-2000:]
    lines = done.errors()
    assert len(lines) == 1 and needle in lines[0], done.err[-2000:]
    assert "Traceback" not in done.err
    assert not (tmp_path / "run").exists()  # validated before anything was written


def test_bare_command_prints_help_and_version(cli: Cli) -> None:
    from stallfree import __version__

    done = cli()
    assert done.code == 0
    for command in ("train", "data", "bench", "eval", "compare", "doctor"):
        assert f"\n    {command} " in done.out
    assert "stallfree doctor" in done.out and "--loader auto" in done.out  # where to start
    done = cli("--version")
    assert done.code == 0 and done.out.strip() == f"stallfree {__version__}"
