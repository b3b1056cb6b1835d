"""Recipes: typed dataclasses loaded from TOML, with type-checked `section.key=value` overrides."""

from __future__ import annotations

import ast
import dataclasses
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the key or path and the fix."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    root: str = ""
    file_list: str = ""
    # Used by the synthetic backend when there is no data root.
    synthetic_samples: int = 1024
    synthetic_classes: int = 10


@dataclass(kw_only=True, slots=True)
class AugmentConfig:
    image_size: int = 224
    resize_size: int = 256
    scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    ratio: list[float] = field(default_factory=lambda: [0.75, 4.0 / 3.0])
    hflip: float = 0.5
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    name: str = "resnet50"
    num_classes: int = 0  # 0: inferred from the data
    zero_init_residual: bool = True


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    name: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-5
    warmup_steps: int = 0
    min_lr_frac: float = 0.0
    label_smoothing: float = 0.0


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    epochs: int = 1
    batch_size: int = 64
    accum_steps: int = 1
    precision: str = "bf16"
    max_grad_norm: float = 0.0  # 0: no clipping
    seed: int = 0
    log_every: int = 20
    channels_last: bool = False
    max_nonfinite_steps: int = 10
    device: str = "auto"  # auto | cpu | cuda
    ckpt_every_steps: int = 0  # 0: checkpoint at epoch ends only
    keep_checkpoints: int = 3


@dataclass(kw_only=True, slots=True)
class LoaderConfig:
    backend: str = "torch"
    device: str = "auto"  # dali: where the graph runs; auto = the training device, or cpu
    workers: int = -1  # torch: -1 derives it from the CPU count
    threads: int = -1  # dali: -1 derives it from the CPU count
    prefetch: int = 2
    dali_decode: str = "auto"  # auto | cpu
    hw_decoder_load: float = 0.65


@dataclass(kw_only=True, slots=True)
class Recipe:
    """The whole resolved configuration of one run."""

    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict, the form written to recipe.toml and into checkpoints."""
        return dataclasses.asdict(self)


_SECTION_TYPES: dict[str, type] = {
    "data": DataConfig, "augment": AugmentConfig, "model": ModelConfig,
    "optim": OptimConfig, "train": TrainConfig, "loader": LoaderConfig,
}


def _check_type(value: Any, annotation: Any, where: str) -> Any:
    """Return `value` coerced to `annotation` (int→float, list→list[float]) or raise RecipeError."""
    origin = typing.get_origin(annotation)
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, (list, tuple)):
            raise RecipeError(f"{where}: expected a list, got {value!r}")
        return [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            try:
                return _check_type(value, option, where)
            except RecipeError:
                continue
        raise RecipeError(f"{where}: {value!r} matches none of {annotation}")
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if (annotation is int and isinstance(value, bool)) or not isinstance(value, annotation):
        name = getattr(annotation, "__name__", str(annotation))
        raise RecipeError(f"{where}: expected {name}, got {type(value).__name__} {value!r}")
    return value


def _set_field(section_obj: Any, section: str, key: str, value: Any, source: str) -> None:
    # get_type_hints resolves the string annotations that `from __future__ import annotations` leaves.
    hints = typing.get_type_hints(type(section_obj))
    if key not in hints:
        raise RecipeError(
            f"{source}: unknown key '{section}.{key}'; known keys in [{section}]: {', '.join(hints)}"
        )
    setattr(section_obj, key, _check_type(value, hints[key], f"{source}: {section}.{key}"))


def recipe_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Recipe:
    """Build a Recipe from nested dicts, refusing unknown sections, unknown keys and wrong types."""
    recipe = Recipe()
    for section, table in raw.items():
        if section not in _SECTION_TYPES:
            raise RecipeError(
                f"{source}: unknown table [{section}]; known tables: {', '.join(_SECTION_TYPES)}"
            )
        if not isinstance(table, dict):
            raise RecipeError(f"{source}: [{section}] must be a table, got {table!r}")
        for key, value in table.items():
            _set_field(getattr(recipe, section), section, key, value, source)
    return recipe


def load_recipe(path: str | Path) -> Recipe:
    """Load a TOML recipe; relative data paths stay relative to the working directory."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file {path} does not exist; recipes live in pipelines/*.toml")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path}: not valid TOML: {exc}") from exc
    return recipe_from_dict(raw, source=str(path))


def _parse_value(text: str) -> Any:
    """Parse an override value as a TOML/Python literal, falling back to a bare string."""
    lowered = text.strip()
    if lowered in ("true", "false"):
        return lowered == "true"
    try:
        return ast.literal_eval(lowered)
    except (ValueError, SyntaxError):
        return text


def apply_overrides(recipe: Recipe, overrides: list[str]) -> Recipe:
    """Apply `section.key=value` overrides in order; each is type-checked like the TOML."""
    for item in overrides:
        dotted, sep, text = item.partition("=")
        section, dot, key = dotted.strip().partition(".")
        if not sep or not dot:
            raise RecipeError(f"--set {item!r}: expected section.key=value, e.g. train.epochs=3")
        if section not in _SECTION_TYPES:
            raise RecipeError(
                f"--set {item!r}: unknown table [{section}]; known: {', '.join(_SECTION_TYPES)}"
            )
        _set_field(getattr(recipe, section), section, key, _parse_value(text), f"--set {item!r}")
    return recipe


_CHOICES = {
    ("train", "precision"): ("bf16", "fp16", "fp32"),
    ("train", "device"): ("auto", "cpu", "cuda"),
    ("loader", "device"): ("auto", "cpu"),
    ("loader", "dali_decode"): ("auto", "cpu"),
    ("optim", "name"): ("sgd", "adamw"),
}


def validate(recipe: Recipe, *, needs_data: bool = True) -> None:
    """Check values and paths before any work starts; raise RecipeError naming key and fix."""
    for (section, key), choices in _CHOICES.items():
        value = getattr(getattr(recipe, section), key)
        if value not in choices:
            raise RecipeError(f"{section}.{key} = {value!r}; choose one of {', '.join(choices)}")
    positive = [("train", "epochs"), ("train", "batch_size"), ("train", "accum_steps"),
                ("train", "log_every"), ("augment", "image_size"), ("augment", "resize_size")]
    for section, key in positive:
        if getattr(getattr(recipe, section), key) < 1:
            raise RecipeError(f"{section}.{key} must be >= 1")
    if recipe.train.keep_checkpoints < 2 or recipe.train.ckpt_every_steps < 0:
        raise RecipeError("train.keep_checkpoints must be >= 2 (a crash mid-save must leave one "
                          "good checkpoint) and train.ckpt_every_steps >= 0")
    aug = recipe.augment
    for key in ("scale", "ratio"):
        lo_hi = getattr(aug, key)
        if len(lo_hi) != 2 or not 0 < lo_hi[0] <= lo_hi[1]:
            raise RecipeError(f"augment.{key} = {lo_hi}; expected [low, high] with 0 < low <= high")
    if len(aug.mean) != 3 or len(aug.std) != 3 or min(aug.std) <= 0:
        raise RecipeError("augment.mean and augment.std need 3 values each, std > 0")
    if aug.resize_size < aug.image_size:
        raise RecipeError(
            f"augment.resize_size ({aug.resize_size}) < augment.image_size ({aug.image_size}); "
            "the val center crop needs resize_size >= image_size"
        )
    if needs_data:
        _validate_data_root(recipe.data)


def _validate_data_root(data: DataConfig) -> None:
    if not data.root:
        raise RecipeError("data.root is empty; set it in the recipe or with --set data.root=PATH")
    root = Path(data.root)
    if not root.is_dir():
        hint = " (run `stallfree data demo data/demo` to build the demo data)" if "demo" in str(root) else ""
        raise RecipeError(f"data.root {root} does not exist{hint}")
    for split in ("train", "val"):
        if not (root / split).is_dir():
            raise RecipeError(
                f"data.root {root} has no {split}/ folder; expected {root}/{split}/<class>/<image>"
            )
    if data.file_list and not Path(data.file_list).is_file():
        raise RecipeError(f"data.file_list {data.file_list} does not exist")


def dump_toml(recipe: Recipe) -> str:
    """Serialise a recipe as TOML (the subset its dataclasses use)."""
    lines: list[str] = []
    for section, table in recipe.to_dict().items():
        lines.append(f"[{section}]")
        for key, value in table.items():
            lines.append(f"{key} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)
