"""Listing an s3:// ImageFolder once: a new run lists every object (and sees any change), a
resume reuses the node's cached listing after listing the class prefixes alone, one rank a node
lists, and a file list lists nothing. Listing requests are counted against a real SeaweedFS
server (a counting wrapper around the storage layer's one request function)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers import PYTHON

from stallfree.data import storage
from stallfree.data.readers import remote
from stallfree.data.readers.factory import resolve_dataset
from stallfree.data.storage import dispatch, split_url
from stallfree.recipe import DataConfig

BUCKET = "listing"
CLASSES = ("a", "b", "c")
FULL = 2 + 2 * len(CLASSES)  # the class prefixes of train/ and val/, then each class prefix of both

COUNTING = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
from stallfree.data.storage import dispatch
from stallfree.data.readers.factory import resolve_dataset
from stallfree.recipe import DataConfig
calls = []
real = dispatch.run
def counting(op, where, *args):
    if op == "list":
        calls.append("/" if args[1] else "")
    return real(op, where, *args)
dispatch.run = counting
d = resolve_dataset(DataConfig(root=sys.argv[1]))
print(json.dumps({"calls": calls, "files": d.splits["train"].files, "sources": d.sources}))
"""


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each listing request the storage layer makes ("/": a delimiter listing, class prefixes)."""
    made: list[str] = []
    real = dispatch.run  # a count of the real requests, not a stand-in for them

    def counting(op: str, where: Any, *args: Any) -> Any:
        if op == "list":
            made.append("/" if args[1] else "")
        return real(op, where, *args)

    monkeypatch.setattr(dispatch, "run", counting)
    return made


@pytest.fixture(scope="module")
def client(s3_server) -> Any:
    """The tests' own client (a boto3 client takes a while to make), with the bucket made."""
    made = s3_server.client()
    try:
        made.create_bucket(Bucket=BUCKET)
    except made.exceptions.BucketAlreadyOwnedByYou:
        pass
    return made


@pytest.fixture
def root(client: Any, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh prefix per test: 3 classes, 4 train objects each (one in a sub-folder), 1 val."""
    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))
    prefix = request.node.name
    for name in CLASSES:
        for key in (
            f"train/{name}/0.jpg",
            f"train/{name}/1.jpg",
            f"train/{name}/2.jpg",
            f"train/{name}/s/3.jpg",
        ):
            client.put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=b"")
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/val/{name}/0.jpg", Body=b"")
    return f"s3://{BUCKET}/{prefix}"


def _put(client: Any, root: str, rel: str) -> None:
    client.put_object(Bucket=BUCKET, Key=f"{split_url(root)[2]}/{rel}", Body=b"")


def test_a_resume_lists_the_class_prefixes_alone(root: str, calls: list[str]) -> None:
    first = resolve_dataset(DataConfig(root=root))
    assert len(calls) == FULL and calls.count("/") == 2
    calls.clear()
    again = resolve_dataset(DataConfig(root=root), reuse_listing=True)
    assert calls == ["/", "/"]  # train/'s and val/'s class prefixes: one page each
    assert again.classes == first.classes == CLASSES and again.sources == first.sources
    for split in ("train", "val"):
        assert again.splits[split].digest() == first.splits[split].digest()
    assert first.splits["train"].files[:4] == [
        f"{root}/train/a/{n}" for n in ("0.jpg", "1.jpg", "2.jpg", "s/3.jpg")
    ]


def test_a_new_run_sees_a_key_added_or_removed_a_resume_keeps_its_listing(
    client: Any, root: str, calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = resolve_dataset(DataConfig(root=root))
    _put(client, root, "train/a/9.jpg")
    client.delete_object(Bucket=BUCKET, Key=f"{split_url(root)[2]}/train/b/1.jpg")
    # A resume continues on the samples its checkpoint positions count: the listing it began with.
    resumed = resolve_dataset(DataConfig(root=root), reuse_listing=True)
    assert resumed.splits["train"].files == first.splits["train"].files
    # And names it (the resume's check says it), with the file to remove and the way to list again.
    assert (
        "cached listing made at" in resumed.cached_listing and "STALLFREE_RELIST=1" in resumed.cached_listing
    )
    assert not first.cached_listing
    monkeypatch.setenv("STALLFREE_RELIST", "1")
    calls.clear()
    relisted = resolve_dataset(DataConfig(root=root), reuse_listing=True)
    assert len(calls) == FULL and not relisted.cached_listing
    monkeypatch.delenv("STALLFREE_RELIST")
    calls.clear()
    fresh = resolve_dataset(DataConfig(root=root))
    assert len(calls) == FULL
    files = fresh.splits["train"].files
    assert f"{root}/train/a/9.jpg" in files and f"{root}/train/b/1.jpg" not in files
    assert fresh.sources != first.sources  # the header check's cache key moves with the keys
    # The new run's listing is the node's entry now: its own resume reuses it.
    calls.clear()
    assert resolve_dataset(DataConfig(root=root), reuse_listing=True).splits["train"].files == files
    assert calls == ["/", "/"]


def test_a_class_prefix_added_is_listed_again_on_a_resume(client: Any, root: str, calls: list[str]) -> None:
    resolve_dataset(DataConfig(root=root))
    _put(client, root, "train/d/0.jpg")
    calls.clear()
    with pytest.warns(UserWarning, match="no folder or no images for 1 training class"):
        grown = resolve_dataset(DataConfig(root=root), reuse_listing=True)
    assert grown.classes == (*CLASSES, "d") and len(calls) == 2 + 2 * 4
    # (A class removed is the same comparison; SeaweedFS keeps an emptied prefix as a folder.)


def test_a_damaged_entry_is_named_and_listed_again(root: str, calls: list[str]) -> None:
    first = resolve_dataset(DataConfig(root=root))
    remote.cache_path(storage.locate(root)).write_bytes(b"not a listing")
    calls.clear()
    with pytest.warns(UserWarning, match="listing cache .* is damaged"):
        again = resolve_dataset(DataConfig(root=root), reuse_listing=True)
    assert len(calls) == FULL and again.sources == first.sources


def test_a_file_list_lists_nothing(root: str, calls: list[str], tmp_path: Path) -> None:
    listed = resolve_dataset(DataConfig(root=root))
    lines = [path[len(root) + 1 :] for split in ("train", "val") for path in listed.splits[split].files]
    file_list = tmp_path / "list.txt"
    file_list.write_text("\n".join(lines) + "\n")
    calls.clear()
    from_list = resolve_dataset(DataConfig(root=root, file_list=str(file_list)))
    assert calls == []
    assert from_list.classes == listed.classes
    for split in ("train", "val"):
        assert from_list.splits[split].files == listed.splits[split].files


def _rank(root: str, rank: int, cache: Path) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "STALLFREE_CACHE": str(cache),
        "WORLD_SIZE": "2",
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": "2",
    }
    return subprocess.Popen([PYTHON, "-c", COUNTING, root], env=env, stdout=subprocess.PIPE, text=True)


def test_one_rank_a_node_lists_the_others_read_its_entry(client: Any, root: str, tmp_path: Path) -> None:
    # An earlier launch's entry is there; the store has changed since.
    resolve_dataset(DataConfig(root=root))
    _put(client, root, "train/b/9.jpg")
    other = _rank(root, 1, tmp_path / "cache")  # first: it must wait for this launch's rank 0
    lister = _rank(root, 0, tmp_path / "cache")
    out = [json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1]) for p in (lister, other)]
    assert len(out[0]["calls"]) == FULL
    assert out[1]["calls"] == ["/", "/"]  # the class prefixes; the objects come from rank 0's entry
    assert out[1]["files"] == out[0]["files"] and f"{root}/train/b/9.jpg" in out[1]["files"]
    assert out[1]["sources"] == out[0]["sources"]


@pytest.mark.slow  # two short training runs from the store
def test_a_requeued_run_lists_the_class_prefixes_alone(
    client: Any, image_root: Path, tmp_path: Path, calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from helpers import small_recipe
    from s3_server import upload_tree

    from stallfree.train.run import train

    monkeypatch.setenv("STALLFREE_CACHE", str(tmp_path / "cache"))
    root = upload_tree(client, image_root, BUCKET, "requeued")
    recipe = small_recipe(root, train={"batch_size": 12, "ckpt_every_steps": 2})
    full = tmp_path / "full"
    train(recipe, full, progress=False)
    run = tmp_path / "requeued"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "checkpoints" / "ckpt-000000002.pt", run / "checkpoints")
    calls.clear()
    assert train(recipe, run, progress=False, resume="auto")["optimizer_steps"] == 5
    assert calls == ["/", "/"]
