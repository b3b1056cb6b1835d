"""The storage layer against a real S3-compatible server (SeaweedFS on loopback)."""

from __future__ import annotations

import os

import pytest
from inprocess import Cli

from stallfree.data import storage
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
    assert storage.read(url) == data
    assert storage.read_range(url, 300, 10) == data[300:310]
    assert read_bytes(url) == data
    assert read_bytes(url, 5) == data[:5]
    assert read_bytes(f"{url}::m.jpg:512:20") == data[512:532]
    assert read_bytes(f"{url}::m.jpg:512:20", 4) == data[512:516]
    assert storage.size(url) == 1024 == storage.locate(url).size()


def test_lists_every_page_and_every_class_prefix(bucket: str) -> None:
    many = storage.locate(f"{bucket}/many")
    assert many.list_dirs() == ["c0", "c1", "c2"]
    listed = storage.list_many([many.join(f"c{i}") for i in range(3)])
    names = [name for names, _ in listed for name, _ in names]
    assert len(names) == 1100 and len(set(names)) == 1100
    assert all(size == 0 for names, _ in listed for _, size in names)


def test_errors_name_the_url_and_reason(bucket: str) -> None:
    with pytest.raises(storage.StoreError, match=r"s3://unit/one/nothing: no such object"):
        storage.read(f"{bucket}/one/nothing")
    with pytest.raises(storage.StoreError, match=r"s3://no-such-bucket/x: no such bucket"):
        storage.locate("s3://no-such-bucket/x").check_root()
    with pytest.raises(storage.StoreError, match=r"s3://unit/empty: no objects under"):
        storage.locate(f"{bucket}/empty").check_root()
    storage.locate(f"{bucket}/many").check_root()
    one = storage.locate(f"{bucket}/one")
    assert not one.join("nothing").exists() and one.join("blob.bin").exists()


def test_a_missing_bucket_is_not_a_missing_object(bucket: str) -> None:
    """exists() said False for a key in a bucket that does not exist, so a root in a wrong
    bucket was read as the other shard format; it names the bucket instead."""
    with pytest.raises(storage.StoreError, match=r"s3://no-such-bucket/x/manifest.json: no such bucket"):
        storage.locate("s3://no-such-bucket/x/manifest.json").exists()


@pytest.mark.e2e  # starts worker or store-helper processes
def test_bad_endpoint_is_one_line_after_the_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv(storage.ATTEMPTS_ENV, "2")
    with pytest.raises(storage.StoreError, match=r"^s3://unit/x: the store did not answer") as err:
        storage.locate("s3://unit/x").check_root()
    assert "\n" not in str(err.value) and "secret" not in str(err.value)


@pytest.mark.e2e  # starts worker or store-helper processes
def test_an_endpoint_without_a_scheme_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """An endpoint without its scheme reached a new user as a traceback (obstore panics on
    it): it is a StoreError naming the endpoint and the fix."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "127.0.0.1:18333")
    with pytest.raises(storage.StoreError) as err:
        storage.locate("s3://unit/x").check_root()
    assert "127.0.0.1:18333" in str(err.value) and "http://127.0.0.1:18333" in str(err.value), err.value


@pytest.mark.e2e  # starts worker or store-helper processes
def test_data_check_on_a_dead_endpoint_ends_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """`data check` waited the whole outage budget (120 s) on an endpoint nothing listens on,
    then exited 75 naming a manifest.json the user never asked about; train's start check
    says it in a second."""
    import time

    from stallfree.data.tools.check import check_dataset

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv(storage.ATTEMPTS_ENV, "2")
    monkeypatch.setenv(storage.OUTAGE_ENV, "40")  # what it waited before: past the test's bound
    started = time.monotonic()
    with pytest.raises(storage.StoreError) as err:
        check_dataset("s3://unit/data", progress=False)
    assert not isinstance(err.value, storage.StoreUnavailableError)  # not "try again later": exit 2
    assert str(err.value).startswith("s3://unit/data") and "manifest" not in str(err.value), err.value
    assert time.monotonic() - started < 30


def test_a_child_forked_after_reads_reads_too(bucket: str) -> None:
    """obstore's runtime does not survive a fork: a child forked after this process's reader
    threads read (a DataLoader worker, a check's worker) hung on its first read."""
    from concurrent.futures import ThreadPoolExecutor

    url = f"{bucket}/one/blob.bin"
    with ThreadPoolExecutor(1, initializer=storage.enable_direct) as pool:  # as a ReaderPool
        assert pool.submit(storage.read, url).result()[:2] == b"\0\1"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its first read must come back
        import signal

        signal.alarm(60)
        ok = storage.read(url)[:2] == b"\0\1" and storage.size(url) == 1024
        os.write(write, b"1" if ok else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(read, 1) == b"1"


def test_an_object_gone_since_the_listing_says_so(bucket: str) -> None:
    """A GET of a listed object that is gone (deleted between a stop and its resume, whose
    listing is cached) told a new user to check the URL, the endpoint and the credentials."""
    with pytest.raises(storage.StoreError) as err:
        storage.read(f"{bucket}/gone.jpg")
    assert isinstance(err.value, storage.ObjectGoneError)
    assert str(err.value).startswith(f"{bucket}/gone.jpg: no such object"), err.value
    assert "credentials" not in err.value.hint and "put it back" in err.value.hint, err.value.hint


def test_data_check_goes_to_the_endpoint_it_is_given(
    s3_server, bucket: str, monkeypatch: pytest.MonkeyPatch, cli: Cli
) -> None:
    """`data check s3://...` could not be pointed at a recipe's endpoint: it went to AWS."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "")  # set, so that the test's end restores them
    monkeypatch.setenv(storage.ENDPOINT_ENV, "")
    done = cli("data", "check", f"{bucket}/empty", "--endpoint-url", s3_server.endpoint, "--no-progress")
    assert "s3://unit/empty: no objects under this prefix" in done.err
