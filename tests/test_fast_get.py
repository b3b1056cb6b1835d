"""A loader's GETs through obstore (readers/fastget.py), against a real SeaweedFS: the same
bytes as botocore's, one request each; anything unusual, every GET outside a loader's reader
threads, with STALLFREE_S3_FAST_GET=0, and in a child forked after obstore's first use (its
runtime does not survive a fork: that child would hang) goes to botocore."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from latency_proxy import LatencyProxy

from stallfree.data.readers import fastget, store

BODY = bytes(range(256)) * 40


@pytest.fixture
def bucket(s3_server, monkeypatch: pytest.MonkeyPatch) -> str:
    client = s3_server.client()
    try:
        client.create_bucket(Bucket="fastget")
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    client.put_object(Bucket="fastget", Key="dir/a b+c.bin", Body=BODY)
    monkeypatch.setattr(store, "_clients", {})
    monkeypatch.setattr(fastget, "_pools", [None, False])
    monkeypatch.setattr(fastget, "_enabled", [True])  # as a loader's ReaderPool does
    monkeypatch.setattr(fastget, "_inherited", [False])
    return "s3://fastget/dir/a b+c.bin"


def _no_botocore_get(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []
    original = store._call  # noqa: SLF001

    def counted(url: str, fn: str, **kwargs: Any) -> Any:
        calls.append(fn)
        return original(url, fn, **kwargs)

    monkeypatch.setattr(store, "_call", counted)
    return calls


def test_reads_do_not_take_botocores_call(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _no_botocore_get(monkeypatch)
    assert store.read(bucket) == BODY
    assert store.read(bucket, limit=100) == BODY[:100]
    assert store.read_range(bucket, 300, 1000) == BODY[300:1300]
    assert calls == []


def test_a_missing_object_is_botocores_one_line(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _no_botocore_get(monkeypatch)
    with pytest.raises(store.StoreError, match="no such object"):
        store.read(bucket + ".missing")
    assert calls == ["get_object"]


@pytest.mark.parametrize("env", [{fastget.ENV: "0"}, {"HTTPS_PROXY": "http://127.0.0.1:9"}])
def test_off_where_botocore_has_settings_urllib3_lacks(
    bucket: str, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")  # botocore's own call goes straight to the store
    calls = _no_botocore_get(monkeypatch)
    assert store.read(bucket) == BODY
    assert calls == ["get_object"]


def test_one_request_a_read_through_a_slow_store(
    s3_server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = LatencyProxy(s3_server.endpoint, delay_ms=5).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.delenv(store.ENDPOINT_ENV, raising=False)
        for _ in range(5):
            assert store.read(bucket) == BODY
    finally:
        proxy.stop()
    assert proxy.requests == 5


def test_outside_a_loader_reads_go_through_botocore(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fastget, "_enabled", [False])
    calls = _no_botocore_get(monkeypatch)
    assert store.read(bucket) == BODY
    assert calls == ["get_object"]


# Run in a fresh interpreter: obstore's runtime, once started in a process (by any test before),
# stays started, so the "before any use" case needs a process of its own.
_FORKS = """
import multiprocessing, sys
from stallfree.data.readers import fastget, store
url, size = sys.argv[1], int(sys.argv[2])

def child(queue):
    calls = []
    original = store._call
    def counted(u, fn, **kwargs):
        calls.append(fn)
        return original(u, fn, **kwargs)
    store._call = counted
    fastget.enable()  # as a DataLoader worker's ReaderPool does
    queue.put((len(store.read(url)) == size, calls))

def forked():
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    process = context.Process(target=child, args=(queue,))
    process.start()
    process.join(60)
    if process.exitcode is None:
        process.kill()
        return "hung"
    return queue.get(timeout=10)

before = forked()
fastget.enable()
assert len(store.read(url)) == size  # the parent starts obstore's runtime
print(before, forked())
"""


def test_a_child_forked_after_obstore_was_used_reads_through_botocore(bucket: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FORKS, bucket, str(len(BODY))], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Nothing used yet: obstore in the child; after the parent's first use, botocore (before
    # this change: the child hung on its read).
    assert done.stdout.split("\n")[-2] == "(True, []) (True, ['get_object'])"
