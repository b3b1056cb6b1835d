"""The bench's CPU limit: cores x the single-thread rate of the fastest decode + crop + resize.

Every path the machine has (`_paths`, and DALI's CPU graph) is timed on the same spread sample
of training files, in passes interleaved between the paths, so that drift hits them alike. The
limit is the fastest path's median rate times the cores, printed with its spread (the slowest
and fastest pass), since a single pass moves it a lot (benchmarks/RESULTS.md, loader mode).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from stallfree.data.readers.factory import resolve_dataset
from stallfree.parallel import cpu_cores
from stallfree.recipe import Recipe, recipe_from_dict

# (path, per-sample seed) -> one augmented image
Transform = Callable[[str, int], Any]


def _paths(recipe: Recipe) -> dict[str, Transform]:
    """The in-process decode + crop + resize paths available here: `pil` (PIL with draft() and
    PIL's resize, the classic path), `fast` (the torch backend's transform: simplejpeg where
    installed, torch's uint8 resize) and `torchvision` (torchvision.io decode and transforms v2,
    where torchvision imports). `dali_single_thread` adds DALI's, where DALI is installed."""
    import stallfree.data.transforms.decode as decode
    from stallfree.data.transforms.augment import train_transform

    aug, side = recipe.augment, recipe.augment.size_at(0)  # the bench times one size

    def pil(path: str, seed: int) -> np.ndarray:
        saved, decode.simplejpeg = decode.simplejpeg, None
        try:
            return train_transform(path, aug, side, seed)
        finally:
            decode.simplejpeg = saved

    paths: dict[str, Transform] = {"pil": pil}
    if decode.simplejpeg is not None:
        paths["fast"] = lambda path, seed: train_transform(path, aug, side, seed)
    try:
        import torchvision
        from torchvision.transforms import v2
    except Exception:  # noqa: BLE001 - absent, or a build that does not match torch
        return paths
    crop = v2.Compose(
        [
            v2.RandomResizedCrop(side, scale=tuple(aug.scale), ratio=tuple(aug.ratio), antialias=True),
            v2.RandomHorizontalFlip(aug.hflip),
        ]
    )
    paths["torchvision"] = lambda path, seed: crop(
        torchvision.io.decode_image(path, mode=torchvision.io.ImageReadMode.RGB)
    )
    return paths


def _pass_rate(transform: Transform, files: list[str]) -> float:
    started = time.perf_counter()
    for i, path in enumerate(files):
        transform(path, i)
    return len(files) / (time.perf_counter() - started)


def measure_limit(
    recipe: Recipe,
    sample: int = 200,
    passes: int = 3,
    dali_rate: Callable[[Recipe, int], float | None] | None = None,
) -> dict[str, Any]:
    """One measurement of the limit: images/s, the rate of every path per pass, the fastest."""
    files = resolve_dataset(recipe.data, seed=recipe.train.seed).splits["train"].files
    picked = files[:: max(1, len(files) // sample)][:sample]
    paths = _paths(recipe)
    rates: dict[str, list[float]] = {name: [] for name in paths}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core's rate: torch's resize would otherwise use them all
    try:
        for transform in paths.values():  # warm the page cache and every decoder
            for path in picked[:8]:
                transform(path, 0)
        for _ in range(passes):
            order = list(paths)
            random.Random(len(rates["pil"])).shuffle(order)
            for name in order:
                rates[name].append(_pass_rate(paths[name], picked))
    finally:
        torch.set_num_threads(threads)
    if dali_rate is not None:
        rate = dali_rate(recipe, len(picked))
        if rate is not None:
            rates["dali"] = [rate]
    return _limit(rates, cpu_cores())


def _limit(rates: dict[str, list[float]], cores: int) -> dict[str, Any]:
    single = {name: statistics.median(values) for name, values in rates.items()}
    best = max(single, key=single.__getitem__)
    return {
        "images_per_s": cores * single[best],
        "cores": cores,
        "fastest": best,
        "single_thread": single,
        "spread": [cores * min(rates[best]), cores * max(rates[best])],
        "passes": {name: values for name, values in rates.items()},
    }


def dali_single_thread(run_isolated: Callable[..., dict[str, Any]]) -> Callable[[Recipe, int], float | None]:
    """The DALI path's rate: the loader alone, one thread, CPU graph, in its own process."""

    def rate(recipe: Recipe, files: int) -> float | None:
        single = recipe_from_dict(recipe.to_dict())
        single.loader.dali.threads, single.train.batch_size = 1, 16
        single.loader.dali.device = "cpu"
        single.loader.backend = "dali"
        result = run_isolated("loader", single, warmup=2, batches=max(4, files // 16))
        return result.get("images_per_s")

    return rate


def median_limit(limits: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The limits of all repeats as one: the median of each path, the spread over all passes."""
    if not limits:
        return None
    rates: dict[str, list[float]] = {}
    for limit in limits:
        for name, values in limit["passes"].items():
            rates.setdefault(name, []).extend(values)
    return {**_limit(rates, limits[0]["cores"]), "runs": len(limits)}
