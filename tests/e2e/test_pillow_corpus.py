"""Pillow's own test images (Tests/images of the Pillow sdist: ~1,000 odd, broken and fuzzed
files) through the header check, the torch loader's decode and DALI's CPU decoders.

The contract: every file is refused by the header check, naming it, or neither loader
crashes on it, and a file PIL decodes, DALI decodes too, to the same size. A native crash of
DALI's decoder is caught in the worker process and named.

The images are Pillow's, under Pillow's licence (MIT-CMU, also known as HPND:
https://github.com/python-pillow/Pillow/blob/main/LICENSE). They are not vendored: the sdist is
fetched once from the package index into data/pillow-corpus/ (ignored by git) and reused;
without network the test is skipped, except under CI (env CI set), where it fails. Files that
sdist lacks, and the crafted ones, come from tests/data/pillow (with the licence) and tests/helpers.py.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import PYTHON, exif_block, jpeg_with_segments

pytestmark = [pytest.mark.dali, pytest.mark.e2e]
WORKER = Path(__file__).parents[1] / "pillow_sweep.py"
CHUNKS = 2  # worker processes at once: the suite runs on two cores


def _run_chunk(paths: list[str], listing: Path) -> tuple[list[dict], list[tuple[str, int]]]:
    """Sweep `paths` in worker processes; a crash names its file and the sweep goes on."""
    results: list[dict] = []
    crashes: list[tuple[str, int]] = []
    while paths:
        listing.write_text("\n".join(paths) + "\n")
        done = subprocess.run(
            [PYTHON, str(WORKER), str(listing)], capture_output=True, text=True, timeout=600
        )
        seen, started = set(), None
        for line in done.stdout.splitlines():
            kind, _, rest = line.partition(" ")
            if kind == "RESULT":
                results.append(json.loads(rest))
                seen.add(results[-1]["path"])
            elif kind == "START":
                started = rest
        paths = [p for p in paths if p not in seen]
        if done.returncode != 0:
            assert started in paths, done.stderr[-2000:]  # a crash with no file being decoded
            crashes.append((started, done.returncode))
            paths.remove(started)
    return results, crashes


def test_every_pillow_image_is_refused_or_decoded_by_both_loaders(
    pillow_images: Path, tmp_path: Path
) -> None:
    extra = [
        Path(__file__).parents[1] / "data" / "pillow" / "crash-74d2a78403a5a59db1fb0a2b8735ac068a75f6e3.tif",
        jpeg_with_segments(tmp_path / "two_exif.jpg", [(0xE1, exif_block(6)), (0xE1, exif_block(3))]),
    ]
    files = sorted(str(p) for p in pillow_images.rglob("*") if p.is_file()) + list(map(str, extra))
    assert len(files) > 1000
    results: list[dict] = []
    crashes: list[tuple[str, int]] = []
    chunks = [files[i::CHUNKS] for i in range(CHUNKS)]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(CHUNKS) as pool:
        for found, crashed in pool.map(
            _run_chunk, chunks, [tmp_path / f"chunk{i}.txt" for i in range(CHUNKS)]
        ):
            results += found
            crashes += crashed
    assert not crashes, f"DALI's decoder crashed the process (path, exit code): {crashes}"
    assert len(results) == len(files)
    refused = [r for r in results if "refused" in r]
    assert all(r["path"] in r["refused"] for r in refused)  # each refusal names its file
    for path in map(str, extra):
        assert any(r["path"] == path for r in refused), path
    differ = [
        r
        for r in results
        if "refused" not in r
        and isinstance(r["torch"], list)
        and not (r["image"] == r["torch"] and isinstance(r["image_random_crop"], list))
    ]
    assert not differ, f"PIL decodes these, DALI does not (alike): {differ}"
    # Same size is not enough: the loaders must agree on the pixels too (a wrong image trains
    # silently). Two decoders of one file differ by rounding only: under a grey level or two.
    apart = sorted((round(r["diff"], 1), r["path"]) for r in results if r.get("diff", 0.0) > 3.0)
    assert not apart, f"both loaders decode these, to different pixels (mean grey levels): {apart}"
    # Files no loader decodes (truncated data) fail at decode on both, named: a sanity count.
    assert sum(isinstance(r.get("torch"), list) for r in results) > 400
