"""ImageFolder-shaped prefixes in an object store: `s3://bucket/prefix/{train,val}/CLASS/...`.

Listed here, made into a Dataset by `folders.resolve_dataset`: the one a local copy of the
same objects gives, sample for sample in the same order (torchvision's ImageFolder walk, see
`folders.class_files`), so a run from the store and one from the copy see the same batches.
Each class prefix is listed in full (paginated), the class prefixes in parallel (see
`store.list_many`). No object is read.

The start-up header check is cached per dataset state as for local folders; here the state is
a digest of every listed key's name, size and ETag (an object replaced under its own name
changes its ETag), carried in the Dataset's `sources`.
"""

from __future__ import annotations

from stallfree.data.readers import store
from stallfree.data.readers.listing import DatasetError


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


def remote_classes(root: str) -> tuple[str, ...]:
    """Train's class prefixes (the label map); a val class that train lacks is an error."""
    classes = tuple(_classes(root, "train"))
    if not classes:
        raise DatasetError(f"{root}/train/ has no class prefixes; expected {root}/train/<class>/<image>")
    unknown = sorted(set(_classes(root, "val")) - set(classes))
    if unknown:
        raise DatasetError(
            f"{root}/val/ has class prefixes that {root}/train/ lacks: {', '.join(unknown)}; "
            "labels come from train's classes, so remove them from val/ or add them to train/"
        )
    return classes


def class_objects(split_url: str, classes: tuple[str, ...]) -> tuple[list[list[str]], str]:
    """Each class prefix's object names (relative to it) in ImageFolder's order, and one digest
    of every key, size and ETag under them (the start-up check cache's key)."""
    listed = store.list_many([store.join(split_url, name) for name in classes])
    names = [imagefolder_order([key for key, _ in objects]) for objects, _ in listed]
    return names, store.digest_of([digest for _, digest in listed])
