"""store.read's GETs through a presigned URL and urllib3 (readers/fastget.py, opt-in), against a
real SeaweedFS: the same bytes as botocore's, one request each; anything unusual, and every
GET unless STALLFREE_S3_FAST_GET=1, goes to botocore."""

from __future__ import annotations

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
    monkeypatch.setenv(fastget.ENV, "1")
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
