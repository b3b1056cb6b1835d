"""Atomic, keep-last-N checkpoints that load without unpickling arbitrary objects."""

from __future__ import annotations

import os
import pickle
import random
import re
import time
import warnings
import zipfile
from pathlib import Path
from typing import Any, TypeGuard, cast

import numpy as np
import torch

from stallfree.errors import StallfreeError
from stallfree.log import LOGGER
from stallfree.train.checkpoint.format import upgrade
from stallfree.train.rundir import CHECKPOINTS  # a run directory's checkpoints/ folder

_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")
LATEST = "latest"
BEST = "best.pt"


class CheckpointError(StallfreeError, RuntimeError):
    """A checkpoint that cannot be read or used; the message names the file."""

    hint = "pass a ckpt-<step>.pt or best.pt that `stallfree train` wrote, or its run directory"


class Checkpointer:
    """Writes `ckpt-<step>.pt` files into one directory; rank 0 writes, every rank reads."""

    def __init__(self, directory: str | Path, *, keep: int = 3, rank: int = 0) -> None:
        if keep < 2:
            raise ValueError("keep must be >= 2 so that a crash mid-save leaves one good checkpoint")
        self.directory, self.keep, self.rank = Path(directory), keep, rank
        self.last_save_s = 0.0

    def save(self, state: dict[str, Any], step: int) -> Path | None:
        """Write atomically (temp file, fsync, rename, fsync dir), update `latest`, prune old ones."""
        if self.rank != 0:
            return None
        started = time.perf_counter()
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"ckpt-{step:09d}.pt"
        _save_atomic(state, path)
        _write_atomic(self.directory / LATEST, path.name + "\n")
        _fsync_dir(self.directory)
        self._prune(keep_also=path)
        self.last_save_s = time.perf_counter() - started
        return path

    def save_best(self, state: dict[str, Any]) -> Path | None:
        """`best.pt`: the weights of the best epoch so far (and its EMA), atomically; never
        pruned, never resumed from (`stallfree eval --checkpoint RUN/checkpoints/best.pt`)."""
        if self.rank != 0:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / BEST
        _save_atomic(state, path)
        _fsync_dir(self.directory)
        return path

    def paths(self) -> list[Path]:
        """Complete checkpoints, newest first (temp files are never listed)."""
        found = [p for p in self.directory.glob("ckpt-*.pt") if _NAME.match(p.name)]
        return sorted(found, key=lambda p: p.name, reverse=True)

    def _prune(self, keep_also: Path) -> None:
        # Never the file just written, even if an older run left higher step numbers here.
        for old in self.paths()[self.keep :]:
            if old != keep_also:
                old.unlink(missing_ok=True)

    def load_latest(self) -> tuple[dict[str, Any], Path] | None:
        """The newest checkpoint that loads; broken ones are reported by name and skipped."""
        for path in self.paths():
            try:
                return load_checkpoint(path), path
            except CheckpointError as exc:
                warnings.warn(f"{exc}; trying the next older checkpoint", stacklevel=2)
        return None


def choose_checkpoint(path: str | Path) -> tuple[Path, str]:
    """(checkpoint file, why): the one rule predict, eval and export read a checkpoint by.

    A run directory (or its checkpoints/ folder) means its best.pt, the weights of its best
    epoch by val top-1 (what a run is judged and used by), else its newest ckpt-<step>.pt;
    `latest` means the checkpoint it names; any other file itself. A resume never reads
    best.pt: `--resume auto` takes the newest (`Checkpointer.load_latest`).
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.is_dir():
        folder = path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path
        if (folder / BEST).is_file():
            return folder / BEST, "the run's best epoch"
        newest = Checkpointer(folder).paths()
        if not newest:
            raise CheckpointError(f"{path} holds no checkpoint (no {folder}/{BEST} or ckpt-<step>.pt)")
        return newest[0], f"the run's newest checkpoint: it has no {BEST}"
    if path.name == LATEST:
        return latest_target(path), f"the newest checkpoint, as {path} names it"
    return path, "as given"


def resolve_checkpoint(path: str | Path) -> Path:
    """`choose_checkpoint`'s file, said on stderr (which file, and why that one)."""
    chosen, why = choose_checkpoint(path)
    LOGGER.info(f"reading checkpoint {chosen} ({why})")
    return chosen


def latest_target(path: Path) -> Path:
    """The checkpoint a `latest` pointer file names (beside it)."""
    name = path.read_text(errors="replace").strip()
    if not _NAME.match(name):
        raise CheckpointError(f"{path} should name a ckpt-<step>.pt beside it, but reads {name[:40]!r}")
    return path.parent / name


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """`torch.load(weights_only=True)`: tensors, containers and primitives only, never code;
    upgraded to the current format (a newer one raises CheckpointFormatError)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    what = _not_a_checkpoint(path)
    if what is not None:
        raise CheckpointError(f"checkpoint {path} {what}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        unsafe = _unsafe_globals(path)
        if not unsafe:  # torch's unpickler meets bytes that are no pickle it writes
            raise CheckpointError(
                f"checkpoint {path} is truncated or corrupt (it does not unpickle)"
            ) from exc
        raise CheckpointError(
            f"checkpoint {path} holds objects outside the weights-only allow-list "
            f"(tensors, dicts, lists, numbers, strings): {', '.join(unsafe)}; refusing to unpickle it"
        ) from exc
    except Exception as exc:  # a damaged file fails in torch's readers in many ways (KeyError too)
        raise CheckpointError(
            f"checkpoint {path} is truncated or corrupt ({type(exc).__name__} in torch.load)"
        ) from exc
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"checkpoint {path} is not a stallfree checkpoint (no 'model' key)")
    return upgrade(state, path)  # every reader sees the current format (format.py)


def _unsafe_globals(path: Path) -> list[str]:
    """The globals of the checkpoint's pickle outside torch's weights-only allow-list, read by
    torch's own scan (nothing is unpickled); none where the file is no pickle torch wrote."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # noqa: BLE001 - a damaged file fails its scan in many ways, as torch.load's
        return []


def _not_a_checkpoint(path: Path) -> str | None:
    """What `path` is when its first bytes show it cannot be a checkpoint; None when it may be
    one (torch.load decides). torch's own words for these are a KeyError from its legacy
    reader, or advice to load with weights_only=False, which would run the file's code."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {exc.strerror or exc}") from exc
    if not head:
        return "is truncated or corrupt (0 bytes)"
    if not head.strip(b"\0"):
        return "is zero-filled (truncated or corrupt)"
    if zipfile.is_zipfile(path) or head.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except (zipfile.BadZipFile, OSError):
            return "is truncated or corrupt (an incomplete zip archive)"
        if any(name.endswith("/constants.pkl") for name in names):
            return "is a TorchScript export (torch.jit.save), not a checkpoint"
        if any(name.endswith("/archive_format") for name in names):
            return "is a torch.export program (model.pt2), not a checkpoint"
        return (
            None if any(name.endswith("data.pkl") for name in names) else "is a zip archive, not a checkpoint"
        )
    if head[0] == 0x80:
        return None  # a pickle: torch's legacy format
    text = head.decode("utf-8", "replace")
    text = text[:-1] if len(head) == 4096 else text  # its last character may be cut in two
    if all(c != "\ufffd" and (c.isprintable() or c in "\t\r\n") for c in text):
        return f"is a text file (it starts {text.strip()[:30]!r}), not a checkpoint"
    return "is truncated or corrupt (neither a zip archive nor a pickle)"


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """Python, numpy, torch and (this rank's device only) CUDA generator states.

    Only `device`'s CUDA state: every visible GPU's would not restore on a host that shows
    a rank fewer GPUs.
    """
    version, mt, gauss = random.getstate()
    # legacy=True (the default) gives the tuple: ("MT19937", keys, pos, has_gauss, gaussian)
    np_state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    return {
        "python": {"version": version, "state": list(mt), "gauss": gauss},
        "numpy": {
            "keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if _is_cuda(device) else torch.empty(0),
    }


def _is_cuda(device: torch.device | None) -> TypeGuard[torch.device]:
    return device is not None and device.type == "cuda"


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore what `rng_state` captured (the CUDA state onto `device`)."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            npy["keys"].numpy().astype(np.uint32),
            npy["pos"],
            npy["has_gauss"],
            npy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if isinstance(cuda, torch.Tensor) and cuda.numel() and _is_cuda(device):
        torch.cuda.set_rng_state(cuda, device)


def _save_atomic(state: dict[str, Any], path: Path) -> None:
    """torch.save into a temporary file, fsync, rename: readers see the old file or the new one
    (atomic on POSIX). The caller fsyncs the directory once its renames are done."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
