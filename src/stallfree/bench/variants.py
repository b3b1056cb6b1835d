"""What `stallfree bench --backends` can run, by name; torch-free, so the CLI can list them.

The bench asks the loader registry for our backends and adds its own peers here: `data/` never
names the bench.
"""

from __future__ import annotations

import importlib.util

from stallfree.data.registry import BACKENDS

# The loaders people pick instead (stallfree.bench.peers), by name -> (builder, module needed).
PEERS: dict[str, tuple[str, str]] = {
    "peer-pil": ("stallfree.bench.peers:pil_plain", "PIL"),
    "peer-webdataset": ("stallfree.bench.peers:webdataset_peer", "webdataset"),
    "peer-torchvision": ("stallfree.bench.peers:torchvision_peer", "torchvision"),
}

# Name -> the recipe overrides that select it, the same `loader.backend` override `train` takes
# (one channel, so a bench row is a train run's loader). Every registered backend under its own
# name, and some settings worth a row: torch-naive (the textbook DataLoader), torch-uint8 (a GPU
# run's worker output, on a CPU), dali-cpudecode (NVIDIA's "dali-cpu" mode: decode on the CPU,
# augment on the GPU).
BENCH_VARIANTS: dict[str, tuple[str, ...]] = {
    **{name: (f'loader.backend="{name}"',) for name in BACKENDS},
    "dali-cpudecode": ('loader.backend="dali"', 'loader.dali.decode="cpu"'),
    "torch-naive": ('loader.backend="stallfree.data.backends.naive:build"',),
    "torch-uint8": ('loader.backend="stallfree.data.backends.torch_backend:build_uint8"',),
    **{name: (f'loader.backend="{target}"',) for name, (target, _) in PEERS.items()},
}


def installed_peers() -> list[str]:
    """The peers whose library is importable here."""
    return [name for name, (_, module) in PEERS.items() if importlib.util.find_spec(module)]
