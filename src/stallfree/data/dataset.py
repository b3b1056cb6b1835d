"""The dataset, resolved once: train's class folders define the labels of every split.

Every backend, the bench and the trainer take this one `Dataset`; nobody lists folders again.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from stallfree.data.imageio import IMAGE_EXTENSIONS
from stallfree.errors import StallfreeError
from stallfree.recipe import DataConfig

SPLITS = ("train", "val")


class DatasetError(StallfreeError, ValueError):
    """A dataset folder that cannot be used; the message names the path and the fix."""


@dataclass(frozen=True, slots=True)
class Listing:
    """Sorted (path, label) pairs of one split, and the class names that labels index."""

    samples: tuple[tuple[str, int], ...]
    classes: tuple[str, ...]

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def files(self) -> list[str]:
        return [path for path, _ in self.samples]

    @property
    def labels(self) -> list[int]:
        return [label for _, label in self.samples]


@dataclass(frozen=True, slots=True)
class Dataset:
    """Listings of train and val under one label map (train's sorted class folders)."""

    root: str
    classes: tuple[str, ...]
    splits: dict[str, Listing]

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def resolve_dataset(data: DataConfig) -> Dataset:
    """List `data.root/{train,val}/<class>/<image>` once, with train's classes as the label map.

    A val class that train lacks is an error (its label would mean nothing); a train class with
    no val folder is a warning (its accuracy simply goes unmeasured).
    """
    if data.format == "tar":
        from stallfree.data.tarshards import resolve_shards

        return resolve_shards(data.root)
    root = _check_root(data.root)
    allowed = _read_file_list(root, data.file_list) if data.file_list else None
    train = list_split(root, "train", None, allowed)
    val_dir = root / "val"
    unknown = sorted(set(_class_dirs(val_dir)) - set(train.classes))
    if unknown:
        raise DatasetError(
            f"{val_dir} has class folders that {root / 'train'} lacks: {', '.join(unknown)}; "
            "labels come from train's class folders, so remove them from val/ or add them to train/"
        )
    missing = sorted(set(train.classes) - set(_class_dirs(val_dir)))
    if missing:
        warnings.warn(f"{val_dir} has no folder for {len(missing)} training class(es): "
                      f"{', '.join(missing[:10])}; their accuracy is not measured", stacklevel=2)
    val = list_split(root, "val", train.classes, allowed)
    return Dataset(root=str(root), classes=train.classes, splits={"train": train, "val": val})


def _check_root(root_text: str) -> Path:
    if not root_text:
        raise DatasetError("data.root is empty; set it in the recipe or with --set data.root=PATH")
    root = Path(root_text)
    if not root.is_dir():
        hint = " (run `stallfree data demo data/demo` to build the demo data)" if "demo" in root_text else ""
        raise DatasetError(f"data.root {root} does not exist{hint}")
    for split in SPLITS:
        if not (root / split).is_dir():
            raise DatasetError(
                f"data.root {root} has no {split}/ folder; expected {root}/{split}/<class>/<image>")
    return root


def _class_dirs(split_dir: Path) -> list[str]:
    return sorted(p.name for p in split_dir.iterdir() if p.is_dir() and not p.name.startswith("."))


def list_split(root: str | Path, split: str, classes: tuple[str, ...] | None = None,
               allowed: set[Path] | None = None) -> Listing:
    """List one split. `classes` (train's) fixes the label map; None lists the split's own folders.

    Files with other extensions are left out and named in one warning; `allowed` (a clean file
    list from the data checker) keeps only the files it names.
    """
    split_dir = Path(root) / split
    if not split_dir.is_dir():
        raise DatasetError(f"{split_dir} does not exist; expected {root}/{split}/<class>/<image>")
    own = _class_dirs(split_dir)
    if classes is None:
        classes = tuple(own)
    if not own:
        raise DatasetError(f"{split_dir} has no class folders; expected {split_dir}/<class>/<image>")
    samples: list[tuple[str, int]] = []
    left_out: list[Path] = []
    for label, name in enumerate(classes):
        folder = split_dir / name
        if not folder.is_dir():
            continue  # a training class without val images: warned about by resolve_dataset
        files = sorted(p for p in folder.iterdir() if not p.name.startswith(".") and p.is_file())
        left_out += [p for p in files if p.suffix.lower() not in IMAGE_EXTENSIONS
                     and (allowed is None or p.resolve() in allowed)]  # a clean list decides
        files = [p for p in files if p.suffix.lower() in IMAGE_EXTENSIONS
                 and (allowed is None or p.resolve() in allowed)]
        if not files and split == "train":
            raise DatasetError(f"class folder {folder} has no images ({', '.join(IMAGE_EXTENSIONS)}); "
                               "add images or remove the folder")
        samples.extend((str(p), label) for p in files)
    if left_out:
        names = ", ".join(str(p.relative_to(split_dir)) for p in left_out[:5])
        more = f" and {len(left_out) - 5} more" if len(left_out) > 5 else ""
        warnings.warn(f"{split_dir}: left out {len(left_out)} file(s) that are not of an accepted "
                      f"image type ({' '.join(IMAGE_EXTENSIONS)}): {names}{more}", stacklevel=2)
    if not samples:
        raise DatasetError(f"{split_dir} has no images ({', '.join(IMAGE_EXTENSIONS)})")
    return Listing(samples=tuple(samples), classes=tuple(classes))


def _read_file_list(root: Path, file_list: str) -> set[Path]:
    path = Path(file_list)
    if not path.is_file():
        raise DatasetError(f"data.file_list {path} does not exist; point it at a file with one "
                           "image path per line (relative to data.root), or unset it")
    lines = path.read_text().splitlines()
    return {(root / line.strip()).resolve() for line in lines
            if line.strip() and not line.lstrip().startswith("#")}
