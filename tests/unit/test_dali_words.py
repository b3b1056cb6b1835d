"""DALI raises RuntimeError for everything and its decoders write the cause to stderr, so its
errors are told apart by their words, in one module (dali_words.py). Each rule is pinned here
to the real words of the installed libraries (DALI 2.x, nvImageCodec, torch 2.x): what they
raise and print on this machine, and, for what a CPU machine cannot make happen (a library
missing from DALI's tree, a GPU allocation), the message text compiled into their binaries.
An upgrade that changes one fails here, not in a user's run."""

from __future__ import annotations

import io
import mmap
import os
import tempfile
from pathlib import Path

import pytest
import torch
from PIL import Image

from stallfree.data.backends import dali_words


def test_torchs_own_allocation_failure_is_out_of_memory() -> None:
    with pytest.raises(RuntimeError) as caught:  # not torch.OutOfMemoryError on the CPU
        torch.empty(1 << 60, dtype=torch.uint8)
    assert dali_words.says_out_of_memory(str(caught.value)), caught.value


def _compiled_in(library: Path, start: bytes) -> str:
    """The NUL-ended string starting with `start` in a shared library (its message text)."""
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        at = data.find(start)
        assert at >= 0, f"{library.name} no longer says {start!r}: see dali_words.py"
        return data[at : data.find(b"\0", at)].decode()


@pytest.fixture(scope="module")
def dali_run() -> object:
    """Run a one-operator DALI pipeline on the CPU: (the exception, what went to fd 2)."""
    pytest.importorskip("nvidia.dali")
    from nvidia.dali import pipeline_def

    def run(make: object) -> tuple[RuntimeError, str]:
        pipe = pipeline_def(
            batch_size=1, num_threads=1, device_id=None, exec_async=False, exec_pipelined=False
        )(make)()
        with tempfile.TemporaryFile() as log:
            saved = os.dup(2)
            os.dup2(log.fileno(), 2)
            try:
                pipe.build()
                with pytest.raises(RuntimeError) as caught:
                    pipe.run()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            log.seek(0)
            return caught.value, log.read().decode(errors="replace")

    return run


@pytest.mark.dali
def test_dalis_allocation_failure_is_out_of_memory(dali_run) -> None:
    from nvidia.dali import fn

    error, _ = dali_run(lambda: fn.constant(fdata=0.0, shape=[1 << 22, 1 << 22]))  # 64 TiB: refused at once
    assert dali_words.says_out_of_memory(str(error)), error
    assert not dali_words.missing_library(str(error))


@pytest.mark.dali
def test_a_file_dali_cannot_decode_is_the_files_fault_and_its_cause_is_found(dali_run) -> None:
    import numpy as np
    from nvidia.dali import fn, types

    jpeg = io.BytesIO()
    Image.new("RGB", (64, 48), (9, 99, 199)).save(jpeg, "JPEG")
    half = np.frombuffer(jpeg.getvalue()[: len(jpeg.getvalue()) // 2], dtype=np.uint8)

    def decode() -> object:
        encoded = fn.external_source(source=lambda: [half], batch=True, dtype=types.UINT8)
        return fn.decoders.image(encoded, device="cpu", output_type=types.RGB)

    error, log = dali_run(decode)
    assert not dali_words.says_out_of_memory(str(error)) and not dali_words.missing_library(str(error))
    assert dali_words.first_cause(str(error)).startswith("nvImageCodec failure"), error
    assert dali_words.logged_causes(log) == ["Invalid marker"], log  # the decoder's own words


@pytest.mark.dali
def test_the_libraries_words_for_a_missing_library_name_it() -> None:
    import nvidia.dali

    dali = Path(nvidia.dali.__file__).parent
    nvimgcodec = dali.parent / "nvimgcodec"
    missing = {
        "nvimgcodec": _compiled_in(dali / "libdali_operators.so", b"dlopen libnvimgcodec.so failed!"),
        "nvjpeg": _compiled_in(
            next((nvimgcodec / "extensions").glob("libnvjpeg_ext.so*")), b"Failed to load nvjpeg library!"
        ),
    }
    for library, words in missing.items():
        assert dali_words.missing_library(words) == library, words
        assert dali_words.missing_library(f"Critical error when building pipeline:\n{words}") == library
    building = _compiled_in(dali / "libdali.so", b"Critical error when building pipeline:")
    assert dali_words.missing_library(f"{building}\nsome other cause") == "other"
    assert dali_words.missing_library("nvImageCodec failure: '#3'") == ""  # a file's, not a library's
    for words in (b"CUDA allocation failed", b"cudaErrorMemoryAllocation"):
        assert dali_words.says_out_of_memory(_compiled_in(dali / "libdali.so", words))
