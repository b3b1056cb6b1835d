"""The `dali` backend's graph: one NVIDIA DALI pipeline for the GPU (nvJPEG, `mixed`) and the CPU.

Decode (ROI-fused with RandomResizedCrop in training), resize, flip, the auto-augment suites,
random erasing and normalisation, each matching the torch backend's transforms
(`stallfree.data.transforms`). The loader that feeds and drives it is `dali_backend`. Importing
this module raises `BackendError` with the install command where DALI is missing.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch

from stallfree.data.loader import LoaderSpec
from stallfree.data.registry import BackendError
from stallfree.data.transforms.policies import FILL, MAX_TRANSLATE

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


__all__ = ["DALIGenericIterator", "LastBatchPolicy", "image_pipeline"]

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
        # DALI's stub omits generator functions, which it takes (its SourceKind.GENERATOR_FUNC);
        # a cast, not an ignore, as it is checked both with DALI's stub and without DALI.
        source=cast(Any, source),
        num_outputs=3,
        batch=True,
        cycle="raise",
        dtype=[types.UINT8, types.INT64, types.FLOAT],
    )
    # Fancy (smooth) chroma upsampling is the mixed decoder's opt-in and PIL's default: without
    # it, GPU-decoded pixels would drift from the parity measured on the CPU.
    hints = (
        _GPU_DECODER_HINTS | {"hw_decoder_load": spec.options.hw_decoder_load, "jpeg_fancy_upsampling": True}
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
    fill that `stallfree.data.transforms.policies` (the torch backend's twin) declares."""
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
