"""The public API (`stallfree.__all__`) as a contract: its names and signatures, a light import,
and `stallfree.loader` giving the loaders `stallfree train` builds, in the same order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_api import BACKENDS, _recipe_file


@pytest.mark.e2e
def test_import_stallfree_does_not_import_torch() -> None:
    """`import stallfree` stays light: the CLI reports a bad recipe before torch loads."""
    code = "import sys, stallfree; stallfree.loader; assert 'torch' not in sys.modules, 'torch'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.e2e
def test_a_loader_is_built_without_the_training_stack() -> None:
    """`stallfree.loader()` builds the run's settings, never the Trainer, model or optimizer."""
    code = (
        "import sys, stallfree\n"
        "recipe = {'loader': {'backend': 'synthetic'}, 'augment': {'image_size': 32, 'resize_size': 36},"
        " 'data': {'synthetic_samples': 16}, 'train': {'batch_size': 8, 'device': 'cpu'}}\n"
        "with stallfree.loader(recipe) as loader:\n"
        "    assert next(iter(loader)).images.shape == (8, 3, 32, 32)\n"
        "heavy = {'stallfree.train.trainer', 'stallfree.models', 'stallfree.train.schedule'}\n"
        "assert not heavy & set(sys.modules), heavy & set(sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


_CLOSED = """
import sys
import stallfree
from stallfree.errors import StallfreeError

loader = stallfree.loader(sys.argv[1], overrides=sys.argv[2:])
live = iter(loader)
next(live)
loader.close()
for name, attempt in (("a new iteration", lambda: next(iter(loader))), ("a live one", lambda: next(live))):
    try:
        attempt()
        print(name, "iterated")
    except StallfreeError as exc:
        print(name, "refused:", exc)
"""


@pytest.mark.e2e
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_closed_loader_refuses_to_iterate_and_python_exits(
    image_root: Path, tmp_path: Path, backend: str
) -> None:
    """Iterating a closed loader, anew or an iterator taken before close(), is one clear error;
    the interpreter then exits (a torch loader with workers once hung at exit)."""
    path = _recipe_file(image_root, tmp_path, backend)
    counts = ["loader.torch.workers=1"] if backend == "torch" else ["loader.dali.threads=1"]
    done = subprocess.run(
        [sys.executable, "-c", _CLOSED, str(path), *counts], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2 and all("refused: " in line and "closed" in line for line in lines), lines
