"""The `synthetic` backend: one random batch made once on the device, the zero-cost upper bound."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from stallfree.data.loader import Batch, Loader, LoaderSpec, ShardedLoader


class SyntheticLoader(ShardedLoader):
    """Yields device-resident batches; counts and positions follow the real backends' plan."""

    def __init__(self, spec: LoaderSpec) -> None:
        super().__init__(
            spec.num_samples, batch_size=spec.batch_size, dist=spec.dist, train=spec.train, seed=spec.seed
        )
        # A different batch for val than for train: otherwise "val accuracy" is memorisation.
        split_offset = 0 if spec.train else 1_000_003
        generator = torch.Generator().manual_seed(spec.seed + spec.dist.rank + split_offset)
        size = spec.crop_size(0)  # one resident batch: the first epoch's size (or val's)
        images = torch.randn((spec.batch_size, 3, size, size), generator=generator)
        labels = torch.randint(0, spec.num_classes, (spec.batch_size,), generator=generator)
        memory_format = torch.channels_last if spec.channels_last else torch.contiguous_format
        self.batch = Batch(
            images.to(spec.device, dtype=spec.dtype, memory_format=memory_format),
            labels.to(spec.device),
        )

    def __iter__(self) -> Iterator[Batch]:
        # Slices of the one batch, so a short last val batch has its true size.
        return self._counted(
            Batch(self.batch.images[: len(ids)], self.batch.labels[: len(ids)])
            for ids in self.remaining_ids()
        )


def build(spec: LoaderSpec) -> Loader:
    """Registry entry point for `--loader synthetic`."""
    return SyntheticLoader(spec)
