"""Our tar shards (`stallfree data pack`), read in place: every sample is a reference into a tar.

A sample's path is "SHARD.tar::MEMBER:OFFSET:SIZE" (from the shard's index), read with one
`pread` or, in a store, one ranged GET: members are never extracted, names are only read, and
nothing in a shard is unpickled. Random access keeps everything the folder format has: the same
(seed, epoch) permutation, positions in samples, exact resume and exact validation. Other
people's WebDataset shards (no manifest) are read by `webdataset.py` into the same references.
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stallfree.data import storage
from stallfree.data.readers.imageio import IMAGE_EXTENSIONS
from stallfree.data.readers.listing import SPLITS, Dataset, DatasetError, ListingBuilder
from stallfree.data.readers.startup_check import cached_check, stat_key
from stallfree.data.storage import Location

# The format `stallfree data pack` writes and this module reads.
MANIFEST = "manifest.json"
FORMAT = "stallfree-wds-1"

BLOCK = 512  # a tar member's data starts on a block, right after its 512-byte header
# (image member, its offset, its size, .cls member offset, .cls size) of one sample
Entry = tuple[str, int, int, int, int]


class ShardError(DatasetError):
    """A shard, index or manifest that does not match; the message names the shard (and member)."""

    hint = "re-pack with `stallfree data pack`, or run `stallfree data check` on the shards"


@dataclass(frozen=True)
class ShardSamples:
    """One shard as `data check` reads it: its samples' paths relative to the root (a listing's
    tails) and labels, or the error that names why it cannot be read (then none)."""

    split: str
    shard: Location
    tails: list[str]
    labels: list[int]
    error: ShardError | None = None


def _safe(name: str) -> bool:
    """A member name to read: relative, no '..', no directory part."""
    return bool(name) and not name.startswith("/") and ".." not in name and "/" not in name


def parse_index(text: str, where: str) -> list[Entry]:
    """The samples of a wds2idx v1.2 index: one image and one .cls member each.

    Members with unsafe names (absolute, '..', a directory part) are ignored, and so is a
    sample without an image; an image without exactly one .cls, or anything malformed, is a
    ShardError.
    """
    lines = text.splitlines()
    head = lines[0].split() if lines else []
    if len(head) != 2 or head[0] != "v1.2" or not head[1].isdigit():
        raise ShardError(f"{where}: not a wds2idx v1.2 index (first line {lines[:1]})")
    if int(head[1]) != len(lines) - 1:
        raise ShardError(f"{where}: says {head[1]} samples but lists {len(lines) - 1}")
    entries: list[Entry] = []
    for number, line in enumerate(lines[1:], 2):
        fields = line.split()
        if not fields or len(fields) % 4:
            raise ShardError(f"{where}:{number}: expected 'ext offset size name' per member")
        members = [fields[i : i + 4] for i in range(0, len(fields), 4)]
        if not all(m[1].isdigit() and m[2].isdigit() for m in members):
            raise ShardError(f"{where}:{number}: offsets and sizes must be integers: {line!r}")
        images = [m for m in members if f".{m[0]}".lower() in IMAGE_EXTENSIONS and _safe(m[3])]
        labels = [m for m in members if m[0] == "cls" and _safe(m[3])]
        if len(images) == 1 and len(labels) == 1:
            image, cls = images[0], labels[0]
            entries.append((image[3], int(image[1]), int(image[2]), int(cls[1]), int(cls[2])))
        elif images:  # an image that cannot be trained on must not vanish silently
            raise ShardError(
                f"{where}:{number}: {images[0][3]} has {len(labels)} .cls members "
                f"and {len(images)} images; each sample needs one of each"
            )
    return entries


def _index_of(shard: Location) -> Location:
    return Location(shard.store, shard.key.rpartition(".")[0] + ".idx")


def read_index(shard: Location) -> list[Entry]:
    """The samples listed by the .idx next to `shard` (a file, or an object in a store)."""
    index = _index_of(shard)
    if not index.exists():
        raise ShardError(
            f"{index} does not exist; shards need the index `stallfree data pack` writes next to them"
        )
    return parse_index(index.read().decode(errors="replace"), str(index))


def _check_placement(shard: Location, entries: list[Entry], size: int) -> None:
    """Every member inside the tar, on a block boundary, in order: cheap, at every start."""
    end = 0
    for name, *spans in entries:
        for offset, length in sorted(((spans[0], spans[1]), (spans[2], spans[3]))):
            if offset % BLOCK or offset < end + BLOCK or offset + length > size:
                raise ShardError(
                    f"{shard}::{name}: index entry at {offset} (+{length}) is not "
                    f"a member of this {size}-byte tar"
                )
            end = offset + length


def _load_manifest(root: Location) -> dict[str, Any]:
    path = root.join(MANIFEST)
    try:
        manifest = json.loads(path.read())
    except ValueError as exc:
        raise ShardError(
            f"{path} is not valid JSON ({exc}); it is written last by "
            "`stallfree data pack`, so the pack did not finish"
        ) from exc
    found = manifest.get("format") if isinstance(manifest, dict) else None
    if found != FORMAT:
        raise ShardError(f"{path}: format {found!r}, expected {FORMAT}")
    for split in SPLITS:
        info = manifest.get("splits", {}).get(split)
        if not isinstance(info, dict) or not {"shards", "labels", "samples"} <= info.keys():
            raise ShardError(f"{path} has no complete {split!r} split (shards, samples, labels)")
        if len(info["labels"]) != info["samples"]:
            raise ShardError(
                f"{path}: {split} lists {len(info['labels'])} labels for {info['samples']} samples"
            )
    return manifest


def _sizes(root: Location) -> tuple[dict[str, int], str]:
    """({name: bytes} of every file or object right under the root: one listing, not a stat
    or HEAD per shard; and the digest of their names, sizes and version tags)."""
    listed = root.list_objects(shallow=True)
    return {name: size for name, (size, _) in listed.items()}, storage.digest_of_listing(root, listed)


def _split_entries(
    root: Location, split: str, info: dict[str, Any], classes: int, sizes: dict[str, int]
) -> list[tuple[Location, list[Entry], list[int]]]:
    """Each shard of a split with its index entries and their manifest labels, checked cheaply."""
    return [_shard_entries(root, split, s, info["labels"], classes, sizes) for s in info["shards"]]


def _shard_entries(
    root: Location,
    split: str,
    shard_info: dict[str, Any],
    labels: list[Any],
    classes: int,
    sizes: dict[str, int],
) -> tuple[Location, list[Entry], list[int]]:
    """One shard of the manifest with its index entries and their labels, checked cheaply."""
    shard = _shard_of(root, shard_info)
    size = sizes.get(shard.name)
    if size is None:
        raise ShardError(f"{shard} is missing ({MANIFEST} lists it)")
    if size != shard_info.get("bytes"):
        raise ShardError(
            f"{shard}: {size} bytes, the manifest says {shard_info.get('bytes')}: "
            "not the shard that was packed"
        )
    entries = read_index(shard)
    if len(entries) != shard_info.get("samples"):
        raise ShardError(
            f"{_index_of(shard)}: {len(entries)} samples, the manifest says {shard_info.get('samples')}"
        )
    _check_placement(shard, entries, size)
    shard_labels = []
    for member, *_ in entries:
        digits = member.partition(".")[0].removeprefix(split)
        if not digits.isdigit() or int(digits) >= len(labels):
            raise ShardError(f"{shard}::{member}: not a {split}NNN key of this manifest")
        label = labels[int(digits)]
        if not isinstance(label, int) or not 0 <= label < classes:
            raise ShardError(f"{shard}::{member}: label {label!r} outside the manifest's {classes} classes")
        shard_labels.append(label)
    return shard, entries, shard_labels


def _shard_of(root: Location, shard_info: dict[str, Any]) -> Location:
    return root.join(Path(shard_info["name"]).name)  # a name, never a path out of root


def samples_by_shard(root: Location) -> tuple[tuple[str, ...], list[ShardSamples]]:
    """Our shards at ROOT one by one (`data check`): (the classes, each shard's samples or its
    error, with every member's header and `.cls` read back), so that one bad shard spoils only
    itself. A manifest that cannot be read raises."""
    manifest = _load_manifest(root)
    classes = tuple(manifest["classes"])
    sizes, _ = _sizes(root)
    out = []
    for split in SPLITS:
        info = manifest["splits"][split]
        for shard_info in info["shards"]:
            try:
                shard, entries, labels = _shard_entries(
                    root, split, shard_info, info["labels"], len(classes), sizes
                )
                verify_members(shard, entries, labels)
            except ShardError as exc:
                out.append(ShardSamples(split, _shard_of(root, shard_info), [], [], exc))
                continue
            tails = [storage.member_path(shard.name, n, o, s) for n, o, s, _, _ in entries]
            out.append(ShardSamples(split, shard, tails, labels))
    return classes, out


def _member_name(header: bytes) -> str:
    name = header[:100].split(b"\0", 1)[0].decode(errors="replace")
    prefix = header[345:500].split(b"\0", 1)[0].decode(errors="replace")  # ustar's long names
    return f"{prefix}/{name}" if prefix else name


def _verify_all(checked: list[tuple[Location, list[Entry], list[int]]]) -> None:
    """`verify_members` of each (shard, entries, labels)."""
    for item in checked:
        verify_members(*item)


def verify_members(shard: Location, entries: list[Entry], labels: list[int]) -> None:
    """Read each member's tar header back (name, place) and each .cls against its label (in a
    store: large ranged GETs, one window at a time, never the whole shard held)."""
    with shard.open() as f:
        _verify(shard, f.pread, entries, labels)


def _verify(
    shard: Location, pread: Callable[[int, int], bytes], entries: list[Entry], labels: list[int]
) -> None:
    for (name, offset, _, cls_offset, cls_size), label in zip(entries, labels, strict=True):
        for member, at in ((name, offset), (name.rpartition(".")[0] + ".cls", cls_offset)):
            if _member_name(pread(BLOCK, at - BLOCK)) != member:
                raise ShardError(
                    f"{shard}::{member}: the index points at another member "
                    f"(offset {at}); the index does not belong to this tar"
                )
        text = pread(cls_size, cls_offset).decode(errors="replace").strip()
        if text != str(label):
            raise ShardError(f"{shard}::{name}: its .cls says {text!r}, the label is {label}")


def index_text(shard: Path) -> str:
    """The wds2idx v1.2 index of any tar (members grouped by the key before the first dot)."""
    samples: list[list[str]] = []
    last = None
    with tarfile.open(shard) as tar:
        for member in tar:
            if not member.isreg():
                continue
            key, _, ext = member.name.partition(".")
            entry = f"{ext} {member.offset_data} {member.size} {member.name}"
            if key != last:
                samples.append([])
                last = key
            samples[-1].append(entry)
    return f"v1.2 {len(samples)}\n" + "".join(" ".join(s) + "\n" for s in samples)


def resolve_shards(root: Location) -> Dataset:
    """Our shards at ROOT (with manifest.json; a folder or an s3:// prefix) as a Dataset.

    Every start checks what is cheap (each shard's size and sample count against the manifest,
    each index entry inside its tar, block-aligned, in order); once per dataset state (cached)
    every member's tar header is read back and every `.cls` compared with the manifest's label,
    so a wrong label cannot be trained on silently (`data check` adds SHA-256 and a full decode).
    A sample in a store is one ranged GET of its member, never a whole shard into a cache: the
    seeded permutation visits a random shard per sample, so a cache that does not hold the whole
    dataset fetches a whole shard for about one sample (benchmarks/RESULTS.md, s3_shard_reads).
    """
    manifest = _load_manifest(root)
    classes = tuple(manifest["classes"])
    splits, sources = {}, []
    checked: list[tuple[Location, list[Entry], list[int]]] = []
    sizes, digest = _sizes(root)
    for split in SPLITS:
        builder = ListingBuilder(f"{root}/", classes)
        info = manifest["splits"][split]
        for shard, entries, labels in _split_entries(root, split, info, len(classes), sizes):
            sources.append(str(shard))
            checked.append((shard, entries, labels))
            builder.add([storage.member_path(shard.name, n, o, s) for n, o, s, _, _ in entries], labels)
        if not len(builder):
            raise ShardError(f"{root}: the {split} shards hold no samples")
        splits[split] = builder.build()
    # Once per dataset state: the listing's digest (the shards', indexes' and manifest's names,
    # sizes and times or ETags; an object has no time to stat) stands for it in the cache key.
    cached_check("shards", stat_key([], f"{root.identity()} {digest}"), lambda: _verify_all(checked))
    # ...and in the start-up checks' key, so a shard replaced in place is checked again.
    state = f"{root}#keys={digest}"
    return Dataset(root=str(root), classes=classes, splits=splits, sources=(*sources, state))
