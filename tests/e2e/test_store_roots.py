"""Training from every object store, on a real server on loopback reached by the store's
standard variables alone (SeaweedFS for s3://, fake-gcs-server for gs://, Azurite for az://):
the same run as from a local copy, bitwise, on both loaders, from folders and from stallfree's
shards, with no credential in the run's files; a wrong root, missing or wrong credentials and
a dead endpoint are one line at start naming the URL, before anything is written."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import CLIENT_WORDS, final_weights, small_recipe
from s3_server import KEY_ID, SECRET

from stallfree.cli import main
from stallfree.data import storage
from stallfree.data.storage.clouds import AZURITE_KEY
from stallfree.recipe import dump_toml
from stallfree.train.run import train

BACKENDS = ["torch", pytest.param("dali", marks=pytest.mark.dali)]
SERVERS = {"s3": "s3_server", "gs": "gcs_server", "az": "azure_server"}
# What must never reach a run's files: each store's credentials (Azurite's key is public, but
# it stands for a real one here). The GCS emulator takes no credentials.
SECRETS = {"s3": [KEY_ID.encode(), SECRET.encode()], "gs": [], "az": [AZURITE_KEY.encode()]}


@pytest.fixture(scope="module")
def packed(image_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("packed")
    assert main(["data", "pack", str(image_root), str(out), "--shard-size", "200KB", "--no-progress"]) == 0
    return out


@pytest.fixture(scope="module", params=list(SERVERS))
def remote(request: pytest.FixtureRequest, image_root: Path, packed: Path) -> dict[str, Any]:
    """One store's server with the folder tree and the shards uploaded to its bucket `roots`."""
    server = request.getfixturevalue(SERVERS[request.param])
    return {
        "scheme": request.param,
        "server": server,
        "folder": server.upload_tree(image_root, "roots", "imagenet-tiny"),
        "tar": server.upload_tree(packed, "roots", "shards"),
    }


def _recipe(root: str | Path, fmt: str, backend: str) -> Any:
    return small_recipe(
        root,
        data={"format": fmt},
        loader={"backend": backend, "torch": {"workers": 1}},
        train={"epochs": 1, "batch_size": 12},
        optim={"name": "sgd", "lr": 0.05},
    )


@pytest.fixture(scope="module")
def local_weights(
    image_root: Path, packed: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], dict[str, torch.Tensor]]:
    """The final weights of the local run, made once per (format, backend) for every store."""
    cache: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

    def weights(fmt: str, backend: str) -> dict[str, torch.Tensor]:
        if (fmt, backend) not in cache:
            out = tmp_path_factory.mktemp(f"local-{fmt}-{backend}")
            train(_recipe(image_root if fmt == "folder" else packed, fmt, backend), out, progress=False)
            cache[fmt, backend] = final_weights(out)
        return cache[fmt, backend]

    return weights


def _train_cli(root: str, tmp_path: Path, fmt: str = "folder", backend: str = "torch", *more: str) -> int:
    recipe_path = tmp_path / "r.toml"
    recipe_path.write_text(dump_toml(_recipe(root, fmt, backend)))
    return main(["train", str(recipe_path), "--out", str(tmp_path / "run"), "--no-progress", *more])


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["folder", "tar"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_from_the_store_is_the_run_from_a_local_copy(
    remote: dict[str, Any], local_weights: Any, tmp_path: Path, fmt: str, backend: str
) -> None:
    assert _train_cli(remote[fmt], tmp_path, fmt, backend) == 0
    mine, theirs = local_weights(fmt, backend), final_weights(tmp_path / "run")
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name
    if remote["scheme"] == "s3":  # resolved.toml names the store the run read, never a credential
        endpoint = remote["server"].endpoint
        assert f'endpoint_url = "{endpoint}"' in (tmp_path / "run" / "resolved.toml").read_text()
    # Credentials come from the environment's standard variables and go nowhere else.
    for path in (tmp_path / "run").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(secret in data for secret in SECRETS[remote["scheme"]]), path


def _refused_at_start(root: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str) -> str:
    """Train from `root`: it fails in one line naming `url`, with no traceback and no run
    directory written. Its stderr."""
    assert _train_cli(root, tmp_path) != 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if url in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert not CLIENT_WORDS.search(err), err  # our words; the store client's go to --verbose
    assert not (tmp_path / "run").exists()
    return err


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("where", "expected"),
    [
        ("no-such-bucket/data", r"no such {bucket} 'no-such-bucket'"),
        ("roots/missing", "no objects under this prefix"),
    ],
)
def test_a_wrong_root_is_one_line_before_anything_is_written(
    remote: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, expected: str
) -> None:
    root = f"{remote['scheme']}://{where}"
    err = _refused_at_start(root, tmp_path, capsys, f"{root}/train")
    bucket = "container" if remote["scheme"] == "az" else "bucket"  # each store's own word
    assert re.search(expected.format(bucket=bucket), err), err


@pytest.mark.e2e
def test_missing_credentials_are_one_line_naming_the_url(
    remote: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in remote["server"].env():
        monkeypatch.delenv(name)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))  # no gcloud login either
    for name in ("AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):  # nor ~/.aws
        monkeypatch.setenv(name, str(tmp_path / "aws"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # nor an instance role
    root = f"{remote['scheme']}://nocreds/data"  # a bucket no earlier test made a client for
    err = _refused_at_start(root, tmp_path, capsys, f"{remote['scheme']}://nocreds")
    assert re.search(r"no (credentials found|Google credentials|Azure storage account)", err), err


@pytest.mark.e2e
@pytest.mark.parametrize("remote", ["s3", "az"], indirect=True)  # fake-gcs-server checks none
def test_wrong_credentials_are_one_line_naming_the_url(
    remote: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wrong = "bm90LXRoZS1rZXk="  # base64, as an Azure key is: "not-the-key"
    for name, value in remote["server"].env().items():
        if name == "AWS_SECRET_ACCESS_KEY":
            monkeypatch.setenv(name, wrong)
        elif name == "AZURE_STORAGE_CONNECTION_STRING":
            monkeypatch.setenv(name, value.replace(AZURITE_KEY, wrong))
    err = _refused_at_start(remote["folder"], tmp_path, capsys, remote["folder"])
    assert re.search(r"wrong credentials|refused the credentials", err), err
    assert wrong not in err


@pytest.mark.e2e
def test_a_dead_endpoint_is_one_line_naming_the_url(
    remote: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, dead = remote["server"], "127.0.0.1:9"  # the discard port: nothing listens
    monkeypatch.setenv(storage.ATTEMPTS_ENV, "2")  # the line is the subject, not the backoff
    for name, value in server.env().items():
        monkeypatch.setenv(name, value.replace(server.endpoint.split("/")[2], dead))
    root = f"{remote['scheme']}://deadend/data"
    err = _refused_at_start(root, tmp_path, capsys, root)
    assert f"did not answer at http://{dead}" in err, err  # the endpoint it asked, and its setting
    setting = {"s3": "AWS_ENDPOINT_URL", "gs": "STORAGE_EMULATOR_HOST", "az": "BlobEndpoint"}
    assert setting[remote["scheme"]] in err, err
    # --verbose adds the store client's own words, whole.
    assert _train_cli(root, tmp_path, "folder", "torch", "--verbose") != 0
    assert "error sending request" in capsys.readouterr().err
