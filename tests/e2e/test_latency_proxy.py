"""The latency proxy (tests/latency_proxy.py) in front of a real SeaweedFS server: each request
waits the delay, and a run from s3:// through it trains the weights of a run from a local copy."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from helpers import small_recipe
from latency_proxy import LatencyProxy
from s3_server import upload_tree

from stallfree.data import storage
from stallfree.train.checkpoint import load_checkpoint
from stallfree.train.run import train

BACKENDS = ["torch", pytest.param("dali", marks=pytest.mark.dali)]


@pytest.fixture
def proxy(s3_server):
    """A proxy at 50 ms in front of the session's server, in this process's thread."""
    proxy = LatencyProxy(s3_server.endpoint, delay_ms=50).start()
    yield proxy
    proxy.stop()


@pytest.fixture
def through(proxy: LatencyProxy, monkeypatch: pytest.MonkeyPatch) -> LatencyProxy:
    """stallfree's reads (this process and its workers) go through the proxy."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.delenv(storage.ENDPOINT_ENV, raising=False)
    return proxy


def test_each_get_through_the_proxy_waits_the_delay(s3_server, proxy: LatencyProxy) -> None:
    direct = s3_server.client()
    direct.create_bucket(Bucket="proxied")
    direct.put_object(Bucket="proxied", Key="a", Body=b"x" * 1000)
    via = _client(s3_server, proxy.endpoint)
    for _ in range(3):  # the first on a new connection, then on the kept-alive one
        started = time.perf_counter()
        body = via.get_object(Bucket="proxied", Key="a")["Body"].read()
        assert time.perf_counter() - started >= 0.050
        assert body == b"x" * 1000
    assert proxy.requests >= 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_through_the_proxy_trains_the_local_weights(
    s3_server, through: LatencyProxy, image_root: Path, tmp_path: Path, backend: str
) -> None:
    url = upload_tree(s3_server.client(), image_root, "proxied", "demo")
    through.delay = 0.020  # a store's latency still; its size is measured by the test above

    def recipe(root: str | Path):
        return small_recipe(
            root,
            loader={"backend": backend, "torch": {"workers": 1}, "dali": {"threads": 1}},
            train={"epochs": 1, "batch_size": 12},
            optim={"name": "sgd", "lr": 0.05},
        )

    train(recipe(image_root), tmp_path / "local", progress=False)
    before = through.requests
    train(recipe(url), tmp_path / "s3", progress=False)
    assert through.requests - before >= 60  # the listing and every train and val image
    mine, theirs = _weights(tmp_path / "local"), _weights(tmp_path / "s3")
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name


def _client(s3_server, endpoint: str):
    """The tests' client, pointed at `endpoint`."""
    import boto3
    from botocore.config import Config
    from s3_server import KEY_ID, SECRET

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=SECRET,
        region_name="us-east-1",
        config=Config(retries={"max_attempts": 1}),
    )


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1])["model"]
