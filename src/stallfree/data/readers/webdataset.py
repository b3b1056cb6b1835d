"""Other people's WebDataset shards: no manifest, labels from each sample's `.cls` member.

Layout: ROOT/train/*.tar and ROOT/val/*.tar, or ROOT/train*.tar and ROOT/val*.tar. Each shard's
samples are read from the tar once, as webdataset groups them, and cached with their labels
(`shard_samples`); from then on the shards have the folder format's exact order, resume and
validation. Shards must be plain tars: samples are read in place by offset, and a compressed
stream can only be read from its start, so a compressed shard is refused with its command.
"""

from __future__ import annotations

import json
import re
import tarfile
import warnings
from pathlib import Path
from typing import BinaryIO

from stallfree.data import storage
from stallfree.data.readers.imageio import IMAGE_EXTENSIONS
from stallfree.data.readers.listing import SPLITS, Dataset, DatasetError, ListingBuilder
from stallfree.data.readers.startup_check import cache_dir, stat_key, write_cache_file
from stallfree.data.readers.tarshards import Entry, ShardError, ShardSamples
from stallfree.data.storage import LocalFile, Location, RangedFile
from stallfree.errors import some_of

# webdataset.tariterators (1.0), copied so the grouping is exactly its own: a member's key is
# its name up to the first dot of the last path component, the rest is its field (lower-cased):
# `cat/k0001.jpg` is key `cat/k0001`, and `x.y.0001.jpg` is sample `x`, field `y.0001.jpg` (an
# image webdataset does not read as one is named, never dropped: `_entries`). Names matching
# _META are webdataset's metadata, which it skips.
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


# What is right under a foreign root and its train/ and val/: {name relative to the root:
# (size, version tag)}, one shallow listing each.
Listed = dict[str, tuple[int, str]]


def _listing(root: Location) -> Listed:
    """The files or objects right under ROOT and its train/ and val/: where shards can be,
    listed without walking anything deeper (an ImageFolder's class folders, when `data check`
    asks whether ROOT holds shards)."""
    found = root.list_objects(shallow=True)
    for split in SPLITS:
        found |= {f"{split}/{k}": v for k, v in root.join(split).list_objects(shallow=True).items()}
    return found


def _shard_files(root: Location, split: str, listed: Listed | None = None) -> list[Location]:
    """The split's shard files, plain and compressed: ROOT/SPLIT/*, else ROOT/SPLIT*."""
    suffixes = (".tar", *_COMPRESSED_NAMES)
    names = _listing(root) if listed is None else listed
    inside = any(name.startswith(f"{split}/") for name in names)
    prefix = f"{split}/" if inside else split
    return [
        root.join(name)
        for name in sorted(names)
        if name.startswith(prefix)
        and "/" not in name[len(prefix) if inside else 0 :]
        and not name.rpartition("/")[2].startswith(".")
        and name.endswith(suffixes)
    ]


def is_shard_folder(root: Location) -> bool:
    """Whether ROOT (a folder or a store's prefix) holds train shards rather than class folders."""
    return bool(_shard_files(root, "train"))


def _refuse_compressed(shard: Location) -> None:
    suffix = next((s for s in _COMPRESSED_NAMES if shard.name.endswith(s)), None)
    if suffix:
        raise ShardError(
            f"{shard} is a compressed shard; {_WHY_PLAIN}: decompress it in "
            f"place (`{_COMPRESSED_NAMES[suffix]} {shard}`)"
        )


def _split_shards(root: Location, split: str, listed: Listed) -> list[Location]:
    shards = _shard_files(root, split, listed)
    for shard in shards:
        _refuse_compressed(shard)
    if not shards:
        raise DatasetError(
            f"{root} has no {split} shards: expected {root}/{split}/*.tar or {root}/{split}*.tar "
            f"(WebDataset shards with KEY.cls labels), or the manifest.json of `stallfree data pack`"
        )
    return shards


def _open_tar(shard: Location, f: BinaryIO) -> tarfile.TarFile:
    """The shard opened as a plain tar, or a one-line ShardError saying what it is instead."""
    head = f.read(8)
    f.seek(0)
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
        return tarfile.open(fileobj=f, mode="r:")  # plain only: never decompressed behind our back
    except tarfile.TarError as exc:
        raise ShardError(f"{shard} is not a tar file ({exc}); copy it again or remove it") from exc


# (key, {field: member}) of each sample, in tar order; and each .cls member's bytes by offset.
Groups = tuple[list[tuple[str, dict[str, tarfile.TarInfo]]], dict[int, bytes]]


def _group(shard: Location, size: int) -> Groups:
    """The shard's samples as webdataset groups them, read front to back once (in a store: in
    large ranged GETs), the `.cls` members' bytes read on the way."""
    with shard.open(size) as f:
        return _walk(shard, f, size)


def _walk(shard: Location, f: LocalFile | RangedFile, size: int) -> Groups:
    samples: list[tuple[str, dict[str, tarfile.TarInfo]]] = []
    texts: dict[int, bytes] = {}
    try:
        with _open_tar(shard, f) as tar:  # type: ignore[arg-type]  # RangedFile: read, seek, tell
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
                if storage.MEMBER_SEP in name:  # what ends a member reference's shard
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
                if field == "cls":  # tarfile seeks back to the next header itself
                    f.seek(member.offset_data)
                    texts[member.offset_data] = f.read(member.size)
    except tarfile.TarError as exc:
        raise ShardError(f"{shard} is not a readable tar ({exc}); copy it again") from exc
    return samples, texts


def _image_ext(field: str) -> bool:
    return f".{field}" in IMAGE_EXTENSIONS


def _entries(shard: Location, groups: Groups) -> tuple[list[Entry], list[str]]:
    """(image member, offset, size, .cls offset, .cls size) per sample, and the keys of samples
    with a .cls but no image of an accepted type (left out, to be named)."""
    entries: list[Entry] = []
    left_out: list[str] = []
    for key, fields in groups[0]:
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


def _labels(shard: Location, entries: list[Entry], texts: dict[int, bytes]) -> list[int]:
    labels = []
    for name, _, _, cls_offset, _ in entries:
        text = texts[cls_offset].decode(errors="replace").strip()
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


def shard_samples(shard: Location, state: tuple[int, str]) -> tuple[list[Entry], list[int], list[str]]:
    """A foreign shard's samples, labels and left-out keys, read from the tar once, then cached
    (keyed by where it is and its `state` as listed: its size and time, or an object's ETag)."""
    size, tag = state
    key = stat_key([], f"{_CACHE_FORMAT} {shard.identity()} {size} {tag}")
    cache = cache_dir() / "wds" / f"{key}.json"
    if (saved := _cached(cache)) is not None:
        return saved
    groups = _group(shard, size)
    entries, left_out = _entries(shard, groups)
    labels = _labels(shard, entries, groups[1])
    # A cache that cannot be written only costs the next start a re-read of the shard.
    write_cache_file(cache, json.dumps({"entries": entries, "labels": labels, "left_out": left_out}))
    return entries, labels, left_out


def _tail(root: Location, shard: Location) -> str:
    """The shard's path relative to the root (what a sample's reference starts with)."""
    return shard.key.removeprefix(f"{root.key.rstrip('/')}/") if root.key else shard.key


def samples_by_shard(root: Location) -> tuple[tuple[str, ...], list[ShardSamples]]:
    """Foreign shards at ROOT one by one (`data check`): (the classes, by their number, each
    shard's samples or its error), so that one bad shard spoils only itself."""
    listed = _listing(root)
    out = []
    for split in SPLITS:
        for shard in _shard_files(root, split, listed):
            try:
                _refuse_compressed(shard)
                entries, labels, _ = shard_samples(shard, listed[_tail(root, shard)])
            except ShardError as exc:
                out.append(ShardSamples(split, shard, [], [], exc))
                continue
            tails = [storage.member_path(_tail(root, shard), n, o, s) for n, o, s, _, _ in entries]
            out.append(ShardSamples(split, shard, tails, labels))
    top = max((max(s.labels) for s in out if s.labels), default=-1)
    return tuple(str(i) for i in range(top + 1)), out


def resolve_foreign(root: Location) -> Dataset:
    """WebDataset shards under ROOT (a folder or a store's prefix) as a Dataset (classes 0..max
    label of train, named by their number): from a store, the samples, labels and order of a
    local copy."""
    listed = _listing(root)
    found = {
        split: [
            (shard, *shard_samples(shard, listed[_tail(root, shard)]))
            for shard in _split_shards(root, split, listed)
        ]
        for split in SPLITS
    }
    left_out = [key for split in SPLITS for *_, keys in found[split] for key in keys]
    if left_out:
        warnings.warn(
            f"{root}: left out {len(left_out)} sample(s) with a .cls but no image of "
            f"an accepted type ({' '.join(IMAGE_EXTENSIONS)}): {some_of(left_out, 5)}",
            stacklevel=4,  # resolve_dataset's caller (through folders._tar_dataset)
        )
    train_labels = [label for _, _, labels, _ in found["train"] for label in labels]
    if not train_labels:
        raise DatasetError(f"{root}: the train shards hold no samples with an image and a .cls")
    classes = tuple(str(i) for i in range(max(train_labels) + 1))
    splits = {}
    for split in SPLITS:
        builder = ListingBuilder(f"{root}/", classes)
        for shard, entries, labels, _ in found[split]:
            if labels and max(labels) >= len(classes):
                raise ShardError(
                    f"{shard}: label {max(labels)} is not a train class "
                    f"(train's labels are 0..{len(classes) - 1})"
                )
            builder.add(
                [storage.member_path(_tail(root, shard), n, o, s) for n, o, s, _, _ in entries], labels
            )
        if not len(builder):
            raise DatasetError(f"{root}: the {split} shards hold no samples")
        splits[split] = builder.build()
    # The listing's digest (every shard's size and time, or ETag: an object has no time to
    # stat) keys the start-up checks' cache, so a shard replaced in place is checked again.
    state = f"{root}#keys={storage.digest_of_listing(root, listed)}"
    sources = (*(str(shard) for split in SPLITS for shard, *_ in found[split]), state)
    return Dataset(root=str(root), classes=classes, splits=splits, sources=sources)
