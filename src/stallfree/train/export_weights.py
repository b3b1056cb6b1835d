"""`stallfree export`: a checkpoint's weights for use outside stallfree.

Writes into OUT: `state_dict.pt` (the plain weights, loadable with `model.load_state_dict`),
`model.torchscript.pt` (traced, when the model traces), `model.onnx` (when the `onnx` package
is installed and the model exports), and `export.json` saying what was written and what the
model expects (the val transform's resize and crop sizes, mean and std on 0-1 pixels, the
class names in label order, channels order).
A model that cannot be traced or exported is said so in export.json, not hidden.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from stallfree.errors import StallfreeError
from stallfree.models import build_model
from stallfree.recipe import recipe_from_dict
from stallfree.train.checkpoint import load_checkpoint, resolve_checkpoint


class ExportError(StallfreeError, ValueError):
    """A checkpoint that cannot be exported as asked; the message says why."""


def checkpoint_num_classes(state: dict[str, Any]) -> int:
    """The class count the checkpoint was trained with: recorded, else its last 2-D weight's."""
    if state.get("num_classes"):
        return int(state["num_classes"])
    weights = [v for v in state["model"].values() if isinstance(v, torch.Tensor) and v.dim() == 2]
    if not weights:
        raise ExportError("the checkpoint records no class count and has no linear layer")
    return int(weights[-1].shape[0])


def class_names(state: dict[str, Any], num_classes: int) -> list[str]:
    """Each label's name, in label order: what the checkpoint records; a checkpoint from before
    class names were saved (or a label beyond them) is named by its number."""
    known = [str(name) for name in state.get("class_names") or []][:num_classes]
    return known + [str(i) for i in range(len(known), num_classes)]


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, ema: bool = False) -> dict[str, Any]:
    """Export a checkpoint (a ckpt-*.pt, best.pt or run directory); return export.json's data."""
    path = resolve_checkpoint(checkpoint)
    state = load_checkpoint(path)
    if ema and "ema" not in state:
        raise ExportError(f"{path} holds no EMA weights (train.ema_decay was 0); drop --ema")
    if "recipe" not in state:
        raise ExportError(f"{path} holds no recipe: not a stallfree checkpoint or best.pt")
    recipe = recipe_from_dict(state["recipe"])
    classes = checkpoint_num_classes(state)
    model = build_model(recipe.model, classes, load_pretrained=False)  # the checkpoint has them
    model.load_state_dict(state["ema"]["module"] if ema else state["model"])
    model.eval()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out / "state_dict.pt")
    size = recipe.augment.val_size  # what evaluation feeds it
    example = torch.zeros(1, 3, size, size)
    info: dict[str, Any] = {
        "checkpoint": str(path),
        "model": recipe.model.name,
        "num_classes": classes,
        "class_names": class_names(state, classes),
        "weights": "ema" if ema else "model",
        "input": [3, size, size],
        # The val transform, for preprocessing outside stallfree: resize the shorter side to
        # resize_size, center crop image_size, scale to 0-1, normalise with mean and std.
        "resize_size": recipe.augment.resize_size,
        "image_size": size,
        "mean": recipe.augment.mean,
        "std": recipe.augment.std,
        "pixels": "RGB, 0-1, NCHW",
        "written": ["state_dict.pt"],
        "not_written": {},
    }
    try:
        with torch.no_grad():
            torch.jit.trace(model, example).save(str(out / "model.torchscript.pt"))
        info["written"].append("model.torchscript.pt")
    except Exception as exc:  # noqa: BLE001 - a model that does not trace is reported, not fatal
        info["not_written"]["model.torchscript.pt"] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        import onnx  # noqa: F401 - torch's exporter needs it

        torch.onnx.export(
            model,
            (example,),
            str(out / "model.onnx"),
            dynamo=False,
            input_names=["images"],
            output_names=["logits"],
            dynamic_axes={"images": {0: "batch"}, "logits": {0: "batch"}},
        )
        info["written"].append("model.onnx")
    except Exception as exc:  # noqa: BLE001 - likewise: reported in export.json
        info["not_written"]["model.onnx"] = f"{type(exc).__name__}: {exc}"[:300]
    (out / "export.json").write_text(json.dumps(info, indent=2) + "\n")
    return info
