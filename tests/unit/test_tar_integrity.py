"""Tar shards that cannot train on wrong labels: each corruption an interrupted re-pack, an
edited index or a swapped file leaves is one line naming the shard (and member), never a
silent wrong label or a silently shorter epoch. And other people's WebDataset shards."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import build_loader, small_recipe
from inprocess import Cli

from stallfree.cli import main
from stallfree.data.readers.factory import resolve_dataset
from stallfree.data.readers.tarshards import ShardError
from stallfree.recipe import DataConfig

CPU = torch.device("cpu")


def _pack(root: Path, out: Path, seed: int = 0, size: str = "200KB") -> Path:
    assert (
        main(
            ["data", "pack", str(root), str(out), "--shard-size", size, "--seed", str(seed), "--no-progress"]
        )
        == 0
    )
    return out


def _resolve(root: Path) -> None:
    resolve_dataset(DataConfig(root=str(root), format="tar"))


@pytest.fixture()
def packed(image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))  # no check remembered
    return _pack(image_root, tmp_path / "packed")


def _manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


def _idx(root: Path, n: int = 0) -> Path:
    return root / _manifest(root)["splits"]["train"]["shards"][n]["name"].replace(".tar", ".idx")


def test_shards_of_another_pack_under_this_manifest(image_root: Path, packed: Path, tmp_path: Path) -> None:
    other = _pack(image_root, tmp_path / "other", seed=1)  # what an interrupted re-pack leaves
    for path in other.glob("train-*"):
        shutil.copy(path, packed / path.name)
    with pytest.raises(ShardError, match=r"train-\d+\.tar"):  # its size, or a .cls
        _resolve(packed)


def test_a_label_that_disagrees_with_its_cls_member(packed: Path) -> None:
    """Sizes, counts and indexes all right: only reading the .cls members back can tell."""
    manifest = _manifest(packed)
    labels = manifest["splits"]["train"]["labels"]
    first = next(i for i, label in enumerate(labels) if label != labels[0])
    labels[0], labels[first] = labels[first], labels[0]
    (packed / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ShardError, match=r"train-\d+\.tar::train\d+\.jpg: its \.cls says"):
        _resolve(packed)


def test_two_offsets_swapped_in_an_index(packed: Path) -> None:
    idx = _idx(packed)
    lines = idx.read_text().splitlines()
    a, b = lines[1].split(), lines[2].split()
    a[1], b[1] = b[1], a[1]
    idx.write_text("\n".join([lines[0], " ".join(a), " ".join(b), *lines[3:]]) + "\n")
    with pytest.raises(ShardError, match=r"train-000000\.tar::train\d+\.jpg"):
        _resolve(packed)


def test_one_shard_replaced_by_another(packed: Path) -> None:
    shards = _manifest(packed)["splits"]["train"]["shards"]
    for suffix in (".tar", ".idx"):
        shutil.copy(
            packed / shards[1]["name"].replace(".tar", suffix),
            packed / shards[0]["name"].replace(".tar", suffix),
        )
    with pytest.raises(ShardError, match=r"train-000000\.(tar|idx)"):
        _resolve(packed)


def test_an_index_listing_only_some_members(packed: Path) -> None:
    idx = _idx(packed)
    lines = idx.read_text().splitlines()
    idx.write_text(f"v1.2 2\n{lines[1]}\n{lines[2]}\n")
    with pytest.raises(ShardError, match=r"train-000000\.idx: 2 samples, the manifest says"):
        _resolve(packed)


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda t: t.replace("train000000000", "train-1", 2), "not a trainNNN key"),
        (lambda t: t.replace("jpg ", "jpg x", 1), "offsets and sizes must be integers"),
    ],
)
def test_bad_keys_and_fields_in_an_index(packed: Path, edit, needle: str) -> None:
    idx = next(p for p in packed.glob("train-*.idx") if "train000000000" in p.read_text())
    idx.write_text(edit(idx.read_text()))
    with pytest.raises(ShardError, match=needle):
        _resolve(packed)


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda m: '{"format": ', "not valid JSON"),
        (lambda m: json.dumps({**m, "splits": {"train": m["splits"]["train"]}}), "no complete 'val'"),
        (
            lambda m: json.dumps(
                {
                    **m,
                    "splits": {
                        **m["splits"],
                        "train": {**m["splits"]["train"], "labels": m["splits"]["train"]["labels"][:5]},
                    },
                }
            ),
            "5 labels for 60 samples",
        ),
    ],
)
def test_a_broken_manifest_is_one_line(packed: Path, edit, needle: str, cli: Cli) -> None:
    (packed / "manifest.json").write_text(edit(_manifest(packed)))
    recipe = packed.parent / "r.toml"
    from stallfree.recipe import dump_toml

    recipe.write_text(dump_toml(small_recipe(packed, data={"format": "tar"})))
    done = cli("train", recipe, "--out", packed.parent / "run", "--no-progress")
    assert done.code == 2
    err = done.err
    assert needle in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


def test_pack_is_all_or_nothing(
    image_root: Path, tmp_path: Path, cli: Cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "afile").write_text("x")
    done = cli("data", "pack", image_root, tmp_path / "afile", "--no-progress")
    assert done.code == 2
    assert "is a file" in done.err
    full = _pack(image_root, tmp_path / "full")
    done = cli("data", "pack", image_root, full, "--no-progress")
    assert done.code == 2
    assert "is not empty" in done.err
    # Interrupted mid-pack (Ctrl-C after the train split): nothing at OUT, and no half-written
    # folder left behind.
    import stallfree.data.tools.pack as pack

    real = pack.pack_split

    def interrupted(samples: object, out: Path, split: str, *args: object, **kwargs: object) -> object:
        if split == "val":
            raise KeyboardInterrupt
        return real(samples, out, split, *args, **kwargs)

    monkeypatch.setattr(pack, "pack_split", interrupted)
    out = tmp_path / "killed"
    with pytest.raises(KeyboardInterrupt):
        pack.pack_dataset(image_root, out, shard_bytes=200000, progress=False)
    assert not out.exists() and not list(tmp_path.glob(".killed*"))


def _webdataset_shards(image_root: Path, out: Path) -> dict[str, list[int]]:
    """Shards written by the webdataset package's TarWriter: ROOT/{train,val}/*.tar."""
    wds = pytest.importorskip("webdataset")
    classes = sorted(p.name for p in (image_root / "train").iterdir())
    labels: dict[str, list[int]] = {}
    for split in ("train", "val"):
        (out / split).mkdir(parents=True)
        files = sorted((image_root / split).glob("*/*.jpg"))
        labels[split] = []
        for part in range(2):
            with wds.TarWriter(str(out / split / f"shard-{part}.tar")) as sink:
                for i, path in enumerate(files[part::2]):
                    label = classes.index(path.parent.name)
                    sink.write({"__key__": f"s{part}_{i:05d}", "jpg": path.read_bytes(), "cls": label})
                    labels[split].append(label)
    return labels


@pytest.mark.parametrize("backend", ["torch", pytest.param("dali", marks=pytest.mark.dali)])
def test_other_peoples_webdataset_shards_train_with_their_cls_labels(
    image_root: Path, tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))
    written = _webdataset_shards(image_root, tmp_path / "wds")
    dataset = resolve_dataset(DataConfig(root=str(tmp_path / "wds"), format="tar"))
    assert dataset.num_classes == 10
    assert sorted(dataset.splits["val"].labels.tolist()) == sorted(written["val"])
    recipe = small_recipe(
        tmp_path / "wds", data={"format": "tar"}, loader={"backend": backend}, train={"batch_size": 5}
    )
    loader = build_loader(recipe, "val", device=CPU)
    got = [label for batch in loader for label in batch.labels.tolist()]
    loader.close()
    assert got == dataset.splits["val"].labels.tolist()  # every val sample once, in order
    assert sorted(got) == sorted(written["val"])
    # A second start reads the cached index and labels, not the shards' headers.
    import stallfree.data.readers.webdataset as foreign

    monkeypatch.setattr(foreign, "_group", None)
    again = resolve_dataset(DataConfig(root=str(tmp_path / "wds"), format="tar"))
    assert again.splits["train"].labels.tolist() == dataset.splits["train"].labels.tolist()


def test_a_foreign_image_without_cls_is_named(tmp_path: Path) -> None:
    import tarfile

    from PIL import Image

    jpeg = io.BytesIO()
    Image.new("RGB", (8, 8)).save(jpeg, "JPEG")
    for split in ("train", "val"):
        (tmp_path / split).mkdir()
        with tarfile.open(tmp_path / split / "a.tar", "w") as tar:
            for name, data in (("k1.jpg", jpeg.getvalue()), ("k1.cls", b"0"), ("k2.jpg", jpeg.getvalue())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ShardError, match=r"k2\.jpg has 0 \.cls members"):
        _resolve(tmp_path)
