"""Every script in benchmarks/ runs: each at its `--smoke` size (a few files, seconds, the real
run's code path), so a signature the scripts call that changes fails here, not in front of the
next person who reproduces a figure of benchmarks/RESULTS.md."""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys

import pytest
from doc_pages import REPO

BENCHMARKS = REPO / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))


# `python benchmarks/X.py ARGS` (any python: python3, .venv/bin/python), a line's continuations
# joined, up to a closing backtick or the line's end.
COMMAND = re.compile(r"\bpython3?\s+benchmarks/(\w+\.py)([^`\n]*)")


class _Parsed(Exception):
    """What a script's parser made of a command, raised in place of running it."""

    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__()
        self.namespace = namespace


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(page, script, arguments) of every benchmarks/ command in the README, the manual and
    benchmarks/RESULTS.md; `...` (the rest, elided) dropped."""
    found = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), BENCHMARKS / "RESULTS.md"]:
        text = re.sub(r"\\\n\s*", " ", page.read_text())
        for script, rest in COMMAND.findall(text):
            words = [w for w in shlex.split(rest, comments=True) if w != "..."]
            found.append((str(page.relative_to(REPO)), script, words))
    return found


@pytest.fixture
def parse_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A script's `parse_args` raises what it parsed, so that running the script stops there."""
    real = argparse.ArgumentParser.parse_args

    def parse(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> argparse.Namespace:
        raise _Parsed(real(self, *args, **kwargs))  # type: ignore[arg-type]

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the scripts put their folders first
    monkeypatch.setattr(sys, "argv", list(sys.argv))


def check_arguments(script: str, words: list[str], where: str) -> None:
    """The script, run in this process under `parse_only`, accepts `words`."""
    assert script in SCRIPTS, f"{where}: no such script"
    sys.argv = [script, *words]
    try:
        runpy.run_path(str(BENCHMARKS / script), run_name="__main__")
    except _Parsed:
        return
    except SystemExit as exc:
        raise AssertionError(f"{where}: refused by its parser") from exc
    raise AssertionError(f"{where}: the script ran without parsing its arguments")


def test_every_documented_benchmark_command_parses_with_its_script(parse_only: None) -> None:
    """Each command the docs give for a figure names a script in benchmarks/ and only arguments
    its parser accepts."""
    commands = documented_commands()
    for page, script, words in commands:
        check_arguments(script, words, f"{page}: python benchmarks/{script} {shlex.join(words)}")
    assert {"scale.py", "val_parity.py", "s3_latency.py", "get_cost.py"} <= {s for _, s, _ in commands}


def test_a_bad_benchmark_command_would_be_caught(parse_only: None) -> None:
    with pytest.raises(AssertionError, match="refused by its parser"):
        check_arguments("scale.py", ["--samples", "100"], "page.md")
    with pytest.raises(AssertionError, match="no such script"):
        check_arguments("scales.py", [], "page.md")


def gpu_check_commands() -> list[list[str]]:
    """The `$PY -m stallfree ...` commands of gpu_check.sh as argv, `"${common[@]}"` expanded
    and every other shell variable replaced by its default there, or else a placeholder word."""
    text = re.sub(r"\\\n\s*", " ", (BENCHMARKS / "gpu_check.sh").read_text())
    (common,) = re.findall(r"^common=\((.*)\)$", text, re.MULTILINE)
    defaults = dict(re.findall(r"^(\w+)=\$\{\w+:-([^}]*)\}", text, re.MULTILINE))  # DEVICE=${DEVICE:-cuda}
    found = []
    for line in re.findall(r"^\s*\$PY -m stallfree (.*)$", text, re.MULTILINE):
        line = re.split(r"\s(?:\||>|\|\||&&)\s", line)[0].replace('"${common[@]}"', common)
        found.append(shlex.split(re.sub(r"\$\{?(\w+)\}?", lambda m: defaults.get(m[1], "X"), line)))
    return found


def test_gpu_check_runs_only_flags_stallfree_has() -> None:
    """What gpu_check.sh can be checked for without a GPU: its stallfree commands parse."""
    from stallfree.cli import build_parser

    commands = gpu_check_commands()
    for argv in commands:
        build_parser().parse_args(argv)  # argparse's SystemExit fails the test
    assert sum(argv[0] == "bench" for argv in commands) == 3, commands
