"""The folder reader of a local root, and a `data.file_list` read for any root: train's class
folders define the labels of every split (data/readers/factory.py picks the reader).

Every backend, the bench and the trainer take this one `Dataset`; nobody lists folders again.
Listing is `os.scandir` (no `stat()` per file) into a `Listing` of bytes (see data/readers/listing.py),
so ImageNet-sized folders list in seconds and cost bytes, not Python objects, per sample.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import numpy as np

from stallfree.data import storage
from stallfree.data.readers.imageio import IMAGE_EXTENSIONS
from stallfree.data.readers.listing import SPLITS, Dataset, DatasetError, Listing, ListingBuilder, hold_out
from stallfree.errors import some_of
from stallfree.recipe import DataConfig, Recipe

# The first line `stallfree data check --write-list` writes: a list it fully decoded under this
# version's rules and pixel limit needs no header check at start, for the root it names.
CHECKED_LIST = re.compile(
    r"^# stallfree data check (.*): \d+ good files \(stallfree (\S+), max_pixels (\d+)\)\s*$"
)


def class_count(recipe: Recipe, dataset: Dataset | None) -> int:
    """The model's number of classes: model.num_classes, else the dataset's, else the
    synthetic count (the one rule; every command asks here)."""
    if recipe.model.num_classes:
        return recipe.model.num_classes
    return dataset.num_classes if dataset else recipe.data.synthetic_classes


def read_folders(root: storage.Location, data: DataConfig, seed: int = 0, reuse: bool = False) -> Dataset:
    """List a local `root/{train,val}/<class>/<image>` once, with train's classes as the label
    map (data/readers/factory.py chooses this reader; `reuse` is a store's).

    A val class that train lacks is an error (its label would mean nothing); a train class with
    no val folder or no val images is a warning (its accuracy simply goes unmeasured). With
    `data.val_fraction`, a root without val/ holds out that share of train, drawn with `seed`
    (train.seed).
    """
    folder = root.folder("the folder reader walks a local folder")
    _check_no_val(folder, data.val_fraction)
    classes = tuple(_class_dirs(folder / "train"))
    if data.val_fraction:
        return _held_out(folder, classes, data.val_fraction, seed)
    val_dir = folder / "val"
    unknown = sorted(set(_class_dirs(val_dir)) - set(classes))
    if unknown:
        raise DatasetError(
            f"{val_dir} has class folders that {folder / 'train'} lacks: {', '.join(unknown)}; "
            "labels come from train's class folders, so remove them from val/ or add them to train/"
        )
    if data.file_list:
        return from_file_list(root, classes, data.file_list)
    train, train_subs = list_split(folder, "train", classes)
    val, val_subs = list_split(folder, "val", classes)
    warn_unmeasured(val_dir, classes, val)
    # Sub-folders too: a file replaced in one moves its time, not the class folder's.
    sources = (*(str(folder / split / name) for split in SPLITS for name in classes), *train_subs, *val_subs)
    return Dataset(root=str(folder), classes=classes, splits={"train": train, "val": val}, sources=sources)


def add_class(
    builder: ListingBuilder, label: int, name: str, files: list[str], left_out: list[str], empty: str
) -> None:
    """One class's files of an accepted image type into the listing, the others into
    `left_out`; `empty` (when given) is the error for a class with none."""
    left_out += [f"{name}/{f}" for f in files if not _accepted(f)]
    kept = [f"{name}/{f}" for f in files if _accepted(f)]
    if not kept and empty:
        raise DatasetError(empty)
    builder.add(kept, label)


def built(builder: ListingBuilder, where: str, left_out: list[str], things: str, stacklevel: int) -> Listing:
    """The listing, once the left-out names are said in one warning (at the caller `stacklevel`
    frames up, as warnings.warn counts them); an empty split is an error."""
    if left_out:
        warnings.warn(
            f"{where.rstrip('/')}: left out {len(left_out)} {things} that are not of an accepted "
            f"image type ({' '.join(IMAGE_EXTENSIONS)}): {some_of(left_out, 5)}",
            stacklevel=stacklevel,
        )
    if not len(builder):
        raise DatasetError(f"{where} has no images ({', '.join(IMAGE_EXTENSIONS)})")
    return builder.build()


def warn_unmeasured(val_dir: Path | str | storage.Location, classes: tuple[str, ...], val: Listing) -> None:
    present = set(val.labels.tolist())
    missing = [name for label, name in enumerate(classes) if label not in present]
    if missing:
        warnings.warn(
            f"{val_dir} has no folder or no images for {len(missing)} training "
            f"class(es): {some_of(missing)}; their accuracy is not measured",
            stacklevel=3,
        )


def _held_out(root: Path, classes: tuple[str, ...], fraction: float, seed: int) -> Dataset:
    """train/ alone: `fraction` of each class, drawn with `seed`, is val and is not trained on."""
    listing, subs = list_split(root, "train", classes)
    train, val = hold_out(listing, fraction, seed)
    sources = (*(str(root / "train" / name) for name in classes), *subs)
    return Dataset(root=str(root), classes=classes, splits={"train": train, "val": val}, sources=sources)


def held_out_record(dataset: Dataset, fraction: float, seed: int) -> str:
    """val_holdout.txt: the held-out files (paths relative to data.root), after one header
    line with the count per class."""
    val = dataset.splits["val"]
    counts = np.bincount(val.labels, minlength=len(dataset.classes))
    per_class = ", ".join(f"{name} {n}" for name, n in zip(dataset.classes, counts.tolist(), strict=True))
    header = (
        f"# data.val_fraction = {fraction} of train/, train.seed {seed}: {len(val)} files held "
        f"out for val (per class: {per_class})"
    )
    return "\n".join([header, *(os.path.relpath(path, dataset.root) for path in val.iter_paths())]) + "\n"


def _check_no_val(root: Path, val_fraction: float) -> None:
    if val_fraction and (root / "val").is_dir():
        raise DatasetError(
            f"data.val_fraction = {val_fraction} holds out part of train/, but {root} has a "
            "val/ folder; set data.val_fraction = 0 to validate on val/, or remove val/"
        )


def _class_dirs(split_dir: Path) -> list[str]:
    with os.scandir(split_dir) as entries:
        return sorted(e.name for e in entries if e.is_dir() and not e.name.startswith("."))


ACCEPTED_SUFFIXES = frozenset(IMAGE_EXTENSIONS)


def _accepted(name: str) -> bool:
    """An accepted image extension, as os.path.splitext reads one (".jpg" alone has none);
    by string partition, since a 14.2M-line file list calls it once a line."""
    stem, dot, ext = name.rpartition(".")
    return bool(dot) and bool(stem.strip(".")) and f".{ext.lower()}" in ACCEPTED_SUFFIXES


def class_files(folder: Path) -> tuple[list[str], list[str]]:
    """Every file under a class folder (paths relative to it), walked as torchvision's
    ImageFolder walks it: folder by folder in sorted order of their path (the class folder
    first), each folder's files sorted by name; and the sub-folders walked. Hidden files and
    folders are skipped; symlinked folders are followed, a link back into its own ancestors is
    an error naming it."""
    found: list[tuple[str, list[str]]] = []
    pending = [("", folder, frozenset[tuple[int, int]]())]
    while pending:
        rel, path, ancestors = pending.pop()
        st = os.stat(path)
        if (st.st_dev, st.st_ino) in ancestors:
            raise DatasetError(f"{path} links back to a folder above it (a loop); remove the link")
        ancestors = ancestors | {(st.st_dev, st.st_ino)}
        files = []
        with os.scandir(path) as entries:  # d_type says "file": no stat() per file
            for e in entries:
                if e.name.startswith("."):
                    continue
                if e.is_dir():
                    pending.append((f"{rel}{e.name}/", Path(e.path), ancestors))
                elif e.is_file() or e.is_symlink():  # a dangling link is named at start, not dropped
                    files.append(e.name)
        found.append((rel, sorted(rel + f for f in files)))
    # ImageFolder sorts os.walk's (folder path, ...) tuples: the class folder first, then the
    # sub-folders by path without a trailing "/" ("a" < "a b" < "a-b" < "a/x" < "a0").
    found.sort(key=lambda item: (item[0] != "", item[0].rstrip("/")))
    return [f for _, names in found for f in names], [rel.rstrip("/") for rel, _ in found[1:]]


def list_split(
    root: str | Path, split: str, classes: tuple[str, ...] | None = None
) -> tuple[Listing, list[str]]:
    """List one split: its listing and every sub-folder of a class folder it walked (the start-up
    cache's sources). `classes` (train's) fixes the label map; None lists the split's own
    folders. Images in sub-folders of a class folder belong to that class (see `class_files`);
    files with other extensions are left out and named in one warning."""
    split_dir = Path(root) / split
    if not split_dir.is_dir():
        raise DatasetError(f"{split_dir} does not exist; expected {root}/{split}/<class>/<image>")
    own = _class_dirs(split_dir)
    if classes is None:
        classes = tuple(own)
    if not own:
        raise DatasetError(f"{split_dir} has no class folders; expected {split_dir}/<class>/<image>")
    builder = ListingBuilder(str(split_dir) + os.sep, classes)
    left_out: list[str] = []
    sub_folders: list[str] = []
    for label, name in enumerate(classes):
        folder = split_dir / name
        if not folder.is_dir():
            continue  # a training class without val images: warned about by resolve_dataset
        files, subs = class_files(folder)
        sub_folders += [str(folder / sub) for sub in subs]
        empty = (
            f"class folder {folder} has no images ({', '.join(IMAGE_EXTENSIONS)}); "
            "add images or remove the folder"
        )
        add_class(builder, label, name, files, left_out, empty if split == "train" else "")
    return built(builder, str(split_dir), left_out, "file(s)", stacklevel=4), sub_folders


def from_file_list(root: storage.Location, classes: tuple[str, ...], list_file: str) -> Dataset:
    """The listing a clean file list names, read from the list alone: no folder is walked.

    Lines are paths relative to data.root (or absolute, under it): SPLIT/CLASS/FILE, or
    SPLIT/CLASS/SUB/.../FILE for an image in a sub-folder of its class folder. Each
    split keeps the list's order within a class, classes in train's order. `root` is a folder,
    or an object-store prefix (the list is a local file).
    """
    path = Path(list_file)

    def under(*parts: str) -> str:
        return str(root.join(*parts))

    if not path.is_file():
        raise DatasetError(
            f"data.file_list {path} does not exist; point it at a file with one "
            "image path per line (relative to data.root), or unset it"
        )
    tails, checked_by, left_out = _read_list(path, root, classes, under("train"))
    if left_out:
        warnings.warn(
            f"{path}: left out {len(left_out)} line(s) that are not of an accepted "
            f"image type: {some_of(left_out, 5)}",
            stacklevel=3,
        )
    _check_every_class_listed(path, root, classes, tails["train"])
    splits = {}
    for split in SPLITS:
        builder = ListingBuilder(under(split) + "/", classes)
        for label, names in enumerate(tails[split]):
            builder.add(names, label)
        if not len(builder):
            raise DatasetError(f"data.file_list {path} names no {split} images under {root}")
        splits[split] = builder.build()
    warn_unmeasured(under("val"), classes, splits["val"])
    folders = [under(split, name) for split in SPLITS for name in classes]
    return Dataset(
        root=str(root), classes=classes, splits=splits, sources=(str(path), *folders), checked_by=checked_by
    )


def _read_list(
    path: Path, root: storage.Location, classes: tuple[str, ...], train_dir: str
) -> tuple[dict[str, list[list[str]]], tuple[str, int] | None, list[str]]:
    """A file list's lines: each split's CLASS/[SUB/]FILE names by label, the version and pixel
    limit its first line says it was checked under (for this root), and the lines left out
    (not an accepted image type)."""
    index = {name: label for label, name in enumerate(classes)}
    tails: dict[str, list[list[str]]] = {split: [[] for _ in classes] for split in SPLITS}
    checked_by, left_out = None, []
    bases = list(dict.fromkeys([str(root), str(root.resolved())]))
    with open(path, encoding="utf-8", errors="surrogateescape") as lines:
        for number, line in enumerate(lines, 1):
            text = line.strip()
            # The list vouches for the bytes of the root it names, resolved as data check
            # wrote it: not for a copy, nor for a relative name meant from another folder.
            if number == 1 and (m := CHECKED_LIST.match(text)) and m.group(1) == str(root.resolved()):
                checked_by = (m.group(2), int(m.group(3)))
            if not text or text.startswith("#"):
                continue
            # Fast path for the usual clean relative line; anything else is normalised first.
            plain = not text.startswith(("/", ".")) and "/." not in text and "//" not in text
            parts = (text if plain else _relative(text, bases)).split(os.sep)
            if len(parts) < 3 or parts[0] not in SPLITS or parts[1] not in index:
                raise DatasetError(
                    f"{path}:{number}: {text!r} is not SPLIT/CLASS/[SUB/]FILE under data.root "
                    f"{root} with a class of {train_dir}; fix the line or data.root"
                )
            if not _accepted(parts[-1]):
                left_out.append(text)
                continue
            tails[parts[0]][index[parts[1]]].append("/".join(parts[1:]))
    return tails, checked_by, left_out


def _check_every_class_listed(
    path: Path, root: storage.Location, classes: tuple[str, ...], train: list[list[str]]
) -> None:
    """A train class the list names no image of is an error, as an empty class folder is:
    a label the model could never learn."""
    empty = [repr(name) for name, names in zip(classes, train, strict=True) if not names]
    if empty:
        raise DatasetError(
            f"data.file_list {path} names no train images of class "
            f"{some_of(empty)} (a class folder of {root}/train); add its "
            "images to the list, or remove the folder (train's class folders "
            "are the label map)"
        )


def _relative(text: str, bases: list[str]) -> str:
    if not os.path.isabs(text):
        return os.path.normpath(text)
    for base in bases:
        rel = os.path.relpath(text, base)
        if not rel.startswith(".."):
            return rel
    return text
