"""The Loader contract, parametrized over every registered backend."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import small_recipe
from stallfree.data.loader import BACKENDS, BackendError, DistInfo, build_loader, resolve_backend
from stallfree.data.sharding import epoch_permutation, shard
from stallfree.data.torch_backend import TorchLoader

BACKEND_PARAMS = [pytest.param(name, marks=pytest.mark.dali) if name == "dali" else name
                  for name in BACKENDS]
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
    recipe = small_recipe(image_root, loader={"backend": backend, "workers": 1})
    loader = build_loader(recipe, "train", device=CPU)
    reference = [b.labels for b in loader]
    head = [b.labels for _, b in zip(range(2), loader)]
    tail = [b.labels for b in loader]
    loader.close()
    assert len(head) + len(tail) == len(reference)
    for got, want in zip(head + tail, reference):
        assert torch.equal(got, want)


def test_shards_are_disjoint_and_complete() -> None:
    order, _ = epoch_permutation(103, seed=5, epoch=2, shuffle=True)
    parts = [shard(order, r, 4) for r in range(4)]
    assert all(len(p) == 103 // 4 for p in parts)
    joined = np.concatenate(parts)
    assert len(set(joined.tolist())) == len(joined) == 100


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_sampler_shards_by_rank(image_root: Path, world_size: int) -> None:
    recipe = small_recipe(image_root)
    seen: list[int] = []
    lengths = set()
    for rank in range(world_size):
        loader = build_loader(recipe, "train", device=CPU, dist=DistInfo(rank, world_size))
        assert isinstance(loader, TorchLoader)
        ids = [i for batch in loader.sampler for i, _ in batch]
        lengths.add(len(loader))
        seen.extend(ids)
        loader.close()
    assert len(lengths) == 1
    assert len(seen) == len(set(seen))  # disjoint
    per_rank_samples = 60 // world_size // 8 * 8
    assert len(seen) == per_rank_samples * world_size


def test_unknown_backend_lists_the_choices() -> None:
    with pytest.raises(BackendError, match="available: torch, synthetic"):
        resolve_backend("ffcv")


def test_plugin_backend_by_module_path(image_root: Path) -> None:
    recipe = small_recipe(image_root, loader={"backend": "stallfree.data.synthetic:build"})
    loader = build_loader(recipe, "train", device=CPU)
    assert len(loader) == 60 // 8


def test_synthetic_without_data_root() -> None:
    recipe = small_recipe("", loader={"backend": "synthetic"}, data={"synthetic_samples": 40})
    loader = build_loader(recipe, "train", device=CPU)
    assert len(loader) == 5
    assert next(iter(loader)).images.shape == (8, 3, 32, 32)
