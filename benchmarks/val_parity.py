"""Val parity: mean absolute difference, in grey levels, between the DALI and torch val outputs.

python benchmarks/val_parity.py data/demo        # any ImageFolder with a val/ split
python benchmarks/val_parity.py --smoke          # 10 demo images written to a temp folder
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import stallfree

RAW = {"mean": [0.0, 0.0, 0.0], "std": [1 / 255] * 3}  # "normalised" output = uint8 pixel values
SIZES = ((32, 36), (64, 73), (224, 256))  # (crop, resize)


def parity(root: str, size: int, resize: int) -> tuple[float, float]:
    """(mean abs difference, worst per-image mean) over the whole val split, CPU graphs."""
    outputs = {}
    for backend in ("torch", "dali"):
        recipe = {
            "data": {"root": root},
            "augment": {"image_size": size, "resize_size": resize, **RAW},
            "train": {"batch_size": 32, "precision": "fp32"},
            "loader": {"backend": backend, "torch": {"workers": 2}, "dali": {"threads": 2}},
        }
        # Each loader as `stallfree train` builds it (the dataset listed, the backend resolved).
        loader = stallfree.loader(recipe, "val", device="cpu")
        try:
            outputs[backend] = torch.cat([b.images for b in loader])
        finally:
            loader.close()
    diff = (outputs["torch"] - outputs["dali"]).abs()
    return diff.mean().item(), diff.flatten(1).mean(1).max().item()


def report(root: str) -> None:
    """One line a size."""
    for size, resize in SIZES:
        mean, worst = parity(root, size, resize)
        print(
            f"{size:>3} px (resize {resize}): mean |dali - torch| = {mean:.3f} grey levels, "
            f"worst image {worst:.3f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default="data/demo", help="an ImageFolder with a val/ split")
    parser.add_argument("--smoke", action="store_true", help="one demo image a class, in a temp folder")
    args = parser.parse_args()
    if not args.smoke:
        report(args.root)
        return
    from stallfree.data.tools.demo import write_demo

    with tempfile.TemporaryDirectory(prefix="val-parity-smoke-") as tmp:
        demo = write_demo(Path(tmp) / "demo", train_per_class=1, val_per_class=1, progress=False)
        report(str(demo))


if __name__ == "__main__":
    main()
