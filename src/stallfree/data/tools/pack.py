"""`stallfree data pack`: a dataset folder as WebDataset tar shards, with indexes and a manifest.

Members are `KEY.<ext>` (the image's bytes, copied as they are) and `KEY.cls` (the label as
text), grouped by sample; each shard gets the index DALI's `readers.webdataset` reads, and
`manifest.json` holds what a start checks the shards against. ROOT may be an s3:// prefix, read
as training reads it, so the shards are byte for byte those of packing a local copy. OUT is a
local folder (staged, then renamed: all or nothing); upload it whole afterwards.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import shutil
import socket
import tarfile
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from stallfree.data import storage
from stallfree.data.readers.factory import resolve_dataset
from stallfree.data.readers.headers import read_bytes
from stallfree.data.readers.listing import SPLITS
from stallfree.data.readers.tarshards import FORMAT, MANIFEST, index_text
from stallfree.data.storage import Location
from stallfree.data.tools.staging import fresh_folder, move_into_place
from stallfree.errors import StallfreeError
from stallfree.recipe import DataConfig

# Each shard ends with two zero blocks, padded to tar's 10 KiB record: kept free in the budget.
_RESERVE = tarfile.RECORDSIZE
# Files or objects read ahead: a read's latency, not its bytes, is what packing would wait on.
_READ_AHEAD = 32


def parse_size(text: str) -> int:
    """'256MB', '1.5GB', '4096' -> bytes."""
    units = {"kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "b": 1}
    lowered = text.strip().lower()
    for unit, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if lowered.endswith(unit):
            return int(float(lowered[: -len(unit)]) * factor)
    return int(lowered)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o444, 0  # fixed metadata: reproducible shards
    tar.addfile(info, io.BytesIO(data))


def write_index(shard: Path) -> int:
    """Write `shard`'s .idx next to it (the `wds2idx` format v1.2: one line per sample of
    `ext offset size name` per member, offsets of the member data); return its sample count."""
    text = index_text(shard)
    shard.with_suffix(".idx").write_text(text)
    return int(text.split(None, 2)[1])


def file_sha256(location: Location) -> str:
    """SHA-256 of a file or an object, read front to back in large blocks (from a store: ranged
    GETs, one block held at a time)."""
    digest = hashlib.sha256()
    for block in location.blocks():
        digest.update(block)
    return digest.hexdigest()


def _contents(paths: list[str]) -> Iterator[bytes]:
    """Each file's or object's bytes in order, `_READ_AHEAD` read at a time: a store's GET
    latency, not its bytes, is what packing would wait on (and a network filesystem's)."""
    with ThreadPoolExecutor(8) as pool:
        for start in range(0, len(paths), _READ_AHEAD):  # bounded: never the whole dataset in memory
            yield from pool.map(read_bytes, paths[start : start + _READ_AHEAD])


def pack_split(
    samples: list[tuple[str, int]], out: Path, split: str, shard_bytes: int, progress: bool = True
) -> list[dict[str, Any]]:
    """Write one split's shards (in the given order); return their manifest entries."""
    shards: list[dict[str, Any]] = []
    tar: tarfile.TarFile | None = None
    size = 0

    def close() -> None:
        assert tar is not None
        tar.close()
        path = out / shards[-1]["name"]
        sha256 = file_sha256(storage.locate(path))
        shards[-1].update(samples=write_index(path), bytes=path.stat().st_size, sha256=sha256)

    contents = _contents([path for path, _ in samples])
    for i, (path, label) in enumerate(
        tqdm(samples, desc=f"packing {split}", unit="img", disable=not progress)
    ):
        data = next(contents)
        # On disk: a 512-byte header for each of the two members, data padded to 512 bytes.
        need = 2 * 512 + -(-len(data) // 512) * 512 + 512
        if tar is None or (size + need > shard_bytes and size > _RESERVE):
            if tar is not None:
                close()
            shards.append({"name": f"{split}-{len(shards):06d}.tar"})
            # Closed by close() when the shard is full: it outlives one loop iteration.
            shard = out / shards[-1]["name"]
            tar = tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115
            size = _RESERVE
        key = f"{split}{i:09d}"
        _add(tar, f"{key}.{Path(path).suffix.lower().lstrip('.') or 'jpg'}", data)
        _add(tar, f"{key}.cls", str(label).encode())
        size += need
    if tar is not None:
        close()
    return shards


def pack_dataset(
    root: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    shard_bytes: int,
    seed: int = 0,
    file_list: str = "",
    progress: bool = True,
) -> dict[str, Any]:
    """Pack ROOT/{train,val} (a folder or an s3:// prefix) into the local folder OUT. Train is
    shuffled (seeded) so every shard mixes classes. The manifest holds the class names, the
    shards of each split with their sample counts, sizes and SHA-256, and the format version.

    Everything is written into a temporary folder beside OUT and renamed into place at the
    end, so an interrupted pack leaves no shards of one run under a manifest of another.
    """
    out = _out_folder(storage.locate(out))
    dataset = resolve_dataset(DataConfig(root=str(storage.locate(root)), file_list=file_list))
    staging = _staging(out)
    try:
        manifest: dict[str, Any] = {"format": FORMAT, "classes": list(dataset.classes), "splits": {}}
        for split in SPLITS:
            listing = dataset.splits[split]
            order = (
                np.random.default_rng(seed).permutation(len(listing))
                if split == "train"
                else np.arange(len(listing))
            )
            samples = [(listing.path(int(i)), int(listing.labels[i])) for i in order]
            shards = pack_split(samples, staging, split, shard_bytes, progress)
            # Labels by sample number (the key's digits), so a reader needs no read per sample.
            manifest["splits"][split] = {
                "samples": len(samples),
                "shards": shards,
                "labels": [label for _, label in samples],
            }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _out_folder(out: Location) -> Path:
    """OUT as a local folder, or a PackError saying to pack into one and upload it."""
    why = (
        "data pack writes a local folder; pack into one, then upload it whole "
        "(e.g. `aws s3 cp --recursive OUT s3://...`) and train from that prefix"
    )
    try:
        return out.folder(why)
    except storage.NotAFolderError as exc:  # pack's own error, as for its other refusals
        raise PackError(str(exc)) from exc


def _staging(out: Path) -> Path:
    """A fresh folder beside OUT, after checking that OUT can be written as a whole."""
    if out.exists() and not out.is_dir():
        raise PackError(f"{out} is a file; pass a folder (new, or empty) for the shards")
    if out.is_dir() and any(out.iterdir()):
        raise PackError(
            f"{out} is not empty; pack into a new folder (shards of two packs "
            "must never mix), or remove it first"
        )
    parent = out.resolve().parent
    if not parent.is_dir():
        raise PackError(f"{parent} does not exist; create it first")
    for folder, owner in staging_leftovers(out):
        if owner is None:
            shutil.rmtree(folder, ignore_errors=True)
            warnings.warn(f"removed {folder}: a `data pack` into {out} was interrupted there", stacklevel=3)
        else:
            warnings.warn(
                f"{folder}: {owner} may still be packing into {out}; if not, remove it", stacklevel=3
            )
    try:
        # Named with its host and process, so the next pack can tell a dead one's leftovers.
        return fresh_folder(parent, f".{out.name}.packing-{os.getpid()}@{socket.gethostname()}-")
    except OSError as exc:
        raise PackError(
            f"cannot write in {parent} ({exc.strerror or exc}); choose another output folder"
        ) from exc


def staging_leftovers(out: Path) -> list[tuple[Path, str | None]]:
    """Staging folders of earlier packs into OUT (beside it), each with who may still be
    writing it ("process N on HOST"), or None when that process is gone (a killed pack)."""
    found: list[tuple[Path, str | None]] = []
    for folder in sorted(out.absolute().parent.glob(f".{glob.escape(out.name)}.packing-*")):
        pid, _, host = folder.name.rpartition(".packing-")[2].rpartition("-")[0].partition("@")
        if not (pid.isdigit() and host):  # an older pack's: no owner to ask
            found.append((folder, None))
        elif host != socket.gethostname():
            found.append((folder, f"process {pid} on {host}"))
        else:
            found.append((folder, f"process {pid}" if _alive(int(pid)) else None))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by another user
    return True


class PackError(StallfreeError, ValueError):
    """An output folder `data pack` cannot write into; the message names it and the fix."""
