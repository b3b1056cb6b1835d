"""Training: the step loop, precision policy, LR schedule, distributed set-up, run orchestration.

Its names load on first use: the CLI imports `train.signals` before torch loads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stallfree.train.trainer import MicroBatchOOMError, NonFiniteLossError, Trainer, TrainerConfig

__all__ = ["MicroBatchOOMError", "NonFiniteLossError", "Trainer", "TrainerConfig"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from stallfree.train import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'stallfree.train' has no attribute {name!r}")
