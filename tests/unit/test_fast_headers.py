"""The header check's fast path and its worker pool: the same verdicts as PIL's check, faster.

`fast_headers.passes` may only ever pass a file that `check_header` (PIL and the rules) passes;
every other file goes to PIL, so the check's verdicts and reasons stay PIL's. Held here on the
odd files of `data check`, the crafted JPEGs, Pillow's own test images, and every truncation and
byte flip of a camera-like JPEG's header segments.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import exif_block, jpeg_with_segments
from PIL import Image
from test_check import _odd_files
from tqdm import tqdm

from stallfree.data.readers import check_pool, fast_headers, imageio
from stallfree.data.readers.fast_headers import passes
from stallfree.data.readers.imageio import BadImageError, check_header, header_problem
from stallfree.recipe import DEFAULT_MAX_PIXELS

_PILLOW_EXTRA = Path(__file__).parents[1] / "data" / "pillow"


def _pil_reason(path: Path, max_pixels: int = DEFAULT_MAX_PIXELS) -> str | None:
    try:
        check_header(str(path), max_pixels)
    except BadImageError as exc:
        return exc.reason
    return None


def _assert_same_verdicts(paths: list[Path], max_pixels: int = DEFAULT_MAX_PIXELS) -> int:
    """Fast passes only what PIL passes, and the combined check says what PIL says; the count
    the fast path decided alone."""
    wrong = [p for p in paths if passes(str(p), max_pixels) and _pil_reason(p, max_pixels) is not None]
    assert not wrong, f"the fast path passes files the header check refuses: {wrong}"
    differ = [p for p in paths if header_problem(str(p), max_pixels) != _pil_reason(p, max_pixels)]
    assert not differ, differ
    return sum(passes(str(p), max_pixels) for p in paths)


def _crafted(folder: Path) -> list[Path]:
    """The odd files of `data check`, and JPEGs with the header segments PIL reads specially."""
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for name, (content, _) in _odd_files().items():
        path = folder / name
        if isinstance(content, Image.Image):
            content.save(path)
        else:
            path.write_bytes(content)
        files.append(path)
    icc = b"ICC_PROFILE\x00\x01\x01" + bytes(200)
    photoshop = b"Photoshop 3.0\x008BIM\x03\xed\x00\x00\x00\x00\x00\x10" + bytes(16)
    segments = {
        "exif6": [(0xE1, exif_block(6))],
        "two_exif": [(0xE1, exif_block(6)), (0xE1, exif_block(3))],
        "exif_in_comment": [(0xFE, exif_block(6))],
        "icc_photoshop_adobe": [(0xE2, icc), (0xED, photoshop), (0xEE, b"Adobe\x00d\x00\x00\x00\x00\x01")],
        "short_icc": [(0xE2, b"ICC_PROFILE\x00\x01")],
        "short_jfif": [(0xE0, b"JFIF\x00")],
        "short_adobe": [(0xEE, b"Adobe")],
        "mpf": [(0xE2, b"MPF\x00" + bytes(40))],
        "big_xmp": [(0xE1, b"http://ns.adobe.com/xap/1.0/\x00" + bytes(60_000))],
        "broken_photoshop": [(0xED, b"Photoshop 3.0\x008BIM\x03\xed")],
        "empty_sof_first": [(0xC0, b"")],  # PIL fails on it; the real SOF after it must not hide that
        "short_sof_first": [(0xC2, b"\x08\x00")],
    }
    files += [jpeg_with_segments(folder / f"{name}.jpg", segs) for name, segs in segments.items()]
    plain = jpeg_with_segments(folder / "plain.jpg", [])
    files.append(plain)
    for extra in (1, 2):  # an SOF with a partial component entry: PIL indexes past its end
        data = bytearray(plain.read_bytes())
        sof = data.index(b"\xff\xc0")
        length = int.from_bytes(data[sof + 2 : sof + 4], "big")
        data[sof + 2 : sof + 4] = (length + extra).to_bytes(2, "big")
        data[sof + 2 + length : sof + 2 + length] = bytes(extra)
        files.append(folder / f"sof_plus_{extra}.jpg")
        files[-1].write_bytes(bytes(data))
    return files


def test_the_fast_path_passes_only_what_pil_passes_on_odd_and_crafted_files(tmp_path: Path) -> None:
    files = _crafted(tmp_path)
    decided = _assert_same_verdicts(files)
    assert decided >= 6  # the plain and camera-like JPEGs: no PIL for them
    bomb = next(p for p in files if p.name == "bomb.jpg")
    assert not passes(str(bomb), DEFAULT_MAX_PIXELS) and _pil_reason(bomb)
    small = next(p for p in files if p.name == "good.jpg")
    assert not passes(str(small), 40 * 30 - 1)  # data.max_pixels is the fast path's limit too
    _assert_same_verdicts([small], 40 * 30 - 1)


def test_the_fast_path_agrees_with_pil_on_pillows_test_images(pillow_images: Path) -> None:
    files = sorted(p for p in pillow_images.rglob("*") if p.is_file()) + sorted(_PILLOW_EXTRA.glob("*.tif"))
    assert len(files) > 1000
    assert _assert_same_verdicts(files) >= 40  # of Pillow's 62 JPEGs: MPOs and broken ones ask PIL


def test_every_cut_and_byte_flip_of_a_jpeg_header_gets_pils_verdict(tmp_path: Path) -> None:
    """A JPEG with EXIF, ICC and Photoshop segments, cut and flipped at every header byte, each
    segment shortened and lengthened: the walk's arithmetic (lengths, tables, SOF fields)
    meets every kind of damage."""
    icc = b"ICC_PROFILE\x00\x01\x01" + bytes(30)
    photoshop = b"Photoshop 3.0\x008BIM\x04\x04\x00\x00\x00\x00\x00\x04abcd"
    source = jpeg_with_segments(
        tmp_path / "source.jpg",
        [(0xE0, b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"), (0xE1, exif_block(6)), (0xE2, icc)]
        + [(0xED, photoshop)],
        size=(16, 8),
    )
    data = source.read_bytes()
    scan = data.index(b"\xff\xda") + 14
    variants = [data[:cut] for cut in range(scan)]
    for at in range(2, scan):
        flipped = bytearray(data)
        flipped[at] ^= 0xFF if at % 2 else 0x01
        variants.append(bytes(flipped))
    pos = 2
    while data[pos + 1] != 0xDA:  # each segment 1-3 bytes shorter or longer, its length to match
        end = pos + 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
        body = data[pos + 4 : end]
        for change in (-3, -2, -1, 1, 2, 3):
            new = body[:change] if change < 0 else body + bytes(change)
            variants.append(data[: pos + 2] + (len(new) + 2).to_bytes(2, "big") + new + data[end:])
        pos = end
    paths = []
    for i, content in enumerate(variants):
        paths.append(tmp_path / f"{i}.jpg")
        paths[-1].write_bytes(content)
    assert _assert_same_verdicts(paths) > scan // 4  # flips in pixels and quiet fields pass


def test_a_worker_that_dies_on_a_chunk_has_the_file_that_kills_it_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Halves of the chunk in fresh workers, down to the one file: the rest are still checked."""
    started: list[int] = []

    class Fake:
        def __init__(self, job: str, max_pixels: int) -> None:
            started.append(1)
            self.proc = type("P", (), {"returncode": None})()

        def check(self, paths: list[str]) -> list[str | None]:
            if "kills" in paths:
                raise check_pool.WorkerDied("exit code -11")
            return ["bad" if p == "bad" else None for p in paths]

        def close(self) -> None:
            pass

    monkeypatch.setattr(check_pool, "_Worker", Fake)
    chunk = ["a", "bad", "c", "kills", "e", "f", "g", "h"]
    found = check_pool.check_all(chunk, "decode", 10, 1, chunk=8, bar=tqdm(disable=True))
    assert found == [(1, "bad", "bad"), (3, "kills", "the decoder crashed on it (exit code -11)")]
    assert len(started) <= 1 + 2 * 3  # log2(8) halvings, not one worker per file


def test_the_fast_path_was_written_for_the_current_header_rules() -> None:
    """A new rule bumps HEADER_RULES and turns the walk off (every file to PIL) until the walk
    is checked against the rule: then bump `fast_headers.RULES`."""
    assert fast_headers.RULES == imageio.HEADER_RULES
