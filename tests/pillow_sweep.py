"""Worker of tests/e2e/test_pillow_corpus.py: each file through the header check, the torch
loader's decode and DALI's two CPU decoders. Run as `python pillow_sweep.py LIST`; prints
`START <path>` before each native decode, so a crash of this process names its file, and one
`RESULT <json>` line per file."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
from nvidia.dali import fn, pipeline_def, types

from stallfree.data.readers.headers import read_bytes
from stallfree.data.readers.imageio import BadImageError, check_header, open_rgb
from stallfree.data.transforms.augment import val_transform
from stallfree.recipe import AugmentConfig

_ENCODED: list[np.ndarray] = []


def _pipeline(op: str) -> Any:
    @pipeline_def(batch_size=1, num_threads=1, device_id=None, exec_async=False, exec_pipelined=False, seed=1)
    def graph() -> Any:  # the dali backend's decoders: val (image) and train (random crop)
        encoded = fn.external_source(source=lambda: _ENCODED[-1:], batch=True, dtype=types.UINT8)
        decoder = fn.decoders.image if op == "image" else fn.decoders.image_random_crop
        return decoder(encoded, device="cpu", output_type=types.RGB)

    pipe = graph()
    pipe.build()
    return pipe


def _dali(pipes: dict[str, Any], op: str, data: np.ndarray) -> np.ndarray | str:
    """The decoded pixels, or DALI's error (a failed pipeline is rebuilt for the next file)."""
    _ENCODED[:] = [data]
    try:
        (out,) = (pipes.get(op) or pipes.setdefault(op, _pipeline(op))).run()
    except RuntimeError as exc:
        pipes.pop(op, None)
        return str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else "failed"
    return np.array(out.at(0))


def sweep(paths: list[str]) -> None:
    """Print one RESULT line per path (see the module docstring)."""
    pipes: dict[str, Any] = {}
    aug = AugmentConfig(image_size=32, resize_size=36)
    for path in paths:
        record: dict[str, Any] = {"path": path}
        try:
            check_header(path)
        except BadImageError as exc:
            record["refused"] = str(exc)
            print("RESULT", json.dumps(record), flush=True)
            continue
        pixels = None
        try:  # the torch loader: the full decode (data check's) and the val transform
            pixels = np.asarray(open_rgb(path))
            record["torch"] = list(pixels.shape)
            val_transform(path, aug, 32)
        except BadImageError as exc:
            record["torch"] = str(exc)
        data = np.frombuffer(read_bytes(path), dtype=np.uint8)
        for op in ("image", "image_random_crop"):
            print("START", path, flush=True)
            out = _dali(pipes, op, data)
            record[op] = list(out.shape) if isinstance(out, np.ndarray) else out
            if (
                op == "image"
                and isinstance(out, np.ndarray)
                and pixels is not None
                and out.shape == pixels.shape
            ):
                # Mean absolute difference of the whole decoded image, PIL's against DALI's.
                record["diff"] = float(np.abs(out.astype(np.int16) - pixels.astype(np.int16)).mean())
        print("RESULT", json.dumps(record), flush=True)


if __name__ == "__main__":
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # libtiff and OpenCV warnings, per file
    with open(sys.argv[1]) as listing:
        sweep([line.rstrip("\n") for line in listing if line.strip()])
