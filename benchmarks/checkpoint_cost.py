"""Checkpoint size and save time for a model with its SGD momentum state (median of 5 saves).

python benchmarks/checkpoint_cost.py small_cnn resnet50
python benchmarks/checkpoint_cost.py --smoke      # small_cnn alone: seconds
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from stallfree.models import build_model
from stallfree.recipe import ModelConfig
from stallfree.train.checkpoint import Checkpointer, rng_state


def measure(name: str, num_classes: int = 1000) -> tuple[float, float]:
    """(size in MB, median save seconds) of a full training checkpoint."""
    model = build_model(ModelConfig(name=name), num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 64, 64)).sum().backward()
    optimizer.step()  # creates the momentum buffers a real checkpoint carries
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng_state()}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Checkpointer(tmp, keep=2)
        times = []
        for step in range(5):
            t0 = time.perf_counter()
            path = ckpt.save(state, step)
            times.append(time.perf_counter() - t0)
        return path.stat().st_size / 1e6, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=["small_cnn", "resnet50"], help="model.name values")
    parser.add_argument("--smoke", action="store_true", help="small_cnn alone: seconds")
    args = parser.parse_args()
    for model_name in ["small_cnn"] if args.smoke else args.models:
        size_mb, save_s = measure(model_name)
        print(f"{model_name:<10} {size_mb:8.1f} MB  save {save_s * 1000:7.1f} ms (median of 5)")


if __name__ == "__main__":
    main()
