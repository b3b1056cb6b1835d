"""The README and the manual in docs/ cannot drift from the code: every stallfree command they
show parses with today's CLI and its recipe keys exist, every script they run is there, every
link lands, every page says what it is for, and CHANGELOG.md names the current version."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
from doc_pages import REPO, manual_pages, pages, python_blocks, shell_commands, stallfree_argv

import stallfree
from stallfree.cli import build_parser, resolve_recipe
from stallfree.recipe import RecipeError, apply_overrides, load_recipe, validate
from stallfree.train.checkpoint.format import FORMAT

README = REPO / "README.md"
CHANGELOG = REPO / "CHANGELOG.md"


def _parse(argv: list[str], where: str) -> argparse.Namespace | None:
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse's way of refusing; --help exits 0
        if exc.code == 0 and "--help" in argv:
            return None
        raise AssertionError(f"{where}: `stallfree {shlex.join(argv)}` no longer parses") from exc


def _check_recipe(args: argparse.Namespace, where: str) -> None:
    """A command's recipe file and --set keys as stallfree resolves them, without running it."""
    recipe_path = getattr(args, "recipe", None)
    if not recipe_path or not (REPO / recipe_path).is_file():
        return  # a recipe the reader writes, or eval's checkpoint recipe
    args.recipe = str(REPO / recipe_path)
    try:
        if args.command in ("train", "eval"):
            resolve_recipe(args)
        else:  # bench: no --loader or --epochs flags
            validate(apply_overrides(load_recipe(args.recipe), args.overrides))
    except RecipeError as exc:
        raise AssertionError(f"{where}: {exc}") from exc


def _subcommand(argv: list[str]) -> str:
    words = [w for w in argv if not w.startswith("-")][:2]
    return " ".join(words) if words[:1] == ["data"] else words[0] if words else ""


def test_every_documented_stallfree_command_parses_with_keys_that_exist() -> None:
    """Each `stallfree ...` (or `python -m` / `torchrun -m stallfree ...`) line of a bash block
    in the README or the manual is accepted by today's parser, and where it names a recipe
    in the repository, its flags and --set keys resolve; every command is shown somewhere."""
    shown = set()
    for name, text in pages().items():
        for command in shell_commands(text):
            argv = stallfree_argv(command)
            if argv is None:
                continue
            where = f"{name}: {shlex.join(command)}"
            args = _parse(argv, name)
            if args is not None:
                _check_recipe(args, where)
            shown.add(_subcommand(argv))
    commands = {"train", "bench", "eval", "compare", "export", "predict", "doctor"}
    commands |= {"data demo", "data check", "data pack"}
    assert commands <= shown, sorted(commands - shown)


def test_a_bad_command_in_a_page_would_be_caught() -> None:
    """The check above fails on a flag the CLI does not have and on a recipe key that is not."""
    with pytest.raises(AssertionError, match="no longer parses"):
        _parse(["train", "pipelines/demo.toml", "--loaders", "torch"], "page.md")
    args = _parse(["train", "pipelines/demo.toml", "--set", "train.batchsize=3"], "page.md")
    assert args is not None
    with pytest.raises(AssertionError, match="page.md: .*batchsize"):
        _check_recipe(args, "page.md")


def test_every_script_the_docs_run_is_in_the_repository() -> None:
    """`python X.py`, `bash X.sh` and `sbatch X` in a bash block name files that exist."""
    checked = []
    for name, text in pages().items():
        for command in shell_commands(text):
            if Path(command[0]).name.startswith("python") or command[0] in ("bash", "sbatch"):
                scripts = [w for w in command[1:2] if re.search(r"\.(py|sh|sbatch)$", w)]
                for script in scripts:
                    assert (REPO / script).is_file(), f"{name}: {shlex.join(command)}"
                    checked.append(script)
    assert "benchmarks/gpu_check.sh" in checked


def _headings(text: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.findall(r"^#+ (.+?)\s*$", text, re.MULTILINE)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_every_link_in_the_docs_lands() -> None:
    """Relative links (and their #anchors into Markdown) in the README, the manual and the
    changelog point at files and headings that exist."""
    for path in [README, CHANGELOG, *manual_pages()]:
        text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.MULTILINE | re.DOTALL)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            assert linked.exists(), f"{path.name}: {target}"
            if anchor and linked.suffix == ".md":
                slugs = {_slug(h) for h in _headings(linked.read_text())}
                assert anchor in slugs, f"{path.name}: {target} (anchors: {sorted(slugs)})"


def test_each_manual_page_says_what_it_is_for_shows_a_command_and_links_back() -> None:
    """A page opens with a link back to the README and what the reader can do with it, and has a
    command to run; the README stays short and lists every page."""
    readme = README.read_text()
    assert len(readme.splitlines()) <= 250
    for page in [*manual_pages(), REPO / "docs/DESIGN.md"]:
        assert f"](docs/{page.name})" in readme, f"README has no link to docs/{page.name}"
    for page in manual_pages():
        paragraphs = page.read_text().split("\n\n")
        assert paragraphs[0].startswith("# "), page.name
        assert "](../README.md)" in paragraphs[1], page.name
        assert paragraphs[2].startswith("With this page you can"), page.name
        assert shell_commands(page.read_text()), f"{page.name} shows no command"


def test_every_python_block_names_the_test_that_runs_it() -> None:
    """A ```python block in the README or the manual is run by a test: the comment above it
    names the test module, which looks the block up by the comment's first word."""
    for name, text in pages().items():
        for marker, _ in python_blocks(text):
            assert marker, f"{name}: a python block without a comment naming its test"
            key = marker.split(":")[0]
            (module,) = re.findall(r"tests/[\w/]+\.py", marker)
            assert f'"{key}' in (REPO / module).read_text(), f"{name}: {module} does not run {key}"


def test_changelog_names_the_current_version_and_checkpoint_format() -> None:
    """The newest entry of CHANGELOG.md is this version's, and it names the checkpoint format
    this version writes: a version or format bump comes with its entry."""
    entries = re.split(r"^## ", CHANGELOG.read_text(), flags=re.MULTILINE)[1:]
    newest = entries[0]
    assert newest.split()[0] == stallfree.__version__, newest.splitlines()[0]
    assert f"format {FORMAT}" in newest


# Every ## section of the README before it became a short page and the manual: where each went.
FORMER_SECTIONS = {
    "Results": ("README.md", "Results"),
    "Set-up": ("README.md", "Set-up"),
    "Usage": ("README.md", "Usage"),
    "Recipes": ("docs/recipes.md", "Recipes"),
    "Checking data, and bad files during training": (
        "docs/data.md",
        "Checking data, and bad files during training",
    ),
    "Tar shards (WebDataset)": ("docs/data.md", "Tar shards (WebDataset)"),
    "Training from an object store": ("docs/object-stores.md", "Training from an object store"),
    "Evaluating a checkpoint": ("docs/eval-predict-export.md", "Evaluating a checkpoint"),
    "Training": ("docs/recipes.md", "Training"),
    "Multi-GPU and multi-node": ("docs/multi-node.md", "Multi-GPU and multi-node"),
    "The loaders in your own loop (Python API)": (
        "docs/python-api.md",
        "The loaders in your own loop (Python API), and Lightning",
    ),
    "Docker": ("docs/multi-node.md", "Docker"),
    "Slurm": ("docs/resume.md", "Slurm"),
    "Checkpoints, resume and preemption": ("docs/resume.md", "Checkpoints, resume, preemption and Slurm"),
    "Benchmarks and profiling": ("docs/benchmarks.md", "Benchmarks, profiling and the doctor"),
    "Doctor": ("docs/benchmarks.md", "Doctor"),
    "GPU check": ("docs/gpu-check.md", "The GPU check"),
    "How the code is laid out": ("README.md", "How the code is laid out"),
}


@pytest.mark.parametrize("section", FORMER_SECTIONS)
def test_every_former_readme_section_has_a_home(section: str) -> None:
    page, heading = FORMER_SECTIONS[section]
    assert heading in _headings((REPO / page).read_text()), f"{section}: no '{heading}' in {page}"
