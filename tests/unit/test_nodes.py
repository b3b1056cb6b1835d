"""Two nodes of one run (`torchrun --nnodes 2`, one rank each, each with its own cache and its
own copy of the data): they refuse to start, every rank exiting, when one node lists a file
the other does not; copies at other paths agree; and two nodes in their own network namespaces
(a rendezvous that is not loopback) train together."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import small_recipe

from stallfree.data.readers.factory import resolve_dataset
from stallfree.data.readers.remote import cached_note
from stallfree.train.listing_check import _mismatch, identity
from stallfree.train.resume import data_record


def _copy_root(src: Path, dst: Path, extra: bool = False) -> Path:
    """A node's own copy of the demo data (hard links); `extra`: one train image more."""
    for path in src.rglob("*.jpg"):
        target = dst / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(path, target)
    if extra:
        first = sorted((dst / "train").glob("*/*.jpg"))[0]
        os.link(first, first.with_name("added-meanwhile.jpg"))
    return dst


def test_copies_at_other_paths_agree_and_one_file_more_does_not(image_root: Path, tmp_path: Path) -> None:
    def ident(root: Path) -> dict[str, tuple[int, str]]:
        dataset = resolve_dataset(small_recipe(root).data)
        return identity(dataset, data_record(dataset))

    same = ident(_copy_root(image_root, tmp_path / "a"))
    assert same == ident(image_root) and set(same) == {"train", "val"}
    assert same["train"][0] == 60
    more = ident(_copy_root(image_root, tmp_path / "b", extra=True))
    assert more["train"][0] == 61 and more["val"] == same["val"]


def test_a_mismatch_names_the_split_both_counts_and_the_fix() -> None:
    ours = {"train": (60, "a"), "val": (30, "b")}
    line = _mismatch(
        (ours, "hostA node 0", ""), ({"train": (60, "c"), "val": (30, "b")}, "hostB node 1", ""), 1, 1
    )
    assert "train split" in line and "hostA node 0) lists 60" in line and "hostB node 1) 60" in line
    assert "other files or labels" in line and "data.file_list" in line and "\n" not in line
    line = _mismatch((ours, "a", ""), ({"train": (60, "a"), "val": (29, "d")}, "b", ""), 3, 2)
    assert "val split" in line and "rank 3 (b) 29" in line and "1 more rank(s)" in line


CACHED = cached_note(0.0, Path("/c/listing-1.json.z"))  # as a resume's list_root names it


@pytest.mark.parametrize("cached_rank", [0, 1])
def test_a_mismatch_after_a_cached_listing_names_it_as_the_cause_and_its_fix(cached_rank: int) -> None:
    """A resume's node on its cached listing, the other listing afresh: the line names that
    node, the listing's time and file and how to list again, not a store that moved."""
    facts = [({"train": (92, "a")}, "hostA node 0", ""), ({"train": (91, "b")}, "hostB node 1", "")]
    facts[cached_rank] = (*facts[cached_rank][:2], CACHED)
    line = _mismatch(facts[0], facts[1], 1, 1)
    node = facts[cached_rank][1]
    assert f"({node}) resumed on {CACHED}" in line and "likely cause" in line and "1970" in line, line
    assert "STALLFREE_RELIST=1" in line and "remove" in line and "\n" not in line
    assert "add or remove no objects" not in line
