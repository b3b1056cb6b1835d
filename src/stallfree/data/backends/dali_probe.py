"""DALI diagnostics: which file stopped a pipeline, whether the environment (a missing library)
did, and whether the `mixed` decoder really runs on the GPU. Used by the dali backend and by
`stallfree doctor`; imported only where DALI is installed."""

from __future__ import annotations

import io
import os
import tempfile
from typing import Any

import numpy as np
from nvidia.dali import fn, pipeline_def, types

from stallfree.data.backends.dali_words import fell_back_to_cpu, first_cause, logged_causes, missing_library
from stallfree.data.readers.headers import read_bytes
from stallfree.errors import StallfreeError


class DaliEnvironmentError(StallfreeError, RuntimeError):
    """DALI cannot run here (a library missing from its tree): names the library and the fix."""

    hint = "run `stallfree doctor` for what is missing and how to install it"


def environment_problem(text: str) -> DaliEnvironmentError | None:
    """The environment error a DALI message reports, if it is one (dali_words tells)."""
    missing = missing_library(text)
    if not missing:
        return None
    if missing == "nvimgcodec":
        what = (
            "DALI cannot load libnvimgcodec: install nvidia-nvimgcodec-cu13 (or -cu12, as "
            "DALI's CUDA) into the same tree as DALI"
        )
    elif missing == "nvjpeg":
        what = (
            "DALI cannot load nvjpeg: install nvidia-nvjpeg (CUDA 13) or nvidia-nvjpeg-cu12 "
            "into the same tree as DALI"
        )
    else:
        what = f"the DALI pipeline cannot be built here: {first_cause(text)}"
    return DaliEnvironmentError(what)


@pipeline_def(batch_size=1, num_threads=1, device_id=None, exec_async=False, exec_pipelined=False)
def _probe_pipeline(paths: list[str]) -> Any:
    # Bytes fed one file at a time: files and tar members alike, nothing extracted.
    encoded = fn.external_source(
        source=([np.frombuffer(read_bytes(path), dtype=np.uint8)] for path in paths),
        batch=True,
        dtype=types.UINT8,
    )
    return fn.decoders.image(encoded, device="cpu", output_type=types.RGB)


def first_undecodable(paths: list[str]) -> tuple[str, str] | None:
    """The first of `paths` that DALI's CPU decoder cannot read, with the cause in one line.

    One synchronous pipeline, one file per run: run i decodes file i, so the run that fails
    names the file. The decoder writes the real cause ("Premature end of JPEG data") to the
    process's stderr, not into the exception, so file descriptor 2 is captured meanwhile.
    """
    if not paths:
        return None
    with tempfile.TemporaryFile() as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        done = 0  # the run that raises names the file: paths[done]
        try:
            pipe = _probe_pipeline(paths)
            try:
                pipe.build()
            except RuntimeError as exc:  # before any file is read: not a file's fault
                raise environment_problem(str(exc)) or DaliEnvironmentError(
                    f"the DALI pipeline cannot be built here: {first_cause(str(exc))}"
                ) from None
            for done in range(len(paths)):  # noqa: B007 - read after the loop, on failure
                log.seek(0)
                log.truncate()
                pipe.run()
            return None
        except DaliEnvironmentError:
            raise
        except RuntimeError as exc:
            error = exc
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        logged = logged_causes(log.read().decode(errors="replace"))
    return paths[done], (logged[-1][:300] if logged else first_cause(str(error)))


def probe_gpu_decode() -> tuple[bool, str]:
    """Decode one JPEG with the `mixed` decoder on GPU 0: (ran on the GPU, what happened).

    DALI falls back to a CPU decode when nvjpeg does not load, with only a warning on stderr:
    the warning is captured and read, and the output must be a GPU tensor.
    """
    from PIL import Image

    jpeg = io.BytesIO()
    Image.new("RGB", (64, 48), (90, 120, 200)).save(jpeg, "JPEG")
    data = np.frombuffer(jpeg.getvalue(), dtype=np.uint8)

    @pipeline_def(batch_size=1, num_threads=1, device_id=0)
    def one() -> Any:
        encoded = fn.external_source(source=lambda: [data], batch=True, dtype=types.UINT8)
        return fn.decoders.image(encoded, device="mixed", output_type=types.RGB)

    with tempfile.TemporaryFile() as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            pipe = one()
            pipe.build()
            (out,) = pipe.run()
            error = None
        except RuntimeError as exc:
            error, out = exc, None
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        said = log.read().decode(errors="replace")
    if error is not None:
        problem = environment_problem(str(error))
        return False, str(problem) if problem else f"mixed decode failed: {first_cause(str(error))}"
    fell_back = fell_back_to_cpu(said)
    on_gpu = type(out).__name__ == "TensorListGPU"
    if fell_back or not on_gpu:
        return False, (
            "the mixed decoder fell back to the CPU: "
            f"{first_cause(said) if said.strip() else 'output not on the GPU'}"
        )
    return True, "one JPEG decoded by nvJPEG on GPU 0 (no CPU fallback)"
