"""A checkpoint as the dict of its parts: each part saves and loads itself under its own key
(torchtitan's `Stateful`), so no function assembles another part's state by hand."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn

from stallfree.errors import StallfreeError
from stallfree.train.checkpoint.files import rng_state, set_rng_state
from stallfree.train.distributed import gather_objects
from stallfree.train.ema import unwrap

if TYPE_CHECKING:  # annotations only: the loader is handed in by the run
    from stallfree.data.loader import Loader


class Stateful(Protocol):
    """What a checkpoint part does: say its state, and take it back."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class MissingPartError(StallfreeError, KeyError):
    """A checkpoint without a part this run needs (e.g. EMA weights when train.ema_decay is set)."""

    def __str__(self) -> str:  # KeyError's own would quote the message
        return str(self.args[0])


def save_parts(parts: Mapping[str, Stateful]) -> dict[str, Any]:
    """Each part's state under its key."""
    return {key: part.state_dict() for key, part in parts.items()}


def load_parts(state: Mapping[str, Any], parts: Mapping[str, Stateful]) -> None:
    """Give each part its key's state; refuse, naming them, when the checkpoint lacks some."""
    missing = [key for key in parts if key not in state]
    if missing:
        raise MissingPartError(
            f"the checkpoint holds no {', '.join(missing)} state, which this run's recipe needs "
            "(train.ema_decay set on a run saved without it?); resume with the recipe the run "
            "was saved with, or start afresh"
        )
    for key, part in parts.items():
        part.load_state_dict(state[key])


@dataclass(frozen=True, slots=True)
class StateFns:
    """A part made of two functions: for state kept as plain attributes of its owner."""

    save: Callable[[], dict[str, Any]]
    load: Callable[[dict[str, Any]], None]

    def state_dict(self) -> dict[str, Any]:
        return self.save()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load(state)


@dataclass(frozen=True, slots=True)
class ModelState:
    """A model's weights, without its DDP or torch.compile wrapper (plain names on disk)."""

    model: nn.Module

    def state_dict(self) -> dict[str, Any]:
        return unwrap(self.model).state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unwrap(self.model).load_state_dict(state)


@dataclass(frozen=True, slots=True)
class ScalerState:
    """fp16's loss scale; a disabled scaler saves {}, which an enabled one does not load."""

    scaler: torch.amp.GradScaler

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.scaler.load_state_dict(state)


@dataclass(frozen=True, slots=True)
class ScheduleState:
    """The LR schedule's clock; {} for a trainer without one."""

    scheduler: torch.optim.lr_scheduler.LRScheduler | None

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict() if self.scheduler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scheduler is not None and state:
            self.scheduler.load_state_dict(state)


@dataclass(frozen=True, slots=True)
class RngState:
    """Python, numpy, torch and this rank's CUDA generators."""

    device: torch.device | None = None

    def state_dict(self) -> dict[str, Any]:
        return rng_state(self.device)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state, self.device)


class StepMark:
    """The train loader's part, as of the last optimizer step once `rewind` is set: an outage
    met between the fetches of an accumulation window leaves the loader past micro-batches
    never trained on (the trainer collects a window before its forwards, so nothing else
    moved); the loader gives them back (`Loader.state_at_last_step`)."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader
        self.rewind = False  # set by a stop that saves as of the last step (a store outage)
        loader.mark_step()  # a resume's point, or 0

    def step(self) -> None:
        """After each optimizer step (the run's on_step hook)."""
        self.loader.mark_step()

    def state_dict(self) -> dict[str, Any]:
        """The loader's state; after `rewind` is set, as of the last step."""
        return self.loader.state_at_last_step() if self.rewind else self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resume: the loader at the checkpoint's positions, marked as its last step."""
        self.loader.load_state_dict(state)
        self.loader.mark_step()


@dataclass(frozen=True, slots=True)
class PerRank:
    """Parts that differ per rank, saved as every rank's states in one list (a gather).

    Under another world size: `positions` (counted in global samples) go on from rank 0's
    state on a rank the checkpoint did not have; `own` parts (RNG streams) load only on a rank
    it had, others keep their fresh seeds; `same_world` parts (the open log interval, whose
    images were counted per rank of the old world) load only under the same world size.
    """

    rank: int
    world_size: int
    positions: Mapping[str, Stateful]
    own: Mapping[str, Stateful]
    same_world: Mapping[str, Stateful]

    def state_dict(self) -> list[dict[str, Any]]:
        mine = save_parts({**self.positions, **self.own, **self.same_world})
        return cast(list[dict[str, Any]], gather_objects(mine, self.world_size))

    def load_state_dict(self, ranks: list[dict[str, Any]]) -> None:
        mine = ranks[self.rank] if self.rank < len(ranks) else None
        load_parts((mine or ranks[0]), self.positions)
        if mine is not None:
            load_parts(mine, self.own)
            if len(ranks) == self.world_size:
                load_parts(mine, self.same_world)
