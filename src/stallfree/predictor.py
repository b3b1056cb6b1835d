"""The top-k class names of each image from a checkpoint (`stallfree predict`, whose parser
lives in commands/predict.py).

Images go through the run's own validation transform (the torch backend's decode, resize of the
shorter side to augment.resize_size, center crop of the val size, normalisation with the
recipe's mean and std), in batches, on the device. A file that does not decode is one line
naming it; the others go on, and the exit code says that some failed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallfree.errors import StallfreeError

# Exit code when some inputs could not be predicted (the others were).
SOME_FAILED_EXIT_CODE = 1


class PredictError(StallfreeError, ValueError):
    """Arguments `stallfree predict` cannot use; the message names the argument and the fix."""


@dataclass(frozen=True, slots=True)
class Prediction:
    """One input's result: its top-k (name, probability) pairs, or why it failed."""

    path: str
    top: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    error: str = ""

    def as_json(self) -> str:
        if self.error:
            return json.dumps({"path": self.path, "error": self.error})
        return json.dumps(
            {"path": self.path, "top": [{"class": name, "prob": round(p, 6)} for name, p in self.top]}
        )

    def as_line(self) -> str:
        return f"{self.path}: " + ", ".join(f"{name} {p:.3f}" for name, p in self.top)


def pick_checkpoint(path: str | Path) -> tuple[Path, str]:
    """(checkpoint file, why it was chosen): the rule every command reads a run by."""
    from stallfree.train.checkpoint import choose_checkpoint

    return choose_checkpoint(path)


def image_paths(inputs: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(files as given, whatever their extension, and folders' image files, sorted; the folders
    that hold no image file, which are failed inputs rather than silently nothing; the other
    files found in folders, not hidden ones, which `skipped_line` names)."""
    from stallfree.data.readers.imageio import IMAGE_EXTENSIONS

    found: list[str] = []
    empty: list[str] = []
    skipped: list[str] = []
    for item in inputs:
        if not os.path.isdir(item):
            found.append(item)  # a missing file is reported with the other failures
            continue
        before = len(found)
        for folder, dirs, files in os.walk(item):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(f for f in files if not f.startswith(".")):
                is_image = os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS
                (found if is_image else skipped).append(os.path.join(folder, name))
        if len(found) == before:
            empty.append(item)
    return found, empty, skipped


def skipped_line(skipped: list[str], shown: int = 3) -> str:
    """One line counting the files skipped for their extension, naming the first `shown`."""
    from stallfree.data.readers.imageio import IMAGE_EXTENSIONS

    names = ", ".join(skipped[:shown]) + (f" and {len(skipped) - shown} more" if len(skipped) > shown else "")
    count = f"{len(skipped)} file{'s' if len(skipped) != 1 else ''}"
    return f"skipped {count} without an image extension: {names} (read: {' '.join(sorted(IMAGE_EXTENSIONS))})"


def no_images_reason() -> str:
    from stallfree.data.readers.imageio import IMAGE_EXTENSIONS

    return f"no image files in this folder or below it ({', '.join(sorted(IMAGE_EXTENSIONS))})"


class Predictor:
    """A checkpoint's model with its recipe's val transform and class names, on a device."""

    def __init__(self, checkpoint: str | Path, device: Any, *, ema: bool = False) -> None:
        import torch

        from stallfree.models import build_model
        from stallfree.recipe import recipe_from_dict
        from stallfree.train.checkpoint import SavedCheckpoint
        from stallfree.train.export_weights import checkpoint_num_classes, class_names

        self.path = Path(checkpoint)
        saved = SavedCheckpoint.read(self.path)
        if not saved.has_recipe:
            raise PredictError(f"{self.path} holds no recipe: not a stallfree checkpoint or best.pt")
        if ema and not saved.has_ema:
            raise PredictError(f"{self.path} holds no EMA weights (train.ema_decay was 0); drop --ema")
        self.recipe = recipe_from_dict(saved.recipe)
        count = checkpoint_num_classes(saved)
        self.class_names = class_names(saved, count)
        # The checkpoint holds every weight: nothing to download or initialise from.
        config = dataclasses.replace(self.recipe.model, init_from="")
        model = build_model(config, count, load_pretrained=False)
        model.load_state_dict(saved.weights(ema=ema))
        self.model = model.to(device).eval()
        self.device = torch.device(device)

    def predict(self, paths: list[str], top_k: int, batch_size: int) -> Iterator[Prediction]:
        """Each path's Prediction, in order; decoded in threads, a batch at a time."""
        import torch

        from stallfree.data.backends.prefetch import Normaliser

        aug = self.recipe.augment
        normalise = Normaliser(aug.mean, aug.std, torch.float32, channels_last=False, device=self.device)
        k = min(top_k, len(self.class_names))
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            for start in range(0, len(paths), batch_size):
                chunk = paths[start : start + batch_size]
                decoded = list(pool.map(self._decode, chunk))
                good = [(p, px) for p, px in zip(chunk, decoded, strict=True) if not isinstance(px, str)]
                top = self._top(normalise, [px for _, px in good], k) if good else []
                results = {p: dataclasses.replace(r, path=p) for (p, _), r in zip(good, top, strict=True)}
                for path, pixels in zip(chunk, decoded, strict=True):
                    yield Prediction(path, error=pixels) if isinstance(pixels, str) else results[path]

    def _decode(self, path: str) -> Any:
        """uint8 HWC pixels, as the val loader makes them; or the one-line reason it failed."""
        from stallfree.data.readers.imageio import BadImageError
        from stallfree.data.transforms.augment import val_transform

        aug = self.recipe.augment
        try:
            return val_transform(path, aug, aug.val_size, 0, self.recipe.data.max_pixels)
        except BadImageError as exc:
            return exc.reason or str(exc)
        except OSError as exc:  # missing, unreadable: named like a bad image
            return f"{type(exc).__name__}: {exc.strerror or exc}"

    def _top(self, normalise: Any, pixels: list[Any], k: int) -> list[Prediction]:
        import numpy as np
        import torch

        batch = torch.from_numpy(np.stack(pixels)).to(self.device)
        with torch.inference_mode():
            probs = self.model(normalise(batch)).float().softmax(dim=1)
        values, indices = probs.topk(k, dim=1)
        return [
            Prediction("", [(self.class_names[i], float(v)) for v, i in zip(vs, ids, strict=True)])
            for vs, ids in zip(values.tolist(), indices.tolist(), strict=True)
        ]
