"""Recipe loading, overrides and validation fail early with errors that name the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_recipe import REPO


@pytest.mark.e2e
@pytest.mark.parametrize("path", sorted((REPO / "pipelines").glob("imagenet-*.toml")), ids=lambda p: p.name)
def test_imagenet_recipes_run_one_cpu_step(path: Path, image_root: Path) -> None:
    from itertools import islice

    from helpers import one_step_trainer

    _, loader, trainer = one_step_trainer(
        path, image_root, ["augment.image_size=32", "augment.resize_size=36", "augment.val_image_size=0"]
    )
    trainer.train_batches(islice(iter(loader), 1), 1)
    assert trainer.optimizer_steps == 1


# The CLI's entry, then whether torch was imported: a recipe error must not wait for it.
_CLI_THEN_MODULES = (
    "import sys\nfrom stallfree.cli import main\nrc = main(sys.argv[1:])\n"
    "print('torch imported:', 'torch' in sys.modules)\nsys.exit(rc)\n"
)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("args", "body", "needle"),
    [
        (["train"], "[train]\nepochs = 0\n", "train.epochs = 0 must be >= 1"),
        (["train"], '[data]\nroot = "{tmp}/nope"\n', "data.root {tmp}/nope does not exist"),
        (["train"], '[data]\nroot = "{tmp}"\n', "no train/ folder"),
        (
            ["train"],
            '[data]\nroot = "{root}"\nfile_list = "{tmp}/list.txt"\n',
            "data.file_list {tmp}/list.txt does not exist",
        ),
        (
            ["train"],
            '[data]\nroot = "{root}"\n[model]\ninit_from = "{tmp}/w.pt"\n',
            "model.init_from = {tmp}/w.pt: no such file",
        ),
        (
            ["eval", "--checkpoint", "{tmp}/ckpt.pt"],
            '[data]\nroot = "{tmp}/nope"\n',
            "data.root {tmp}/nope does not exist",
        ),
    ],
)
def test_a_bad_recipe_or_path_is_named_before_torch_is_imported(
    tmp_path: Path, image_root: Path, args: list[str], body: str, needle: str
) -> None:
    import subprocess
    import sys

    def fill(text: str) -> str:
        return text.format(tmp=tmp_path, root=image_root)

    recipe = tmp_path / "bad.toml"
    recipe.write_text(fill(body))
    command, *flags = args
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _CLI_THEN_MODULES,
            command,
            str(recipe),
            *map(fill, flags),
            "--out",
            str(tmp_path / "run"),
        ][: None if command == "train" else -2],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 2 and len(errors) == 1, done.stderr[-2000:]
    assert fill(needle) in errors[0] and str(recipe) in errors[0]
    assert "torch imported: False" in done.stdout
    assert not (tmp_path / "run").exists()
