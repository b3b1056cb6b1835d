"""The `dali` backend: one NVIDIA DALI graph for the GPU (nvJPEG, `mixed`) and the CPU.

Each rank's samples are fed through an external source in the epoch's global order, cut by the
shared `ShardPlan`, so class indices, sample order and `len()` are identical to the torch
backend's; the bytes are read from the compact listing as they are needed (files and tar
members alike), so no per-sample list lives in DALI. One pipeline serves the whole run: at the
end of an epoch the source ends, and the next epoch's iteration resets the pipeline, whose source
then starts over in the new epoch's order (a rebuild cost ~0.5 s of start-up a epoch). It is
rebuilt only on resume (with DALI's own checkpoint, i.e. its random state, when the shards are
unchanged); the source restarts at the next unseen sample.

Every file's header is checked before training (DALI cannot skip a sample, and nothing else
would stop a decompression bomb); when the pipeline fails anyway, the batches in flight are
decoded one by one to name the file.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from stallfree.data.autoaug import FILL, MAX_TRANSLATE
from stallfree.data.headers import read_bytes
from stallfree.data.imageio import BadImageError, check_header
from stallfree.data.loader import Batch, Loader, LoaderSpec, ShardedLoader
from stallfree.data.prefetch import DevicePrefetcher
from stallfree.data.registry import BackendError
from stallfree.data.startup import cached_bad_files
from stallfree.errors import StallfreeError, some_of
from stallfree.log import NATIVE_STDERR
from stallfree.parallel import cpu_workers

try:
    import nvidia.dali.math as dmath
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.auto_aug import rand_augment, trivial_augment
    from nvidia.dali.plugin.base_iterator import LastBatchPolicy
    from nvidia.dali.plugin.pytorch import DALIGenericIterator
except ImportError as exc:  # only raised when --loader dali is chosen
    missing = getattr(exc, "name", None) or ""
    if missing and not missing.startswith("nvidia"):  # DALI is there, one of its imports is not
        raise BackendError(
            f"NVIDIA DALI is installed but does not import: missing module {missing!r}; "
            f"pip install {missing.replace('_', '-')} into the same tree as DALI "
            "(`stallfree doctor` lists everything missing)"
        ) from exc
    raise BackendError(
        "the dali backend needs NVIDIA DALI: pip install 'stallfree[dali]' "
        "(or pip install nvidia-dali-cuda120; dali-cuda130 for a CUDA 13 torch)"
    ) from exc

from stallfree.data.dali_probe import environment_problem, first_cause, first_undecodable

# Samples feed DALI through an external source, which DALI's checkpoint does not cover; the
# loader restarts that source at the next unseen sample itself, as the warning asks.
warnings.filterwarnings("ignore", message="Checkpointing enabled in a pipeline with external")

# nvJPEG buffer sizes from NVIDIA's ResNet-50 example: big enough for ImageNet's largest
# images, so buffers are allocated once instead of growing mid-run.
_GPU_DECODER_HINTS = {
    "device_memory_padding": 211_025_920,
    "host_memory_padding": 140_544_512,
    "preallocate_width_hint": 5_980,
    "preallocate_height_hint": 6_430,
}


class DataPipelineError(StallfreeError, RuntimeError):
    """The DALI pipeline stopped on a file it could not read; the message names it."""


# Conditionals: the auto-augment policies pick an operation per sample with `if`.
@pipeline_def(enable_checkpointing=True, enable_conditionals=True)
def image_pipeline(
    *,
    source: Callable[[], Iterator[Any]],
    spec: LoaderSpec,
    decode_device: str,
    augment_on_gpu: bool,
    raw_uint8: bool = False,
) -> tuple[Any, Any]:
    """Decode, crop/resize, flip, normalise. `decode_device` is "mixed" or "cpu"; `source()`
    yields this rank's batches of one epoch as (encoded bytes, labels, crop sides): the side
    comes with every sample, so one pipeline follows a progressive-resizing schedule.

    `raw_uint8`: stop before normalising and hand uint8 HWC to the caller (a CPU graph feeding a
    GPU run: a quarter of the bytes to copy, normalised on the GPU like the torch backend's).
    """
    aug = spec.augment
    # cycle="raise": the end of the source ends DALI's epoch, and a reset calls `source` again.
    jpegs, label, size = fn.external_source(
        source=source, num_outputs=3, batch=True, cycle="raise", dtype=[types.UINT8, types.INT64, types.FLOAT]
    )
    # Fancy (smooth) chroma upsampling is the mixed decoder's opt-in and PIL's default: without
    # it, GPU-decoded pixels would drift from the parity measured on the CPU.
    hints = (
        _GPU_DECODER_HINTS
        | {"hw_decoder_load": spec.loader.dali.hw_decoder_load, "jpeg_fancy_upsampling": True}
        if decode_device == "mixed"
        else {}
    )
    # Bilinear with antialiasing is what PIL's resize does: the torch backend's interpolation.
    resize = {"interp_type": types.INTERP_LINEAR, "antialias": True}
    if spec.train:
        # ROI decode fused with RandomResizedCrop: only the crop's pixels are decoded.
        images = fn.decoders.image_random_crop(
            jpegs,
            device=decode_device,
            output_type=types.RGB,
            random_area=aug.scale,
            random_aspect_ratio=aug.ratio,
            num_attempts=10,
            **hints,
        )
        if augment_on_gpu and decode_device == "cpu":
            images = images.gpu()
        images = fn.resize(images, resize_x=size, resize_y=size, **resize)
        mirror = fn.random.coin_flip(probability=aug.hflip)
        if aug.auto_augment != "none":
            # Flip first, as the torch backend (and torchvision) do: a shear about the origin
            # leaves its uncovered wedge on one side, which a later flip would move.
            images = _auto_augment(fn.flip(images, horizontal=mirror), aug)
            mirror = 0
        if aug.random_erasing > 0:
            images = _random_erasing(images, aug)
    else:
        images = fn.decoders.image(jpegs, device=decode_device, output_type=types.RGB, **hints)
        if augment_on_gpu and decode_device == "cpu":
            images = images.gpu()
        images = fn.resize(images, resize_shorter=aug.resize_size, **resize)
        mirror = 0
    if raw_uint8:
        images = fn.crop_mirror_normalize(
            images,
            crop_h=size,
            crop_w=size,
            crop_pos_x=0.5,
            crop_pos_y=0.5,
            mirror=mirror,
            dtype=types.UINT8,
            output_layout="HWC",
        )
        return images, label
    images = fn.crop_mirror_normalize(
        images,
        crop_h=size,
        crop_w=size,
        crop_pos_x=0.5,
        crop_pos_y=0.5,
        mirror=mirror,
        mean=[m * 255 for m in aug.mean],
        std=[s * 255 for s in aug.std],
        dtype=types.FLOAT16 if spec.dtype == torch.float16 else types.FLOAT,
        output_layout="HWC" if spec.channels_last else "CHW",
    )
    return images, label.gpu() if augment_on_gpu else label


def _auto_augment(images: Any, aug: Any) -> Any:
    """augment.auto_augment in the graph: DALI's own suites, with the translation range and
    fill that `stallfree.data.autoaug` (the torch backend's twin) declares."""
    common = {
        "num_magnitude_bins": aug.magnitude_bins,
        "shape": images.shape(),
        "max_translate_rel": MAX_TRANSLATE[aug.auto_augment],
        "fill_value": FILL,
    }
    with warnings.catch_warnings():
        # DALI's suites call the deprecated experimental aliases of filter and equalize, and
        # DALI forces that warning past every filter, once per operation and run.
        warnings.showwarning = lambda *args, **kwargs: None
        if aug.auto_augment == "randaugment":
            return rand_augment.rand_augment(images, n=aug.randaugment_n, m=aug.randaugment_m, **common)
        return trivial_augment.trivial_augment_wide(images, **common)


def _random_erasing(images: Any, aug: Any) -> Any:
    """augment.random_erasing in the graph: the torch backend's `erasing_box`, drawn alike in
    normalised coordinates (a region of size 0 when the coin says no)."""
    area = fn.random.uniform(range=aug.erasing_scale)
    ratio = dmath.exp(fn.random.uniform(range=[math.log(r) for r in aug.erasing_ratio]))
    h_frac = dmath.min(dmath.sqrt(area * ratio), 1.0)
    w_frac = dmath.min(dmath.sqrt(area / ratio), 1.0)
    on = fn.cast(fn.random.coin_flip(probability=aug.random_erasing), dtype=types.FLOAT)
    anchor = fn.stack(
        fn.random.uniform(range=[0.0, 1.0]) * (1.0 - h_frac),
        fn.random.uniform(range=[0.0, 1.0]) * (1.0 - w_frac),
    )
    return fn.erase(
        images,
        anchor=anchor,
        shape=fn.stack(h_frac * on, w_frac * on),
        axis_names="HW",
        normalized_anchor=True,
        normalized_shape=True,
        fill_value=[float(round(m * 255)) for m in aug.mean],
    )


class DaliLoader(ShardedLoader):
    """Adapter over DALIGenericIterator that yields `Batch` and hides DALI's iterator quirks."""

    def __init__(self, spec: LoaderSpec) -> None:
        if spec.listing is None:
            raise BackendError("the dali backend needs a dataset listing (data.root)")
        opts = spec.loader.dali
        # DALI needs at least one thread: 0 means "derive it", like -1.
        self.threads = cpu_workers(opts.threads if opts.threads != 0 else -1, spec.dist.local_world_size)
        # Sample i of the plan is listing entry kept[i] (all of them unless files are skipped).
        self._kept = _usable_ids(spec, self.threads)
        n = len(spec.listing) if self._kept is None else len(self._kept)
        super().__init__(n, batch_size=spec.batch_size, dist=spec.dist, train=spec.train, seed=spec.seed)
        # Files left out by data.on_error = skip count as skipped once per epoch (on rank 0,
        # so that the all-ranks sum is their number).
        self._left_out = len(spec.listing) - n if spec.dist.rank == 0 else 0
        self.spec = spec
        # loader.dali.device = "cpu" keeps the whole graph on the CPU even when training on a GPU.
        gpu = spec.device.type == "cuda" and opts.device != "cpu"
        self.device_id = (spec.device.index or 0) if gpu else None
        self.decode_device = "mixed" if gpu and opts.decode == "auto" else "cpu"
        self.augment_on_gpu = gpu
        # A CPU graph feeding a GPU run hands over uint8; the prefetcher normalises on the GPU.
        self.prefetcher = (
            DevicePrefetcher(spec.device, spec.augment.mean, spec.augment.std, spec.dtype, spec.channels_last)
            if spec.device.type == "cuda" and not gpu
            else None
        )
        self._iterator: DALIGenericIterator | None = None
        self._ended = False  # the live pipeline finished an epoch and awaits its reset
        self._feed_start = 0  # where the source starts in the epoch's order (set before a reset)
        self._checkpoint: str | None = None  # DALI's own state, to restore on the next build
        # Files fed per batch of the plan, in order, until the batch is taken: 0 marks a batch
        # whose every file was skipped, which DALI (no empty batches) never sees.
        self._fed: deque[int] = deque()
        self._routing = False  # fd 2 routed (NATIVE_STDERR) until close()

    def _build(self) -> DALIGenericIterator:
        """The run's pipeline, starting at `position` (DALI's state from `_checkpoint`)."""
        spec = self.spec
        if not self._routing:  # libpng's bare warnings from DALI's threads: through the log
            NATIVE_STDERR.acquire()
            self._routing = True
        pipe = image_pipeline(
            source=self._feed,
            spec=spec,
            decode_device=self.decode_device,
            augment_on_gpu=self.augment_on_gpu,
            raw_uint8=self.prefetcher is not None,
            batch_size=spec.batch_size,
            num_threads=self.threads,
            device_id=self.device_id,
            seed=_pipeline_seed(spec.seed, self.epoch, spec.dist.rank, self.position),
            prefetch_queue_depth=max(1, spec.loader.prefetch),
            checkpoint=self._checkpoint,
        )
        self._checkpoint = None
        policy = LastBatchPolicy.DROP if spec.train else LastBatchPolicy.PARTIAL
        return DALIGenericIterator(
            [pipe], ["images", "labels"], size=-1, last_batch_policy=policy, auto_reset=False
        )

    def _listing_ids(self, ids: np.ndarray) -> np.ndarray:
        return ids if self._kept is None else self._kept[ids]

    def _feed(self) -> Iterator[tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]]:
        """This rank's batches of the current epoch from `_feed_start` on: bytes, labels and
        the epoch's crop side.

        DALI calls it anew after each reset; its body runs at the first batch DALI asks for,
        i.e. after `__iter__` has set the epoch and the start.
        """
        listing = self.spec.listing
        assert listing is not None
        self._fed.clear()  # a fresh source: what the last one fed is gone with its pipeline
        side = np.array(self.spec.crop_size(self.epoch), dtype=np.float32)
        for ids in self.plan.batches(self.epoch_order()[0], self._feed_start):
            ids = self._listing_ids(ids)
            kept = [
                (data, np.array([label], dtype=np.int64))
                for path, label in zip(listing.paths(ids), listing.labels[ids].tolist())
                if (data := self._screened(path)) is not None
            ]
            images, labels = [k[0] for k in kept], [k[1] for k in kept]
            self._fed.append(len(kept))
            if images:
                yield images, labels, [side] * len(images)

    def _screened(self, path: str) -> np.ndarray | None:
        """The file's bytes once its header passes; a bad one raises, or (skip) is counted,
        named and left out of its batch, as the torch backend's decode does. The start-up
        check's cache cannot see a file rewritten in place, and DALI must never get a bomb."""
        data = read_bytes(path)
        try:
            check_header(path, self.spec.max_pixels)
        except BadImageError as exc:
            if self.spec.on_error != "skip":
                raise
            self.skipped_samples += 1
            warnings.warn(f"skipped {exc.path}: {exc.reason}", stacklevel=2)
            return None
        return np.frombuffer(data, dtype=np.uint8)

    def __iter__(self) -> Iterator[Batch]:
        if self.batches_left() == 0:
            self._start, self._taken = 0, 0
            return
        if self.position == 0:
            self.skipped_samples += self._left_out
        try:
            if self._iterator is None:
                self._feed_start = self.position
                self._iterator = self._build()
            elif self._ended:  # the next epoch (or the same one again): the source starts over
                self._feed_start, self._ended = self.position, False
                self._iterator.reset()
            elif self.prefetcher is not None:
                # The GPU-side prefetcher took one batch more from DALI than it handed out:
                # rebuild from the next unseen sample rather than skip that batch.
                self._close_iterator()
                self._feed_start = self.position
                self._iterator = self._build()
            # else: re-iterated after stopping mid-epoch; the live pipeline's next batch is the
            # next unseen one, as in the torch backend.
            yield from self._counted(self._batches(self._iterator))
        except (DataPipelineError, BadImageError):  # a bad file met in the source, or named
            self._close_iterator()
            raise
        except RuntimeError as exc:
            self._close_iterator()
            if _is_memory_error(exc):
                raise  # out of memory is not a bad file: the trainer's advice applies
            raise self._explain(exc) from None
        self._ended = True

    def _explain(self, exc: RuntimeError) -> StallfreeError:
        """Name the file that stopped the pipeline: decode the batches in flight one by one."""
        environment = environment_problem(str(exc))
        if environment is not None:
            return environment
        in_flight = itertools.islice(
            self.plan.batches(self.epoch_order()[0], self.position), self.spec.loader.prefetch + 2
        )
        assert self.spec.listing is not None
        culprit = first_undecodable(
            self.spec.listing.paths(self._listing_ids(np.concatenate([*in_flight, np.zeros(0, np.int64)])))
        )
        if culprit is not None:
            return BadImageError(culprit[0], f"DALI cannot decode it: {culprit[1]}")
        return DataPipelineError(f"the DALI pipeline stopped: {first_cause(str(exc))}")

    def _batches(self, iterator: DALIGenericIterator) -> Iterator[Batch]:
        # A batch of only skipped files is an empty one, as the torch backend's: the steps and
        # the accumulation window (and DDP's collectives) stay in step.
        side, raw = self.spec.crop_size(self.epoch), self.prefetcher is not None
        hwc = raw or self.spec.channels_last
        empty = [
            {
                "images": torch.zeros(
                    (0, side, side, 3) if hwc else (0, 3, side, side),
                    dtype=torch.uint8 if raw else self.spec.dtype,
                ),
                "labels": torch.zeros(0, dtype=torch.int64),
            }
        ]
        outputs = (empty if data is None else data for data in self._until_epoch_end(iterator))
        if self.prefetcher is None:
            return (self._to_batch(data[0]) for data in outputs)
        return self.prefetcher(
            (data[0]["images"].pin_memory(), data[0]["labels"].reshape(-1).long()) for data in outputs
        )

    def _until_epoch_end(self, iterator: DALIGenericIterator) -> Iterator[Any]:
        """The epoch's remaining outputs, None for a batch of only skipped files. DALI's end
        of epoch is taken with the last one, not when the caller asks past it: a caller that
        takes exactly `len()` batches leaves the pipeline ready for its reset all the same
        (else the next epoch would need a rebuild, whose fresh random state would differ from
        a reset's)."""
        left, taken = self.batches_left(), 0
        while taken < left:
            if self._fed and self._fed[0] == 0:  # known before DALI is asked for more
                self._fed.popleft()
                taken += 1
                yield None
                continue
            data = next(iterator, None)
            self._ended = data is None  # DALI's end: only batches of skipped files may be left
            for _ in itertools.takewhile(lambda n: n == 0, list(self._fed)):
                self._fed.popleft()  # fed while DALI was asked, before this output's files
                taken += 1
                yield None
            if data is None:
                if taken < left:
                    raise DataPipelineError("the DALI pipeline gave fewer batches than planned")
                return
            self._fed.popleft()
            taken += 1
            if taken == left:
                if next(iterator, None) is not None:
                    raise DataPipelineError("the DALI pipeline gave more batches than planned")
                self._ended = True
            yield data

    def _to_batch(self, out: dict[str, torch.Tensor]) -> Batch:
        images = out["images"]
        if self.spec.channels_last:
            images = images.permute(0, 3, 1, 2)  # NHWC memory viewed as channels_last NCHW
        if images.dtype != self.spec.dtype:
            images = images.to(self.spec.dtype)
        labels = out["labels"].reshape(-1).long()
        return Batch(
            images.to(self.spec.device, non_blocking=True), labels.to(self.spec.device, non_blocking=True)
        )

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch and self._iterator is not None and not self._ended:
            # Left mid-epoch: the live pipeline holds that epoch's batches, not this one's.
            self._close_iterator()
            self._checkpoint = None
        # A restored checkpoint with no pipeline yet (a run stopped on an epoch's last step)
        # is kept: it is the random state the next epoch continues from.
        super().set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._iterator is not None and self.prefetcher is None:
            # DALI's own checkpoint, as of the last batch yielded: every RNG of the run's one
            # pipeline, at an epoch's end too, so that a resume continues its random stream.
            state["dali"] = self._iterator.checkpoints()[0]
            # (With the GPU-side prefetcher DALI is a batch ahead of `position`: its state would
            # shift the resumed stream, so such a resume starts a fresh one; order stays exact.)
        elif self._checkpoint is not None:  # restored, not built yet: still the run's state
            state["dali"] = self._checkpoint
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._close_iterator()
        # DALI's checkpoint holds its random state, which continues this rank's stream: it
        # applies only when the shards are unchanged (and not to a 0.2 checkpoint, whose
        # pipeline had a file reader: "dali_list_start").
        usable = "dali" in state and self.same_shards(state) and "dali_list_start" not in state
        self._checkpoint = state["dali"] if usable else None

    def _close_iterator(self) -> None:
        self._iterator, self._ended = None, False  # drops the pipeline, its threads and buffers
        self._fed.clear()

    def close(self) -> None:
        self._close_iterator()
        if self._routing:
            NATIVE_STDERR.release()
            self._routing = False


def _usable_ids(spec: LoaderSpec, threads: int) -> np.ndarray | None:
    """The listing entries DALI may read: None for all of them.

    DALI cannot skip a sample, and a decompression bomb would decode to many GB first: every
    header is checked (each rank its share; cached per dataset state), and a bad one raises.
    Under data.on_error = "skip" the split is fully decoded once instead (cached likewise) and
    the bad files are left out, so the epoch has fewer samples than the torch backend's.
    """
    assert spec.listing is not None
    if spec.on_error != "skip":
        bad = spec.bad_headers(threads)
        if bad:
            raise bad[0]
        return None
    bad_files = cached_bad_files(
        spec.listing, sources=spec.sources, max_pixels=spec.max_pixels, workers=threads, dist=spec.dist
    )
    if not bad_files:
        return None
    named = [f"{path}: {reason}" for path, reason in bad_files.items()]
    warnings.warn(
        f"data.on_error = skip: {len(bad_files)} file(s) of the {spec.split} split "
        f"left out: {some_of(named)}",
        stacklevel=3,
    )
    return np.array(
        [i for i, path in enumerate(spec.listing.iter_paths()) if path not in bad_files], dtype=np.int64
    )


def _pipeline_seed(seed: int, epoch: int, rank: int, start: int) -> int:
    # DALI wants a 32-bit-ish non-negative seed; derive it from (seed, epoch, rank, start).
    return int(np.random.SeedSequence([seed, epoch, rank, start]).generate_state(1)[0] & 0x7FFFFFFF)


def _is_memory_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return (
        isinstance(exc, torch.OutOfMemoryError)
        or "out of memory" in text
        or "bad_alloc" in text
        or "can't allocate" in text
        or "cudaerrormemoryallocation" in text
        or "cuda allocation failed" in text
    )


def build(spec: LoaderSpec) -> Loader:
    """Registry entry point for `--loader dali`."""
    return DaliLoader(spec)
