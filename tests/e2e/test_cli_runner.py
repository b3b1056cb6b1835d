"""The `cli` fixture (a command in this process) ends as `python -m stallfree` does: the same
exit code, stdout and stderr, so a command test run in-process checks what a user sees."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from helpers import PYTHON
from inprocess import Cli, Result

# Off a terminal every log line starts with its time: the two runs differ there only.
_STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", re.MULTILINE)


def _process(*args: str) -> Result:
    done = subprocess.run(
        [PYTHON, "-m", "stallfree", *args], capture_output=True, text=True, timeout=120, check=False
    )
    return Result(done.returncode, done.stdout, done.stderr)


def _unstamped(result: Result) -> Result:
    return Result(result.code, result.out, _STAMP.sub("", result.err))


def _both(cli: Cli, *args: str) -> tuple[Result, Result]:
    """(in this process, in a process of its own), their log lines' times taken out."""
    return _unstamped(cli(*args)), _unstamped(_process(*args))


@pytest.mark.parametrize(
    "args",
    [["train", "{recipe}", "--no-progress"], ["train"], ["--version"]],
    ids=["recipe-error", "usage-error", "version"],
)
def test_a_command_ends_here_as_in_a_process(cli: Cli, tmp_path: Path, args: list[str]) -> None:
    recipe = tmp_path / "bad.toml"
    recipe.write_text("[train]\nepochs = 0\n")
    here, there = _both(cli, *(a.format(recipe=recipe) for a in args))
    assert here == there
    if args[0] == "train":
        assert here.code == 2 and not here.out
    if len(args) > 1:  # the recipe's error: one line naming the key and the file
        assert len(here.errors()) == 1 and "train.epochs = 0 must be >= 1" in here.errors()[0]


def test_data_demo_writes_and_says_the_same_here_as_in_a_process(cli: Cli, tmp_path: Path) -> None:
    flags = ["--train-per-class", "1", "--val-per-class", "1", "--no-progress"]
    here = cli("data", "demo", str(tmp_path / "here"), *flags)
    there = _process("data", "demo", str(tmp_path / "there"), *flags)
    assert (here.code, here.err) == (there.code, there.err) == (0, "")
    assert here.out.replace("here", "there") == there.out == f"demo data ready in {tmp_path / 'there'}\n"

    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    assert files(tmp_path / "here") == files(tmp_path / "there") != {}
