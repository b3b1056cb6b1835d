"""Training from an object store (a real S3-compatible server on loopback): the same run as
from a local copy of the same objects, bitwise, on both loaders; errors at start in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import final_weights, small_recipe
from s3_server import KEY_ID, SECRET, upload_tree

from stallfree.cli import main
from stallfree.recipe import dump_toml
from stallfree.train.run import train

BACKENDS = ["torch", pytest.param("dali", marks=pytest.mark.dali)]


@pytest.fixture(scope="module")
def packed(image_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("packed")
    assert main(["data", "pack", str(image_root), str(out), "--shard-size", "200KB", "--no-progress"]) == 0
    return out


@pytest.fixture(scope="module")
def remote(s3_server, image_root: Path, packed: Path) -> dict[str, str]:
    client = s3_server.client()
    return {
        "folder": upload_tree(client, image_root, "roots", "imagenet-tiny"),
        "tar": upload_tree(client, packed, "roots", "shards"),
    }


def _recipe(root: str | Path, fmt: str, backend: str):
    return small_recipe(
        root,
        data={"format": fmt},
        loader={"backend": backend, "torch": {"workers": 1}},
        train={"epochs": 1, "batch_size": 12},
        optim={"name": "sgd", "lr": 0.05},
    )


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["folder", "tar"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_from_the_store_is_the_run_from_a_local_copy(
    remote: dict[str, str], image_root: Path, packed: Path, tmp_path: Path, fmt: str, backend: str, s3_server
) -> None:
    local = image_root if fmt == "folder" else packed
    train(_recipe(local, fmt, backend), tmp_path / "local", progress=False)
    recipe_path = tmp_path / "s3.toml"
    recipe_path.write_text(dump_toml(_recipe(remote[fmt], fmt, backend)))
    assert main(["train", str(recipe_path), "--out", str(tmp_path / "s3"), "--no-progress"]) == 0
    mine, theirs = final_weights(tmp_path / "local"), final_weights(tmp_path / "s3")
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name
    # recipe.toml names the store the run read (its endpoint), never a credential.
    assert f'endpoint_url = "{s3_server.endpoint}"' in (tmp_path / "s3" / "recipe.toml").read_text()
    # Credentials come from the environment's standard chain and go nowhere else.
    for path in (tmp_path / "s3").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert SECRET.encode() not in data and KEY_ID.encode() not in data, path


@pytest.mark.parametrize(
    ("root", "expected"),
    [
        ("s3://no-such-bucket/data", "s3://no-such-bucket/data/train: no such bucket 'no-such-bucket'"),
        ("s3://roots/missing", "s3://roots/missing/train: no objects under this prefix"),
    ],
)
def test_a_wrong_root_is_one_line_before_anything_is_written(
    remote: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str], root: str, expected: str
) -> None:
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text(dump_toml(_recipe(root, "folder", "torch")))
    assert main(["train", str(recipe_path), "--out", str(tmp_path / "run"), "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_wrong_credentials_are_one_line(
    remote: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text(dump_toml(_recipe(remote["folder"], "folder", "torch")))
    assert main(["train", str(recipe_path), "--out", str(tmp_path / "run"), "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert f"{remote['folder']}/train: " in err and "(wrong credentials" in err and "Traceback" not in err, (
        err
    )
    assert "not-the-secret" not in err
    assert not (tmp_path / "run").exists()
