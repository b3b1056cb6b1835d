"""A training sample's random draws, one function per choice, made from the sample's own seed.

Both loaders call `draw_train` with the image's displayed size (after EXIF orientation) and the
sample's seed (`sharding.sample_seeds`): the torch workers apply the draws to the pixels they
decode (`augment.train_transform`), the DALI loader hands them to its graph with the bytes. The
two loaders therefore augment every sample alike, and neither keeps a random state between
samples: a resume, a requeue or another world size needs no state but positions.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from stallfree.data.transforms.policies import draw_ops
from stallfree.recipe import AugmentConfig

__all__ = ["Draws", "draw_train", "erasing_box", "random_resized_crop_box"]


@dataclass(frozen=True, slots=True)
class Draws:
    """What one training sample drew: the crop box in displayed pixels (left, top, w, h), the
    flip, the auto-augment operations (suite index, magnitude bin, negated) and the erasing box
    in the crop's pixels (top, left, h, w), None when the coin said no."""

    box: tuple[int, int, int, int]
    flip: bool
    ops: tuple[tuple[int, int, bool], ...] = ()
    erase: tuple[int, int, int, int] | None = None


def draw_train(width: int, height: int, aug: AugmentConfig, side: int, seed: int) -> Draws:
    """Every random choice of one training sample of `width` x `height` cropped to `side`, from
    one stream in this order: the RandomResizedCrop box, the flip, the auto-augment operations
    (`policies.draw_ops`), then the erasing coin and box."""
    rng = random.Random(seed)
    box = random_resized_crop_box(width, height, aug.scale, aug.ratio, rng)
    flip = rng.random() < aug.hflip
    ops: tuple[tuple[int, int, bool], ...] = ()
    if aug.auto_augment != "none":
        ops = draw_ops(
            aug.auto_augment, rng, n=aug.randaugment_n, m=aug.randaugment_m, bins=aug.magnitude_bins
        )
    erase = None
    if aug.random_erasing > 0 and rng.random() < aug.random_erasing:
        erase = erasing_box(side, aug, rng)
    return Draws(box, flip, ops, erase)


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


def erasing_box(size: int, aug: AugmentConfig, rng: random.Random) -> tuple[int, int, int, int]:
    """(top, left, h, w) of a random-erasing rectangle in a size x size crop: area a share of
    erasing_scale, log-uniform aspect ratio, clamped to the crop rather than redrawn."""
    area = rng.uniform(*aug.erasing_scale)
    ratio = math.exp(rng.uniform(math.log(aug.erasing_ratio[0]), math.log(aug.erasing_ratio[1])))
    h_frac, w_frac = min(1.0, math.sqrt(area * ratio)), min(1.0, math.sqrt(area / ratio))
    top_frac, left_frac = rng.random() * (1 - h_frac), rng.random() * (1 - w_frac)
    return (round(top_frac * size), round(left_frac * size), round(h_frac * size), round(w_frac * size))
