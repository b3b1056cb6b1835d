"""The augmentation spec, implemented for the torch backend (decode and resize: `data/transforms/decode.py`).

Train: RandomResizedCrop(scale, ratio) to `side`, horizontal flip, optional RandAugment or
TrivialAugmentWide (`data/transforms/policies.py`), optional random erasing (filled with the mean colour),
(normalise on device).
Val: resize the shorter side to resize_size, center crop `side`, (normalise on device).
The caller passes `side`, this epoch's (`LoaderSpec.crop_size(epoch)`): augment.image_size is
the schedule, which a transform never reads.
Both use bilinear filtering with antialiasing (PIL's default when downscaling), which is what
the DALI backend's `interp_type=INTERP_LINEAR, antialias=True` matches. The val path's sub-pixel
conventions (long side rounded, crop offset rounded half up) follow DALI's, so that the two
backends agree to a fraction of a grey level rather than differ by a one-pixel shift.

Which files are accepted and how they become RGB (16-bit and alpha handling, EXIF orientation,
the max_pixels guard) live in `stallfree.data.readers.imageio`, shared with the DALI backend's checks.
"""

from __future__ import annotations

import math
import random

import numpy as np

from stallfree.data.readers.imageio import DEFAULT_MAX_PIXELS, open_rgb
from stallfree.data.transforms.decode import decode_resized, jpeg_reduction, open_image
from stallfree.data.transforms.policies import auto_augment
from stallfree.recipe import AugmentConfig

__all__ = ["open_rgb", "random_resized_crop_box", "resized_shape", "train_transform", "val_transform"]


def random_resized_crop_box(
    width: int, height: int, scale: list[float], ratio: list[float], rng: random.Random
) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params: (left, top, crop_w, crop_h)."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        crop_w = int(round(math.sqrt(target_area * aspect)))
        crop_h = int(round(math.sqrt(target_area / aspect)))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            return rng.randint(0, width - crop_w), rng.randint(0, height - crop_h), crop_w, crop_h
    # Fallback: the whole image, clamped to the ratio range, centered.
    in_ratio = width / height
    if in_ratio < ratio[0]:
        crop_w, crop_h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        crop_w, crop_h = int(round(height * ratio[1])), height
    else:
        crop_w, crop_h = width, height
    return (width - crop_w) // 2, (height - crop_h) // 2, crop_w, crop_h


def train_transform(
    path: str,
    aug: AugmentConfig,
    side: int,
    seed: int,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    *,
    data: bytes | None = None,
) -> np.ndarray:
    """Decode, random-resized-crop, flip: uint8 HWC array of side x side.

    Raises BadImageError (before any pixel is decoded where the header tells) for a file that
    is not an image both backends decode alike, or that has more than `max_pixels` pixels.
    `data`: the file's bytes when already read (the torch workers read a batch's at once).
    """
    rng = random.Random(seed)
    opened = open_image(path, max_pixels, data)
    full_w, full_h = opened.width, opened.height
    left, top, crop_w, crop_h = random_resized_crop_box(full_w, full_h, aug.scale, aug.ratio, rng)
    flip = rng.random() < aug.hflip
    # DCT-scaled decode to the smallest size whose crop still covers `side` pixels on both axes.
    reduce = jpeg_reduction(opened, math.ceil(full_w * side / crop_w), math.ceil(full_h * side / crop_h))
    out = decode_resized(opened, (left, top, crop_w, crop_h), side, side, flip=flip, reduce=reduce)
    if aug.auto_augment != "none":
        out = auto_augment(
            out, aug.auto_augment, rng, n=aug.randaugment_n, m=aug.randaugment_m, bins=aug.magnitude_bins
        )
    if aug.random_erasing > 0 and rng.random() < aug.random_erasing:
        out = np.array(out)  # PIL's array is read-only
        top, left, h, w = erasing_box(side, aug, rng)
        out[top : top + h, left : left + w] = [round(m * 255) for m in aug.mean]
    return out


def erasing_box(size: int, aug: AugmentConfig, rng: random.Random) -> tuple[int, int, int, int]:
    """(top, left, h, w) of a random-erasing rectangle in a size x size crop: area a share of
    erasing_scale, log-uniform aspect ratio, clamped to the crop rather than redrawn. The DALI
    graph draws the same quantities in the same way (normalised coordinates)."""
    area = rng.uniform(*aug.erasing_scale)
    ratio = math.exp(rng.uniform(math.log(aug.erasing_ratio[0]), math.log(aug.erasing_ratio[1])))
    h_frac, w_frac = min(1.0, math.sqrt(area * ratio)), min(1.0, math.sqrt(area / ratio))
    top_frac, left_frac = rng.random() * (1 - h_frac), rng.random() * (1 - w_frac)
    return (round(top_frac * size), round(left_frac * size), round(h_frac * size), round(w_frac * size))


def val_transform(
    path: str,
    aug: AugmentConfig,
    side: int,
    seed: int = 0,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    *,
    data: bytes | None = None,
) -> np.ndarray:
    """Decode, resize the shorter side to resize_size, center crop side x side: uint8 HWC array.

    Raises BadImageError like `train_transform`; `data` as there.
    """
    opened = open_image(path, max_pixels, data)
    new_w, new_h = resized_shape(opened.width, opened.height, aug.resize_size)
    resized = decode_resized(opened, (0, 0, opened.width, opened.height), new_w, new_h)
    # Round half up, as DALI's crop_pos=0.5 does (torchvision rounds half to even: a 1 px shift).
    left = math.floor((new_w - side) / 2 + 0.5)
    top = math.floor((new_h - side) / 2 + 0.5)
    return np.ascontiguousarray(resized[top : top + side, left : left + side])


def resized_shape(width: int, height: int, short: int) -> tuple[int, int]:
    """(w, h) with the shorter side equal to `short`; the longer side rounded, as DALI's
    `resize_shorter` does (torchvision truncates: at most 1 px narrower)."""
    if width <= height:
        return short, round(short * height / width)
    return round(short * width / height), short
