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
    assert ctx.recipe.loader.synthetic_decode == "torch"
    assert ctx.backend.inner is not None and ctx.backend.inner.name == "torch"


def test_each_resolved_auto_is_recorded_beside_the_request(image_root: Path) -> None:
    """The run's recipe says what ran and, beside it, that "auto" was asked; on another
    machine a machine's fact is asked again, and a key set anew is a new request."""
    from stallfree.parallel import DistInfo
    from stallfree.recipe import apply_overrides, dump_toml, recipe_from_dict, tomllib
    from stallfree.train.prepare import prepare_recipe

    recipe = small_recipe(
        image_root,
        train={"device": "auto", "precision": "auto"},
        loader={"backend": "auto", "io_depth": "auto"},
    )
    ran = prepare(recipe).recipe
    t, loader = ran.train, ran.loader
    assert (t.device, t.device_requested) == ("cpu", "auto")
    assert (t.precision, t.precision_requested) in (("fp32", "auto"), ("bf16", "auto"))
    assert (loader.backend, loader.backend_requested) == (choose.CPU_CHOICE, "auto")
    assert (loader.io_depth, loader.io_depth_requested) == (16, "auto")  # a local path's depth
    recorded = recipe_from_dict(tomllib.loads(dump_toml(ran)))
    assert prepare(recorded).recipe.to_dict() == ran.to_dict()  # the record reads back the same
    asked = apply_overrides(recorded, ['train.device="cpu"', "loader.io_depth=3"])
    again = prepare_recipe(asked, DistInfo()).recipe
    assert (again.train.device, again.train.device_requested) == ("cpu", "")
    assert again.loader.io_depth_requested == ""
