"""`stallfree compare`: runs side by side, each with where its data came from, and every
numeric column in one format."""

from __future__ import annotations

import json
import re
from pathlib import Path

from inprocess import Cli


def _run(path: Path, summary: dict[str, object], data: str, backend: str = "torch", loader: str = "") -> Path:
    path.mkdir()
    (path / "summary.json").write_text(json.dumps({"backend": backend, **summary}))
    (path / "recipe.toml").write_text(
        f"[data]\n{data}\n\n[loader]\nbackend = {json.dumps(backend)}\n{loader}"
    )
    return path


def test_compare_names_the_data_source_and_formats_columns_alike(tmp_path: Path, cli: Cli) -> None:
    runs = [
        _run(
            tmp_path / "store",
            {"images_per_s": 5.008, "data_wait_frac": 0.5, "val_top1": 0.25, "wall_s": 5.008},
            'root = "s3://bucket/demo"',
        ),
        _run(
            tmp_path / "local",
            {"images_per_s": 1234.56, "data_wait_frac": 0.01, "val_top1": 1.0, "wall_s": 17.8},
            'root = "data/shards"\nformat = "tar"',
        ),
        _run(tmp_path / "synth", {"images_per_s": 17.8, "wall_s": 123.0}, 'root = ""', "synthetic"),
    ]
    done = cli("compare", *runs)
    assert done.code == 0
    lines = done.out.splitlines()
    header, rows = lines[0], lines[2:]
    assert "data" in header.split()
    assert "s3 folders" in rows[0] and "local tar" in rows[1] and "synthetic" in rows[2]
    # Each numeric column: one number of decimals down the column (or "-" where unknown).
    cells = [re.findall(r"-?\d+\.(\d+)|(?<!\S)-(?!\S)", row) for row in rows]
    for column in zip(*cells, strict=True):
        assert len({len(c) for c in column if c}) == 1, rows


def test_compare_says_whether_the_torch_loader_decoded_in_full(tmp_path: Path, cli: Cli) -> None:
    """The strict comparison (`loader.torch.exact_decode`) per run: on or off for a torch run (off
    for a recipe written before the key), n/a for DALI, which decodes in full either way."""
    figures = {"images_per_s": 100.0}
    runs = [
        _run(tmp_path / "strict", figures, 'root = "d"', loader="\n[loader.torch]\nexact_decode = true\n"),
        _run(tmp_path / "scaled", figures, 'root = "d"'),
        _run(tmp_path / "dali", figures, 'root = "d"', "dali"),
    ]
    done = cli("compare", *runs)
    assert done.code == 0
    lines = done.out.splitlines()
    column = lines[0].split().index("strict")
    assert [row.split()[column] for row in lines[2:]] == ["on", "off", "n/a"]
