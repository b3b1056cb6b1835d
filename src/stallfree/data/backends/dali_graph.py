"""The `dali` backend's graph: one NVIDIA DALI pipeline for the GPU (nvJPEG, `mixed`) and the CPU.

Decode (ROI-fused with the crop in training), resize, flip, the auto-augment operations, random
erasing and normalisation, each matching the torch backend's transforms
(`stallfree.data.transforms`). The graph draws nothing: every random choice of a training sample
comes with its bytes through the external source (`draw_columns`, from `draws.draw_train`), so
both loaders augment each sample alike. The loader that feeds and drives it is `dali_backend`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np
import torch

from stallfree.data.loader import LoaderSpec
from stallfree.data.registry import BackendError
from stallfree.data.transforms.draws import Draws
from stallfree.data.transforms.policies import FILL, MAX_TRANSLATE, SUITES
from stallfree.recipe import AugmentConfig

# Without DALI, importing this module raises BackendError with the install command.
try:
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.auto_aug import rand_augment, trivial_augment
    from nvidia.dali.auto_aug.core import select, signed_bin
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


__all__ = ["DALIGenericIterator", "LastBatchPolicy", "draw_columns", "image_pipeline"]

# nvJPEG buffer sizes from NVIDIA's ResNet-50 example: big enough for ImageNet's largest
# images, so buffers are allocated once instead of growing mid-run.
_GPU_DECODER_HINTS = {
    "device_memory_padding": 211_025_920,
    "host_memory_padding": 140_544_512,
    "preallocate_width_hint": 5_980,
    "preallocate_height_hint": 6_430,
}


# Conditionals: the auto-augment operations are chosen per sample with `if`.
@pipeline_def(enable_conditionals=True)
def image_pipeline(
    *,
    source: Callable[[], Iterator[Any]],
    spec: LoaderSpec,
    decode_device: str,
    augment_on_gpu: bool,
    raw_uint8: bool = False,
) -> tuple[Any, Any]:
    """Decode, crop/resize, flip, normalise. `decode_device` is "mixed" or "cpu"; `source()`
    yields this rank's batches of one epoch as (encoded bytes, labels, crop sides) and, in
    training, the columns of `draw_columns`: the side comes with every sample, so one pipeline
    follows a progressive-resizing schedule.

    `raw_uint8`: stop before normalising and hand uint8 HWC to the caller (a CPU graph feeding a
    GPU run: a quarter of the bytes to copy, normalised on the GPU like the torch backend's).
    """
    aug = spec.augment
    columns = _columns(aug) if spec.train else {}
    # cycle="raise": the end of the source ends DALI's epoch, and a reset calls `source` again.
    jpegs, label, size, *drawn = fn.external_source(
        # DALI's stub omits generator functions, which it takes (its SourceKind.GENERATOR_FUNC);
        # a cast, not an ignore, as it is checked both with DALI's stub and without DALI.
        source=cast(Any, source),
        num_outputs=3 + len(columns),
        batch=True,
        cycle="raise",
        dtype=[types.UINT8, types.INT64, types.FLOAT, *columns.values()],
    )
    draws = dict(zip(columns, drawn))
    # Fancy (smooth) chroma upsampling is the mixed decoder's opt-in and PIL's default: without
    # it, GPU-decoded pixels would drift from the parity measured on the CPU.
    hints = (
        _GPU_DECODER_HINTS | {"hw_decoder_load": spec.options.hw_decoder_load, "jpeg_fancy_upsampling": True}
        if decode_device == "mixed"
        else {}
    )
    if spec.train:
        images, mirror = _train_images(jpegs, draws, size, aug, decode_device, augment_on_gpu, hints)
    else:
        images, mirror = _val_images(jpegs, aug, decode_device, augment_on_gpu, hints), 0
    # The center crop of the side (a train crop is already that side), the flip, and the output.
    out = (
        {"dtype": types.UINT8, "output_layout": "HWC"}
        if raw_uint8
        else {
            "mean": [m * 255 for m in aug.mean],
            "std": [s * 255 for s in aug.std],
            "dtype": types.FLOAT16 if spec.dtype == torch.float16 else types.FLOAT,
            "output_layout": "HWC" if spec.channels_last else "CHW",
        }
    )
    images = fn.crop_mirror_normalize(
        images, crop_h=size, crop_w=size, crop_pos_x=0.5, crop_pos_y=0.5, mirror=mirror, **out
    )
    return images, label.gpu() if augment_on_gpu and not raw_uint8 else label


# Bilinear with antialiasing is what PIL's resize does: the torch backend's interpolation.
_RESIZE = {"interp_type": types.INTERP_LINEAR, "antialias": True}


def _columns(aug: AugmentConfig) -> dict[str, Any]:
    """The training draws the source hands over after (bytes, label, side), with their types:
    only those the graph uses (DALI warns about the others)."""
    columns = {"anchor": types.FLOAT, "shape": types.FLOAT, "flip": types.INT32}
    if aug.random_erasing > 0:
        columns |= {"erase_anchor": types.FLOAT, "erase_shape": types.FLOAT}
    return columns | {"ops": types.INT32} if aug.auto_augment != "none" else columns


def draw_columns(drawn: list[Draws], side: int, aug: AugmentConfig) -> list[list[np.ndarray]]:
    """A batch's draws as the source's columns of `_columns`, one array per sample each: the
    crop's (x, y) and (w, h), the flip, the erasing box's (top, left) and (h, w) (0 x 0 when the
    coin said no) and, with a policy, the operations as rows of (index, bin, negated)."""
    policy, erasing = aug.auto_augment != "none", aug.random_erasing > 0
    columns: list[list[np.ndarray]] = [[] for _ in range(3 + 2 * erasing + policy)]
    for d in drawn:
        left, top, w, h = d.box
        row = [
            np.array([left, top], np.float32),
            np.array([w, h], np.float32),
            np.array(int(d.flip), np.int32),
        ]
        if erasing:
            e_top, e_left, e_h, e_w = d.erase or (0, 0, 0, 0)
            if d.flip and not policy:
                # Without a policy the flip comes last (fused into the normalisation): the box
                # is erased where the flip will put the torch backend's.
                e_left = side - e_left - e_w
            row += [np.array([e_top, e_left], np.float32), np.array([e_h, e_w], np.float32)]
        if policy:
            row.append(np.array(d.ops, np.int32).reshape(-1, 3))
        for column, value in zip(columns, row, strict=True):
            column.append(value)
    return columns


def _val_images(
    jpegs: Any, aug: AugmentConfig, decode_device: str, augment_on_gpu: bool, hints: dict[str, Any]
) -> Any:
    """The whole image, its shorter side resized to `resize_size` (the center crop comes after)."""
    images = fn.decoders.image(jpegs, device=decode_device, output_type=types.RGB, **hints)
    if augment_on_gpu and decode_device == "cpu":
        images = images.gpu()
    return fn.resize(images, resize_shorter=aug.resize_size, **_RESIZE)


def _train_images(
    jpegs: Any,
    draws: dict[str, Any],
    size: Any,
    aug: AugmentConfig,
    decode_device: str,
    augment_on_gpu: bool,
    hints: dict[str, Any],
) -> tuple[Any, Any]:
    """The crop (ROI decode: only its pixels are decoded, nvJPEG's on `mixed`), resized to the
    side, then the policy and erasing; and the flip still to apply (0 when applied here)."""
    images = fn.decoders.image_slice(
        jpegs,
        draws["anchor"],
        draws["shape"],
        device=decode_device,
        output_type=types.RGB,
        axis_names="WH",
        normalized_anchor=False,
        normalized_shape=False,
        **hints,
    )
    if augment_on_gpu and decode_device == "cpu":
        images = images.gpu()
    images = fn.resize(images, resize_x=size, resize_y=size, **_RESIZE)
    mirror = draws["flip"]
    if "ops" in draws:
        # Flip first, as the torch backend (and torchvision) do: a shear about the origin
        # leaves its uncovered wedge on one side, which a later flip would move.
        images = _apply_ops(fn.flip(images, horizontal=mirror), draws["ops"], aug)
        mirror = 0
    if aug.random_erasing > 0:
        images = fn.erase(
            images,
            anchor=draws["erase_anchor"],
            shape=draws["erase_shape"],
            axis_names="HW",
            fill_value=[float(round(m * 255)) for m in aug.mean],
        )
    return images, mirror


def dali_suite(policy: str) -> list[Any]:
    """DALI's augmentations of `policy`, in the order of `policies.SUITES[policy]` (whose
    indices the draws carry), with its translation range."""
    getter = (
        rand_augment.get_rand_augment_suite
        if policy == "randaugment"
        else trivial_augment.get_trivial_augment_wide_suite
    )
    by_name = {op.name: op for op in getter(use_shape=True, max_translate_rel=MAX_TRANSLATE[policy])}
    return [by_name[op.name] for op in SUITES[policy]]


def _apply_ops(images: Any, ops: Any, aug: AugmentConfig) -> Any:
    """The drawn operations (rows of `ops`: suite index, magnitude bin, negated), in order,
    with the translation range and fill of `stallfree.data.transforms.policies`."""
    suite = dali_suite(aug.auto_augment)
    steps = aug.randaugment_n if aug.auto_augment == "randaugment" else 1
    with warnings.catch_warnings():
        # DALI's suites call the deprecated experimental aliases of filter and equalize, and
        # DALI forces that warning past every filter, once per operation and run.
        warnings.showwarning = lambda *args, **kwargs: None
        for step in range(steps):
            images = select(
                suite,
                ops[step, 0],
                data=images,
                magnitude_bin=signed_bin(ops[step, 1], ops[step, 2]),
                num_magnitude_bins=aug.magnitude_bins,
                shape=images.shape(),
                fill_value=FILL,
            )
    return images
