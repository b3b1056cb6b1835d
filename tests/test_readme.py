"""The README's commands work as a new user types them: set-up, PATH, and example recipes that
stallfree itself does not warn about."""

from __future__ import annotations

import inspect
import re
import shlex
from pathlib import Path

from stallfree.cli import build_parser, resolve_recipe
from stallfree.data.demo import CLASSES, write_demo
from stallfree.train.build import steps_per_epoch

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _bash_blocks(text: str) -> list[list[str]]:
    """Each ```bash block as its commands: continuation lines joined, comments dropped."""
    blocks = []
    for body in re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        joined = re.sub(r"\\\n\s*", " ", body)
        blocks.append([shlex.split(line, comments=True) for line in joined.splitlines()
                       if line.strip() and not line.lstrip().startswith("#")])
    return blocks


def test_readme_train_examples_on_the_demo_data_run_past_their_warmup() -> None:
    """Every `stallfree train pipelines/demo.toml ...` example, with its flags and --set values,
    has more optimizer steps than warm-up steps (else stallfree warns that the LR never leaves
    warm-up): checked from the recipe and the demo data's size, without training."""
    train_images = len(CLASSES) * inspect.signature(write_demo).parameters["train_per_class"].default
    checked = []
    for block in _bash_blocks(README):
        for words in block:
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
