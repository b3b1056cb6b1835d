"""Recipe -> model, optimizer, schedule and Trainer: shared by `train` and `bench`."""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from stallfree.metrics import Sink
from stallfree.models import build_model
from stallfree.parallel import DistInfo
from stallfree.recipe import Recipe, RecipeError
from stallfree.train.distributed import wrap_model
from stallfree.train.ema import ModelEma
from stallfree.train.mix import Mixer
from stallfree.train.schedule import build_optimizer, warmup_cosine
from stallfree.train.trainer import Trainer, TrainerConfig


def steps_per_epoch(train_batches: int, accum_steps: int) -> int:
    """Optimizer steps in one epoch: the last, shorter window is stepped too."""
    return math.ceil(train_batches / accum_steps)


def sync_batchnorm(model: nn.Module, recipe: Recipe, dist: DistInfo,
                   device: torch.device) -> nn.Module:
    """`train.sync_bn` under DDP: BatchNorm layers that average statistics over all ranks."""
    if not recipe.train.sync_bn or dist.world_size <= 1:
        return model
    if device.type != "cuda":
        raise RecipeError("train.sync_bn = true needs CUDA devices (SyncBatchNorm does not run "
                          "on the CPU); set it to false for a CPU run")
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def build_trainer(recipe: Recipe, *, train_batches: int, num_classes: int, device: torch.device,
                  dist: DistInfo | None = None, sinks: list[Sink] | None = None,
                  progress: bool = True, log_every: int | None = None) -> Trainer:
    """Model, optimizer and schedule from the recipe (precision already resolved), in a Trainer."""
    dist = dist or DistInfo()
    model = sync_batchnorm(build_model(recipe.model, num_classes), recipe, dist, device).to(device)
    if recipe.train.channels_last:
        model = model.to(memory_format=torch.channels_last)
    ema = ModelEma(model, recipe.train.ema_decay) if recipe.train.ema_decay > 0 else None
    if recipe.train.compile:
        model = torch.compile(model)  # inside DDP: DDP's bucketing sees the compiled graph
    model = wrap_model(model, device, dist)
    opt = recipe.optim
    optimizer = build_optimizer(model, opt.name, lr=opt.lr, momentum=opt.momentum,
                                weight_decay=opt.weight_decay, nesterov=opt.nesterov,
                                exclude_norm_bias=opt.wd_exclude_norm_bias)
    total = recipe.train.epochs * steps_per_epoch(train_batches, recipe.train.accum_steps)
    if opt.warmup_steps >= total:
        warnings.warn(f"optim.warmup_steps ({opt.warmup_steps}) >= the run's {total} optimizer "
                      "steps: the LR never leaves warmup and never decays; lower warmup_steps",
                      stacklevel=2)
    scheduler = warmup_cosine(optimizer, total_steps=total, warmup_steps=opt.warmup_steps,
                              min_lr_frac=opt.min_lr_frac)
    t = recipe.train
    config = TrainerConfig(precision=t.precision, accum_steps=t.accum_steps,
                           max_grad_norm=t.max_grad_norm, log_every=log_every or t.log_every,
                           max_nonfinite_steps=t.max_nonfinite_steps,
                           label_smoothing=opt.label_smoothing, progress=progress,
                           micro_batch=t.micro_batch if isinstance(t.micro_batch, int) else 0,
                           auto_micro_batch=t.micro_batch == "auto")
    trainer = Trainer(model, optimizer, scheduler, config=config, device=device,
                      sinks=sinks or [], dist=dist)
    aug = recipe.augment
    mixer = Mixer(mixup_alpha=aug.mixup_alpha, cutmix_alpha=aug.cutmix_alpha, prob=aug.mix_prob,
                  seed=recipe.train.seed, rank=dist.rank)
    trainer.mixer = mixer if mixer.enabled else None
    trainer.ema = ema
    return trainer
