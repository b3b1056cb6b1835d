"""stallfree's loaders in Lightning: a LightningDataModule whose train and val dataloaders are
`stallfree.loader(...)`, resumable mid-epoch through Lightning's own checkpoint.

    pip install -e '.[lightning]'
    python examples/lightning_datamodule.py pipelines/demo.toml --set train.epochs=2

The recipe decides the data, the augmentation, the batch size, the backend and the shuffle seed;
the epoch order is the one `stallfree train` iterates with the same recipe.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import lightning as L
import torch
from torch import nn

import stallfree

if TYPE_CHECKING:
    from stallfree.recipe import Recipe


class _Epochs:
    """The stallfree loader as Lightning iterates it: each pass takes the trainer's epoch (the
    (seed, epoch) shuffle). Sized, so Lightning asks for a batch only when it trains on it: the
    loader's position is always "after the last batch trained on"."""

    def __init__(self, loader: stallfree.Loader, owner: StallfreeDataModule) -> None:
        self.loader, self.owner = loader, owner

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[stallfree.Batch]:
        self.loader.set_epoch(self.owner.trainer.current_epoch)
        return iter(self.loader)

    # Lightning resumes mid-epoch without a warning only from a loader with these two; the
    # position itself travels in the DataModule's state_dict (below), as a DataModule's should.
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class _Passes:
    """The val loader, read whole each time: Lightning stops after len() batches without
    asking for one more, which would leave the loader at the end of its pass; asking for the
    next batch before yielding one ends the pass, so the next validation starts afresh."""

    def __init__(self, loader: stallfree.Loader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[stallfree.Batch]:
        batches = iter(self.loader)
        batch = next(batches, None)
        while batch is not None:
            following = next(batches, None)
            yield batch
            batch = following


class StallfreeDataModule(L.LightningDataModule):
    """Train and val batches from a stallfree recipe; `state_dict` is the train loader's
    (epoch, position), saved in and restored from Lightning's checkpoint."""

    def __init__(self, recipe: str, overrides: Sequence[str] = (), **fields: Any) -> None:
        super().__init__()
        self.recipe, self.overrides, self.fields = recipe, list(overrides), fields
        self.loaders: dict[str, stallfree.Loader] = {}
        self.restored: dict[str, Any] | None = None  # a checkpoint's train loader state

    @property
    def num_classes(self) -> int:
        """The class count `stallfree train` gives its model with this recipe: model.num_classes
        when set, else the data's (train's class folders, or the shard manifest's)."""
        from stallfree.data.readers.factory import resolve_dataset
        from stallfree.data.readers.folders import class_count
        from stallfree.recipe import set_key

        recipe = stallfree_recipe(self.recipe, self.overrides)
        for name, value in self.fields.items():  # as stallfree.loader applies them
            set_key(recipe, name.replace("__", "."), value, f"{name}=...")
        dataset = resolve_dataset(recipe.data, recipe.train.seed) if recipe.data.root else None
        return class_count(recipe, dataset)

    def _loader(self, split: str) -> stallfree.Loader:
        if split not in self.loaders:
            # Batches arrive on the trainer's device: Lightning's transfer has nothing to move.
            device = self.trainer.strategy.root_device
            self.loaders[split] = stallfree.loader(
                self.recipe, split, device=device, overrides=self.overrides, **self.fields
            )
        return self.loaders[split]

    def train_dataloader(self) -> _Epochs:
        loader = self._loader("train")
        if self.restored is not None:  # resuming: the checkpoint's position, before the first pass
            loader.load_state_dict(self.restored)
        return _Epochs(loader, self)

    def val_dataloader(self) -> _Passes:
        return _Passes(self._loader("val"))

    def state_dict(self) -> dict[str, Any]:
        return {"train_loader": self.loaders["train"].state_dict()} if "train" in self.loaders else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.restored = state.get("train_loader")
        if self.restored is not None and "train" in self.loaders:
            self.loaders["train"].load_state_dict(self.restored)

    def teardown(self, stage: str) -> None:
        for loader in self.loaders.values():
            loader.close()
        self.loaders.clear()


class TinyClassifier(L.LightningModule):
    """A small CNN: enough to show the loop; use any model (stallfree.models has ResNets)."""

    def __init__(self, num_classes: int, lr: float = 3e-3) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(16, num_classes),
        )

    def training_step(self, batch: stallfree.Batch, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        loss = nn.functional.cross_entropy(self.net(images), labels)
        self.log("loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: stallfree.Batch, batch_idx: int) -> None:
        images, labels = batch
        top1 = (self.net(images).argmax(1) == labels).float().mean()
        self.log("val_top1", top1, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main(argv: list[str] | None = None) -> None:
    """Train the recipe's data with Lightning; --ckpt resumes from a Lightning checkpoint."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--ckpt", default=None, help="a Lightning checkpoint to resume from")
    parser.add_argument(
        "--out", default="runs/lightning", help="Lightning's logs and checkpoints (default runs/lightning)"
    )
    args = parser.parse_args(argv)
    data = StallfreeDataModule(args.recipe, args.overrides)
    epochs = stallfree_epochs(args.recipe, args.overrides)
    # use_distributed_sampler=False: stallfree shards by rank itself (torchrun's RANK/WORLD_SIZE).
    # default_root_dir: Lightning would otherwise write lightning_logs/ into the working directory.
    trainer = L.Trainer(
        max_epochs=epochs, use_distributed_sampler=False, log_every_n_steps=5, default_root_dir=args.out
    )
    # The head's size is the data's class count (or the recipe's model.num_classes), as train's.
    trainer.fit(TinyClassifier(data.num_classes), datamodule=data, ckpt_path=args.ckpt)


def stallfree_recipe(recipe: str, overrides: Sequence[str]) -> Recipe:
    """The recipe with the --set overrides applied."""
    from stallfree.recipe import apply_overrides, load_recipe

    return apply_overrides(load_recipe(recipe), list(overrides))


def stallfree_epochs(recipe: str, overrides: Sequence[str]) -> int:
    """The recipe's train.epochs, with the overrides: Lightning counts the epochs."""
    return stallfree_recipe(recipe, overrides).train.epochs


if __name__ == "__main__":
    main()
