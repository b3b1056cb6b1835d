"""Host-to-device transfer and normalisation of uint8 batches, one batch ahead of compute."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from stallfree.data.loader import Batch


class DevicePrefetcher:
    """Turn uint8 NHWC CPU batches into normalised float NCHW device batches.

    Normalising on the device keeps workers doing integer work only and sends 4x fewer bytes
    over PCIe. On CUDA the copy and normalisation of batch i+1 run on a side stream while the
    model computes on batch i.
    """

    def __init__(self, device: torch.device, mean: list[float], std: list[float],
                 dtype: torch.dtype, channels_last: bool) -> None:
        self.device, self.dtype, self.channels_last = device, dtype, channels_last
        shape = (1, 3, 1, 1)
        # Scale to 0-255 once, so the per-batch work is one sub and one mul.
        self.mean = torch.tensor([m * 255 for m in mean], device=device).view(shape)
        self.inv_std = torch.tensor([1 / (s * 255) for s in std], device=device).view(shape)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def convert(self, images: torch.Tensor, labels: torch.Tensor) -> Batch:
        """Copy (non_blocking from pinned memory) and normalise one batch on the device."""
        images = images.to(self.device, non_blocking=True)
        labels = labels.to(self.device, non_blocking=True)
        n, h, w, c = images.shape
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        # One pass converts uint8->float and lays out NCHW (or channels_last) together; then two
        # in-place passes normalise. 3x faster than permute/float/normalise/contiguous copies.
        x = torch.empty((n, c, h, w), device=self.device, dtype=torch.float32,
                        memory_format=memory_format)
        x.copy_(images.permute(0, 3, 1, 2)).sub_(self.mean).mul_(self.inv_std)
        return Batch(x if self.dtype == torch.float32 else x.to(self.dtype), labels)

    def __call__(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[Batch]:
        if self.stream is None:
            for images, labels in batches:
                yield self.convert(images, labels)
            return
        yield from self._overlapped(iter(batches))

    def _overlapped(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> Iterator[Batch]:
        assert self.stream is not None
        pending = self._preload(batches)
        while pending is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            ready = pending
            # The caching allocator must not reuse these buffers while the main stream reads them.
            ready.images.record_stream(torch.cuda.current_stream(self.device))
            ready.labels.record_stream(torch.cuda.current_stream(self.device))
            pending = self._preload(batches)
            yield ready

    def _preload(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> Batch | None:
        raw = next(batches, None)
        if raw is None:
            return None
        with torch.cuda.stream(self.stream):
            return self.convert(*raw)
