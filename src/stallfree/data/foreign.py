"""Other people's WebDataset shards: no manifest, labels from each sample's `.cls` member.

Layout: ROOT/train/*.tar and ROOT/val/*.tar, or ROOT/train*.tar and ROOT/val*.tar. Each shard's
index is built once from the tar itself (what `wds2idx` does) and cached with the labels read
from its `.cls` members (an integer each), keyed by the shard's size and time; from then on the
shards have the folder format's exact order, resume and validation. Classes are 0..max label,
named by their number.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from stallfree.data.listing import SPLITS, Dataset, DatasetError, ListingBuilder
from stallfree.data.startup import cache_dir, stat_key, write_cache_file
from stallfree.data.tarshards import Entry, ShardError, index_text, parse_index


def _split_shards(root: Path, split: str) -> list[Path]:
    folder = root / split
    shards = sorted(folder.glob("*.tar")) if folder.is_dir() else sorted(root.glob(f"{split}*.tar"))
    if not shards:
        raise DatasetError(
            f"{root} has no {split} shards: expected {root}/{split}/*.tar or {root}/{split}*.tar "
            f"(WebDataset shards with KEY.cls labels), or the manifest.json of `stallfree data pack`")
    return shards


def _labels(shard: Path, entries: list[Entry]) -> list[int]:
    labels = []
    with open(shard, "rb") as f:
        for name, _, _, cls_offset, cls_size in entries:
            text = os.pread(f.fileno(), cls_size, cls_offset).decode(errors="replace").strip()
            if not text.isdigit():
                raise ShardError(f"{shard}::{name}: its .cls member holds {text[:40]!r}, not a "
                                 "class number; stallfree reads labels from KEY.cls")
            labels.append(int(text))
    return labels


def shard_samples(shard: Path) -> tuple[list[Entry], list[int]]:
    """A foreign shard's samples and labels, read from the tar once and then cached."""
    cache = cache_dir() / "wds" / f"{stat_key([str(shard.resolve())])}.json"
    try:
        saved = json.loads(cache.read_text())
        entries = [tuple(e) for e in saved["entries"]]
        return entries, saved["labels"]  # type: ignore[return-value]
    except (OSError, ValueError, KeyError):
        pass
    entries = parse_index(index_text(shard), str(shard))
    labels = _labels(shard, entries)
    # A cache that cannot be written only costs the next start a re-read of the shard.
    write_cache_file(cache, json.dumps({"entries": entries, "labels": labels}))
    return entries, labels


def resolve_foreign(root: Path) -> Dataset:
    """WebDataset shards under ROOT as a Dataset (classes 0..max label of train)."""
    found = {split: [(shard, *shard_samples(shard)) for shard in _split_shards(root, split)]
             for split in SPLITS}
    train_labels = [label for _, _, labels in found["train"] for label in labels]
    if not train_labels:
        raise DatasetError(f"{root}: the train shards hold no samples with an image and a .cls")
    classes = tuple(str(i) for i in range(max(train_labels) + 1))
    splits = {}
    for split in SPLITS:
        builder = ListingBuilder(str(root) + "/", classes)
        for shard, entries, labels in found[split]:
            if labels and max(labels) >= len(classes):
                raise ShardError(f"{shard}: label {max(labels)} is not a train class "
                                 f"(train's labels are 0..{len(classes) - 1})")
            tail = shard.relative_to(root)
            builder.add([f"{tail}::{n}:{o}:{s}" for n, o, s, _, _ in entries], labels)
        if not len(builder):
            raise DatasetError(f"{root}: the {split} shards hold no samples")
        splits[split] = builder.build()
    sources = tuple(str(shard) for split in SPLITS for shard, _, _ in found[split])
    return Dataset(root=str(root), classes=classes, splits=splits, sources=sources)
