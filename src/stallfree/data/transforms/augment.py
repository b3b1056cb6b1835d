"""The augmentation spec, implemented for the torch backend (decode and resize: `decode.py`).

Train: RandomResizedCrop(scale, ratio) to `side`, horizontal flip, optional RandAugment or
TrivialAugmentWide (`policies.py`), optional random erasing (filled with the mean colour).
Val: resize the shorter side to resize_size, center crop `side`. Both normalise on the device
and filter bilinearly with antialiasing, as the DALI backend's `INTERP_LINEAR, antialias=True`.
`side` is this epoch's (`LoaderSpec.crop_size(epoch)`); a transform never reads the schedule.
"""

from __future__ import annotations

import math

import numpy as np

from stallfree.data.readers.imageio import DEFAULT_MAX_PIXELS, open_rgb
from stallfree.data.transforms.decode import decode_resized, jpeg_reduction, open_image
from stallfree.data.transforms.draws import draw_train, erasing_box, random_resized_crop_box
from stallfree.data.transforms.policies import apply_ops
from stallfree.recipe import AugmentConfig

__all__ = [
    "erasing_box",
    "open_rgb",
    "random_resized_crop_box",
    "resized_shape",
    "train_transform",
    "val_transform",
]


def train_transform(
    path: str,
    aug: AugmentConfig,
    side: int,
    seed: int,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    *,
    data: bytes | None = None,
    exact: bool = False,
) -> np.ndarray:
    """Decode, random-resized-crop, flip: uint8 HWC array of side x side.

    Raises BadImageError (before any pixel is decoded where the header tells) for a file that
    is not an image both backends decode alike, or that has more than `max_pixels` pixels.
    `data`: the file's bytes when already read (the torch workers read a batch's at once).
    `exact`: decode in full, never DCT-scaled (`loader.torch.exact_decode`).
    """
    opened = open_image(path, max_pixels, data)
    full_w, full_h = opened.width, opened.height
    drawn = draw_train(full_w, full_h, aug, side, seed)  # the DALI loader's draws too
    left, top, crop_w, crop_h = drawn.box
    # DCT-scaled decode to the smallest size whose crop still covers `side` pixels on both axes;
    # `exact` decodes in full, as DALI does (the scaled IDCT moves a small crop by grey levels).
    need_w, need_h = math.ceil(full_w * side / crop_w), math.ceil(full_h * side / crop_h)
    reduce = 1 if exact else jpeg_reduction(opened, need_w, need_h)
    out = decode_resized(opened, drawn.box, side, side, flip=drawn.flip, reduce=reduce)
    if drawn.ops:
        out = apply_ops(out, aug.auto_augment, drawn.ops, aug.magnitude_bins)
    if drawn.erase is not None:
        out = np.array(out)  # PIL's array is read-only
        top, left, h, w = drawn.erase
        out[top : top + h, left : left + w] = [round(m * 255) for m in aug.mean]
    return out


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

    The sub-pixel conventions (long side rounded, crop offset rounded half up) follow DALI's, so
    that the two backends agree to a fraction of a grey level rather than differ by a one-pixel
    shift. Raises BadImageError like `train_transform` (rules: `readers/imageio.py`); `data` as there.
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
