"""The `dali` backend: one NVIDIA DALI graph for the GPU (nvJPEG, `mixed`) and the CPU.

The reader gets an explicit, per-epoch file list from the shared listing and sharding, so
class indices, sample order and `len()` are identical to the torch backend's. The pipeline is
rebuilt for each epoch with that epoch's order (and with a DALI checkpoint to resume mid-epoch).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from stallfree.data.loader import BackendError, Batch, CursorLoader, Loader, LoaderSpec
from stallfree.data.sharding import epoch_permutation, num_batches
from stallfree.data.torch_backend import cpu_workers

try:
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.base_iterator import LastBatchPolicy
    from nvidia.dali.plugin.pytorch import DALIGenericIterator
except ImportError as exc:  # only raised when --loader dali is chosen
    raise BackendError(
        "the dali backend needs NVIDIA DALI: pip install 'stallfree[dali]' "
        "(or pip install nvidia-dali-cuda120)"
    ) from exc

# nvJPEG buffer sizes from NVIDIA's ResNet-50 example: big enough for ImageNet's largest
# images, so buffers are allocated once instead of growing mid-run.
_GPU_DECODER_HINTS = {
    "device_memory_padding": 211_025_920, "host_memory_padding": 140_544_512,
    "preallocate_width_hint": 5_980, "preallocate_height_hint": 6_430,
}


class DataPipelineError(RuntimeError):
    """The DALI pipeline stopped, usually on a corrupt or unreadable file."""


@pipeline_def(enable_checkpointing=True)
def image_pipeline(*, files: list[str], labels: list[int], spec: LoaderSpec, decode_device: str,
                   augment_on_gpu: bool, shard_id: int, num_shards: int) -> tuple[Any, Any]:
    """Read, decode, crop/resize, flip, normalise. `decode_device` is "mixed" or "cpu"."""
    aug = spec.augment
    size = aug.image_size
    jpegs, label = fn.readers.file(files=files, labels=labels, shard_id=shard_id,
                                   num_shards=num_shards, random_shuffle=False,
                                   pad_last_batch=True, name="Reader")
    hints = _GPU_DECODER_HINTS | {"hw_decoder_load": spec.loader.hw_decoder_load} \
        if decode_device == "mixed" else {}
    # Bilinear with antialiasing is what PIL's resize does: the torch backend's interpolation.
    resize = {"interp_type": types.INTERP_LINEAR, "antialias": True}
    if spec.train:
        # ROI decode fused with RandomResizedCrop: only the crop's pixels are decoded.
        images = fn.decoders.image_random_crop(
            jpegs, device=decode_device, output_type=types.RGB, random_area=aug.scale,
            random_aspect_ratio=aug.ratio, num_attempts=10, **hints)
        if augment_on_gpu and decode_device == "cpu":
            images = images.gpu()
        images = fn.resize(images, resize_x=size, resize_y=size, **resize)
        mirror = fn.random.coin_flip(probability=aug.hflip)
    else:
        images = fn.decoders.image(jpegs, device=decode_device, output_type=types.RGB, **hints)
        if augment_on_gpu and decode_device == "cpu":
            images = images.gpu()
        images = fn.resize(images, resize_shorter=aug.resize_size, **resize)
        mirror = 0
    images = fn.crop_mirror_normalize(
        images, crop=(size, size), crop_pos_x=0.5, crop_pos_y=0.5, mirror=mirror,
        mean=[m * 255 for m in aug.mean], std=[s * 255 for s in aug.std],
        dtype=types.FLOAT16 if spec.dtype == torch.float16 else types.FLOAT,
        output_layout="HWC" if spec.channels_last else "CHW")
    return images, label.gpu() if augment_on_gpu else label


class DaliLoader(CursorLoader):
    """Adapter over DALIGenericIterator that yields `Batch` and hides DALI's iterator quirks."""

    def __init__(self, spec: LoaderSpec) -> None:
        if spec.listing is None:
            raise BackendError("the dali backend needs a dataset listing (data.root)")
        super().__init__()
        self.spec = spec
        self.per_rank = len(spec.listing) // spec.dist.world_size
        self.length = num_batches(self.per_rank, spec.batch_size, drop_last=spec.train)
        # loader.device = "cpu" keeps the whole graph on the CPU even when training on a GPU.
        gpu = spec.device.type == "cuda" and spec.loader.device != "cpu"
        self.device_id = (spec.device.index or 0) if gpu else None
        self.decode_device = "mixed" if gpu and spec.loader.dali_decode == "auto" else "cpu"
        self.augment_on_gpu = gpu
        # DALI needs at least one thread: 0 means "derive it", like -1.
        self.threads = cpu_workers(spec.loader.threads if spec.loader.threads > 0 else -1,
                                   spec.dist.local_world_size)
        self._iterator: DALIGenericIterator | None = None
        self._resume_checkpoint: str | None = None
        self._paths = np.array(spec.listing.files)
        self._labels = np.array(spec.listing.labels, dtype=np.int64)

    def __len__(self) -> int:
        return self.length

    def _build(self) -> DALIGenericIterator:
        """A pipeline over this epoch's order; every rank gets the same list, DALI shards it."""
        spec, world = self.spec, self.spec.dist.world_size
        order, _ = epoch_permutation(len(self._paths), seed=spec.seed, epoch=self.cursor.epoch,
                                     shuffle=spec.train)
        order = order[:self.per_rank * world]  # equal shards: drop the remainder, as torch does
        pipe = image_pipeline(
            files=self._paths[order].tolist(), labels=self._labels[order].tolist(), spec=spec,
            decode_device=self.decode_device, augment_on_gpu=self.augment_on_gpu,
            shard_id=spec.dist.rank,  # the global rank: local rank would repeat shards per node
            num_shards=world, batch_size=spec.batch_size, num_threads=self.threads,
            device_id=self.device_id, seed=_pipeline_seed(spec.seed, self.cursor.epoch, spec.dist.rank),
            prefetch_queue_depth=max(1, spec.loader.prefetch), checkpoint=self._resume_checkpoint,
        )
        self._resume_checkpoint = None
        policy = LastBatchPolicy.DROP if spec.train else LastBatchPolicy.PARTIAL
        return DALIGenericIterator([pipe], ["images", "labels"], reader_name="Reader",
                                   last_batch_policy=policy, auto_reset=False)

    def __iter__(self) -> Iterator[Batch]:
        if self.cursor.position >= self.length:
            self.cursor.position = 0
            return
        if self.cursor.position and self._resume_checkpoint is None and self._iterator is not None:
            # Re-iterated after stopping mid-epoch: continue on the next unseen batch, as the
            # torch backend does, instead of restarting the epoch under a mid-epoch counter.
            self._resume_checkpoint = self._iterator.checkpoints()[0]
        self._iterator = self._build()
        try:
            yield from self._counted(self._to_batch(data[0]) for data in self._iterator)
        except RuntimeError as exc:
            raise _explain(exc) from exc
        self._close_iterator()

    def _to_batch(self, out: dict[str, torch.Tensor]) -> Batch:
        images = out["images"]
        if self.spec.channels_last:
            images = images.permute(0, 3, 1, 2)  # NHWC memory viewed as channels_last NCHW
        if images.dtype != self.spec.dtype:
            images = images.to(self.spec.dtype)
        labels = out["labels"].reshape(-1).long()
        return Batch(images.to(self.spec.device, non_blocking=True),
                     labels.to(self.spec.device, non_blocking=True))

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = self.cursor.state_dict()
        if self._iterator is not None and 0 < self.cursor.position < self.length:
            # DALI's own checkpoint: reader position and every RNG, as of the last batch yielded.
            state["dali"] = self._iterator.checkpoints()[0]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.cursor.load_state_dict(state)
        self._resume_checkpoint = state.get("dali")

    def _close_iterator(self) -> None:
        self._iterator = None  # drops the pipeline, its threads and buffers

    def close(self) -> None:
        self._close_iterator()


def _pipeline_seed(seed: int, epoch: int, rank: int) -> int:
    # DALI wants a 32-bit-ish non-negative seed; derive it from (seed, epoch, rank).
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0] & 0x7FFFFFFF)


def _explain(exc: RuntimeError) -> DataPipelineError:
    """Turn a DALI stack trace into an error that names the file and the fix."""
    text = str(exc)
    match = re.search(r"(/[^\s'\"\]\[]+\.(?:jpe?g|png|bmp|webp|tiff?|ppm|pgm))", text, re.IGNORECASE)
    where = f" while reading {match.group(1)}" if match else ""
    first = next((line.strip() for line in text.splitlines() if "rror" in line), text[:300])
    return DataPipelineError(
        f"the DALI pipeline stopped{where}: {first}. A corrupt or unsupported image is the usual "
        "cause: run the data checker on the dataset, or exclude the file via data.file_list."
    )


def build(spec: LoaderSpec) -> Loader:
    """Registry entry point for `--loader dali`."""
    return DaliLoader(spec)
