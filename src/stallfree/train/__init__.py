"""Training: the step loop, precision policy, LR schedule, distributed set-up, run orchestration."""

from stallfree.train.trainer import MicroBatchOOMError, NonFiniteLossError, Trainer, TrainerConfig

__all__ = ["MicroBatchOOMError", "NonFiniteLossError", "Trainer", "TrainerConfig"]
