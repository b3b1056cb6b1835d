"""Run under torchrun by tests/e2e/test_api_examples.py: each rank joins a gloo group, then writes
the labels of every batch `stallfree.loader` gives it (ranks from the group), per backend."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

import stallfree


def main(recipe: str, out: str) -> None:
    dist.init_process_group("gloo")
    seen = {}
    for backend in sys.argv[3:]:
        with stallfree.loader(recipe, loader__backend=backend) as loader:
            loader.set_epoch(1)
            seen[backend] = [batch.labels.tolist() for batch in loader]
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
