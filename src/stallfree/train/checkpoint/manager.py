"""A training run's checkpoints: `CheckpointManager` owns what goes into one (the dict of its
parts, torchtitan's `Stateful`), when it is saved (every N optimizer steps, at each epoch's end
with best.pt beside, on a stop), the files it lands in (atomic, keep-last-N) and their format."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stallfree.train.checkpoint.files import Checkpointer
from stallfree.train.checkpoint.format import FORMAT
from stallfree.train.checkpoint.parts import PerRank, RngState, Stateful, load_parts, save_parts
from stallfree.train.checkpoint.saved import SavedCheckpoint
from stallfree.version import __version__

if TYPE_CHECKING:  # annotations only: the trainer imports this package's parts
    from stallfree.train.prepare import RunContext
    from stallfree.train.trainer import Trainer


class CheckpointManager:
    """The checkpoints of one run: its parts (the trainer's, the segment clock, every rank's
    loader, RNGs and open log interval), the facts that say which run they belong to (what
    resume's checks compare, and what export and predict read), and the save policy.

    Every rank calls the `on_*` hooks (a save gathers every rank's state); rank 0 writes.
    """

    def __init__(
        self,
        checkpointer: Checkpointer,
        parts: dict[str, Stateful],
        facts: dict[str, Any],
        *,
        every_steps: int = 0,
        records: Callable[[], int] = lambda: 0,
        best: Callable[[int], dict[str, Any]] | None = None,
    ) -> None:
        self.checkpointer, self.parts, self.facts = checkpointer, parts, facts
        self.every_steps = every_steps  # 0: at epoch ends and stops only
        self.records = records  # lines in metrics.jsonl: a resume cuts it back to them
        self.best = best  # best.pt's dict after an epoch (`best_state`); None: no best.pt

    @classmethod
    def for_run(
        cls,
        checkpointer: Checkpointer,
        trainer: Trainer,
        loader: Stateful,
        clock: Stateful,
        ctx: RunContext,
        data: dict[str, Any],
    ) -> CheckpointManager:
        """A training run's: `loader` is the train loader's part (the run's `StepMark`), `clock`
        the segment clock's, `data` the run's `data_record`."""
        dist = trainer.dist
        per_rank = PerRank(
            dist.rank,
            dist.world_size,
            positions={"loader": loader},
            own={"rng": RngState(ctx.device)},
            same_world={"interval": trainer.interval_part()},
        )
        facts = {
            "recipe": ctx.recipe.to_dict(),  # as given; what its "auto" values became is "resolved"
            "resolved": ctx.resolved.to_dict(),
            "num_classes": ctx.num_classes,  # what the model was built with (export reads it)
            "class_names": ctx.class_names,  # label order; predict and export.json read it
            "world_size": dist.world_size,
            "data": dict(data),
        }
        return cls(
            checkpointer,
            {**trainer.parts(), "segments": clock, "ranks": per_rank},
            facts,
            every_steps=ctx.recipe.train.ckpt_every_steps,
            records=lambda: trainer.sinks.records,
            best=lambda epoch: best_state(trainer, ctx, epoch),
        )

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint: each part's state under its key, the facts, the format stamp."""
        return {
            **save_parts(self.parts),
            **self.facts,
            "metrics_records": self.records(),
            "stallfree_version": __version__,
            "format": FORMAT,  # a new key: bump FORMAT and give older files its default there
        }

    def load(self, saved: SavedCheckpoint) -> None:
        """Give each part its state from `saved` (a resume)."""
        load_parts(saved.state, self.parts)

    def save(self, step: int) -> Path | None:
        """ckpt-<step>.pt now (rank 0's path; None on the others)."""
        return self.checkpointer.save(self.state_dict(), step)

    def on_step(self, step: int) -> None:
        """After each optimizer step: a save every `every_steps`."""
        if self.every_steps and step % self.every_steps == 0:
            self.save(step)

    def on_epoch_end(self, step: int, epoch: int, improved: bool) -> None:
        """After an epoch (and its validation): a save, and best.pt when val top-1 improved."""
        self.save(step)
        if improved and self.best is not None:
            self.checkpointer.save_best(self.best(epoch))

    def on_stop(self, step: int) -> None:
        """On a stop signal or an outage: a save, even if `on_step` just made one (a rare,
        atomic rewrite beats tracking which boundary the last save was at)."""
        self.save(step)

    @property
    def last_save_s(self) -> float:
        """Seconds the last periodic or epoch-end save took."""
        return self.checkpointer.last_save_s

    def newest(self) -> Path:
        """The newest ckpt-<step>.pt (the one a stop just saved)."""
        return self.checkpointer.paths()[0]


def best_state(trainer: Trainer, ctx: RunContext, epoch: int) -> dict[str, Any]:
    """What best.pt holds: the weights (and EMA) after `epoch`, its val top-1, the recipe.
    A checkpoint `stallfree eval` and `model.init_from` read; not one to resume from."""
    weights = {key: part for key, part in trainer.parts().items() if key in ("model", "ema")}
    return {
        **save_parts(weights),
        "epoch": epoch,
        "step": trainer.optimizer_steps,
        "val_top1": trainer.best_val_top1,
        "recipe": ctx.recipe.to_dict(),
        "resolved": ctx.resolved.to_dict(),
        "num_classes": ctx.num_classes,
        "class_names": ctx.class_names,
        "stallfree_version": __version__,
        "format": FORMAT,  # a new key: bump FORMAT and give older files its default there
    }
