"""Trainer equivalences: accumulation vs big batch, the partial window, the LR clock, precision."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers import TensorLoader
from test_trainer import CPU, _data, _mlp
from torch import nn

from stallfree.train.trainer import (
    Trainer,
    TrainerConfig,
    TrainerHooks,
)


class _Slow(nn.Module):
    """A model whose forward takes `seconds`: a step long enough for a signal to land inside."""

    def __init__(self, inner: nn.Module, seconds: float) -> None:
        super().__init__()
        self.inner, self.seconds = inner, seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.inner(x)


def _stop_rank(rank: int, init_file: str, results: str) -> None:
    """One of two gloo ranks: rank 1 is asked to stop after step 3; both report where they stop."""
    import torch.distributed as torch_dist
    from torch.nn.parallel import DistributedDataParallel

    from stallfree.parallel import DistInfo
    from stallfree.train.trainer import PreemptedError

    torch_dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    model = DistributedDataParallel(_Slow(_mlp(), seconds=0.1))
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        device=CPU,
        dist=DistInfo(rank=rank, world_size=2),
        config=TrainerConfig(progress=False, log_every=100),
    )
    hooks = TrainerHooks(stop_requested=lambda: rank == 1 and trainer.optimizer_steps >= 3)
    images, labels = _data(8 * 25)
    stopped = -1
    try:
        trainer.train_batches(iter(TensorLoader(images, labels, 8)), 25, hooks=hooks)
    except PreemptedError:
        stopped = trainer.optimizer_steps
    Path(results, f"rank{rank}").write_text(str(stopped))
    torch_dist.destroy_process_group()


@pytest.mark.e2e
def test_a_stop_on_one_rank_is_agreed_within_two_steps_under_ddp(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    mp.start_processes(
        _stop_rank, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    # Flagged after step 3: its vote, started then, is read after step 4 on both ranks.
    assert [int((tmp_path / f"rank{r}").read_text()) for r in (0, 1)] == [4, 4]
