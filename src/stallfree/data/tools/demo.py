"""A deterministic, procedurally drawn JPEG ImageFolder that a small CNN can learn.

Ten shape classes drawn with random colour, size, position and rotation over a cluttered,
noisy background, at photo-like sizes (short side 200-500 px, mixed aspect ratios), with a
few grayscale files. Not trivially separable by colour or texture statistics alone.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter
from tqdm import tqdm

from stallfree.data.tools.staging import fresh_folder, move_into_place
from stallfree.errors import StallfreeError
from stallfree.log import LOGGER

Color = tuple[int, int, int]
# draw(canvas, cx, cy, radius, rotation, colour, background colour)
Shape = Callable[[ImageDraw.ImageDraw, float, float, float, float, Color, Color], None]


def _polygon(sides: int, star: bool = False) -> Shape:
    def draw(
        d: ImageDraw.ImageDraw, cx: float, cy: float, r: float, rot: float, col: Color, bg: Color
    ) -> None:
        points = []
        count = sides * 2 if star else sides
        for k in range(count):
            radius = r * (0.45 if star and k % 2 else 1.0)
            angle = rot + 2 * math.pi * k / count
            points.append((cx + radius * math.cos(angle), cy + radius * math.sin(angle)))
        d.polygon(points, fill=col)

    return draw


def _circle(d, cx, cy, r, rot, col, bg) -> None:  # type: ignore[no-untyped-def]
    d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=col)


def _ring(d, cx, cy, r, rot, col, bg) -> None:  # type: ignore[no-untyped-def]
    d.ellipse((cx - r, cy - r, cx + r, cy + r), outline=col, width=max(3, int(r * 0.28)))


def _cross(d, cx, cy, r, rot, col, bg) -> None:  # type: ignore[no-untyped-def]
    w = r * 0.32
    for a in (rot, rot + math.pi / 2):
        dx, dy, px, py = math.cos(a) * r, math.sin(a) * r, -math.sin(a) * w, math.cos(a) * w
        d.polygon(
            [
                (cx - dx + px, cy - dy + py),
                (cx + dx + px, cy + dy + py),
                (cx + dx - px, cy + dy - py),
                (cx - dx - px, cy - dy - py),
            ],
            fill=col,
        )


def _crescent(d, cx, cy, r, rot, col, bg) -> None:  # type: ignore[no-untyped-def]
    d.ellipse((cx - r, cy - r, cx + r, cy + r), fill=col)
    ox, oy = cx + 0.45 * r * math.cos(rot), cy + 0.45 * r * math.sin(rot)
    d.ellipse((ox - 0.8 * r, oy - 0.8 * r, ox + 0.8 * r, oy + 0.8 * r), fill=bg)  # the bite


def _stripes(d, cx, cy, r, rot, col, bg) -> None:  # type: ignore[no-untyped-def]
    for k in range(-3, 4):
        off = k * r * 0.3
        px, py = -math.sin(rot) * off, math.cos(rot) * off
        dx, dy = math.cos(rot) * r, math.sin(rot) * r
        d.line(
            (cx - dx + px, cy - dy + py, cx + dx + px, cy + dy + py), fill=col, width=max(2, int(r * 0.12))
        )


def _checker(d, cx, cy, r, rot, col, bg) -> None:  # type: ignore[no-untyped-def]
    cell = r / 2
    for i in range(4):
        for j in range(4):
            if (i + j) % 2 == 0:
                x0, y0 = cx - r + i * cell, cy - r + j * cell
                d.rectangle((x0, y0, x0 + cell, y0 + cell), fill=col)


CLASSES: dict[str, Shape] = {
    "circle": _circle,
    "square": _polygon(4),
    "triangle": _polygon(3),
    "hexagon": _polygon(6),
    "star": _polygon(5, star=True),
    "cross": _cross,
    "ring": _ring,
    "crescent": _crescent,
    "stripes": _stripes,
    "checker": _checker,
}
SPLITS = {"train": 0, "val": 1}
COMPLETE = ".complete"  # written last: the demo's settings, and that every file is there


def _random_color(rng: np.random.Generator) -> Color:
    return tuple(int(v) for v in rng.integers(0, 256, size=3))  # type: ignore[return-value]


def pink_noise(height: int, width: int, rng: np.random.Generator, alpha: float = 1.1) -> np.ndarray:
    """Colour texture with a 1/f^alpha spectrum, the power law of natural images; unit variance."""
    fy, fx = np.fft.fftfreq(height)[:, None], np.fft.rfftfreq(width)[None, :]
    freq = np.sqrt(fx**2 + fy**2)
    freq[0, 0] = 1.0
    amplitude = freq**-alpha
    channels = [
        np.fft.irfft2(amplitude * np.exp(2j * np.pi * rng.random(amplitude.shape)), s=(height, width))
        for _ in range(3)
    ]
    # Correlated channels, as in photos, rather than three independent greys.
    texture = np.stack(channels, axis=-1) @ (np.eye(3) + 0.3 * rng.normal(size=(3, 3)))
    return (texture - texture.mean()) / texture.std()


def draw_image(
    class_index: int, rng: np.random.Generator, photo_like: bool = False, scale: float = 1.0
) -> Image.Image:
    """One sample of class `class_index`: shape over clutter, noise, photo-like size.

    `photo_like` adds a natural-image texture (short side 333-500): JPEGs near 100 KB that
    cost what ImageNet files cost to decode, where flat drawings would flatter every loader.
    `scale` shrinks the short side (0.2: 40-100 px), for tests that need many cheap images;
    the random draws are the same, so each class looks the same, smaller.
    """
    short = int(rng.integers(333, 501) if photo_like else rng.integers(200, 501))
    short = max(16, int(short * scale))
    aspect = float(rng.uniform(0.75, 1.6))
    w, h = (int(short * aspect), short) if rng.random() < 0.7 else (short, int(short * aspect))
    bg = _random_color(rng)
    img = Image.new("RGB", (w, h), bg)
    d = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(4, 12))):  # clutter: lines and small blobs
        x, y = rng.uniform(0, w), rng.uniform(0, h)
        if rng.random() < 0.5:
            d.line(
                (x, y, x + rng.uniform(-w / 3, w / 3), y + rng.uniform(-h / 3, h / 3)),
                fill=_random_color(rng),
                width=int(rng.integers(1, 5)),
            )
        else:
            s = rng.uniform(4, max(4.0, short * 0.06))
            d.ellipse((x - s, y - s, x + s, y + s), fill=_random_color(rng))
    r = rng.uniform(0.18, 0.38) * short
    cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
    col = _random_color(rng)
    while sum(abs(a - b) for a, b in zip(col, bg)) < 150:  # keep the shape visible
        col = _random_color(rng)
    list(CLASSES.values())[class_index](d, cx, cy, r, rng.uniform(0, 2 * math.pi), col, bg)
    img = img.filter(ImageFilter.GaussianBlur(radius=float(rng.uniform(0, 1.2))))
    pixels = np.asarray(img, dtype=np.float32) + rng.normal(0, rng.uniform(3, 14), (h, w, 3))
    if photo_like:
        pixels += pink_noise(h, w, rng) * rng.uniform(35, 55)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def write_demo(
    out: str | Path,
    *,
    train_per_class: int = 120,
    val_per_class: int = 30,
    seed: int = 0,
    gray_every: int = 25,
    progress: bool = True,
    photo_like: bool = False,
    scale: float = 1.0,
) -> Path:
    """Write `out/{train,val}/<class>/*.jpg` and mark it complete with `out/.complete`
    (`scale`: a smaller short side, see `draw_image`). OUT must be new or empty, or hold this
    very demo already (then nothing is written); the files are written beside it and renamed
    into place, so an interrupted demo leaves nothing at OUT."""
    out = Path(out)
    stamp = f"seed={seed} train={train_per_class} val={val_per_class} photo_like={photo_like}\n"
    if _holds_demo(out, stamp):
        LOGGER.info(f"{out} already holds this demo ({stamp.strip()}): nothing to write")
        return out
    counts = {"train": train_per_class, "val": val_per_class}
    jobs = [(split, c, i) for split in SPLITS for c in range(len(CLASSES)) for i in range(counts[split])]
    names = list(CLASSES)
    staging = fresh_folder(out.absolute().parent, f".{out.name}.demo-")
    try:
        for split, c, i in tqdm(jobs, desc=f"demo data -> {out}", disable=not progress, unit="img"):
            rng = np.random.default_rng([seed, SPLITS[split], c, i])
            img = draw_image(c, rng, photo_like, scale)
            if gray_every and i % gray_every == gray_every - 1:
                img = img.convert("L")
            path = staging / split / names[c] / f"{names[c]}_{i:05d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            img.save(path, quality=int(rng.integers(75, 96) if photo_like else rng.integers(80, 96)))
        (staging / COMPLETE).write_text(stamp)
        move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _holds_demo(out: Path, stamp: str) -> bool:
    """True when OUT is this demo, complete; False when it is absent or empty; else refused:
    a demo is never merged into another dataset, nor into a demo of other settings."""
    if out.exists() and not out.is_dir():
        raise DemoError(f"{out} is a file; pass a folder (new, or empty) for the demo data")
    if not out.is_dir() or not any(out.iterdir()):
        return False
    done = out / COMPLETE
    if not done.is_file():
        raise DemoError(
            f"{out} is not empty and holds no demo of ours ({COMPLETE} missing): write the demo "
            "into a new or empty folder, or remove this one first"
        )
    if done.read_text() != stamp:
        raise DemoError(
            f"{out} holds a demo of other settings ({done.read_text().strip()}), not "
            f"{stamp.strip()}: write this one into another folder, or remove {out} first"
        )
    return True


class DemoError(StallfreeError, ValueError):
    """An output folder `data demo` cannot write into; the message names it and the fix."""
