"""`stallfree export`: a checkpoint's weights for use outside stallfree.

Writes into OUT: `state_dict.pt` (for `model.load_state_dict`), `model.pt2` (a `torch.export`
program: `torch.export.load(path).module()` runs it), `model.onnx` (torch's `dynamo=True`
exporter, with the `onnx` extra), both for any batch size, and `export.json`: what was written
and what the model expects (the val resize and crop, mean and std on 0-1 pixels, the class
names in label order). A model that cannot be exported is said so there, not hidden.
"""

from __future__ import annotations

import importlib
import json
import logging
import warnings
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from stallfree.errors import StallfreeError
from stallfree.models import build_model
from stallfree.recipe import Recipe, recipe_from_dict
from stallfree.train.checkpoint import SavedCheckpoint, resolve_checkpoint
from stallfree.train.checkpoint.saved import last_linear_rows


class ExportError(StallfreeError, ValueError):
    """A checkpoint that cannot be exported as asked; the message says why."""


def checkpoint_num_classes(checkpoint: SavedCheckpoint) -> int:
    """The class count the checkpoint was trained with: recorded, else its last 2-D weight's."""
    if checkpoint.recorded_num_classes:
        return checkpoint.recorded_num_classes
    rows = last_linear_rows(checkpoint.weights())
    if rows is None:
        raise ExportError("the checkpoint records no class count and has no linear layer")
    return rows


def class_names(checkpoint: SavedCheckpoint, num_classes: int) -> list[str]:
    """Each label's name, in label order: what the checkpoint records; a checkpoint from before
    class names were saved (or a label beyond them) is named by its number."""
    known = checkpoint.class_names[:num_classes]
    return known + [str(i) for i in range(len(known), num_classes)]


# What `stallfree export` can write beside state_dict.pt and export.json, by default all.
FORMATS = ("pt2", "onnx")
ONNX_INSTALL = "pip install -e '.[onnx]'"
PROGRAMS = ("model.pt2", "model.onnx", "model.onnx.data")
EMBED_LIMIT = 1536 << 20  # bytes of weights model.onnx holds itself (protobuf stops at 2 GB)


def export_checkpoint(
    checkpoint: str | Path, out: str | Path, *, ema: bool = False, formats: Collection[str] | None = None
) -> dict[str, Any]:
    """Export a checkpoint (a ckpt-*.pt, best.pt or run directory) beside its state dict; return
    export.json's data. `formats` (of FORMATS) None: model.pt2, and model.onnx where its
    packages are installed (else export.json says what to install); named: each of them, and
    ONNX without its packages is an ExportError naming the install."""
    asked = FORMATS if formats is None else tuple(formats)
    unknown = sorted(set(asked) - set(FORMATS))
    if unknown:
        raise ExportError(f"export format {', '.join(unknown)}: choose from {', '.join(FORMATS)}")
    missing = _onnx_missing() if "onnx" in asked else ""
    if missing and formats is not None:
        raise ExportError(f"model.onnx needs {missing}: {ONNX_INSTALL}")
    path = resolve_checkpoint(checkpoint)
    saved = SavedCheckpoint.read(path)
    if ema and not saved.has_ema:
        raise ExportError(f"{path} holds no EMA weights (train.ema_decay was 0); drop --ema")
    if not saved.has_recipe:
        raise ExportError(f"{path} holds no recipe: not a stallfree checkpoint or best.pt")
    recipe = recipe_from_dict(saved.recipe)
    classes = checkpoint_num_classes(saved)
    model = build_model(recipe.model, classes, load_pretrained=False)  # the checkpoint has them
    model.load_state_dict(saved.weights(ema=ema))
    model.eval()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out / "state_dict.pt")
    info = _export_info(path, recipe, saved, classes, ema=ema)
    for name in PROGRAMS:  # a previous export's: the folder holds what export.json says
        (out / name).unlink(missing_ok=True)
    if missing:
        info["not_written"]["model.onnx"] = f"needs {missing}: {ONNX_INSTALL}"
    wanted = [f for f in FORMATS if f in asked and not (f == "onnx" and missing)]
    if wanted:
        _export_programs(model, recipe.augment.val_size, out, wanted, info)
    (out / "export.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _export_info(
    path: Path, recipe: Recipe, saved: SavedCheckpoint, classes: int, *, ema: bool
) -> dict[str, Any]:
    """export.json's data before the programs are written: the model and what it expects."""
    size = recipe.augment.val_size  # what evaluation feeds it
    return {
        "checkpoint": str(path),
        "model": recipe.model.name,
        "num_classes": classes,
        "class_names": class_names(saved, classes),
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


def _onnx_missing() -> str:
    """The packages torch's ONNX exporter needs that do not import, or ""."""
    missing = []
    for name in ("onnx", "onnxscript"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return " and ".join(missing)


def _export_programs(
    model: torch.nn.Module, size: int, out: Path, formats: list[str], info: dict[str, Any]
) -> None:
    """model.pt2 and/or model.onnx from one torch.export program, the batch dimension dynamic;
    what fails is recorded in info["not_written"] rather than raised."""
    # A batch of 2: torch.export specialises a dimension whose example is 1 to a constant.
    example = torch.zeros(2, 3, size, size)
    try:
        batch = torch.export.Dim("batch", min=1)
        program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    except Exception as exc:  # noqa: BLE001 - a model that does not export is reported, not fatal
        for name in formats:
            info["not_written"][f"model.{name}"] = _reason(exc)
        return
    if "pt2" in formats:
        torch.export.save(program, out / "model.pt2")
        info["written"].append("model.pt2")
    if "onnx" in formats:
        try:
            _write_onnx(program, example, out / "model.onnx")
            info["written"].append("model.onnx")
            if (out / "model.onnx.data").exists():  # a model over 2 GB: its weights beside it
                info["written"].append("model.onnx.data")
        except Exception as exc:  # noqa: BLE001 - likewise: reported in export.json
            info["not_written"]["model.onnx"] = _reason(exc)


def _write_onnx(program: torch.export.ExportedProgram, example: torch.Tensor, path: Path) -> None:
    """torch's dynamo=True exporter (the one torch recommends since 2.9), quietly: its progress
    lines and its note that torchvision's detection ops are not registered mean nothing here."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's own pytree deprecations
            torch.onnx.export(
                program,
                (example,),
                str(path),
                dynamo=True,
                verbose=False,
                input_names=["images"],
                output_names=["logits"],
                # One file, unless the weights near protobuf's 2 GB limit: then model.onnx.data.
                external_data=_weight_bytes(program) > EMBED_LIMIT,
            )
    finally:
        registration.setLevel(level)


def _weight_bytes(program: torch.export.ExportedProgram) -> int:
    return sum(t.numel() * t.element_size() for t in program.state_dict.values())


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
