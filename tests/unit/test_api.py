"""The public API (`stallfree.__all__`) as a contract: its names and signatures, a light import,
and `stallfree.loader` giving the loaders `stallfree train` builds, in the same order."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import small_recipe

import stallfree
from stallfree.parallel import DistInfo
from stallfree.recipe import Recipe, RecipeError, dump_toml, load_recipe
from stallfree.train.prepare import prepare_recipe

BACKENDS = ["torch", pytest.param("dali", marks=pytest.mark.dali)]


def test_public_names_and_signatures_are_the_versioned_contract() -> None:
    """What `stallfree` exports and how `loader` is called: changing either is an API change
    (a new minor version and a CHANGELOG.md entry), so this test changes with it."""
    assert sorted(stallfree.__all__) == ["Batch", "Loader", "StallfreeError", "__version__", "loader"]
    assert str(inspect.signature(stallfree.loader)) == (
        "(recipe: 'str | os.PathLike[str] | Recipe | Mapping[str, Any]', split: 'str' = 'train', *, "
        "rank: 'int | None' = None, world_size: 'int | None' = None, "
        "device: 'str | torch.device | None' = None, overrides: 'str | Iterable[str]' = (), "
        "**fields: 'Any') -> 'Loader'"
    )
    assert stallfree.Batch._fields == ("images", "labels")
    methods = {"__iter__", "__len__", "set_epoch", "state_dict", "load_state_dict", "close"}
    assert methods | {"__enter__", "__exit__"} <= set(dir(stallfree.Loader))
    for name in methods - {"__iter__", "__len__"}:
        assert getattr(stallfree.Loader, name).__doc__, name


def _recipe_file(root: Path, tmp_path: Path, backend: str = "torch", **sections: dict[str, Any]) -> Path:
    """A small recipe over `root` with precision and device left to "auto", as a user writes it."""
    recipe = small_recipe(root, loader={"backend": backend}, **sections)
    recipe.train.precision = recipe.train.device = "auto"
    path = tmp_path / "recipe.toml"
    path.write_text(dump_toml(recipe))
    return path


def _cli_batches(recipe: Recipe, split: str, dist: DistInfo, epoch: int) -> list[Any]:
    """The batches `stallfree train` iterates: its RunContext's loader, built as train/run.py does."""
    ctx = prepare_recipe(recipe, dist).with_dataset().with_loader_counts(None)
    loader = ctx.loader(split)
    try:
        loader.set_epoch(epoch)
        return [(b.images.clone(), b.labels.clone()) for b in loader]
    finally:
        loader.close()


def _same(ours: list[Any], cli: list[Any]) -> None:
    assert [b.labels.tolist() for b in ours] == [labels.tolist() for _, labels in cli]
    for got, (images, _) in zip(ours, cli, strict=True):
        # Same samples, same per-sample augmentation seeds: the same pixels, up to decode noise.
        assert got.images.shape == images.shape and got.images.dtype == images.dtype
        assert (got.images - images).abs().max() < 0.05


@pytest.mark.parametrize("backend", BACKENDS)
def test_loader_is_the_clis_loader_in_the_clis_order(image_root: Path, tmp_path: Path, backend: str) -> None:
    """Precision "auto" and the default worker count resolve as the CLI resolves them (no
    "resolve train.precision" error), and both splits match the CLI's batches epoch by epoch."""
    path = _recipe_file(image_root, tmp_path, backend)
    for split, epoch in (("train", 0), ("train", 1), ("val", 0)):
        with stallfree.loader(path, split) as loader:
            assert isinstance(loader, stallfree.Loader)
            loader.set_epoch(epoch)
            ours = [stallfree.Batch(b.images.clone(), b.labels.clone()) for b in loader]
            assert len(ours) == len(loader)
        _same(ours, _cli_batches(load_recipe(path), split, DistInfo(), epoch))


def test_overrides_by_keyword_and_set_strings(image_root: Path, tmp_path: Path) -> None:
    """`--set`-style strings, then `section__key=value` keywords (applied last); a wrong key
    is one RecipeError naming it."""
    path = _recipe_file(image_root, tmp_path)
    with stallfree.loader(
        path, overrides=["train.batch_size=5", "loader.torch.workers=0"], augment__image_size=24
    ) as loader:
        images, labels = next(iter(loader))
        assert images.shape == (5, 3, 24, 24) and labels.dtype == torch.int64
    with stallfree.loader(path, overrides=["train.batch_size=5"], train__batch_size=3) as loader:
        assert len(loader) == 60 // 3
    with pytest.raises(RecipeError, match="train.batch_sise"):
        stallfree.loader(path, train__batch_sise=3)
    with pytest.raises(RecipeError, match="SECTION__KEY"):
        stallfree.loader(path, batch_size=3)
    with pytest.raises(RecipeError, match="split"):
        stallfree.loader(path, "test")


def test_ranks_from_the_environment_or_arguments_shard_as_the_cli(
    image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a process group, torchrun's RANK/WORLD_SIZE give this rank's share; explicit
    rank/world_size win; each share is the CLI's for that rank."""
    path = _recipe_file(image_root, tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    shares = {}
    for rank, kwargs in ((1, {}), (0, {"rank": 0, "world_size": 2})):
        with stallfree.loader(path, **kwargs) as loader:
            shares[rank] = [b.labels.tolist() for b in loader]
        cli = _cli_batches(load_recipe(path), "train", DistInfo(rank=rank, world_size=2), 0)
        assert shares[rank] == [labels.tolist() for _, labels in cli]
    assert len(shares[0]) == len(shares[1]) == 60 // (8 * 2)
    with pytest.raises(RecipeError, match="world_size"):
        stallfree.loader(path, rank=2, world_size=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mid_epoch_state_dict_round_trip(image_root: Path, tmp_path: Path, backend: str) -> None:
    """state_dict after 3 batches, a fresh loader, load_state_dict: the same next batches."""
    path = _recipe_file(image_root, tmp_path, backend)
    with stallfree.loader(path) as first:
        first.set_epoch(2)
        batches = iter(first)
        for _ in range(3):
            next(batches)
        state = first.state_dict()
        rest = [stallfree.Batch(b.images.clone(), b.labels.clone()) for b in batches]
    with stallfree.loader(path) as second:
        second.load_state_dict(state)
        second.set_epoch(2)  # as a loop re-announces the epoch it resumes in
        resumed = [stallfree.Batch(b.images.clone(), b.labels.clone()) for b in second]
    assert len(rest) == len(second) - 3 > 0
    _same(resumed, [(b.images, b.labels) for b in rest])


def test_context_manager_closes(image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    closed = []
    with stallfree.loader(_recipe_file(image_root, tmp_path)) as loader:
        monkeypatch.setattr(loader, "close", lambda: closed.append(True))
    assert closed == [True]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_state_saved_at_an_epochs_end_resumes_at_the_next_epoch(
    image_root: Path, tmp_path: Path, backend: str
) -> None:
    """The README's loop saves after an epoch's last batch; resumed as a loop does (from the
    loader's epoch, announcing each), the next batches are the next epoch's, not a replay."""
    path = _recipe_file(image_root, tmp_path, backend)
    with stallfree.loader(path) as first:
        first.set_epoch(0)
        assert sum(1 for _ in first) == len(first) > 0
        state = first.state_dict()
        first.set_epoch(1)
        straight = [b.labels.tolist() for b in first]
    with stallfree.loader(path) as second:
        second.load_state_dict(state)
        resumed = []
        for epoch in range(second.epoch, 2):
            second.set_epoch(epoch)
            resumed += [b.labels.tolist() for b in second]
    assert resumed == straight


def test_overrides_may_be_one_string_and_stallfree_error_is_public(image_root: Path, tmp_path: Path) -> None:
    """`overrides="train.batch_size=5"` is that one override, not one per character; a script
    catches every error stallfree raises as `stallfree.StallfreeError`."""
    path = _recipe_file(image_root, tmp_path)
    with stallfree.loader(path, overrides="train.batch_size=5") as loader:
        assert len(loader) == 60 // 5
    assert "StallfreeError" in stallfree.__all__
    from stallfree import StallfreeError

    with pytest.raises(StallfreeError, match="train.batch_sise"):
        stallfree.loader(path, overrides="train.batch_sise=5")


class _Resolved(Exception):
    """Stops stallfree.loader once the backend is chosen: no CUDA work on a CPU host."""


def test_the_given_device_is_the_one_precision_and_the_backend_choice_see(
    image_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`device="cuda:1"` on LOCAL_RANK 0: precision "auto" and `--loader auto` (the nvJPEG
    probe) are resolved on cuda:1, not on the rank's default GPU with the device swapped after."""
    import stallfree.data.choose as choose
    import stallfree.train.prepare as prepare

    seen: dict[str, torch.device] = {}

    def precision(requested: str, device: torch.device) -> str:
        seen["precision"] = device
        return "fp32"

    def choose_backend(device: torch.device, local_world_size: int = 1) -> Any:
        seen["backend"] = device
        raise _Resolved

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    monkeypatch.setattr(prepare, "resolve_precision", precision)
    monkeypatch.setattr(choose, "choose_backend", choose_backend)
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(_Resolved):
        stallfree.loader(_recipe_file(image_root, tmp_path, "auto"), device="cuda:1")
    assert seen == {"precision": torch.device("cuda", 1), "backend": torch.device("cuda", 1)}
