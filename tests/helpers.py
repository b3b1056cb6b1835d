"""Test helpers: an in-memory Loader for trainer tests and small recipe builders."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from stallfree.data.loader import Batch, Loader
from stallfree.recipe import Recipe, recipe_from_dict


class TensorLoader(Loader):
    """Fixed micro-batches, in order; honours the resume position like a real backend."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int) -> None:
        self.batches = [Batch(images[i:i + batch_size], labels[i:i + batch_size])
                        for i in range(0, len(images), batch_size)]
        self.epoch, self.position = 0, 0

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.batches[self.position:]:
            self.position += 1
            yield batch
        self.position = 0

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


def small_recipe(root: Path | str, **sections: dict[str, Any]) -> Recipe:
    """A fast CPU recipe over `root`; `sections` override tables key by key."""
    raw: dict[str, dict[str, Any]] = {
        "data": {"root": str(root)},
        "augment": {"image_size": 32, "resize_size": 36},
        "model": {"name": "small_cnn"},
        "optim": {"name": "adamw", "lr": 0.003, "weight_decay": 0.0},
        "train": {"epochs": 1, "batch_size": 8, "precision": "fp32", "log_every": 1,
                  "device": "cpu"},
        "loader": {"backend": "torch", "workers": 0},
    }
    for name, table in sections.items():
        raw.setdefault(name, {}).update(table)
    return recipe_from_dict(raw)
