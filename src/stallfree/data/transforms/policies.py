"""RandAugment and TrivialAugmentWide for the torch backend, op for op DALI's suites.

The DALI backend runs `nvidia.dali.auto_aug`'s suites in its graph; this module is the same
suites for the torch backend's workers: the same operations, magnitude ranges, bins, random
signs and fill, applied to the uint8 crop after the flip and before normalising and random
erasing (torchvision's and timm's order). Both loaders apply the operations `draw_ops` drew from
the sample's seed (`draws.draw_train`): they agree to about a grey level (tests/unit/test_autoaug.py).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

FILL = 128  # DALI's fill for the pixels a warp uncovers (its auto_aug default)


@dataclass(frozen=True)
class Op:
    """One operation of a suite: magnitudes are linspace(low, high, bins), negated with
    probability 1/2 when `signed` (DALI's `randomly_negate`)."""

    name: str
    low: float = 0.0
    high: float = 0.0
    signed: bool = False

    def value(self, magnitude_bin: int, bins: int, negative: bool) -> float:
        """The operation's parameter for a bin (DALI's `magnitudes[bin] * (-1) ** sign`)."""
        value = self.low if bins == 1 else self.low + (self.high - self.low) * magnitude_bin / (bins - 1)
        return -value if negative and self.signed else value


def _suite(
    translate: float, shear: float, rotate: float, enhance: tuple[float, float], posterize_bits: float
) -> tuple[Op, ...]:
    return (
        Op("translate_x", 0, translate, True),
        Op("translate_y", 0, translate, True),
        Op("shear_x", 0, shear, True),
        Op("shear_y", 0, shear, True),
        Op("rotate", 0, rotate, True),
        *(Op(name, *enhance, True) for name in ("brightness", "contrast", "color", "sharpness")),
        Op("posterize", 8, posterize_bits),
        Op("solarize", 256, 0),
        Op("equalize"),
        Op("auto_contrast"),
        Op("identity"),
    )


# The largest translation, a share of the crop's side (DALI's max_translate_rel, its `shape=`
# form), scaled so that a 224 px crop gets DALI's absolute defaults: 100 px and 32 px.
MAX_TRANSLATE = {"randaugment": 100 / 224, "trivialaugment": 32 / 224}
# get_rand_augment_suite and get_trivial_augment_wide_suite of nvidia.dali.auto_aug.
SUITES: dict[str, tuple[Op, ...]] = {
    "randaugment": _suite(MAX_TRANSLATE["randaugment"], 0.3, 30, (0, 0.9), 4),
    "trivialaugment": _suite(MAX_TRANSLATE["trivialaugment"], 0.99, 135, (0.01, 0.99), 2),
}


def _warp(img: torch.Tensor, forward: np.ndarray) -> torch.Tensor:
    """DALI's warp_affine (inverse_map=False, linear, constant fill): `forward` maps input to
    output pixel coordinates (x right, y down, pixel i spanning [i, i+1])."""
    h, w = img.shape[1:]
    inverse = np.linalg.inv(np.vstack([forward, [0, 0, 1]]))[:2]
    # grid_sample wants the inverse map in [-1, 1] coordinates (align_corners=False).
    to_unit = np.array([[2 / w, 0, -1], [0, 2 / h, -1], [0, 0, 1]])
    from_unit = np.linalg.inv(to_unit)
    theta = (to_unit @ np.vstack([inverse, [0, 0, 1]]) @ from_unit)[:2]
    grid = F.affine_grid(torch.tensor(theta, dtype=torch.float32)[None], [1, 3, h, w], align_corners=False)
    # Sampling (img - FILL) with zero padding blends the border towards FILL, as DALI does.
    out = (
        F.grid_sample(
            img[None].float() - FILL, grid, mode="bilinear", padding_mode="zeros", align_corners=False
        )[0]
        + FILL
    )
    return _to_uint8(out)


def _to_uint8(x: torch.Tensor) -> torch.Tensor:
    return x.round().clamp_(0, 255).to(torch.uint8)


def _rotation(angle: float, w: int, h: int) -> np.ndarray:
    """DALI's fn.rotate about the image centre (keep_size): positive is counter-clockwise on
    screen (y down)."""
    c, s = math.cos(math.radians(angle)), math.sin(math.radians(angle))
    cx, cy = w / 2, h / 2
    return np.array([[c, s, cx - c * cx - s * cy], [-s, c, cy + s * cx - c * cy]])


def _blend_grey(img: torch.Tensor, factor: float, grey: torch.Tensor) -> torch.Tensor:
    return _to_uint8(grey + (img.float() - grey) * factor)


_LUMA = torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1)


def _translate(img: torch.Tensor, dx: float, dy: float) -> torch.Tensor:
    """A warp by (dx, dy), as two-tap linear interpolation along one axis: what `_warp` gives
    for a translation, in a tenth of its time."""
    axis, shift = (2, dx) if dx else (1, dy)
    whole = math.floor(shift)
    frac, size, pad = shift - whole, img.shape[axis], abs(whole) + 2
    centred = img.float() - FILL  # zero padding is the fill, as in `_warp`
    padded = F.pad(centred, (pad, pad) if axis == 2 else (0, 0, pad, pad))
    out = (
        padded.narrow(axis, pad - whole, size) * (1 - frac)
        + padded.narrow(axis, pad - whole - 1, size) * frac
    )
    return _to_uint8(out + FILL)


def _sharpen(img: torch.Tensor, magnitude: float) -> torch.Tensor:
    """DALI's 3x3 sharpness filter (PIL's SMOOTH kernel [[1,1,1],[1,5,1],[1,1,1]] / 13 blended
    with identity), with its default border (reflect-101); the kernel as a 3x3 box sum plus 4
    times the centre, which is several times faster than conv2d on one core."""
    h, w = img.shape[1:]
    # Reflect-101 needs 2 pixels a side; a 1-pixel side can only repeat its pixel.
    mode = "reflect" if min(h, w) >= 2 else "replicate"
    x = img.float()
    padded = F.pad(x[None], (1, 1, 1, 1), mode=mode)[0]
    box = sum(padded[:, i : i + h, j : j + w] for i in range(3) for j in range(3))
    blur = (box + 4 * x) / 13
    return _to_uint8((1 + magnitude) * x - magnitude * blur)


def _equalize(img: torch.Tensor) -> torch.Tensor:
    """OpenCV's equalizeHist per channel (DALI's fn.equalize)."""
    out = torch.empty_like(img)
    for c in range(img.shape[0]):
        channel = img[c].flatten().long()
        hist = torch.bincount(channel, minlength=256)
        first = int(torch.nonzero(hist)[0])
        total = channel.numel()
        if hist[first] == total:
            out[c] = img[c]
            continue
        cdf = torch.cumsum(hist, 0).double()
        lut = _to_uint8((cdf - hist[first]) * (255.0 / (total - hist[first])))
        lut[:first] = 0
        out[c] = lut[channel].view(img.shape[1:])
    return out


def _auto_contrast(img: torch.Tensor) -> torch.Tensor:
    flat = img.flatten(1)
    lo, hi = flat.min(1).values.view(3, 1, 1), flat.max(1).values.view(3, 1, 1)
    diff = (hi - lo).float()
    scale = torch.where(diff > 0, 255 / diff.clamp(min=1), torch.ones_like(diff))
    return _to_uint8((img - torch.where(diff > 0, lo, 0)).float() * scale)


def _posterize_mask(bits: float) -> int:
    kept = min(max(round(bits), 1), 8)
    return 255 ^ (2 ** (8 - kept) - 1)


def apply_op(img: torch.Tensor, name: str, value: float) -> torch.Tensor:
    """One operation on a uint8 CHW image with its parameter `value` (a shift relative to the
    side for translations, a shear, degrees, an enhance factor minus 1, bits, a threshold)."""
    h, w = img.shape[1:]
    if name in ("translate_x", "translate_y", "shear_x", "shear_y"):
        dx, dy = (value * w, 0.0) if name == "translate_x" else (0.0, value * h)
        if name.startswith("shear"):
            shear_x, shear_y = (value, 0.0) if name == "shear_x" else (0.0, value)
            return _warp(img, np.array([[1, shear_x, 0], [shear_y, 1, 0]]))
        return _translate(img, dx, dy)
    if name == "rotate":
        return _warp(img, _rotation(value, w, h))
    if name == "brightness":
        return _to_uint8(img.float() * (1 + value))
    if name == "contrast":  # PIL's centre: the luma-weighted mean of the channel means
        centre = (img.float().mean((1, 2), keepdim=True) * _LUMA).sum()
        return _blend_grey(img, 1 + value, centre)
    if name == "color":  # saturation: a blend with the luma grey
        return _blend_grey(img, 1 + value, (img.float() * _LUMA).sum(0, keepdim=True))
    if name == "sharpness":
        return _sharpen(img, value)
    if name == "posterize":
        return img & _posterize_mask(value)
    if name == "solarize":
        return torch.where(img < value, img, 255 - img)
    if name == "equalize":
        return _equalize(img)
    if name == "auto_contrast":
        return _auto_contrast(img)
    if name == "identity":
        return img
    raise ValueError(f"unknown augmentation {name!r}; known: {[op.name for op in SUITES['randaugment']]}")


def draw_ops(
    policy: str, rng: random.Random, *, n: int = 2, m: int = 9, bins: int = 31
) -> tuple[tuple[int, int, bool], ...]:
    """RandAugment's `n` operations at bin `m`, or TrivialAugmentWide's one at a random bin,
    drawn from `rng`: (index in SUITES[policy], magnitude bin, negated) per operation."""
    suite = SUITES[policy]
    drawn = []
    for _ in range(n if policy == "randaugment" else 1):
        index = rng.randrange(len(suite))
        magnitude_bin = m if policy == "randaugment" else rng.randrange(bins)
        drawn.append((index, magnitude_bin, rng.random() < 0.5))
    return tuple(drawn)


def apply_ops(
    image: np.ndarray, policy: str, ops: tuple[tuple[int, int, bool], ...], bins: int
) -> np.ndarray:
    """A uint8 HWC crop through the operations `draw_ops` drew, in order."""
    suite = SUITES[policy]
    img = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)
    for index, magnitude_bin, negative in ops:
        op = suite[index]
        img = apply_op(img, op.name, op.value(magnitude_bin, bins, negative))
    return img.permute(1, 2, 0).contiguous().numpy()


def auto_augment(
    image: np.ndarray, policy: str, rng: random.Random, *, n: int = 2, m: int = 9, bins: int = 31
) -> np.ndarray:
    """A uint8 HWC crop through RandAugment or TrivialAugmentWide, drawn from `rng`."""
    return apply_ops(image, policy, draw_ops(policy, rng, n=n, m=m, bins=bins), bins)
