"""Other people's WebDataset shards: no manifest, labels from each sample's `.cls` member.

Layout: ROOT/train/*.tar and ROOT/val/*.tar, or ROOT/train*.tar and ROOT/val*.tar. Members are
grouped into samples by webdataset's own rule (`_KEY_FIELD`), so a shard gives the samples
webdataset gives: `cat/k0001.jpg` is key `cat/k0001`, and an image webdataset does not read as
an image field (`x.y.0001.jpg` is sample `x`, field `y.0001.jpg`) is named, never dropped.
Each shard's samples are read from the tar once and cached with their labels (an integer in
each `.cls`), keyed by the shard's size and time; from then on the shards have the folder
format's exact order, resume and validation. Classes are 0..max label, named by their number.

Shards must be plain tars. Samples are read in place by offset (random access: the seeded
permutation, exact resume, DALI's source); a compressed stream can only be read from its start,
so a compressed shard is refused by name, with the command that decompresses it.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
import warnings
from pathlib import Path

from stallfree.data.readers.imageio import IMAGE_EXTENSIONS
from stallfree.data.readers.listing import SPLITS, Dataset, DatasetError, ListingBuilder
from stallfree.data.readers.startup_check import cache_dir, stat_key, write_cache_file
from stallfree.data.readers.tarshards import Entry, ShardError
from stallfree.errors import some_of

# webdataset.tariterators (1.0), copied so the grouping is exactly its own: a member's key is
# its name up to the first dot of the last path component, the rest is its field (lower-cased);
# names matching _META are webdataset's metadata, which it skips.
_KEY_FIELD = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
_META = re.compile(r"__[^/]*__($|/)")
_CACHE_FORMAT = "webdataset-keys-2"  # a cache of the older grouping (first dot anywhere) is stale

# Compressed shards, by name and by their first bytes, with the command that gives a plain tar.
_COMPRESSED_NAMES = {
    ".tar.gz": "gunzip",
    ".tgz": "gunzip",
    ".tar.bz2": "bunzip2",
    ".tar.xz": "unxz",
    ".tar.zst": "unzstd",
}
_MAGIC = {
    b"\x1f\x8b": ("gzip", "gunzip"),
    b"BZh": ("bzip2", "bunzip2"),
    b"\xfd7zXZ\x00": ("xz", "unxz"),
    b"\x28\xb5\x2f\xfd": ("zstd", "unzstd"),
}
_WHY_PLAIN = "stallfree reads samples in place by offset, which needs a plain (uncompressed) tar"


def _shard_files(root: Path, split: str) -> list[Path]:
    """The split's shard files, plain and compressed: ROOT/SPLIT/*, else ROOT/SPLIT*."""
    place, prefix = (root / split, "") if (root / split).is_dir() else (root, split)
    if not place.is_dir():
        return []
    suffixes = (".tar", *_COMPRESSED_NAMES)
    return sorted(
        p
        for p in place.iterdir()
        if p.name.startswith(prefix) and not p.name.startswith(".") and p.name.endswith(suffixes)
    )


def is_shard_folder(root: Path) -> bool:
    """Whether ROOT holds train shards (plain or compressed) rather than class folders."""
    return bool(_shard_files(root, "train"))


def _split_shards(root: Path, split: str) -> list[Path]:
    shards = _shard_files(root, split)
    for shard in shards:
        suffix = next((s for s in _COMPRESSED_NAMES if shard.name.endswith(s)), None)
        if suffix:
            raise ShardError(
                f"{shard} is a compressed shard; {_WHY_PLAIN}: decompress it in "
                f"place (`{_COMPRESSED_NAMES[suffix]} {shard}`)"
            )
    if not shards:
        raise DatasetError(
            f"{root} has no {split} shards: expected {root}/{split}/*.tar or {root}/{split}*.tar "
            f"(WebDataset shards with KEY.cls labels), or the manifest.json of `stallfree data pack`"
        )
    return shards


def _open_tar(shard: Path) -> tarfile.TarFile:
    """The shard opened as a plain tar, or a one-line ShardError saying what it is instead."""
    with open(shard, "rb") as f:
        head = f.read(8)
    if not head:
        raise ShardError(f"{shard} is empty (0 bytes), not a tar shard; copy it again or remove it")
    for magic, (kind, command) in _MAGIC.items():
        if head.startswith(magic):
            raise ShardError(
                f"{shard} is {kind}-compressed, not a plain tar; {_WHY_PLAIN}: "
                f"decompress it (`{command} -c {shard} > plain.tar`) and put the "
                "plain tar in its place"
            )
    try:
        return tarfile.open(shard, "r:")  # plain only: never decompressed behind our back
    except tarfile.TarError as exc:
        raise ShardError(f"{shard} is not a tar file ({exc}); copy it again or remove it") from exc


def _group(shard: Path) -> list[tuple[str, dict[str, tarfile.TarInfo]]]:
    """The shard's samples as webdataset groups them: (key, {field: member}), in tar order."""
    samples: list[tuple[str, dict[str, tarfile.TarInfo]]] = []
    size = shard.stat().st_size
    try:
        with _open_tar(shard) as tar:
            for member in tar:
                name = member.name
                if (
                    not member.isreg()
                    or _META.match(name)
                    or ("/" not in name and name.startswith("__") and name.endswith("__"))
                ):
                    continue
                match = _KEY_FIELD.match(name)
                if not match:
                    continue  # no field: webdataset skips it too
                if member.offset_data + member.size > size:
                    raise ShardError(
                        f"{shard}::{name}: ends past the end of the shard (truncated); copy it again"
                    )
                if "::" in name:  # the separator of a member reference (data/readers/headers.py)
                    raise ShardError(
                        f"{shard}::{name}: a member name with '::' cannot be read in place; rename the member"
                    )
                key, field = match.group(1), match.group(2).lower()
                if not samples or samples[-1][0] != key:
                    samples.append((key, {}))
                if field in samples[-1][1]:
                    raise ShardError(
                        f"{shard}::{name}: a second '{field}' of sample '{key}' "
                        "(webdataset refuses it too); rename one of them"
                    )
                samples[-1][1][field] = member
    except tarfile.TarError as exc:
        raise ShardError(f"{shard} is not a readable tar ({exc}); copy it again") from exc
    return samples


def _image_ext(field: str) -> bool:
    return f".{field}" in IMAGE_EXTENSIONS


def _entries(shard: Path) -> tuple[list[Entry], list[str]]:
    """(image member, offset, size, .cls offset, .cls size) per sample, and the keys of samples
    with a .cls but no image of an accepted type (left out, to be named)."""
    entries: list[Entry] = []
    left_out: list[str] = []
    for key, fields in _group(shard):
        images = [m for f, m in fields.items() if _image_ext(f)]
        cls = fields.get("cls")
        hidden = [m.name for f, m in fields.items() if not _image_ext(f) and _image_ext(f.rpartition(".")[2])]
        if hidden and not images:  # images webdataset does not see as an image field
            field = hidden[0][len(key) + 1 :]
            raise ShardError(
                f"{shard}::{hidden[0]}: webdataset reads it as sample '{key}', "
                f"field '{field}' (the key ends at the name's first dot), so no "
                "image of a sample; rename the members without dots before the "
                "extension (x_y_0001.jpg, x_y_0001.cls)"
            )
        if len(images) == 1 and cls is not None:
            image = images[0]
            entries.append((image.name, image.offset_data, image.size, cls.offset_data, cls.size))
        elif images:  # an image that cannot be trained on must not vanish silently
            raise ShardError(
                f"{shard}::{images[0].name} has {int(cls is not None)} .cls members "
                f"and {len(images)} images; each sample needs one of each"
            )
        elif cls is not None:
            left_out.append(f"{shard.name}::{key}")
    return entries, left_out


def _labels(shard: Path, entries: list[Entry]) -> list[int]:
    labels = []
    with open(shard, "rb") as f:
        for name, _, _, cls_offset, cls_size in entries:
            text = os.pread(f.fileno(), cls_size, cls_offset).decode(errors="replace").strip()
            if not text.isdigit():
                raise ShardError(
                    f"{shard}::{name}: its .cls member holds {text[:40]!r}, not a "
                    "class number; stallfree reads labels from KEY.cls"
                )
            labels.append(int(text))
    return labels


def _cached(cache: Path) -> tuple[list[Entry], list[int], list[str]] | None:
    """A cache file's samples, or None unless it holds exactly what `shard_samples` writes."""
    try:
        saved = json.loads(cache.read_text())
        entries = [(str(n), int(o), int(s), int(co), int(cs)) for n, o, s, co, cs in saved["entries"]]
        labels, left_out = [int(x) for x in saved["labels"]], [str(x) for x in saved["left_out"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # absent, half-written or edited: read the shard again
    return (entries, labels, left_out) if len(entries) == len(labels) else None


def shard_samples(shard: Path) -> tuple[list[Entry], list[int], list[str]]:
    """A foreign shard's samples, labels and left-out keys, read from the tar once, then cached."""
    cache = cache_dir() / "wds" / f"{stat_key([str(shard.resolve())], _CACHE_FORMAT)}.json"
    if (saved := _cached(cache)) is not None:
        return saved
    entries, left_out = _entries(shard)
    labels = _labels(shard, entries)
    # A cache that cannot be written only costs the next start a re-read of the shard.
    write_cache_file(cache, json.dumps({"entries": entries, "labels": labels, "left_out": left_out}))
    return entries, labels, left_out


def resolve_foreign(root: Path) -> Dataset:
    """WebDataset shards under ROOT as a Dataset (classes 0..max label of train)."""
    found = {
        split: [(shard, *shard_samples(shard)) for shard in _split_shards(root, split)] for split in SPLITS
    }
    left_out = [key for split in SPLITS for *_, keys in found[split] for key in keys]
    if left_out:
        warnings.warn(
            f"{root}: left out {len(left_out)} sample(s) with a .cls but no image of "
            f"an accepted type ({' '.join(IMAGE_EXTENSIONS)}): {some_of(left_out, 5)}",
            stacklevel=3,
        )
    train_labels = [label for _, _, labels, _ in found["train"] for label in labels]
    if not train_labels:
        raise DatasetError(f"{root}: the train shards hold no samples with an image and a .cls")
    classes = tuple(str(i) for i in range(max(train_labels) + 1))
    splits = {}
    for split in SPLITS:
        builder = ListingBuilder(str(root) + "/", classes)
        for shard, entries, labels, _ in found[split]:
            if labels and max(labels) >= len(classes):
                raise ShardError(
                    f"{shard}: label {max(labels)} is not a train class "
                    f"(train's labels are 0..{len(classes) - 1})"
                )
            tail = shard.relative_to(root)
            builder.add([f"{tail}::{n}:{o}:{s}" for n, o, s, _, _ in entries], labels)
        if not len(builder):
            raise DatasetError(f"{root}: the {split} shards hold no samples")
        splits[split] = builder.build()
    sources = tuple(str(shard) for split in SPLITS for shard, *_ in found[split])
    return Dataset(root=str(root), classes=classes, splits=splits, sources=sources)
