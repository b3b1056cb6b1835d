"""C libraries' bare lines on fd 2 (libpng's, from DALI's decoder threads) go through the log,
once per kind, and nothing else written to fd 2 is lost or changed."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import build_loader, small_recipe
from PIL import Image

from stallfree.data.tools.demo import write_demo
from stallfree.log import NativeStderr


def _said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "libpng" in r.getMessage()]


def test_libpng_lines_are_logged_once_per_kind_and_the_rest_passes_unchanged(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    router = NativeStderr()
    chunks = [
        b"partial",
        b" line\n",
        b"libpng warning: iCCP: too short\n" * 3,
        b"\rframe 1",
        b"\rframe 2\n",
        b"libpng warning: iCCP: known incorrect sRGB profile\n",
        b"lib",
        b"rary\n",
        b"libpng error: IDAT: CRC error\n",
    ]
    with caplog.at_level(logging.INFO, logger="stallfree"):
        router.acquire()
        router.acquire()  # a second loader: one pipe
        for chunk in chunks:
            os.write(2, chunk)
        router.release()
        os.write(2, b"libpng warning: iCCP: too short\n")  # still routed: one user left
        os.write(2, b"no newline at the end")
        router.release()
    # The log's own lines reach fd 2 too when an earlier test gave the logger a stderr handler
    # (the CLI's): what is asserted is everything else, byte for byte.
    err = "".join(
        line for line in capfd.readouterr().err.splitlines(keepends=True) if "stallfree: libpng" not in line
    )
    assert err == (
        "partial line\n\rframe 1\rframe 2\nlibrary\nlibpng error: IDAT: CRC error\nno newline at the end"
    )
    said = _said(caplog)
    assert len(said) == 2 and "iCCP: too short" in said[0] and "sRGB profile" in said[1], said
    os.write(2, b"after\n")  # fd 2 is the original again
    assert capfd.readouterr().err == "after\n"


def test_dali_libpng_warnings_go_through_the_log_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("nvidia.dali", reason="the dali extra")
    root = write_demo(tmp_path / "data", train_per_class=2, val_per_class=1, progress=False)
    pixels = np.random.default_rng(0).integers(0, 255, (40, 50, 3), dtype=np.uint8)
    for i, folder in enumerate(sorted((root / "train").iterdir())[:4]):
        # A bogus ICC profile: libpng warns "iCCP: too short" for every decode of it.
        Image.fromarray(pixels).save(folder / f"iccp{i}.png", icc_profile=b"not a profile")
    recipe = small_recipe(root, loader={"backend": "dali", "dali": {"threads": 1}}, train={"batch_size": 4})
    with caplog.at_level(logging.INFO, logger="stallfree"):
        loader = build_loader(recipe, "train", device=torch.device("cpu"))
        try:
            assert sum(len(batch.labels) for batch in loader) == 24
        finally:
            loader.close()
    raw = [line for line in capfd.readouterr().err.splitlines() if "stallfree: libpng" not in line]
    assert not [line for line in raw if "libpng" in line], raw  # only the log's own line, if any
    said = _said(caplog)
    assert len(said) == 1 and "iCCP: too short" in said[0], said
