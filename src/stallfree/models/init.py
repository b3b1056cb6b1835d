"""`model.init_from`: start a fresh run from saved weights (fine-tuning).

The file is a stallfree checkpoint (its "model"), a `best.pt`, or a
plain state dict (what `stallfree export` writes, or torchvision's and timm's weight files).
Loaded without unpickling code (`weights_only`). Every tensor must find its place; the only
ones allowed to differ are those whose shape no longer fits, i.e. a classifier for another
number of classes, which keeps its fresh initialisation and is named in a warning.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from stallfree.errors import StallfreeError

# Prefixes that wrappers add to parameter names: DDP ("module."), torch.compile ("_orig_mod.").
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class InitFromError(StallfreeError, ValueError):
    """model.init_from names a file that cannot initialise this model."""

    hint = "model.init_from takes a checkpoint, a best.pt or a state dict of the same model"


def _weights(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise InitFromError(f"model.init_from = {path}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # any failure to read the file is the user's to fix
        raise InitFromError(
            f"model.init_from = {path}: cannot read it as weights ({type(exc).__name__}: {exc})"
        ) from exc
    from stallfree.train.checkpoint.saved import model_weights

    state = model_weights(state)  # a stallfree checkpoint's or best.pt's, or a plain state dict
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise InitFromError(f"model.init_from = {path}: not a state dict of tensors")
    for prefix in _WRAPPER_PREFIXES:
        if state and all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    return state


def init_from(model: nn.Module, path: str | Path) -> list[str]:
    """Load `path`'s weights into `model`; return the names kept fresh (another shape)."""
    path = Path(path)
    state = _weights(path)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise InitFromError(
            f"model.init_from = {path} does not fit model: missing {_few(missing) or 'none'}; "
            f"not in the model {_few(unexpected) or 'none'}"
        )
    fresh = sorted(k for k in state if state[k].shape != own[k].shape)
    model.load_state_dict({k: v for k, v in state.items() if k not in fresh}, strict=False)
    if fresh:
        warnings.warn(
            f"model.init_from = {path}: {_few(fresh)} differ in shape (another "
            "class count?) and start from a fresh initialisation",
            stacklevel=2,
        )
    return fresh


def _few(names: list[str], shown: int = 4) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
