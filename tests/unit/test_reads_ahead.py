"""Reads ahead: DALI's source starts reading the next epoch's first batches
before this epoch ends, uses them when that epoch comes, and drops them when another one does;
a torch worker starts its next batch's reads behind its current one's. Each file is read once."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers import build_loader, small_recipe
from test_reads_in_flight import RAW_PIXELS, SlowReads

from stallfree.parallel import DistInfo

CPU = torch.device("cpu")
BATCH = 12  # 60 train images: 5 batches an epoch


def _loader(image_root: Path, backend: str = "dali"):
    keys = {
        "backend": backend,
        "io_depth": 16,
        "prefetch": 2,
        "dali": {"threads": 1},
        "torch": {"workers": 0},
    }
    recipe = small_recipe(image_root, augment=RAW_PIXELS, train={"batch_size": BATCH}, loader=keys)
    return build_loader(recipe, "train", device=CPU, dist=DistInfo())


def _labels(loader, epoch: int) -> list[torch.Tensor]:
    loader.set_epoch(epoch)
    return [batch.labels.clone() for batch in loader]


@pytest.mark.dali
def test_the_next_epochs_first_batches_are_read_before_it_starts(
    image_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _loader(image_root).close()  # the start-up check's verdicts are cached: the next one reads none
    slow = SlowReads(0.01).install(monkeypatch)
    loader = _loader(image_root)
    try:
        first = _labels(loader, 0)
        time.sleep(0.5)  # the reads submitted ahead end
        read_in_epoch_0 = len(slow.paths)
        second = _labels(loader, 1)
        time.sleep(0.5)  # epoch 2's reads ahead end too
    finally:
        loader.close()
    per_epoch = len(first) * BATCH
    assert read_in_epoch_0 >= per_epoch + BATCH, "nothing of epoch 1 was read during epoch 0"
    # Epoch 1 read what epoch 0 had not read of it, and as much of epoch 2's start.
    assert len(slow.paths) - read_in_epoch_0 == per_epoch, "a read ahead was lost, or a file read twice"
    assert len(second) == len(first)


@pytest.mark.dali
def test_reads_ahead_for_an_epoch_that_does_not_come_are_dropped(
    image_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh = _loader(image_root)
    try:
        expected = _labels(fresh, 3)
    finally:
        fresh.close()
    loader = _loader(image_root)
    try:
        _labels(loader, 0)  # reads epoch 1's first batches ahead
        got = _labels(loader, 3)
    finally:
        loader.close()
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected):
        assert torch.equal(mine, theirs)


def test_a_torch_worker_reads_its_next_batch_behind_this_one(
    image_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loader = _loader(image_root, "torch")
    slow = SlowReads(0.01).install(monkeypatch)  # after the start-up check's reads
    try:
        batches = iter(loader)
        first = next(batches)
        time.sleep(0.5)
        read_with_the_first = len(slow.paths)
        rest = list(batches)
    finally:
        loader.close()
    assert read_with_the_first == 2 * BATCH, "the next batch's reads did not start early"
    assert len(slow.paths) == len(set(slow.paths)) == (1 + len(rest)) * BATCH
    assert len(first.labels) == BATCH


@pytest.mark.dali
def test_dalis_first_reads_start_with_the_loader(image_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _loader(image_root).close()  # the start-up check's verdicts are cached: the next one reads none
    slow = SlowReads(0.01).install(monkeypatch)
    loader = _loader(image_root)
    try:
        time.sleep(0.5)
        read_before_asked = len(slow.paths)
        batches = _labels(loader, 0)
    finally:
        loader.close()
    assert read_before_asked == 3 * BATCH  # loader.prefetch + 1 batches
    per_epoch = len(batches) * BATCH
    assert per_epoch <= len(slow.paths) <= per_epoch + 3 * BATCH, "a file was read twice"
