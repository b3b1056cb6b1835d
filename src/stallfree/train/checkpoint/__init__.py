"""Checkpoints: the one package that knows a checkpoint's layout.

`files` writes and reads them (atomic, keep-last-N, weights-only), `format` brings an older file
up to the current format, `parts` is what each piece saves, `manager` owns a run's (its parts,
when to save, keep-k), and `saved` is the typed view every other reader takes (`SavedCheckpoint`).
"""

from __future__ import annotations

from stallfree.train.checkpoint.files import (
    BEST,
    LATEST,
    Checkpointer,
    CheckpointError,
    choose_checkpoint,
    latest_target,
    load_checkpoint,
    resolve_checkpoint,
    rng_state,
    set_rng_state,
)
from stallfree.train.checkpoint.format import FORMAT, CheckpointFormatError
from stallfree.train.checkpoint.saved import SavedCheckpoint

__all__ = [
    "BEST",
    "FORMAT",
    "LATEST",
    "CheckpointError",
    "CheckpointFormatError",
    "Checkpointer",
    "SavedCheckpoint",
    "choose_checkpoint",
    "latest_target",
    "load_checkpoint",
    "resolve_checkpoint",
    "rng_state",
    "set_rng_state",
]
