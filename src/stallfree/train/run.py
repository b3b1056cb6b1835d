"""`stallfree train`: recipe -> loaders -> model -> Trainer -> run directory."""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stallfree import __version__
from stallfree.data.listing import list_split
from stallfree.data.loader import build_loader
from stallfree.metrics import open_sinks, write_json_atomic
from stallfree.models import build_model
from stallfree.recipe import Recipe, dump_toml, validate
from stallfree.train.distributed import cleanup, init_distributed, resolve_device, wrap_model
from stallfree.train.schedule import build_optimizer, warmup_cosine
from stallfree.train.trainer import Trainer, TrainerConfig


def seed_everything(seed: int, rank: int) -> None:
    """Same model init on every rank (DDP broadcasts it anyway); per-rank streams elsewhere."""
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed)


def train(recipe: Recipe, out_dir: str | Path, *, progress: bool = True) -> dict[str, Any]:
    """Run the recipe; write recipe.toml, metrics.jsonl and summary.json into `out_dir`."""
    backend = recipe.loader.backend
    validate(recipe, needs_data=backend != "synthetic" or bool(recipe.data.root))
    started = time.perf_counter()
    device_type = "cuda" if recipe.train.device == "cuda" or (
        recipe.train.device == "auto" and torch.cuda.is_available()) else "cpu"
    dist = init_distributed(device_type)
    device = resolve_device(recipe.train.device, dist)
    seed_everything(recipe.train.seed, dist.rank)
    run_dir = Path(out_dir)
    if dist.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "recipe.toml").write_text(dump_toml(recipe))
    listings = {s: list_split(recipe.data.root, s, recipe.data.file_list or None)
                for s in ("train", "val")} if recipe.data.root else {"train": None, "val": None}
    num_classes = recipe.model.num_classes or (
        len(listings["train"].classes) if listings["train"] else recipe.data.synthetic_classes)
    loaders = {s: build_loader(recipe, s, device=device, dist=dist, listing=listings[s])
               for s in ("train", "val")}
    sinks = open_sinks(run_dir) if dist.rank == 0 else []
    try:
        model = build_model(recipe.model, num_classes).to(device)
        if recipe.train.channels_last:
            model = model.to(memory_format=torch.channels_last)
        model = wrap_model(model, device, dist)
        opt_cfg = recipe.optim
        optimizer = build_optimizer(model, opt_cfg.name, lr=opt_cfg.lr, momentum=opt_cfg.momentum,
                                    weight_decay=opt_cfg.weight_decay)
        steps_per_epoch = math.ceil(len(loaders["train"]) / recipe.train.accum_steps)
        scheduler = warmup_cosine(optimizer, total_steps=recipe.train.epochs * steps_per_epoch,
                                  warmup_steps=opt_cfg.warmup_steps, min_lr_frac=opt_cfg.min_lr_frac)
        trainer = Trainer(model, optimizer, scheduler, config=trainer_config(recipe, progress),
                          device=device, sinks=sinks, dist=dist)
        summary = trainer.fit(loaders["train"], loaders["val"], epochs=recipe.train.epochs)
    finally:
        for loader in loaders.values():
            loader.close()
        for sink in sinks:
            sink.close()
        cleanup()
    summary.update(wall_s=time.perf_counter() - started, backend=backend, device=str(device),
                   world_size=dist.world_size, stallfree_version=__version__,
                   global_batch=recipe.train.batch_size * recipe.train.accum_steps * dist.world_size)
    if dist.rank == 0:
        write_json_atomic(run_dir / "summary.json", summary)
    return summary


def trainer_config(recipe: Recipe, progress: bool = True) -> TrainerConfig:
    """The Trainer's slice of the recipe."""
    t = recipe.train
    return TrainerConfig(precision=t.precision, accum_steps=t.accum_steps,
                         max_grad_norm=t.max_grad_norm, log_every=t.log_every,
                         max_nonfinite_steps=t.max_nonfinite_steps,
                         label_smoothing=recipe.optim.label_smoothing, progress=progress)
