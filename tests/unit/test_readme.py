"""The README's and the manual's commands work as a new user types them: set-up, PATH, and
example recipes that stallfree itself does not warn about."""

from __future__ import annotations

import inspect
import shlex

from doc_pages import REPO, bash_lines, pages, shell_commands

from stallfree.cli import build_parser, resolve_recipe
from stallfree.data.tools.demo import CLASSES, write_demo
from stallfree.train.assemble import steps_per_epoch

README = (REPO / "README.md").read_text()


def test_train_examples_on_the_demo_data_run_past_their_warmup() -> None:
    """Every one-process `stallfree train pipelines/demo.toml ...` example in the README and the
    manual, with its flags and --set values, has more optimizer steps than warm-up steps (else
    stallfree warns that the LR never leaves warm-up): checked from the recipe and the demo
    data's size, without training."""
    train_images = len(CLASSES) * inspect.signature(write_demo).parameters["train_per_class"].default
    checked = []
    for text in pages().values():
        for words in shell_commands(text):
            if words[:2] != ["stallfree", "train"] or not words[2].endswith("demo.toml"):
                continue
            args = build_parser().parse_args(words[1:])
            args.recipe = str(REPO / args.recipe)
            recipe = resolve_recipe(args)
            batches = train_images // recipe.train.batch_size  # one rank, drop-last
            total = recipe.train.epochs * steps_per_epoch(batches, recipe.train.accum_steps)
            assert recipe.optim.warmup_steps < total, f"{shlex.join(words)}: {total} steps"
            checked.append(words)
    assert any("train.accum_steps=4" in w for words in checked for w in words), checked


def test_setup_is_two_commands_and_usage_starts_by_putting_stallfree_on_path() -> None:
    """`make demo` and `make test` are the set-up; the usage commands that follow need
    .venv/bin on PATH, so the README activates it before its first `stallfree` command."""
    blocks = bash_lines(README)
    assert blocks[0] == [["make", "demo"], ["make", "test"]]
    commands = [words for block in blocks[1:] for words in block]
    first = next(i for i, words in enumerate(commands) if words[0] == "stallfree")
    assert ["source", ".venv/bin/activate"] in commands[:first]


def test_where_the_docs_show_mlflow_they_say_how_to_read_the_store() -> None:
    """MLflow 3 refuses a file store without MLFLOW_ALLOW_FILE_STORE=true, and the track extra's
    mlflow-skinny has no `mlflow ui` (no flask): both said in the tracker's paragraph (in the
    README or the manual page that holds it)."""
    text = "\n\n".join(pages().values())
    (paragraph,) = [p for p in text.split("\n\n") if "train.trackers = [" in p]
    assert "MLFLOW_ALLOW_FILE_STORE=true" in paragraph
    assert "pip install mlflow" in paragraph and "mlflow ui" in paragraph
