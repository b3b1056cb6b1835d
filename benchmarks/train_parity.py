"""Train-crop parity: per image, the mean absolute difference in grey levels between the DALI and
torch loaders' train crops (the same draws, epoch 0), with the torch loader's default DCT-scaled
decode and in strict mode (`loader.torch.exact_decode = true`: decoded in full, as DALI does).
Also the torch train transform's single-thread rate in each mode: what strict mode costs.

stallfree data demo data/photo --photo-like --train-per-class 100 --val-per-class 20
python benchmarks/train_parity.py data/photo            # 32 and 224 px
python benchmarks/train_parity.py data/photo --sizes 64
python benchmarks/train_parity.py --smoke               # 20 photo-like images in a temp folder, 32 px

Exit status 1 when a strict-mode crop differs from DALI's by more than one grey level.
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

import stallfree
from stallfree.data.loader import Loader
from stallfree.data.tools.demo import write_demo
from stallfree.data.transforms.augment import train_transform
from stallfree.recipe import AugmentConfig

RAW = {"mean": [0.0, 0.0, 0.0], "std": [1 / 255] * 3}  # "normalised" output = uint8 pixel values
MODES = {"torch": "DCT-scaled (default)", "torch-exact": "full (exact_decode)"}
STRICT_BOUND = 1.0  # grey levels, per image: strict mode's promise


def _loader(root: str, size: int, mode: str) -> Loader:
    recipe = {
        "data": {"root": root},
        "augment": {"image_size": size, "resize_size": size, **RAW},
        "train": {"batch_size": 8, "precision": "fp32", "device": "cpu"},
        "loader": {
            "backend": "dali" if mode == "dali" else "torch",
            "torch": {"workers": 1, "exact_decode": mode == "torch-exact"},
            "dali": {"threads": 1},
        },
    }
    return stallfree.loader(recipe, "train", device="cpu")


def _images(loader: Loader) -> Iterator[torch.Tensor]:
    return (batch.images for batch in loader)


def parity(root: str, size: int) -> dict[str, tuple[float, float, int]]:
    """{torch mode: (mean over images, worst image, images)} of the per-image mean |dali - torch|
    over the whole train split's epoch 0; the three loaders run in step, one batch at a time."""
    loaders = {mode: _loader(root, size, mode) for mode in ("dali", *MODES)}
    per_image: dict[str, list[torch.Tensor]] = {mode: [] for mode in MODES}
    try:
        streams = [_images(loaders[mode]) for mode in ("dali", *MODES)]
        for dali, *torches in zip(*streams, strict=True):
            for mode, ours in zip(MODES, torches, strict=True):
                per_image[mode].append((ours - dali).abs().flatten(1).mean(1))
    finally:
        for loader in loaders.values():
            loader.close()
    out = {}
    for mode, parts in per_image.items():
        diffs = torch.cat(parts)
        out[mode] = (diffs.mean().item(), diffs.max().item(), len(diffs))
    return out


def decode_rates(root: str, size: int, files: int) -> dict[str, float]:
    """{torch mode: images per CPU second} of the torch train transform on one thread, over the
    first `files` train images, the two modes interleaved (three passes each, the fastest kept).
    CPU time, not wall time: on a shared machine other processes' load moves it much less."""
    paths = [str(p) for p in sorted(Path(root, "train").glob("*/*"))[:files]]
    aug = AugmentConfig(image_size=size)
    best = dict.fromkeys(MODES, 0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the resize's intra-op threads would count twice
    try:
        for _ in range(3):
            for mode in MODES:
                started = time.process_time()
                for seed, path in enumerate(paths):
                    train_transform(path, aug, size, seed, exact=mode == "torch-exact")
                best[mode] = max(best[mode], len(paths) / (time.process_time() - started))
    finally:
        torch.set_num_threads(threads)
    return best


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def report(root: str, sizes: list[int], rate_files: int) -> bool:
    """Print the figures; True when strict mode held its bound at every size."""
    print(f"train-crop parity on {root}: {_cpu()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    held = True
    for size in sizes:
        figures, rates = parity(root, size), decode_rates(root, size, rate_files)
        for mode, (mean, worst, count) in figures.items():
            print(
                f"{size:>4} px, torch decode {MODES[mode]:<21}: per-image mean |dali - torch| "
                f"{mean:.2f} on average, {worst:.2f} worst ({count} images); "
                f"torch transform {rates[mode]:.0f} img per CPU second"
            )
        held = held and figures["torch-exact"][1] <= STRICT_BOUND
    print(f"strict mode within {STRICT_BOUND:g} grey level at every size: {'yes' if held else 'NO'}")
    return held


def main(argv: list[str] | None = None) -> int:
    """The command line; the exit status."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("root", nargs="?", help="an ImageFolder root with train/ and val/, e.g. data/photo")
    parser.add_argument("--sizes", default="32,224", help="train crop sides, comma-separated")
    parser.add_argument("--rate-files", type=int, default=200, help="files timed per mode and size")
    parser.add_argument("--smoke", action="store_true", help="20 photo-like images in a temp folder, 32 px")
    args = parser.parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory() as tmp:
            root = write_demo(
                Path(tmp) / "photo", train_per_class=2, val_per_class=1, photo_like=True, progress=False
            )
            return 0 if report(str(root), [32], rate_files=20) else 1
    if not args.root:
        parser.error("give a data root (e.g. data/photo), or --smoke")
    return 0 if report(args.root, [int(s) for s in args.sizes.split(",")], args.rate_files) else 1


if __name__ == "__main__":
    raise SystemExit(main())
