"""Reading `stallfree data pack` shards: every sample is a reference into a tar file.

A sample's path is "SHARD.tar::MEMBER:OFFSET:SIZE" (offset and size from the shard's .idx),
which `imageio` reads with one `pread`: members are never extracted, names are only read, and
nothing in a shard is unpickled. Random access keeps everything the folder format has: the
same full (seed, epoch) permutation, positions in samples, exact resume and exact validation,
for both loaders.
"""

from __future__ import annotations

import json
from pathlib import Path

from stallfree.data.dataset import SPLITS, Dataset, DatasetError
from stallfree.data.imageio import IMAGE_EXTENSIONS
from stallfree.data.listing import Listing, ListingBuilder
from stallfree.data.pack import FORMAT, MANIFEST


def _safe(name: str) -> bool:
    """A member name to read: relative, no '..', no directory part."""
    return bool(name) and not name.startswith("/") and ".." not in name and "/" not in name


def read_index(shard: Path) -> list[tuple[str, int, int]]:
    """(image member, offset, size) per sample of a shard's .idx; samples without exactly one
    image member and one .cls member, or with an unsafe name, are left out."""
    index = shard.with_suffix(".idx")
    if not index.is_file():
        raise DatasetError(f"{index} does not exist; shards need the index `stallfree data pack` "
                           "writes next to them")
    lines = index.read_text().splitlines()
    if not lines or not lines[0].startswith("v1.2 "):
        raise DatasetError(f"{index} is not a wds2idx v1.2 index")
    samples = []
    for line in lines[1:]:
        fields = line.split()
        members = [fields[i:i + 4] for i in range(0, len(fields) - 3, 4)]
        images = [m for m in members if f".{m[0]}" in IMAGE_EXTENSIONS and _safe(m[3])]
        labels = [m for m in members if m[0] == "cls" and _safe(m[3])]
        if len(images) == 1 and len(labels) == 1:
            _, offset, size, name = images[0]
            samples.append((name, int(offset), int(size)))
    return samples


def resolve_shards(root_text: str) -> Dataset:
    """The packed dataset at ROOT (manifest.json, shards, indexes) as a Dataset."""
    root = Path(root_text)
    manifest_path = root / MANIFEST
    if not manifest_path.is_file():
        raise DatasetError(f"{manifest_path} does not exist; data.format = \"tar\" reads the output "
                           "of `stallfree data pack ROOT OUT` (set data.root to OUT)")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("format") != FORMAT:
        raise DatasetError(f"{manifest_path}: format {manifest.get('format')!r}, expected {FORMAT}")
    classes = tuple(manifest["classes"])
    splits: dict[str, Listing] = {}
    sources: list[str] = []
    for split in SPLITS:
        builder = ListingBuilder(str(root) + "/", classes)
        labels = manifest["splits"][split]["labels"]
        for entry in manifest["splits"][split]["shards"]:
            shard = root / Path(entry["name"]).name  # a name, never a path out of root
            sources.append(str(shard))
            tails, shard_labels = [], []
            for name, offset, size in read_index(shard):
                number = int(name.partition(".")[0].removeprefix(split))
                label = labels[number]
                if not 0 <= label < len(classes):
                    raise DatasetError(f"{shard}::{name}: label {label} outside the manifest's "
                                       f"{len(classes)} classes")
                tails.append(f"{shard.name}::{name}:{offset}:{size}")
                shard_labels.append(label)
            builder.add(tails, shard_labels)
        if not len(builder):
            raise DatasetError(f"{root}: the {split} shards hold no samples")
        splits[split] = builder.build()
    return Dataset(root=str(root), classes=classes, splits=splits, sources=tuple(sources))
