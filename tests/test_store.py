"""The object-store layer against a real S3-compatible server (SeaweedFS on loopback)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stallfree.data.readers import store
from stallfree.data.readers.headers import read_bytes


@pytest.fixture(scope="module")
def bucket(s3_server) -> str:
    client = s3_server.client()
    client.create_bucket(Bucket="unit")
    for i in range(1100):  # over one 1000-key page
        client.put_object(Bucket="unit", Key=f"many/c{i % 3}/k{i:05d}", Body=b"")
    client.put_object(Bucket="unit", Key="one/blob.bin", Body=bytes(range(256)) * 4)
    return "s3://unit"


def test_reads_ranges_and_member_references(bucket: str) -> None:
    url = f"{bucket}/one/blob.bin"
    data = bytes(range(256)) * 4
    assert store.read(url) == data
    assert store.read_range(url, 300, 10) == data[300:310]
    assert read_bytes(url) == data
    assert read_bytes(url, 5) == data[:5]
    assert read_bytes(f"{url}::m.jpg:512:20") == data[512:532]
    assert read_bytes(f"{url}::m.jpg:512:20", 4) == data[512:516]
    assert store.size(url) == 1024


def test_lists_every_page_and_every_class_prefix(bucket: str) -> None:
    assert store.list_dirs(f"{bucket}/many") == ["c0", "c1", "c2"]
    listed = store.list_many([f"{bucket}/many/c{i}" for i in range(3)])
    names = [name for names, _ in listed for name, _ in names]
    assert len(names) == 1100 and len(set(names)) == 1100
    assert all(size == 0 for names, _ in listed for _, size in names)


def test_errors_name_the_url_and_reason(bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(store.StoreError, match=r"s3://unit/one/nothing: no such object"):
        store.read(f"{bucket}/one/nothing")
    with pytest.raises(store.StoreError, match=r"s3://no-such-bucket/x: no such bucket"):
        store.check_readable("s3://no-such-bucket/x")
    with pytest.raises(store.StoreError, match=r"s3://unit/empty: no objects under"):
        store.check_readable(f"{bucket}/empty")
    store.check_readable(f"{bucket}/many")


def test_bad_endpoint_is_one_line_after_the_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    # Its own key pair: without one (no session server started in this worker yet) botocore
    # stops at "no credentials" before it tries the endpoint.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv(store.ATTEMPTS_ENV, "2")
    monkeypatch.setattr(store, "_clients", {})
    with pytest.raises(store.StoreError, match=r"^s3://unit/x: Could not connect to the endpoint"):
        store.check_readable("s3://unit/x")


def test_an_endpoint_without_a_scheme_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """botocore's ValueError ("Invalid endpoint: 127.0.0.1:18333") reached a new user as a
    traceback: it is a StoreError naming the endpoint and the fix."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "127.0.0.1:18333")
    monkeypatch.setattr(store, "_clients", {})
    with pytest.raises(store.StoreError) as err:
        store.check_readable("s3://unit/x")
    assert "127.0.0.1:18333" in str(err.value) and "http://127.0.0.1:18333" in str(err.value), err.value


def test_data_check_on_a_dead_endpoint_ends_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`data check` waited the whole outage budget (120 s) on an endpoint nothing listens on,
    then exited 75 naming a manifest.json the user never asked about; train's start check
    says it in a second."""
    import time

    from stallfree.data.tools.check import check_dataset

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv(store.ATTEMPTS_ENV, "2")
    monkeypatch.setenv(store.OUTAGE_ENV, "40")  # what it waited before: past the test's bound
    monkeypatch.setattr(store, "_clients", {})
    started = time.monotonic()
    with pytest.raises(store.StoreError) as err:
        check_dataset("s3://unit/data", progress=False)
    assert not isinstance(err.value, store.StoreUnavailableError)  # not "try again later": exit 2
    assert str(err.value).startswith("s3://unit/data") and "manifest" not in str(err.value), err.value
    assert time.monotonic() - started < 30


def test_one_client_per_process(bucket: str) -> None:
    """A forked child makes its own client (sockets never cross a fork)."""
    parent = store.client()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: read through its own client
        ok = store.client() is not parent and store.read(f"{bucket}/one/blob.bin")[:2] == b"\0\1"
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"
    assert store.client() is parent


def test_is_remote() -> None:
    assert store.is_remote("s3://b/p") and not store.is_remote("/data/s3://x")
    assert not store.is_remote(Path("s3:/b"))


@pytest.mark.parametrize("read", [lambda url: store.read(url), lambda url: store.read_range(url, 0, 10)])
def test_a_get_that_failed_for_good_is_not_made_again(monkeypatch: pytest.MonkeyPatch, read) -> None:
    """A GET's failure comes after botocore's retries and the outage budget: asking again
    would multiply the wait before a run that cannot go on stops (read_range once asked 3x)."""
    calls: list[str] = []

    def down(url: str, fn: str, **kwargs: object) -> dict:
        calls.append(fn)
        raise store.StoreUnavailableError(f"{url}: the store is down (still after 120 s)")

    monkeypatch.setattr(store, "_call", down)
    monkeypatch.setattr(store.fastget, "_enabled", [False])
    with pytest.raises(store.StoreUnavailableError):
        read("s3://bucket/key")
    assert calls == ["get_object"]


def test_an_object_gone_since_the_listing_says_so(bucket: str) -> None:
    """A GET of a listed object that is gone (deleted between a stop and its resume, whose
    listing is cached) told a new user to check the URL, the endpoint and the credentials."""
    with pytest.raises(store.StoreError) as err:
        store.read(f"{bucket}/gone.jpg")
    assert isinstance(err.value, store.ObjectGoneError)
    assert str(err.value).startswith(f"{bucket}/gone.jpg: no such object"), err.value
    assert "credentials" not in err.value.hint and "put it back" in err.value.hint, err.value.hint
