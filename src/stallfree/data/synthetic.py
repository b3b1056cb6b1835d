"""The `synthetic` backend: one random batch made once on the device, the zero-cost upper bound."""

from __future__ import annotations

from collections.abc import Iterator
import torch

from stallfree.data.loader import Batch, CursorLoader, Loader, LoaderSpec
from stallfree.data.sharding import num_batches


class SyntheticLoader(CursorLoader):
    """Yields the same device-resident batch; `len` matches the real backends for the same data."""

    def __init__(self, spec: LoaderSpec) -> None:
        super().__init__()
        n = len(spec.listing) if spec.listing is not None else spec.synthetic_samples
        self.length = num_batches(n // spec.dist.world_size, spec.batch_size, drop_last=spec.train)
        # A different batch for val than for train: otherwise "val accuracy" is memorisation.
        split_offset = 0 if spec.train else 1_000_003
        generator = torch.Generator().manual_seed(spec.seed + spec.dist.rank + split_offset)
        size = spec.augment.image_size
        images = torch.randn((spec.batch_size, 3, size, size), generator=generator)
        labels = torch.randint(0, spec.num_classes, (spec.batch_size,), generator=generator)
        memory_format = torch.channels_last if spec.channels_last else torch.contiguous_format
        self.batch = Batch(
            images.to(spec.device, dtype=spec.dtype, memory_format=memory_format),
            labels.to(spec.device),
        )

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[Batch]:
        return self._counted(self.batch for _ in range(self.cursor.position, self.length))


def build(spec: LoaderSpec) -> Loader:
    """Registry entry point for `--loader synthetic`."""
    return SyntheticLoader(spec)
