"""The model, optimizer, schedule, mixer and EMA of a run, assembled into a Trainer from its
RunContext (train/prepare.py, which imports none of this): shared by `train` and `bench`.
"""

from __future__ import annotations

import math
import warnings
from typing import cast

import torch
from torch import nn

from stallfree.metrics import SinkSet
from stallfree.models import build_model
from stallfree.models.init import init_from
from stallfree.parallel import DistInfo
from stallfree.recipe import Recipe, RecipeError
from stallfree.train.distributed import wrap_model
from stallfree.train.ema import ModelEma
from stallfree.train.microbatch import MicroBatcher
from stallfree.train.mix import Mixer
from stallfree.train.prepare import RunContext
from stallfree.train.schedule import build_optimizer, warmup_cosine
from stallfree.train.trainer import Trainer, TrainerConfig


def steps_per_epoch(train_batches: int, accum_steps: int) -> int:
    """Optimizer steps in one epoch: the last, shorter window is stepped too."""
    return math.ceil(train_batches / accum_steps)


def sync_batchnorm(model: nn.Module, recipe: Recipe, dist: DistInfo, device: torch.device) -> nn.Module:
    """`train.sync_bn` under DDP: BatchNorm layers that average statistics over all ranks."""
    if not recipe.train.sync_bn or dist.world_size <= 1:
        return model
    if device.type != "cuda":
        raise RecipeError(
            "train.sync_bn = true needs CUDA devices (SyncBatchNorm does not run "
            "on the CPU); set it to false for a CPU run"
        )
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def build_trainer(
    ctx: RunContext,
    *,
    train_batches: int,
    sinks: SinkSet | None = None,
    progress: bool = True,
    log_every: int | None = None,
) -> Trainer:
    """Model, optimizer, schedule, mixer and EMA from the run context, in a complete Trainer.

    Resuming (`ctx.resume`): the checkpoint's weights are loaded next, so model.init_from and
    model.pretrained are not read (a requeued job needs the file no longer).
    """
    recipe, device, dist = ctx.recipe, ctx.device, ctx.dist
    model, ema = _model_and_ema(ctx)
    optimizer, scheduler = _optimizer_and_schedule(model, recipe, train_batches)
    t, aug, opt = recipe.train, recipe.augment, recipe.optim
    config = TrainerConfig(
        precision=ctx.resolved.precision,
        accum_steps=t.accum_steps,
        max_grad_norm=t.max_grad_norm,
        log_every=log_every or t.log_every,
        max_nonfinite_steps=t.max_nonfinite_steps,
        label_smoothing=opt.label_smoothing,
        progress=progress,
    )
    mixer = Mixer(
        mixup_alpha=aug.mixup_alpha,
        cutmix_alpha=aug.cutmix_alpha,
        prob=aug.mix_prob,
        seed=t.seed,
        rank=dist.rank,
    )
    size = ctx.resolved.micro_batch  # a DDP run's "auto" is probed later (train/run.py)
    micro = MicroBatcher(size=size if isinstance(size, int) else 0, auto=size == "auto")
    return Trainer(
        model,
        optimizer,
        scheduler,
        config=config,
        device=device,
        dist=dist,
        sinks=sinks,
        mixer=mixer,
        ema=ema,
        micro=micro,
    )


def _model_and_ema(ctx: RunContext) -> tuple[nn.Module, ModelEma | None]:
    """The run's model on its device with its EMA (of the weights before compiling), compiled
    and wrapped for DDP as the recipe says."""
    recipe, device, dist = ctx.recipe, ctx.device, ctx.dist
    model = build_model(recipe.model, ctx.num_classes, load_pretrained=not ctx.resuming)
    if recipe.model.init_from and not ctx.resuming:
        init_from(model, recipe.model.init_from)
    model = sync_batchnorm(model, recipe, dist, device)
    model = model.to(device)
    if recipe.train.channels_last:
        # torch's stubs omit Module.to's memory_format, which it accepts (as `Tensor.to` does)
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    ema = ModelEma(model, recipe.train.ema_decay) if recipe.train.ema_decay > 0 else None
    if recipe.train.compile:
        # Inside DDP: DDP's bucketing sees the compiled graph. A Module in, an OptimizedModule (a
        # Module) out; torch types the result as a bare callable.
        model = cast(nn.Module, torch.compile(model))
    model = wrap_model(model, device, dist)
    return model, ema


def _optimizer_and_schedule(
    model: nn.Module, recipe: Recipe, train_batches: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The optimizer and its warmup-then-cosine schedule over the run's optimizer steps."""
    opt = recipe.optim
    optimizer = build_optimizer(
        model,
        opt.name,
        lr=opt.lr,
        momentum=opt.momentum,
        weight_decay=opt.weight_decay,
        nesterov=opt.nesterov,
        exclude_norm_bias=opt.wd_exclude_norm_bias,
    )
    total = recipe.train.epochs * steps_per_epoch(train_batches, recipe.train.accum_steps)
    if opt.warmup_steps >= total:
        warnings.warn(
            f"optim.warmup_steps ({opt.warmup_steps}) >= the run's {total} optimizer "
            "steps: the LR never leaves warmup and never decays; lower warmup_steps",
            stacklevel=3,
        )
    scheduler = warmup_cosine(
        optimizer, total_steps=total, warmup_steps=opt.warmup_steps, min_lr_frac=opt.min_lr_frac
    )
    return optimizer, scheduler
