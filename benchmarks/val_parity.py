"""Val parity: mean absolute difference, in grey levels, between the DALI and torch val outputs.

python benchmarks/val_parity.py data/demo        # any ImageFolder with a val/ split
"""

from __future__ import annotations

import sys

import torch

from stallfree.data.build import build_loader
from stallfree.recipe import recipe_from_dict

RAW = {"mean": [0.0, 0.0, 0.0], "std": [1 / 255] * 3}  # "normalised" output = uint8 pixel values


def parity(root: str, size: int, resize: int) -> tuple[float, float]:
    """(mean abs difference, worst per-image mean) over the whole val split, CPU graphs."""
    outputs = {}
    for backend in ("torch", "dali"):
        recipe = recipe_from_dict(
            {
                "data": {"root": root},
                "augment": {"image_size": size, "resize_size": resize, **RAW},
                "train": {"batch_size": 32, "precision": "fp32"},
                "loader": {"backend": backend, "torch": {"workers": 2}, "dali": {"threads": 2}},
            }
        )
        loader = build_loader(recipe, "val", device=torch.device("cpu"))
        try:
            outputs[backend] = torch.cat([b.images for b in loader])
        finally:
            loader.close()
    diff = (outputs["torch"] - outputs["dali"]).abs()
    return diff.mean().item(), diff.flatten(1).mean(1).max().item()


if __name__ == "__main__":
    data_root = sys.argv[1] if len(sys.argv) > 1 else "data/demo"
    for size, resize in ((32, 36), (64, 73), (224, 256)):
        mean, worst = parity(data_root, size, resize)
        print(
            f"{size:>3} px (resize {resize}): mean |dali - torch| = {mean:.3f} grey levels, "
            f"worst image {worst:.3f}"
        )
