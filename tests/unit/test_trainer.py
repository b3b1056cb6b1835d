"""Trainer equivalences: accumulation vs big batch, the partial window, the LR clock, precision."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import Collect, TensorLoader
from torch import nn

from stallfree.train.microbatch import MicroBatcher
from stallfree.train.schedule import warmup_cosine
from stallfree.train.trainer import (
    MicroBatchOOMError,
    NonFiniteLossError,
    Trainer,
    TrainerConfig,
)

CPU = torch.device("cpu")


def _mlp(seed: int = 0) -> nn.Module:
    """BatchNorm-free, so a micro-batch and the big batch see the same function."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def _data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


def _train(
    model: nn.Module,
    loader: TensorLoader,
    accum: int,
    precision: str = "fp32",
    lr: float = 0.1,
    auto_micro_batch: bool = False,
    **config: object,
) -> Trainer:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
    trainer = Trainer(
        model,
        optimizer,
        config=TrainerConfig(precision=precision, accum_steps=accum, progress=False, log_every=1, **config),
        device=CPU,
        micro=MicroBatcher(auto=auto_micro_batch),
    )
    trainer.train_epoch(loader, 0)
    return trainer


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def test_accumulation_matches_the_big_batch() -> None:
    images, labels = _data(32)
    micro, big = _mlp(), _mlp()
    t_micro = _train(micro, TensorLoader(images, labels, 8), accum=4)
    t_big = _train(big, TensorLoader(images, labels, 32), accum=1)
    assert t_micro.optimizer_steps == t_big.optimizer_steps == 1
    assert _max_diff(micro, _mlp()) > 1e-3  # the step did move the weights
    assert _max_diff(micro, big) < 1e-6


def test_partial_last_window_is_stepped_with_its_true_count() -> None:
    # 5 micro-batches, accum 4: windows of 4 and 1. Equal to big batches of 32 then 8.
    images, labels = _data(40)
    micro, big = _mlp(), _mlp()
    t_micro = _train(micro, TensorLoader(images, labels, 8), accum=4)
    t_big = _train(big, TensorLoader(images, labels, 32), accum=1)  # batches of 32 and 8
    assert t_micro.optimizer_steps == t_big.optimizer_steps == 2
    assert _max_diff(micro, big) < 1e-6


class _PoisonFirst(nn.Module):
    """Produces infinite logits on its first `bad` calls, to force non-finite gradients."""

    def __init__(self, inner: nn.Module, bad: int) -> None:
        super().__init__()
        self.inner, self.bad, self.calls = inner, bad, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = self.inner(x)
        return out * float("inf") if self.calls <= self.bad else out


def test_scheduler_counts_only_real_steps_under_fp16_overflow() -> None:
    images, labels = _data(48)
    model = _PoisonFirst(_mlp(), bad=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = warmup_cosine(optimizer, total_steps=10, warmup_steps=4)
    trainer = Trainer(
        model,
        optimizer,
        scheduler,
        device=CPU,
        config=TrainerConfig(precision="fp16", accum_steps=2, progress=False, log_every=1),
    )
    assert trainer.scaler.is_enabled()
    trainer.train_epoch(TensorLoader(images, labels, 8), 0)  # 6 micro-batches = 3 windows
    # Window 1 held both poisoned micro-batches: the scaler skipped it, the schedule did not move.
    assert trainer.skipped_steps == 1 and trainer.optimizer_steps == 2
    assert scheduler.last_epoch == 2
    assert optimizer.param_groups[0]["lr"] == pytest.approx(3 / 4)  # warmup factor at step 2


def test_nonfinite_steps_are_skipped_then_abort() -> None:
    images, labels = _data(64)
    model = _PoisonFirst(_mlp(), bad=2)
    before = copy.deepcopy(model)
    trainer = _train(model, TensorLoader(images, labels, 8), accum=1, lr=0.0, max_nonfinite_steps=3)
    assert trainer.skipped_steps == 2 and trainer.optimizer_steps == 6
    assert _max_diff(model, before) == 0.0  # lr 0: and the skipped steps wrote no NaNs
    with pytest.raises(NonFiniteLossError, match="3 optimizer steps in a row"):
        _train(_PoisonFirst(_mlp(), bad=100), TensorLoader(images, labels, 8), accum=1, max_nonfinite_steps=3)


def test_bf16_autocast_runs_on_cpu() -> None:
    images, labels = _data(16)
    model = _mlp()
    trainer = _train(model, TensorLoader(images, labels, 8), accum=1, precision="bf16")
    assert trainer.optimizer_steps == 2
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_gradient_clipping_bounds_the_update() -> None:
    images, labels = _data(8)
    model = _mlp()
    before = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer = Trainer(model, optimizer, device=CPU, config=TrainerConfig(max_grad_norm=1e-3, progress=False))
    trainer.train_epoch(TensorLoader(images, labels * 0 + 1, 8), 0)
    delta = torch.cat([(p - q).flatten() for p, q in zip(model.parameters(), before.parameters())])
    assert delta.norm().item() == pytest.approx(1e-3, rel=1e-3)


class _OOM(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_oom_is_an_error_that_names_the_fix() -> None:
    images, labels = _data(8)
    model = _OOM()
    model.p = nn.Parameter(torch.zeros(1))
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        device=CPU,
        config=TrainerConfig(accum_steps=2, progress=False),
    )
    with pytest.raises(MicroBatchOOMError, match="micro-batch of 8 images.*raise train.accum_steps"):
        trainer.train_epoch(TensorLoader(images, labels, 8), 0)


def test_metrics_are_logged_per_interval() -> None:
    sink = Collect()
    records = sink.records
    images, labels = _data(48)
    model = _mlp()
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        device=CPU,
        sinks=[sink],
        config=TrainerConfig(log_every=2, progress=False),
    )
    summary = trainer.fit(TensorLoader(images, labels, 8), TensorLoader(images, labels, 16), epochs=2)
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [2, 4, 6, 8, 10, 12]
    for r in train_records:
        assert {"epoch", "loss", "lr", "images_per_s", "data_wait_frac"} <= r.keys()
        assert 0 <= r["data_wait_frac"] <= 1 and r["images_per_s"] > 0
    val = [r for r in records if "val_top1" in r]
    assert len(val) == 2 and 0 <= val[-1]["val_top1"] <= val[-1]["val_top5"] <= 1
    assert summary["optimizer_steps"] == 12 and "val_top1" in summary


def test_fp16_that_never_finishes_a_step_stops_and_never_counts_a_skip() -> None:
    images, labels = _data(64 * 4)
    model = _PoisonFirst(_mlp(), bad=10_000)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = warmup_cosine(optimizer, total_steps=100, warmup_steps=0)
    trainer = Trainer(
        model,
        optimizer,
        scheduler,
        device=CPU,
        config=TrainerConfig(precision="fp16", progress=False, log_every=1, max_nonfinite_steps=3),
    )
    with pytest.raises(NonFiniteLossError, match="3 optimizer steps in a row.*3 skipped in all"):
        trainer.train_epoch(TensorLoader(images, labels, 8), 0)
    assert trainer.optimizer_steps == 0 and trainer.skipped_steps == 3
    assert scheduler.last_epoch == 0  # the schedule never moved


def test_fp16_skips_even_when_the_scale_has_collapsed_to_zero() -> None:
    # Once GradScaler's scale reaches 0, "scale did not drop" no longer means "stepped".
    images, labels = _data(80)
    model = _PoisonFirst(_mlp(), bad=10_000)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        device=CPU,
        config=TrainerConfig(precision="fp16", progress=False, max_nonfinite_steps=1000),
    )
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=0.0)
    trainer.train_epoch(TensorLoader(images, labels, 8), 0)
    assert trainer.optimizer_steps == 0 and trainer.skipped_steps == 10


def test_logged_lr_is_the_lr_the_step_used() -> None:
    sink = Collect()
    images, labels = _data(32)
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = warmup_cosine(optimizer, total_steps=4, warmup_steps=2)
    trainer = Trainer(
        model,
        optimizer,
        scheduler,
        device=CPU,
        sinks=[sink],
        config=TrainerConfig(progress=False, log_every=1),
    )
    trainer.train_epoch(TensorLoader(images, labels, 8), 0)
    # Warmup of 2: step 1 ran at 0.005, step 2 at 0.01, then the cosine.
    assert [round(r["lr"], 6) for r in sink.records][:2] == [0.005, 0.01]


@pytest.mark.parametrize("old_split, new_split", [((8, 2), (4, 4)), ((4, 4), (16, 1))])
def test_resume_with_another_micro_batch_split_continues_on_the_next_sample(
    old_split: tuple[int, int], new_split: tuple[int, int]
) -> None:
    """Same global batch, another split: the resumed steps equal the uninterrupted run's."""
    images, labels = _data(96)
    full = _mlp()
    _train(full, TensorLoader(images, labels, old_split[0]), accum=old_split[1])  # 6 steps

    first = _mlp()
    trainer = _train(
        first, TensorLoader(images[:32], labels[:32], old_split[0]), accum=old_split[1]
    )  # the first 2 steps: 32 samples
    state, loader_state = trainer.state_dict(), {"epoch": 0, "position": 32}

    resumed = _mlp(seed=99)
    optimizer = torch.optim.SGD(resumed.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    trainer = Trainer(
        resumed, optimizer, device=CPU, config=TrainerConfig(accum_steps=new_split[1], progress=False)
    )
    trainer.load_state_dict(state)
    loader = TensorLoader(images, labels, new_split[0])
    loader.load_state_dict(loader_state)
    assert loader.batches_left() == 64 // new_split[0]  # the 64 unseen samples, none again
    trainer.train_epoch(loader, 0)
    assert trainer.optimizer_steps == 6
    assert _max_diff(resumed, full) < 1e-5


def test_weight_decay_groups_and_nesterov() -> None:
    from stallfree.train.schedule import build_optimizer

    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    opt = build_optimizer(model, "sgd", lr=0.1, momentum=0.9, weight_decay=0.1, nesterov=True)
    # conv weight decayed; conv bias, BN weight and BN bias (1-D) not
    assert sorted((g["weight_decay"], len(g["params"])) for g in opt.param_groups) == [(0.0, 3), (0.1, 1)]
    assert all(g["nesterov"] for g in opt.param_groups)
    opt = build_optimizer(model, "sgd", lr=0.1, momentum=0.9, weight_decay=0.1, exclude_norm_bias=False)
    assert [(g["weight_decay"], len(g["params"])) for g in opt.param_groups] == [(0.1, 4)]


class _SmallMemory(nn.Module):
    """Runs out of memory on more than `limit` images, once it has been called `after` times."""

    def __init__(self, inner: nn.Module, limit: int, after: int = 0) -> None:
        super().__init__()
        self.inner, self.limit, self.after, self.calls = inner, limit, after, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if x.shape[0] > self.limit and self.calls > self.after:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.inner(x)


@pytest.mark.parametrize("after", [0, 1])  # OOM on a window's first batch, or on its second
def test_auto_micro_batch_backs_off_and_matches_the_plain_run(after: int) -> None:
    images, labels = _data(64)
    reference = _mlp()
    _train(reference, TensorLoader(images, labels, 16), accum=2)
    model = _SmallMemory(_mlp(), limit=5, after=after)
    with pytest.warns(UserWarning, match="chunks of 8.*retries the window"):
        trainer = _train(model, TensorLoader(images, labels, 16), accum=2, auto_micro_batch=True)
    assert trainer.micro.size == 4 and trainer.optimizer_steps == 2
    assert _max_diff(model.inner, reference) < 1e-5  # same gradients, no sample lost or doubled


def test_without_auto_an_oom_is_an_error_that_suggests_it() -> None:
    images, labels = _data(32)
    with pytest.raises(MicroBatchOOMError, match='micro-batch of 16 images.*micro_batch = "auto"'):
        _train(_SmallMemory(_mlp(), limit=5), TensorLoader(images, labels, 16), accum=2)


def test_the_ddp_probe_takes_the_smallest_size_that_fits_everywhere() -> None:
    from stallfree.train.microbatch import probe_micro_batch

    tried: list[int] = []

    def step(n: int) -> None:
        tried.append(n)
        if n > 5:
            raise torch.OutOfMemoryError("out of memory")

    assert probe_micro_batch(step, 32, lambda n: min(n, 2)) == 2  # another rank fits only 2
    assert tried == [32, 16, 8, 4]


class _OomAfterNorm(nn.Module):
    """Out of memory on more than `limit` images from the second call on, raised after the
    BatchNorm before it has run (and updated its statistics), as a real OOM mid-forward does."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.calls = limit, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if x.shape[0] > self.limit and self.calls > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return x


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        _OomAfterNorm(limit=8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 5),
    )


def test_an_oom_retry_leaves_no_trace_in_batchnorm() -> None:
    """OOM on a window's second micro-batch: the retried window equals a run that used the
    backed-off chunks from the start, buffers (running stats, batches tracked) included."""
    images, labels = _data(64)
    reference, model = _bn_net(), _bn_net()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    Trainer(
        reference,
        optimizer,
        config=TrainerConfig(accum_steps=2, progress=False),
        device=CPU,
        micro=MicroBatcher(size=8),
    ).train_epoch(TensorLoader(images, labels, 16), 0)
    with pytest.warns(UserWarning, match="chunks of 8"):
        _train(model, TensorLoader(images, labels, 16), accum=2, auto_micro_batch=True)
    for (name, mine), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(mine, theirs), name
