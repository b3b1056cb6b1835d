"""Class names travel with the weights (checkpoint, best.pt, export.json), and `stallfree
predict` uses them: a tiny run on 3 named classes predicts its own val images."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import small_recipe

from stallfree.data.tools.demo import draw_image
from stallfree.train.checkpoint import load_checkpoint, resolve_checkpoint
from stallfree.train.run import train

pytestmark = pytest.mark.e2e  # every test here trains a run or starts a process

# Not the demo's names and not in label order as written: the label map is train's sorted
# folder names, so "apple" is 0, "mango" 1 and "zebra" 2.
NAMES = ("zebra", "apple", "mango")
LABEL_ORDER = ["apple", "mango", "zebra"]


def _write_tree(root: Path, per_class: dict[str, int]) -> Path:
    for split, count in per_class.items():
        for shape, name in enumerate(NAMES):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                img = draw_image(shape, np.random.default_rng([shape, i, len(split)]))
                img.resize((img.width // 4, img.height // 4)).save(folder / f"{name}_{i}.jpg")
    return root


@pytest.fixture(scope="module")
def named_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(data root, run directory) of a 2-epoch run on 3 named classes: a few seconds."""
    base = tmp_path_factory.mktemp("named")
    root = _write_tree(base / "data", {"train": 6, "val": 3})
    recipe = small_recipe(root, train={"epochs": 2, "batch_size": 6})
    train(recipe, base / "run", progress=False)
    return root, base / "run"


def test_class_names_travel_with_the_weights(named_run: tuple[Path, Path], tmp_path: Path) -> None:
    """The checkpoint, best.pt and export.json list train's class names in label order."""
    from stallfree.cli import main

    _, run = named_run
    latest = load_checkpoint(resolve_checkpoint(run))
    best = load_checkpoint(run / "checkpoints" / "best.pt")
    assert latest["class_names"] == LABEL_ORDER
    assert best["class_names"] == LABEL_ORDER
    best_pt = str(run / "checkpoints" / "best.pt")
    assert main(["export", best_pt, "--out", str(tmp_path / "x"), "--format", "pt2"]) == 0
    info = json.loads((tmp_path / "x" / "export.json").read_text())
    assert info["class_names"] == LABEL_ORDER


def test_export_json_carries_the_val_transform(named_run: tuple[Path, Path], tmp_path: Path) -> None:
    """export.json has what preprocessing outside stallfree needs: the val resize and crop
    sides, mean and std (the recipe's), beside the class names."""
    from stallfree.train.export_weights import export_checkpoint

    _, run = named_run
    info = export_checkpoint(run / "checkpoints" / "best.pt", tmp_path / "x", formats=())
    assert (info["resize_size"], info["image_size"]) == (36, 32)
    assert info["mean"] == [0.485, 0.456, 0.406] and info["std"] == [0.229, 0.224, 0.225]
    assert json.loads((tmp_path / "x" / "export.json").read_text())["resize_size"] == 36


def _images_with_a_bad_one(root: Path, into: Path) -> Path:
    shutil.copytree(root / "val", into)
    (into / "mango" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    return into


def test_predict_names_the_trained_classes(
    named_run: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run directory predicts its own val images with best.pt through the val transform:
    the names are the trained ones, top-1 agrees with best.pt's val top-1, a bad file is one
    line naming it, the others are predicted, and the exit code says some failed."""
    from stallfree.cli import main

    root, run = named_run
    folder = _images_with_a_bad_one(root, tmp_path / "images")
    assert main(["predict", str(run), str(folder), "--json", "--top-k", "2", "--batch-size", "4"]) == 1
    out, err = capsys.readouterr()
    assert "best.pt" in err.splitlines()[0]
    records = [json.loads(line) for line in out.splitlines()]
    assert len(records) == 10
    failed = [r for r in records if "error" in r]
    assert [Path(r["path"]).name for r in failed] == ["broken.jpg"]
    done = [r for r in records if "top" in r]
    for r in done:
        assert len(r["top"]) == 2 and {t["class"] for t in r["top"]} <= set(LABEL_ORDER)
        assert 1 >= r["top"][0]["prob"] >= r["top"][1]["prob"] >= 0
    right = [Path(r["path"]).parent.name == r["top"][0]["class"] for r in done]
    best = load_checkpoint(run / "checkpoints" / "best.pt")
    assert sum(right) / len(right) == pytest.approx(best["val_top1"], abs=1e-6)

    assert main(["predict", str(run / "checkpoints" / "best.pt"), str(folder / "apple")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3  # --top-k 5 capped at the 3 classes
    assert all(line.count(",") == 2 and all(n in line for n in LABEL_ORDER) for line in lines)


def test_predict_names_a_bad_file_in_human_mode(
    named_run: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --json: one line per good image on stdout, the bad one named on stderr, and
    one line counting the files a folder holds that are not images, naming the first three."""
    from stallfree.cli import main

    root, run = named_run
    folder = _images_with_a_bad_one(root, tmp_path / "images")
    for name in ("a.txt", "b.txt", "c.csv", "d.md", "zebra/e.txt", ".hidden"):
        (folder / name).write_text("not an image")
    missing = tmp_path / "nope.jpg"
    assert main(["predict", str(run), str(folder), str(missing)]) == 1
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 9
    assert "broken.jpg" in err and "nope.jpg" in err
    skipped = [line for line in err.splitlines() if "a.txt" in line]
    assert len(skipped) == 1 and "5 files" in skipped[0] and "2 more" in skipped[0], err
    assert all(str(folder / name) in skipped[0] for name in ("a.txt", "b.txt", "c.csv")), skipped


def test_predict_says_when_a_folder_holds_no_images(
    named_run: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing to predict is one line naming the folder and a non-zero exit, never silence;
    an empty folder beside images is one failed input, named, the others predicted."""
    from stallfree.cli import main

    root, run = named_run
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (empty / "notes.txt").write_text("not an image")
    assert main(["predict", str(run), str(empty)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and str(empty) in err and "no image" in err
    assert len(err.strip().splitlines()) == 1
    assert main(["predict", str(run), str(root / "val" / "apple"), str(empty), "--json"]) == 1
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["path"] for r in records if "error" in r] == [str(empty)]
    assert sum("top" in r for r in records) == 3


def test_predict_names_a_device_it_does_not_know(
    named_run: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """--device gpu is an argument error naming the choices, as train's and eval's are."""
    from stallfree.cli import main

    root, run = named_run
    for command in (["predict", str(run), str(root / "val")], ["eval", "r.toml", "--checkpoint", str(run)]):
        with pytest.raises(SystemExit) as stop:
            main([*command, "--device", "gpu"])
        assert stop.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert "'gpu'" in last and all(name in last for name in ("auto", "cpu", "cuda")), last
