"""`stallfree data check`: decode every image of a dataset and name each bad one.

A file the checker passes is one both loaders decode (the same `imageio` rules, full decode, not
just the header), so its clean list (`--write-list`) is safe for `data.file_list` under either.
On tar shards it does the full job a start cannot afford (`check_shards`). ROOT may be an s3://
prefix (folders or shards): the objects are listed as training lists them and read where they
are (shards by ranged GETs), and each bad one is named by its URL.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from stallfree.data import storage
from stallfree.data.readers.check_pool import decode_all
from stallfree.data.readers.folders import class_files
from stallfree.data.readers.imageio import IMAGE_EXTENSIONS, rules_id
from stallfree.data.readers.listing import SPLITS, DatasetError
from stallfree.data.readers.tarshards import MANIFEST
from stallfree.data.readers.webdataset import is_shard_folder
from stallfree.data.storage import Location
from stallfree.data.tools.pack import file_sha256
from stallfree.parallel import cpu_cores
from stallfree.recipe import DEFAULT_MAX_PIXELS

# Problem kinds, in the order the summary lists them; `kind_of` maps a reason onto one.
KINDS = (
    "zero bytes",
    "not an image",
    "truncated",
    "over the pixel limit",
    "unsupported format or mode",
    "decode error",
    "not an image file type",
    "missing file or dangling link",
    "shard mismatch",
)


def kind_of(reason: str) -> str:
    """The problem kind of a BadImageError reason."""
    text = reason.lower()
    rules = (
        ("shard:", "shard mismatch"),
        ("no such file", "missing file or dangling link"),
        ("file type", "not an image file type"),
        ("empty file", "zero bytes"),
        ("cannot identify", "not an image"),
        ("not an image", "not an image"),
        ("truncated", "truncated"),
        ("max_pixels", "over the pixel limit"),
        ("not accepted", "unsupported format or mode"),
        ("pixel mode", "unsupported format or mode"),
        ("dali", "unsupported format or mode"),
    )
    return next((kind for needle, kind in rules if needle in text), "decode error")


def _relative(path: str, root: Location) -> str:
    return path[len(str(root)) + 1 :]


@dataclass(slots=True)
class CheckReport:
    """What a check found: good files, bad files with reasons, counts by class and by kind.
    A file or shard is named by its path or URL (text, as a listing holds it)."""

    root: Location
    good: list[str] = field(default_factory=list)
    bad: list[tuple[str, str]] = field(default_factory=list)
    per_class: Counter[str] = field(default_factory=Counter)
    per_class_bad: Counter[str] = field(default_factory=Counter)
    # Shards (a shard root's): how many, and each one that is not whole with a line naming it.
    shards: int = 0
    bad_shards: list[tuple[str, str]] = field(default_factory=list)
    unreadable_shards: int = 0  # of the bad ones: those whose samples could not be listed
    seconds: float = 0.0
    max_pixels: int = DEFAULT_MAX_PIXELS

    @property
    def per_kind(self) -> Counter[str]:
        return Counter(kind_of(reason) for _, reason in self.bad)

    def clean_list(self) -> str:
        """One good file per line, relative to the root: the format `data.file_list` reads."""
        lines = sorted(_relative(p, self.root) for p in self.good)
        # The first line says under which rules and limit every file was decoded: a run with
        # the same ones needs no header check at start (data/readers/folders.py reads it back).
        # The root resolved: the list vouches for that folder's files, not a copy's.
        head = (
            f"# stallfree data check {self.root.resolved()}: {len(lines)} good files "
            f"(stallfree {rules_id()}, max_pixels {self.max_pixels})"
        )
        return head + "\n" + "\n".join(lines) + "\n"


def _class_of(path: str, root: Location) -> str:
    split, name = _relative(path, root).split("/")[:2]  # SPLIT/CLASS/[SUB/...]FILE
    return f"{split}/{name}"


def _files(root: Location) -> list[str]:
    """Every file under ROOT/{train,val}/<class>/ in the order training lists them, listed as
    the reader of its store lists them (a folder walked, a store's prefixes listed)."""
    return _LISTERS[root.store.kind](root)


def _folder_files(root: Location) -> list[str]:
    """Every file under ROOT/{train,val}/<class>/, sub-folders included, as the loaders list
    them (data/readers/folders.py: `class_files`; hidden ones aside, dangling links named)."""
    found: list[str] = []
    for split in SPLITS:
        split_dir = root.join(split)
        path = split_dir.folder("walked as a folder")  # `_LISTERS` sends only folders here
        if not path.is_dir():
            raise DatasetError(f"{split_dir} does not exist; expected {root}/{split}/<class>/<image>")
        for folder in sorted(p for p in path.iterdir() if p.is_dir()):
            found += [str(split_dir.join(folder.name, name)) for name in class_files(folder)[0]]
    return found


def _objects(root: Location) -> list[str]:
    """Every object under ROOT/{train,val}/<class>/ of a store's prefix, in the order training
    lists them (data/readers/remote.py), non-images too (to be named)."""
    from stallfree.data.readers.remote import class_objects, class_prefixes

    found: list[str] = []
    for split, prefixes in class_prefixes(root).items():
        split_root = root.join(split)
        classes = tuple(prefixes)
        if not classes:
            raise DatasetError(f"{split_root}/ has no class prefixes; expected {split_root}/<class>/<image>")
        names, _ = class_objects(split_root, classes)
        found += [str(split_root.join(c, n)) for c, files in zip(classes, names, strict=True) for n in files]
    return found


_LISTERS = {storage.LocalStore.kind: _folder_files, storage.ObjectStore.kind: _objects}


def _is_shards(root: Location) -> bool:
    return root.join(MANIFEST).exists() or is_shard_folder(root)


def _suffix(path: str) -> str:
    return Path(path.rpartition("/")[2]).suffix.lower()


def check_dataset(
    root: str | os.PathLike[str],
    *,
    workers: int = -1,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    progress: bool = True,
    endpoint_url: str = "",
) -> CheckReport:
    """Fully decode every image under ROOT/{train,val} (a folder or a store's prefix) in
    `workers` processes (or, for tar shards, check them whole: see `check_shards`).
    `endpoint_url`: an s3:// root's endpoint, as a recipe's data.endpoint_url."""
    storage.configure(endpoint_url)
    where = storage.locate(root)
    _name_interrupted_pack(where)
    # As train starts: a wrong endpoint, bucket or key pair in one line, not the outage wait.
    where.check_root("tar")
    if _is_shards(where):
        return check_shards(
            where, workers=cpu_cores() if workers < 1 else workers, max_pixels=max_pixels, progress=progress
        )
    files = _files(where)
    report = CheckReport(root=where, max_pixels=max_pixels)
    images = [p for p in files if _suffix(p) in IMAGE_EXTENSIONS]
    for path in files:
        report.per_class[_class_of(path, where)] += 1
        if _suffix(path) not in IMAGE_EXTENSIONS:
            report.bad.append((path, f"not an image file type (accepted: {' '.join(IMAGE_EXTENSIONS)})"))
    started = time.perf_counter()
    reasons = decode_all(
        images,
        max_pixels,
        cpu_cores() if workers < 1 else workers,
        desc=f"checking {where}",
        progress=progress,
    )
    for path, reason in zip(images, reasons):
        if reason is None:
            report.good.append(path)
        else:
            report.bad.append((path, reason))
    report.seconds = time.perf_counter() - started
    for path, _ in report.bad:
        report.per_class_bad[_class_of(path, where)] += 1
    return report


def _name_interrupted_pack(where: Location) -> None:
    """A `data pack` into ROOT killed midway left its staging folder beside it: say so."""
    from stallfree.data.tools.pack import staging_leftovers

    root = where.path
    if root is None:
        return  # a pack writes local folders only: none was interrupted in a store
    left = staging_leftovers(root)
    if left and not root.exists():
        raise DatasetError(
            f"{root} does not exist: a `data pack` into it was interrupted and "
            f"left {left[0][0]}; run the pack again (it removes that folder)"
        )
    for folder, _ in left:
        warnings.warn(
            f"{folder}: left by a `data pack` into {root} that did not finish; remove it", stacklevel=3
        )


def summary(report: CheckReport) -> str:
    """The report as text: each bad shard and file with its reason, then counts (of samples and
    shards for shards, of files for folders) by kind and by class."""
    lines = [f"BAD {line}" for _, line in report.bad_shards]  # a shard's error names it
    lines += [f"BAD {path}: {reason}" for path, reason in report.bad]
    rate = len(report.good) / report.seconds if report.seconds else 0.0
    what = "samples" if report.shards or report.bad_shards else "files"
    lines.append(
        f"{len(report.good)} good, {len(report.bad)} bad {what} in {report.root} "
        f"({report.seconds:.1f} s, {rate:.0f} good images/s)"
    )
    if what == "samples":
        unread = report.unreadable_shards
        said = f"{unread} cannot be read: their samples are not in the counts" if unread > 1 else ""
        said = said or ("it cannot be read: its samples are not in the counts" if unread else "")
        lines.append(
            f"shards: {max(0, report.shards - len(report.bad_shards))} good, {len(report.bad_shards)} bad"
            + (f" ({said})" if said else "")
        )
    for kind, count in sorted(report.per_kind.items(), key=lambda kv: KINDS.index(kv[0])):
        lines.append(f"  {kind}: {count}")
    bad_classes = [c for c in sorted(report.per_class) if report.per_class_bad[c]]
    for name in bad_classes:
        lines.append(f"  {name}: {report.per_class_bad[name]} of {report.per_class[name]} bad")
    return "\n".join(lines)


def _checksum_problems(root: Location) -> dict[str, str]:
    """{shard: why} of every shard of our manifest whose SHA-256 is not the manifest's."""
    try:
        manifest = json.loads(root.join(MANIFEST).read().decode())
        shards = [s for split in SPLITS for s in manifest["splits"][split]["shards"]]
    except (ValueError, KeyError, TypeError):
        return {}  # samples_by_shard names what is wrong with the manifest
    problems: dict[str, str] = {}
    present = root.list_objects(shallow=True)
    for entry in shards:
        name = Path(str(entry.get("name", ""))).name
        shard = root.join(name)
        if name in present and file_sha256(shard) != entry.get("sha256"):
            problems[str(shard)] = (
                f"{shard}: SHA-256 differs from the manifest's: not the shard that was packed "
                "(re-pack, or restore it)"
            )
    return problems


def check_shards(root: Location, *, workers: int, max_pixels: int, progress: bool) -> CheckReport:
    """Check the shards at ROOT whole, one by one: a shard that cannot be read is named and
    the others' samples are still checked; every problem names the shard (and member).

    For shards of `stallfree data pack`: every shard's SHA-256 against the manifest, the
    structure and every `.cls` against the manifest's labels (what a start checks once), and
    every member decoded. For other WebDataset shards: the labels read from `.cls` and every
    member decoded.
    """
    from stallfree.data.readers import tarshards, webdataset

    report = CheckReport(root=root, max_pixels=max_pixels)
    started = time.perf_counter()
    ours = root.join(tarshards.MANIFEST).exists()
    try:
        classes, shards = (tarshards if ours else webdataset).samples_by_shard(root)
    except (DatasetError, storage.StoreError) as exc:  # the root as a whole: no manifest, no shards
        report.bad_shards.append((str(root), str(exc)))
        report.unreadable_shards = 1
        report.seconds = time.perf_counter() - started
        return report
    changed = _checksum_problems(root) if ours else {}
    paths: list[str] = []
    names: list[str] = []
    for item in shards:
        report.shards += 1
        reason = str(item.error) if item.error else changed.get(str(item.shard))
        if reason is not None:
            report.bad_shards.append((str(item.shard), reason))
        report.unreadable_shards += item.error is not None
        paths += [f"{root}/{tail}" for tail in item.tails]
        names += [f"{item.split}/{classes[label]}" for label in item.labels]
    reasons = decode_all(paths, max_pixels, workers, desc=f"checking {root}", progress=progress)
    for path, name, reason in zip(paths, names, reasons, strict=True):
        report.per_class[name] += 1
        if reason is None:
            report.good.append(path)
        else:
            report.bad.append((path, reason))
            report.per_class_bad[name] += 1
    report.seconds = time.perf_counter() - started
    return report
