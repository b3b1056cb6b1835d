"""The header check's fast path and its worker pool: the same verdicts as PIL's check, faster.

`fast_headers.passes` may only ever pass a file that `check_header` (PIL and the rules) passes;
every other file goes to PIL, so the check's verdicts and reasons stay PIL's. Held here on the
odd files of `data check`, the crafted JPEGs, Pillow's own test images, and every truncation and
byte flip of a camera-like JPEG's header segments.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stallfree.data.readers import check_pool
from stallfree.data.readers.imageio import bad_headers


def _jpeg(value: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.full((8, 8, 3), value, np.uint8)).save(out, "JPEG")
    return out.getvalue()


@pytest.mark.e2e  # starts worker interpreters
def test_headers_checked_in_worker_interpreters_are_named_in_file_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(check_pool, "IN_PROCESS_BELOW", 0)
    paths = []
    for i in range(40):
        paths.append(tmp_path / f"{i:02d}.jpg")
        paths[-1].write_bytes(_jpeg(i) if i % 7 else b"not a jpeg")
    found = check_pool.check_headers(map(str, paths), len(paths), 10**8, 2, progress=False)
    assert found == [(e.path, e.reason) for e in bad_headers(map(str, paths), 10**8)]
    assert [Path(p).name for p, _ in found] == ["00.jpg", "07.jpg", "14.jpg", "21.jpg", "28.jpg", "35.jpg"]
