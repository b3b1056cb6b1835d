"""The Loader contract, parametrized over every registered backend."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import build_loader, small_recipe
from PIL import Image

from stallfree.data.backends.torch_backend import TorchLoader
from stallfree.data.readers.imageio import BadImageError
from stallfree.data.registry import BACKENDS, BackendError, resolve, resolve_backend
from stallfree.data.sharding import ShardPlan, epoch_permutation
from stallfree.parallel import DistInfo
from stallfree.recipe import RecipeError, apply_overrides
from stallfree.train.prepare import prepare_recipe

BACKEND_PARAMS = [pytest.param(name, marks=pytest.mark.dali) if name == "dali" else name for name in BACKENDS]
CPU = torch.device("cpu")


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
@pytest.mark.parametrize("split", ["train", "val"])
def test_contract(image_root: Path, backend: str, split: str) -> None:
    recipe = small_recipe(image_root, loader={"backend": backend})
    loader = build_loader(recipe, split, device=CPU)
    try:
        batches = list(loader)
        n_samples = 60 if split == "train" else 30
        expected = n_samples // 8 if split == "train" else -(-n_samples // 8)
        assert len(loader) == expected == len(batches)
        for batch in batches:
            assert batch.images.dtype == torch.float32 and batch.images.device == CPU
            assert batch.images.shape[1:] == (3, 32, 32)
            assert batch.labels.dtype == torch.int64 and batch.labels.device == CPU
            assert batch.images.shape[0] == batch.labels.shape[0]
            assert 0 <= int(batch.labels.min()) and int(batch.labels.max()) < 10
        assert batches[0].images.shape[0] == 8
        if backend != "synthetic":
            # Normalised: roughly zero-centred, not 0-255 pixels.
            assert -3 < float(batches[0].images.mean()) < 3
            assert float(batches[0].images.std()) > 0.1
            assert sum(b.labels.numel() for b in batches) == (56 if split == "train" else 30)
    finally:
        loader.close()


@pytest.mark.parametrize("backend", [b for b in BACKEND_PARAMS if b != "synthetic"])
def test_epoch_order_is_deterministic(image_root: Path, backend: str) -> None:
    recipe = small_recipe(image_root, loader={"backend": backend})

    def labels(epoch: int) -> list[int]:
        loader = build_loader(recipe, "train", device=CPU)
        loader.set_epoch(epoch)
        out = [lab for b in loader for lab in b.labels.tolist()]
        loader.close()
        return out

    first = labels(3)
    assert first == labels(3)
    assert first != labels(4)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_resume_mid_epoch_yields_the_next_unseen_batch(image_root: Path, backend: str) -> None:
    recipe = small_recipe(image_root, loader={"backend": backend})
    full = build_loader(recipe, "train", device=CPU)
    full.set_epoch(1)
    reference = list(full)
    full.close()

    first = build_loader(recipe, "train", device=CPU)
    first.set_epoch(1)
    for _ in zip(range(3), first):
        pass
    state = first.state_dict()
    first.close()
    resumed = build_loader(recipe, "train", device=CPU)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)
    rest = list(resumed)
    resumed.close()
    assert len(rest) == len(reference) - 3
    for got, want in zip(rest, reference[3:]):
        assert torch.equal(got.labels, want.labels)
        assert torch.equal(got.images, want.images)


@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_reiterating_after_a_break_continues_the_epoch(image_root: Path, backend: str) -> None:
    recipe = small_recipe(image_root, loader={"backend": backend, "torch": {"workers": 1}})
    loader = build_loader(recipe, "train", device=CPU)
    reference = [b.labels for b in loader]
    head = [b.labels for _, b in zip(range(2), loader)]
    tail = [b.labels for b in loader]
    loader.close()
    assert len(head) + len(tail) == len(reference)
    for got, want in zip(head + tail, reference):
        assert torch.equal(got, want)


@pytest.mark.parametrize("start", [0, 24, 50])
def test_train_shards_are_disjoint_equal_and_a_prefix(start: int) -> None:
    order, _ = epoch_permutation(103, seed=5, epoch=2, shuffle=True)
    plans = [ShardPlan(103, 3, r, 4, drop_last=True) for r in range(4)]
    parts = [list(p.batches(order, start)) for p in plans]
    assert len({len(p) for p in parts}) == 1  # every rank the same number of batches
    joined = np.concatenate([b for p in parts for b in p])
    assert len(set(joined.tolist())) == len(joined) == (103 - start) // 12 * 12
    # What the ranks have consumed together is always a prefix of the epoch's order.
    assert set(joined.tolist()) == set(order[start : start + len(joined)].tolist())


@pytest.mark.parametrize("n, batch, world", [(30, 8, 1), (30, 8, 2), (31, 4, 3), (5, 8, 4)])
def test_val_shards_read_every_sample_exactly_once(n: int, batch: int, world: int) -> None:
    order = np.arange(n)
    plans = [ShardPlan(n, batch, r, world, drop_last=False) for r in range(world)]
    ids = [i for p in plans for b in p.batches(order) for i in b.tolist()]
    assert sorted(ids) == list(range(n))
    for p in plans:
        assert p.num_batches() == len(list(p.batches(order)))


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_sampler_shards_by_rank(image_root: Path, world_size: int) -> None:
    recipe = small_recipe(image_root)
    seen: list[int] = []
    lengths = set()
    for rank in range(world_size):
        loader = build_loader(recipe, "train", device=CPU, dist=DistInfo(rank, world_size))
        assert isinstance(loader, TorchLoader)
        ids = [int(i) for batch in loader.remaining_ids() for i in batch]
        lengths.add(len(loader))
        seen.extend(ids)
        loader.close()
    assert len(lengths) == 1
    assert len(seen) == len(set(seen))  # disjoint
    # Whole global batches only: 60 // (8 x world size) of them, each 8 samples a rank.
    assert len(seen) == 60 // (8 * world_size) * 8 * world_size


def test_unknown_backend_lists_the_choices() -> None:
    with pytest.raises(BackendError, match="available: torch, synthetic"):
        resolve_backend("ffcv")


def test_plugin_backend_by_module_path(image_root: Path) -> None:
    recipe = small_recipe(image_root, loader={"backend": "stallfree.data.backends.synthetic:build"})
    loader = build_loader(recipe, "train", device=CPU)
    assert len(loader) == 60 // 8


def test_plugin_declares_its_own_table(image_root: Path) -> None:
    """[loader.plugin] is checked against the dataclass the plug-in declares, like the
    built-in tables: typed, defaults filled in (and so written to the run's resolved.toml),
    an unknown key or a wrong type refused by name before anything runs."""
    from plugin_loader import Options

    recipe = apply_overrides(
        small_recipe(image_root, loader={"backend": "plugin_loader:build"}),
        ["loader.plugin.brightness=2", "loader.plugin.tag=bright"],
    )
    loader = build_loader(recipe, "train", device=CPU)
    assert loader.options_seen == Options(brightness=2.0, tag="bright")
    assert isinstance(loader.options_seen.brightness, float)
    prepared = prepare_recipe(small_recipe(image_root, loader={"backend": "plugin_loader:build"}), DistInfo())
    assert prepared.resolved.plugin == {"brightness": 1.0, "tag": "plain"}
    assert prepared.recipe.loader.plugin == {}  # the recipe as given
    for table, error in (
        ({"brightnes": 2}, "unknown key 'loader.plugin.brightnes'; did you mean 'loader.plugin.brightness'"),
        ({"brightness": "high"}, "loader.plugin.brightness: expected float"),
    ):
        bad = small_recipe(image_root, loader={"backend": "plugin_loader:build", "plugin": table})
        with pytest.raises(RecipeError, match=error):
            prepare_recipe(bad, DistInfo())
    silent = small_recipe(
        image_root, loader={"backend": "plugin_loader:build_without_options", "plugin": {"brightness": 2}}
    )
    with pytest.raises(RecipeError, match="declares no options"):
        build_loader(silent, "train", device=CPU)
    # A built-in backend's table comes to it the same way; one without a table gets None.
    assert resolve(recipe.loader, "dali").options is recipe.loader.dali
    assert resolve(recipe.loader, "synthetic").options is None


def test_plugin_options_as_authors_write_them(image_root: Path) -> None:
    """Frozen and nested options, free tables merged key by key, a text option given digits;
    types a recipe cannot hold are refused naming the field, not met by a traceback."""
    from plugin_loader import FrozenOptions, Inner

    recipe = apply_overrides(
        small_recipe(image_root, loader={"backend": "plugin_loader:build_frozen"}),
        [
            "loader.plugin.name=2024",
            "loader.plugin.inner.x=1",
            "loader.plugin.inner.y=2",
            "loader.plugin.table.k=1",
            "loader.plugin.table.j=2",
        ],
    )
    loader = build_loader(recipe, "train", device=CPU)
    assert loader.options_seen == FrozenOptions(name="2024", inner=Inner(x=1, y=2), table={"k": 1, "j": 2})
    assert FrozenOptions().inner == Inner()  # the shared frozen default is left alone
    typo = apply_overrides(
        small_recipe(image_root, loader={"backend": "plugin_loader:build_frozen"}),
        ['loader.plugin.table.k="one"'],
    )
    with pytest.raises(RecipeError, match=r"loader.plugin.table.k: expected int"):
        prepare_recipe(typo, DistInfo())
    for builder, error in (
        ("build_none_default", r"loader.plugin.cache is declared .*None"),
        ("build_tuple", r"loader.plugin.size is declared tuple"),
        ("build_no_default", "loader.plugin.needed has no default"),
    ):
        bad = small_recipe(image_root, loader={"backend": f"plugin_loader:{builder}"})
        with pytest.raises(RecipeError, match=error):
            prepare_recipe(bad, DistInfo())


def test_synthetic_without_data_root() -> None:
    recipe = small_recipe("", loader={"backend": "synthetic"}, data={"synthetic_samples": 40})
    loader = build_loader(recipe, "train", device=CPU)
    assert len(loader) == 5
    assert next(iter(loader)).images.shape == (8, 3, 32, 32)


def _root_with_one_bad_file(root: Path, name: str, data: bytes, bad_split: str) -> Path:
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        folder = root / split / "a"
        folder.mkdir(parents=True)
        for k in range(6):
            pixels = rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"{k}.jpg", quality=90)
    bad = root / bad_split / "a" / name
    bad.write_bytes(data)
    return bad


def _bomb_jpeg() -> bytes:
    """A 1 KB JPEG whose frame header says 30000 x 30000 (900 megapixels)."""
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), (90, 20, 20)).save(buffer, "JPEG")
    data = bytearray(buffer.getvalue())
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = (30000).to_bytes(2, "big") * 2  # height, width
    return bytes(data)


def _truncated_jpeg() -> bytes:
    buffer = io.BytesIO()
    pixels = np.random.default_rng(1).integers(0, 255, (200, 300, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
    return buffer.getvalue()[:4000]  # header intact, entropy data cut off


@pytest.mark.parametrize("backend", [b for b in BACKEND_PARAMS if b != "synthetic"])
@pytest.mark.parametrize("split", ["train", "val"])
@pytest.mark.parametrize("kind", ["truncated", "junk_header", "bomb"])
def test_a_bad_file_is_named_in_one_line(tmp_path: Path, backend: str, split: str, kind: str) -> None:
    """Both loaders refuse the same files; a decompression bomb before any pixel is decoded."""
    data = {
        "truncated": _truncated_jpeg,
        "bomb": _bomb_jpeg,
        "junk_header": lambda: b"\xff\xd8\xff\xe0 not a jpeg at all",
    }[kind]()
    bad = _root_with_one_bad_file(tmp_path, "3.jpg", data, split)
    recipe = small_recipe(tmp_path, loader={"backend": backend}, train={"batch_size": 2})
    if kind != "truncated":  # refused from its header, when the loader is built: before step 1
        with pytest.raises(BadImageError) as info:
            build_loader(recipe, split, device=CPU)
        assert info.value.path == str(bad)
    with pytest.raises(BadImageError) as info:
        loader = build_loader(recipe, split, device=CPU)
        try:
            for epoch in range(3):  # train drops a remainder: a few epochs reach every file
                loader.set_epoch(epoch)
                list(loader)
        finally:
            loader.close()
    message = str(info.value)
    assert str(bad) in message and "\n" not in message and "Traceback" not in message
    assert info.value.path == str(bad)
    if kind == "bomb":
        assert "data.max_pixels" in message


def test_synthetic_val_counts_its_samples_exactly() -> None:
    recipe = small_recipe(
        "", loader={"backend": "synthetic"}, data={"synthetic_samples": 180}, train={"batch_size": 64}
    )
    loader = build_loader(recipe, "val", device=CPU)
    assert sum(b.labels.numel() for b in loader) == 180
