"""`stallfree data check` on tar shards: the full job a start cannot afford.

For shards of `stallfree data pack`: every shard's SHA-256 against the manifest, the structure
and every `.cls` against the manifest's labels (what a start checks once), and every member
decoded. For other WebDataset shards: the labels read from `.cls` and every member decoded.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from stallfree.data.check import CheckReport
from stallfree.data.dataset import SPLITS, Dataset, DatasetError
from stallfree.data.pack import file_sha256
from stallfree.data.startup import decode_all


def _checksum_problems(root: Path) -> list[tuple[Path, str]]:
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        return []  # other people's shards: no checksums to compare
    try:
        manifest = json.loads(manifest_path.read_text())
        shards = [s for split in SPLITS for s in manifest["splits"][split]["shards"]]
    except (ValueError, KeyError, TypeError):
        return []  # resolve_shards names what is wrong with the manifest
    problems = []
    for entry in shards:
        shard = root / Path(str(entry.get("name", ""))).name
        if shard.is_file() and file_sha256(shard) != entry.get("sha256"):
            problems.append((shard, "shard: SHA-256 differs from the manifest's: not the shard "
                                    "that was packed (re-pack, or restore it)"))
    return problems


def check_shards(root: Path, *, workers: int, max_pixels: int, progress: bool) -> CheckReport:
    """Check the shards at ROOT whole; every problem names the shard (and member)."""
    from stallfree.data.tarshards import resolve_shards

    report = CheckReport(root=root, max_pixels=max_pixels)
    started = time.perf_counter()
    report.bad += _checksum_problems(root)
    try:
        dataset: Dataset = resolve_shards(str(root))
    except DatasetError as exc:
        report.bad.append((root, f"shard: {exc}"))
        report.seconds = time.perf_counter() - started
        return report
    for split in SPLITS:
        listing = dataset.splits[split]
        paths = listing.files
        reasons = decode_all(paths, max_pixels, workers, desc=f"checking {root} {split}",
                             progress=progress)
        for path, label, reason in zip(paths, listing.labels.tolist(), reasons):
            name = f"{split}/{dataset.classes[label]}"
            report.per_class[name] += 1
            if reason is None:
                report.good.append(Path(path))
            else:
                report.bad.append((Path(path), reason))
                report.per_class_bad[name] += 1
    report.seconds = time.perf_counter() - started
    return report
