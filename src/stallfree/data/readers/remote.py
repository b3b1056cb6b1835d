"""ImageFolder-shaped prefixes in an object store: `s3://bucket/prefix/{train,val}/CLASS/...`.

The same Dataset as the folder reader gives for a local copy of the same objects, sample for
sample in the same order (torchvision's ImageFolder walk, see `folders.class_files`), so a run
from the store and one from the copy see the same batches. Each class prefix is listed in
full (paginated), the class prefixes in parallel (see `store.list_many`). No object is read.

The start-up header check is cached per dataset state as for local folders; here the state is
a digest of every listed key's name, size and ETag (an object replaced under its own name
changes its ETag), carried in the Dataset's `sources`.
"""

from __future__ import annotations

import warnings

from stallfree.data.readers import store
from stallfree.data.readers.folders import _accepted, _warn_unmeasured
from stallfree.data.readers.imageio import IMAGE_EXTENSIONS
from stallfree.data.readers.listing import SPLITS, Dataset, DatasetError, Listing, ListingBuilder
from stallfree.errors import some_of


def imagefolder_order(names: list[str]) -> list[str]:
    """Object names under a class prefix in the order `folders.class_files` walks a local copy:
    the class folder's own files first, then each sub-folder's by its path; hidden ones
    (a part starting with ".") and folder markers (a key ending in "/") left out."""
    groups: dict[str, list[str]] = {}
    for name in names:
        parts = name.split("/")
        if not parts[-1] or any(p.startswith(".") for p in parts):
            continue
        groups.setdefault("/".join(parts[:-1]), []).append(name)
    order = sorted(groups, key=lambda rel: (rel != "", rel))
    return [name for rel in order for name in sorted(groups[rel])]


def _classes(root: str, split: str) -> list[str]:
    return [name for name in store.list_dirs(store.join(root, split)) if not name.startswith(".")]


def resolve_remote_folders(root: str, file_list: str = "") -> Dataset:
    """The Dataset of an ImageFolder-shaped prefix; train's class prefixes are the label map."""
    root = root.rstrip("/")
    classes = tuple(_classes(root, "train"))
    if not classes:
        raise DatasetError(f"{root}/train/ has no class prefixes; expected {root}/train/<class>/<image>")
    unknown = sorted(set(_classes(root, "val")) - set(classes))
    if unknown:
        raise DatasetError(
            f"{root}/val/ has class prefixes that {root}/train/ lacks: {', '.join(unknown)}; "
            "labels come from train's classes, so remove them from val/ or add them to train/"
        )
    if file_list:
        from stallfree.data.readers.folders import _from_file_list

        return _from_file_list(root, classes, file_list)
    splits, digests = {}, []
    for split in SPLITS:
        splits[split], digest = _list_split(root, split, classes)
        digests.append(digest)
    _warn_unmeasured(f"{root}/val", classes, splits["val"])
    # The key of the start-up check cache: no times to stat, the listing's digest instead.
    sources = tuple(f"{root}/{split}#keys={d}" for split, d in zip(SPLITS, digests, strict=True))
    return Dataset(root=root, classes=classes, splits=splits, sources=sources)


def _list_split(root: str, split: str, classes: tuple[str, ...]) -> tuple[Listing, str]:
    """One split's listing, and a digest of every key, size and ETag under its class prefixes."""
    split_url = store.join(root, split)
    listed = store.list_many([store.join(split_url, name) for name in classes])
    builder = ListingBuilder(split_url + "/", classes)
    left_out: list[str] = []
    for label, (name, (objects, _)) in enumerate(zip(classes, listed, strict=True)):
        files = imagefolder_order([key for key, _ in objects])
        left_out += [f"{name}/{f}" for f in files if not _accepted(f)]
        files = [f"{name}/{f}" for f in files if _accepted(f)]
        if not files and split == "train":
            raise DatasetError(
                f"class prefix {split_url}/{name}/ has no images ({', '.join(IMAGE_EXTENSIONS)}); "
                "add images or remove it"
            )
        builder.add(files, label)
    if left_out:
        warnings.warn(
            f"{split_url}: left out {len(left_out)} object(s) that are not of an accepted "
            f"image type ({' '.join(IMAGE_EXTENSIONS)}): {some_of(left_out, 5)}",
            stacklevel=3,
        )
    if not len(builder):
        raise DatasetError(f"{split_url}/ has no images ({', '.join(IMAGE_EXTENSIONS)})")
    digest = store.digest_of([d for _, d in listed])
    return builder.build(), digest
