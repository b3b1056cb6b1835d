"""A run resolves its loader backend once, in prepare_recipe, and every loader
of the run is built from that one value; backends read their typed options."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import small_recipe

import stallfree.data.choose as choose
import stallfree.data.registry as registry
from stallfree.train.prepare import prepare


def test_a_run_resolves_its_backend_once(image_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    original = registry.resolve

    def counting(loader, name=None):
        calls.append(name or loader.backend)
        return original(loader, name)

    monkeypatch.setattr(registry, "resolve", counting)
    ctx = prepare(small_recipe(image_root))
    for split in ("train", "val", "train"):
        ctx.loader(split).close()
    assert calls == ["torch"]
    assert ctx.backend.name == "torch" and ctx.backend.entry is registry.BACKENDS["torch"]
    assert ctx.backend.options is ctx.recipe.loader.torch  # the typed table, not a copy


def test_backends_read_their_typed_options(image_root: Path) -> None:
    """The torch backend takes its worker count from the resolved options, not the recipe."""
    ctx = prepare(small_recipe(image_root, loader={"torch": {"workers": 0}}))
    options = dataclasses.replace(ctx.backend.options, workers=1)
    ctx = dataclasses.replace(ctx, backend=dataclasses.replace(ctx.backend, options=options))
    loader = ctx.loader("val")
    try:
        assert loader.dataloader.num_workers == 1
    finally:
        loader.close()


def test_synthetic_decode_auto_is_chosen_once(image_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """synthetic-decode's "auto" is decided in prepare_recipe; its loaders wrap that backend."""
    chosen: list[torch.device] = []

    def fake_choose(device: torch.device, local_world_size: int = 1) -> choose.Choice:
        chosen.append(device)
        return choose.Choice("torch", "test")

    monkeypatch.setattr(choose, "choose_backend", fake_choose)
    recipe = small_recipe(image_root, loader={"backend": "synthetic-decode", "synthetic_decode": "auto"})
    ctx = prepare(recipe)
    for split in ("train", "val"):
        ctx.loader(split).close()
    assert len(chosen) == 1
    assert ctx.recipe.loader.synthetic_decode == "auto" and ctx.resolved.wraps == "torch"
    assert ctx.backend.inner is not None and ctx.backend.inner.name == "torch"


def test_the_recipe_keeps_auto_and_the_record_says_what_it_became(image_root: Path) -> None:
    """The run's recipe stays as given; its Resolved record holds what each "auto" became, and
    reads back from resolved.toml's text the same."""
    from stallfree.recipe import tomllib
    from stallfree.resolved import Resolved

    recipe = small_recipe(
        image_root,
        train={"device": "auto", "precision": "auto"},
        loader={"backend": "auto", "io_depth": "auto"},
    )
    ctx = prepare(recipe)
    assert ctx.recipe.to_dict() == recipe.to_dict()  # "auto" everywhere it was
    resolved = ctx.resolved
    assert (resolved.device, resolved.backend, resolved.io_depth) == ("cpu", choose.CPU_CHOICE, 16)
    assert resolved.precision in ("fp32", "bf16")
    assert Resolved.from_dict(tomllib.loads(resolved.to_toml()), "resolved.toml") == resolved


def test_a_loader_needs_its_auto_count_decided_and_its_data(image_root: Path) -> None:
    """A context's loader is built only once `workers = "auto"` is decided (with_loader_counts),
    and only from a listed dataset when its backend reads files: a caller skipping either step
    hears which one, before any loader starts."""
    from stallfree.parallel import DistInfo
    from stallfree.train.prepare import prepare_recipe

    undecided = prepare_recipe(small_recipe(image_root, loader={"torch": {"workers": "auto"}}), DistInfo())
    with pytest.raises(ValueError, match=r'loader.torch.workers = "auto": decide it before building'):
        undecided.with_dataset().loader("val")
    unlisted = prepare_recipe(small_recipe(image_root), DistInfo())
    with pytest.raises(registry.BackendError, match=r"'torch' needs data.root; set --set data.root=PATH"):
        unlisted.loader("train")
    with pytest.raises(registry.BackendError, match=r"'torch' needs data.root"):
        undecided.with_loader_counts()  # "auto" is measured on a loader of the data
