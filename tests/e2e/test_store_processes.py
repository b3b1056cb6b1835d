"""Which process makes a store request, against a real SeaweedFS: obstore's runtime does not
survive a fork, so a main process lists and checks through its helper process, its reader
threads and forked workers read themselves, and a child forked after its parent read still
reads (it hung before on its first read)."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest
from helpers import PYTHON
from latency_proxy import LatencyProxy

from stallfree.data import storage
from stallfree.data.storage import wire

BODY = bytes(range(256)) * 40


@pytest.fixture
def bucket(s3_server) -> str:
    client = s3_server.client()
    try:
        client.create_bucket(Bucket="procs")
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    client.put_object(Bucket="procs", Key="dir/a b+c.bin", Body=BODY)
    return "s3://procs/dir/a b+c.bin"


def test_one_request_a_read_through_a_slow_store(
    s3_server, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    proxy = LatencyProxy(s3_server.endpoint, delay_ms=5).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        monkeypatch.delenv(storage.ENDPOINT_ENV, raising=False)
        for _ in range(5):
            assert storage.read(bucket) == BODY
        assert storage.read(bucket, 100) == BODY[:100]
        assert storage.read_range(bucket, 300, 1000) == BODY[300:1300]
    finally:
        proxy.stop()
    assert proxy.requests == 7


# Run in a fresh interpreter: whether this process has made a request directly depends on the
# tests before. Each child says whether it read, and who made its request ("direct"/"helper").
_FORKS = """
import multiprocessing, sys
from concurrent.futures import ThreadPoolExecutor
from stallfree.data import storage
from stallfree.data.storage import wire
url, size = sys.argv[1], int(sys.argv[2])

def child(queue):
    queue.put((len(storage.read(url)) == size, "direct" if wire.direct() else "helper"))

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

main = (len(storage.read(url)) == size, "direct" if wire.direct() else "helper")
before = forked()
with ThreadPoolExecutor(1, initializer=storage.enable_direct) as pool:  # as a ReaderPool
    assert len(pool.submit(storage.read, url).result()) == size
print(main, before, forked())
"""


def test_a_child_forked_after_its_parent_read_still_reads(bucket: str) -> None:
    done = subprocess.run(
        [PYTHON, "-c", _FORKS, bucket, str(len(BODY))], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # The main thread through its helper, a worker forked then directly, and one forked after
    # the parent's reader threads read through a helper of its own (directly it would hang).
    assert done.stdout.split("\n")[-2] == "(True, 'helper') (True, 'direct') (True, 'helper')"


def test_a_failure_crosses_the_helper_as_its_kind(bucket: str) -> None:
    """A missing object is told apart by type in the helper and arrives as the same error."""
    assert not wire.direct()
    with pytest.raises(storage.ObjectGoneError):
        storage.read(bucket + ".missing")
    assert not storage.locate(bucket + ".missing").exists()


def test_concurrent_requests_through_the_helper(bucket: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:
        got: list[Any] = list(pool.map(lambda i: storage.read_range(bucket, i, 7), range(64)))
    assert got == [BODY[i : i + 7] for i in range(64)]
