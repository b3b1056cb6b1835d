"""Recipes: typed dataclasses loaded from TOML, with type-checked `section.key=value` overrides
(each value checked by its field's rules when it is set: stallfree.tables)."""

from __future__ import annotations

import copy
import dataclasses
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from stallfree.tables import RecipeError, at_least, field_annotation, parse_text, set_field
from stallfree.tomlwrite import dumps_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (NVIDIA containers of 2024): the same parser, packaged as tomli
    import tomli as tomllib


Precision = Literal["auto", "bf16", "fp16", "fp32"]
Device = Literal["auto", "cpu", "cuda"]
DEVICES: tuple[str, ...] = typing.get_args(Device)  # train.device and every command's --device
DEFAULT_MAX_PIXELS = 89_478_485  # PIL's Image.MAX_IMAGE_PIXELS


@dataclass(kw_only=True, slots=True)
class DataConfig:
    root: str = ""
    # folder: root/{train,val}/<class>/<image>; tar: root holds `stallfree data pack` shards.
    format: Literal["folder", "tar"] = "folder"
    file_list: str = ""
    endpoint_url: str = ""  # an s3:// root's store; "" takes AWS_ENDPOINT_URL (or AWS's own)
    # Images over this many pixels are refused before decoding (decompression bombs).
    max_pixels: int = field(default=DEFAULT_MAX_PIXELS, metadata=at_least(1))
    # A file that cannot be decoded: "raise" stops the run naming it; "skip" drops the sample
    # (torch) or leaves the file out after a cached check of the split (dali).
    on_error: Literal["raise", "skip"] = "raise"
    # Used by the synthetic backend when there is no data root.
    synthetic_samples: int = field(default=1024, metadata=at_least(1))
    synthetic_classes: int = field(default=10, metadata=at_least(1))
    # No val/: this share of each train class, drawn with train.seed, is val (0: refuse the root).
    val_fraction: float = field(default=0.0, metadata=at_least(0))


@dataclass(kw_only=True, slots=True)
class AugmentConfig:
    # The train crops' schedule (one epoch's side: LoaderSpec.crop_size): a side, or [epoch,
    # size] pairs, each size from its epoch on (e.g. [[0, 160], [12, 192]]; the first at 0).
    image_size: int | list[list[int]] = field(default=224, metadata=at_least(1))
    resize_size: int = field(default=256, metadata=at_least(1))  # val: the shorter side first
    val_image_size: int = field(default=0, metadata=at_least(0))  # 0: the last train size
    scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    ratio: list[float] = field(default_factory=lambda: [0.75, 4.0 / 3.0])
    hflip: float = 0.5
    # Random erasing (Zhong et al. 2017; torchvision's RandomErasing, timm's re_prob): with this
    # probability a rectangle of erasing_scale of the crop's area and an aspect ratio in
    # erasing_ratio is filled with the mean colour (0 after normalisation). Both loaders.
    random_erasing: float = 0.0
    erasing_scale: list[float] = field(default_factory=lambda: [0.02, 0.33])
    erasing_ratio: list[float] = field(default_factory=lambda: [0.3, 3.3])
    # RandAugment (Cubuk et al. 2020: randaugment_n operations at bin randaugment_m) or
    # TrivialAugmentWide (Mueller & Hutter 2021: one at a random bin), after the flip, on both
    # loaders: DALI's nvidia.dali.auto_aug suites, and the same operations in the torch workers.
    auto_augment: Literal["none", "randaugment", "trivialaugment"] = "none"
    randaugment_n: int = field(default=2, metadata=at_least(1))
    randaugment_m: int = field(default=9, metadata=at_least(0))
    magnitude_bins: int = field(default=31, metadata=at_least(1))
    # Batch mixing on the device after either loader (0: off); mix_prob: share of batches mixed.
    mixup_alpha: float = field(default=0.0, metadata=at_least(0))
    cutmix_alpha: float = field(default=0.0, metadata=at_least(0))
    mix_prob: float = 1.0
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])

    def size_at(self, epoch: int) -> int:
        """The train crop's side in `epoch`."""
        if isinstance(self.image_size, int):
            return self.image_size
        return [size for start, size in self.image_size if start <= epoch][-1]

    def sizes(self) -> list[int]:
        """Every train size the schedule uses."""
        return (
            [self.image_size] if isinstance(self.image_size, int) else [size for _, size in self.image_size]
        )

    @property
    def val_size(self) -> int:
        """The val crop's side: val_image_size, else the last train size (test-time resolution
        above the train one is FFCV's and FixRes's trick: the train crops' objects look larger)."""
        return self.val_image_size or self.sizes()[-1]


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    name: str = "resnet50"
    num_classes: int = field(default=0, metadata=at_least(0))  # 0: inferred from the data
    zero_init_residual: bool = True
    drop_rate: float = field(default=0.0, metadata=at_least(0))  # dropout before the classifier
    # Start from these weights (a stallfree checkpoint, best.pt, or a plain state dict file):
    # fine-tuning. A classifier whose shape differs (another class count) starts afresh.
    init_from: str = ""
    # timm models: start from timm's pretrained weights (the Hugging Face Hub, or its cache
    # offline; name = "timm:hf-hub:ORG/REPO" for a Hub repo). init_from, when set, loads after.
    pretrained: bool = False
    pretrained_file: str = ""  # those weights from a local file instead (timm's cfg "file")
    # Keyword arguments for the model factory (timm.create_model, an in-house model or a
    # module:function), e.g. {drop_path_rate = 0.1}.
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    name: Literal["sgd", "adamw"] = "sgd"
    lr: float = field(default=0.1, metadata=at_least(0))
    momentum: float = 0.9
    nesterov: bool = False  # sgd only
    weight_decay: float = field(default=5e-5, metadata=at_least(0))
    # No weight decay on BatchNorm weights and biases (every 1-D parameter): the usual ImageNet
    # practice (Goyal et al. 2017; FFCV's bn_wd = 0).
    wd_exclude_norm_bias: bool = True
    warmup_steps: int = field(default=0, metadata=at_least(0))
    min_lr_frac: float = 0.0
    label_smoothing: float = 0.0


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    epochs: int = field(default=1, metadata=at_least(1))
    batch_size: int = field(default=64, metadata=at_least(1))  # per rank, per micro-step
    accum_steps: int = field(default=1, metadata=at_least(1))
    # auto: what the device runs natively (see train/precision.py); resolved once at start.
    precision: Precision = "auto"
    max_grad_norm: float = field(default=0.0, metadata=at_least(0))  # 0: no clipping
    seed: int = 0
    log_every: int = field(default=20, metadata=at_least(1))
    # Beside metrics.jsonl (and TensorBoard when installed): "mlflow" (a local store in
    # RUN/mlruns, or MLFLOW_TRACKING_URI) and "wandb" (offline unless WANDB_MODE says otherwise).
    trackers: list[Literal["mlflow", "wandb"]] = field(default_factory=list)
    channels_last: bool = False
    sync_bn: bool = False  # BatchNorm statistics over all ranks (DDP on CUDA)
    compile: bool = False  # torch.compile the model
    ema_decay: float = 0.0  # EMA of the weights, evaluated beside them (0: off), e.g. 0.9998
    # Each loaded batch runs in chunks of this size (0: whole); "auto" finds the largest that
    # fits. The global batch, the samples and the loader positions stay as they are.
    micro_batch: int | Literal["auto"] = field(default=0, metadata=at_least(0))
    max_nonfinite_steps: int = field(default=10, metadata=at_least(1))
    device: Device = "auto"
    ckpt_every_steps: int = field(default=0, metadata=at_least(0))  # 0: at epoch ends only
    # >= 2: a crash in the middle of a save must leave one good checkpoint.
    keep_checkpoints: int = field(default=3, metadata=at_least(2))
    # Under Slurm, SIGUSR1 (#SBATCH --signal=USR1@300) saves, then rank 0 runs
    # `scontrol requeue $SLURM_JOB_ID` so that the job comes back and resumes; false: just exit 75.
    slurm_requeue: bool = True


@dataclass(kw_only=True, slots=True)
class TorchLoaderConfig:
    """`[loader.torch]`: the DataLoader backend's own keys."""

    # -1: this rank's share of the cores; "auto": the fastest count near it, measured at start
    # (a run's resolved.toml and checkpoints say which; a resume reuses it, not measuring again)
    workers: int | Literal["auto"] = field(default=-1, metadata=at_least(-1))
    # Strict comparison: decode every JPEG in full, as DALI does, instead of DCT-scaled where the
    # crop allows (slower); train crops then match DALI's within a grey level at any size.
    exact_decode: bool = False


@dataclass(kw_only=True, slots=True)
class DaliLoaderConfig:
    """`[loader.dali]`: the DALI backend's own keys."""

    # -1 or 0: this rank's share; "auto": the fastest count near it, measured at start
    threads: int | Literal["auto"] = field(default=-1, metadata=at_least(-1))
    device: Literal["auto", "cpu"] = "auto"  # cpu: keep the graph on the CPU, even on a GPU run
    decode: Literal["auto", "cpu"] = "auto"  # cpu: decode on the CPU, augment on the GPU
    hw_decoder_load: float = 0.65  # share of JPEGs for the A100+ hardware decoder


@dataclass(kw_only=True, slots=True)
class LoaderConfig:
    backend: str = "torch"  # dali | torch | synthetic | synthetic-decode | auto | module:function
    # synthetic-decode: the pipeline that decodes the in-memory files ("auto": as --loader auto)
    synthetic_decode: Literal["auto", "torch", "dali"] = "auto"
    prefetch: int = field(default=2, metadata=at_least(1))  # batches queued ahead
    # Files read at once per torch worker, or by the dali source's reader pool: on network or
    # object storage every read waits milliseconds, so many must be in flight.
    # "auto": 16 from a path, 64 from an s3:// root (data/readers/inflight.py says why).
    io_depth: int | Literal["auto"] = field(default="auto", metadata=at_least(1))
    torch: TorchLoaderConfig = field(default_factory=TorchLoaderConfig)
    dali: DaliLoaderConfig = field(default_factory=DaliLoaderConfig)
    # A module:function backend's own keys, checked against the dataclass it declares
    # (stallfree.data.registry.resolve).
    plugin: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True, slots=True)
class Recipe:
    """The whole configuration of one run, as the user gave it ("auto" stays "auto": what it
    became on a run is that run's `Resolved` record, stallfree.resolved)."""

    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict, the form written to recipe.toml and into checkpoints."""
        return dataclasses.asdict(self)

    def copy(self) -> Recipe:
        """An independent deep copy."""
        return recipe_from_dict(self.to_dict())


# Keys that moved into a backend's own table: say where, rather than "unknown key".
_MOVED = {
    "loader.workers": "loader.torch.workers",
    "loader.threads": "loader.dali.threads",
    "loader.device": "loader.dali.device",
    "loader.dali_decode": "loader.dali.decode",
    "loader.hw_decoder_load": "loader.dali.hw_decoder_load",
}


# Keys whose "auto" older runs (checkpoint format 5 and before) overwrote in their recipe.toml
# and checkpoints with what it became, writing `<key>_requested = "auto"` beside it.
_REQUESTED: tuple[str, ...] = ("train.device", "train.precision", "train.micro_batch", "loader.backend")
_REQUESTED += ("loader.io_depth", "loader.torch.workers", "loader.dali.threads")


def lift_requested(raw: dict[str, Any]) -> dict[str, Any]:
    """An older run's recipe (a dict, changed in place) as the user gave it: each `<key>_requested`
    dropped, "auto" back where it was "auto"; returns {dotted key: what that "auto" became}."""
    chosen: dict[str, Any] = {}
    for dotted in _REQUESTED:
        *tables, key = dotted.split(".")
        table: Any = raw
        for name in tables:
            table = table.get(name) if isinstance(table, dict) else None
        if isinstance(table, dict) and table.pop(f"{key}_requested", "") == "auto" and key in table:
            chosen[dotted], table[key] = table[key], "auto"
    return chosen


def recipe_from_dict(raw: dict[str, Any], source: str = "<dict>") -> Recipe:
    """Build a Recipe from nested dicts, refusing unknown tables and keys, wrong types and values
    (an older run's recipe.toml reads as the recipe its user gave: `lift_requested`)."""
    recipe, raw = Recipe(), copy.deepcopy(raw)
    lift_requested(raw)
    for section, table in raw.items():
        if section not in Recipe.__dataclass_fields__:
            raise RecipeError(
                f"{source}: unknown table [{section}]; known tables: {', '.join(Recipe.__dataclass_fields__)}"
            )
        if not isinstance(table, dict):
            raise RecipeError(f"{source}: [{section}] must be a table, got {table!r}")
    _refuse_moved(raw, source)
    for section, table in raw.items():
        for key, value in table.items():
            set_field(getattr(recipe, section), section, key, value, source, _MOVED)
    return recipe


def _refuse_moved(raw: dict[str, Any], source: str) -> None:
    """Every moved key of an old recipe in one message, so that one edit fixes them all."""
    moved = [
        f"'{old}' -> '{_MOVED[old]}'"
        for old in (f"{section}.{key}" for section, table in raw.items() for key in table)
        if old in _MOVED
    ]
    if len(moved) > 1:
        raise RecipeError(
            f"{source}: {len(moved)} keys have moved into their backend's table: "
            f"{', '.join(moved)}; write each under its new table instead"
        )


def load_recipe(path: str | Path) -> Recipe:
    """Load a TOML recipe; relative data paths stay relative to the working directory."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file {path} does not exist; recipes live in pipelines/*.toml")
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: not valid TOML: {exc}") from exc
    return recipe_from_dict(raw, source=str(path))


def apply_overrides(recipe: Recipe, overrides: list[str]) -> Recipe:
    """Apply `section.key=value` (or `loader.dali.key=value`) overrides in order."""
    for item in overrides:
        dotted, sep, text = item.partition("=")
        *tables, key = dotted.strip().split(".")
        if not sep or not tables or not key:
            raise RecipeError(f"--set {item!r}: expected section.key=value, e.g. train.epochs=3")
        value = parse_text(text, field_annotation(recipe, tables, key))
        set_key(recipe, dotted.strip(), value, f"--set {item!r}")
    return recipe


def set_key(recipe: Recipe, dotted: str, value: Any, source: str) -> None:
    """Set one `section.key` (or `loader.dali.key`) to a Python value, checked as TOML's is."""
    *tables, key = dotted.split(".")
    nested = value
    for name in reversed(tables[1:]):
        nested, key = {key: nested}, name
    recipe_from_dict({tables[0]: {key: nested}}, source)  # checks the table name first
    set_field(getattr(recipe, tables[0]), tables[0], key, nested, source, _MOVED)


def apply_flags(recipe: Recipe, flags: Mapping[str, Any], overrides: Sequence[str] = ()) -> Recipe:
    """A command's flags as typed values (`{"loader.backend": "dali"}` for --loader dali), then
    its --set overrides, in order."""
    for dotted, value in flags.items():
        set_key(recipe, dotted, value, f"the flag for {dotted}")
    return apply_overrides(recipe, list(overrides))


def validate(recipe: Recipe) -> None:
    """Rules that span several keys (one key's own rules are checked when it is set)."""
    aug = recipe.augment
    for key in ("scale", "ratio", "erasing_scale", "erasing_ratio"):
        lo_hi = getattr(aug, key)
        if len(lo_hi) != 2 or not 0 < lo_hi[0] <= lo_hi[1]:
            raise RecipeError(f"augment.{key} = {lo_hi}; expected [low, high] with 0 < low <= high")
    if len(aug.mean) != 3 or len(aug.std) != 3 or min(aug.std) <= 0:
        raise RecipeError("augment.mean and augment.std need 3 values each, std > 0")
    _check_size_schedule(aug.image_size)
    if aug.resize_size < aug.val_size:
        raise RecipeError(
            f"augment.resize_size ({aug.resize_size}) < the val crop ({aug.val_size}: "
            "augment.val_image_size, else the last augment.image_size); the val center crop "
            "needs resize_size >= it"
        )
    if aug.auto_augment == "randaugment" and aug.randaugment_m >= aug.magnitude_bins:
        raise RecipeError(
            f"augment.randaugment_m = {aug.randaugment_m} must be below "
            f"augment.magnitude_bins ({aug.magnitude_bins}); bins count from 0"
        )
    for key in ("hflip", "mix_prob", "random_erasing"):
        if not 0 <= getattr(aug, key) <= 1:
            raise RecipeError(f"augment.{key} = {getattr(aug, key)}; a probability in [0, 1]")
    if not 0 <= recipe.data.val_fraction < 1:
        raise RecipeError(f"data.val_fraction = {recipe.data.val_fraction}; 0 (off) or a share in (0, 1)")
    if not 0 <= recipe.train.ema_decay < 1:
        raise RecipeError(f"train.ema_decay = {recipe.train.ema_decay}; 0 (off) or in (0, 1)")


def _check_size_schedule(sizes: int | list[list[int]]) -> None:
    if isinstance(sizes, int):
        return
    epochs = [pair[0] for pair in sizes if len(pair) == 2]
    if (
        not sizes
        or len(epochs) != len(sizes)
        or epochs[0] != 0
        or epochs != sorted(set(epochs))
        or min(size for _, size in sizes) < 1
    ):
        raise RecipeError(
            f"augment.image_size = {sizes}; expected a size, or [epoch, size] pairs "
            "from epoch 0 in increasing epochs, e.g. [[0, 160], [12, 192]]"
        )


def dump_toml(recipe: Recipe) -> str:
    """Serialise a recipe as TOML (the form of recipe.toml and of `--set` round trips)."""
    return dumps_toml(recipe.to_dict())
