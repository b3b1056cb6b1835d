"""Faults of a real store's server during a run: a store that restarts mid-epoch costs time, not
the run, and its retries are counted in metrics.jsonl; one that stays down stops the run in one
line with a checkpoint at its last step, exit code 75, and `--resume auto` then ends where an
uninterrupted run does, bitwise. On S3 (SeaweedFS), and once on GCS (fake-gcs-server): both on
loopback, each keeping its objects on disk across a restart. A frozen store is S3's alone."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import torch
from emulators import environment
from helpers import CLIENT_WORDS, PYTHON, final_weights, small_recipe, train_until_logged
from s3_server import upload_tree

from stallfree.cli import main
from stallfree.data import storage
from stallfree.data.storage import settings
from stallfree.errors import PREEMPTED_EXIT_CODE
from stallfree.train.checkpoint import load_checkpoint
from stallfree.train.run import train

pytestmark = pytest.mark.slow

BUCKET, PREFIX = "faults", "data"


class Store:
    """One store's server, to kill and start again: SeaweedFS (s3) or fake-gcs-server (gs)."""

    def __init__(self, scheme: str, server: Any) -> None:
        self.scheme, self.server = scheme, server

    @property
    def proc(self) -> Any:
        return self.server.proc

    def start(self) -> None:
        self.server.start()

    def kill(self) -> None:
        self.server.kill()

    def upload(self, local: Path) -> str:
        """Every file under `local` at <scheme>://faults/data/<relative path>; the URL."""
        if self.scheme == "s3":
            return upload_tree(self.server.client(), local, BUCKET, PREFIX)
        return str(self.server.upload_tree(local, BUCKET, PREFIX))

    def serves(self, key: str) -> bool:
        """Whether a GET of `key` works now (not only a listing)."""
        if self.scheme == "s3":
            client = self.server.client()
            try:
                client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
            except client.exceptions.ClientError:
                return False
            return True
        try:
            with urllib.request.urlopen(f"{self.server.endpoint}/{BUCKET}/{quote(key)}", timeout=5):
                return True
        except urllib.error.HTTPError:
            return False


def _server(scheme: str, root: Path) -> Any:
    if scheme == "s3":
        from s3_server import Server, need_weed

        return Server(need_weed(), root)
    from gcs_server import Server as GcsServer
    from gcs_server import need_binary

    return GcsServer(need_binary(), root)


def _own(scheme: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    own = Store(scheme, _server(scheme, tmp_path_factory.mktemp(scheme)))
    own.start()
    try:
        with environment(own.server.env()):
            yield own
    finally:
        own.kill()


# Servers of this module's own, to kill (the session's are shared by other modules); the runs'
# subprocesses find them by the standard variables. Each started once, when first asked for.
@pytest.fixture(scope="module")
def s3_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    yield from _own("s3", tmp_path_factory)


@pytest.fixture(scope="module")
def gs_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    yield from _own("gs", tmp_path_factory)


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Store:
    """The module's server of the store a test names (`indirect`; S3 where it names none),
    running (a test that failed with it down left it so)."""
    own: Store = request.getfixturevalue(f"{getattr(request, 'param', 's3')}_store")
    if own.proc is None or own.proc.poll() is not None:
        own.start()
    return own


def _recipe(root: str | Path, backend: str = "torch"):
    return small_recipe(
        root,
        loader={"backend": backend, "torch": {"workers": 1}, "dali": {"threads": 1}},
        # 60 images, batch 4: 15 steps, the store killed after 2 (a second epoch only cost time).
        train={"epochs": 1, "batch_size": 4},
        optim={"name": "sgd", "lr": 0.05},
    )


@pytest.fixture(scope="module")
def local_runs(image_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted run from a local copy of the same objects, per loader (made once)."""
    made: dict[str, dict[str, torch.Tensor]] = {}

    def weights(backend: str) -> dict[str, torch.Tensor]:
        if backend not in made:
            run = tmp_path_factory.mktemp(f"local-{backend}") / "run"
            train(_recipe(image_root, backend), run, progress=False)
            made[backend] = final_weights(run)
        return made[backend]

    return weights


@pytest.fixture(scope="module")
def local_weights(local_runs) -> dict[str, torch.Tensor]:
    return local_runs("torch")


def _wait_until_it_serves_reads(server: Store, image_root: Path, timeout: float = 60) -> None:
    """After a restart SeaweedFS lists before its volumes serve reads (a GET then answers 500
    InternalError for a while): wait for a GET to work, so the resume starts on a whole store."""
    first = next(p for p in sorted(image_root.rglob("*")) if p.is_file())
    key, deadline = f"{PREFIX}/{first.relative_to(image_root).as_posix()}", time.monotonic() + timeout
    while not server.serves(key):
        assert time.monotonic() < deadline, f"{server.scheme}: no GET of {key} works after a restart"
        time.sleep(0.05)


def _assert_equal(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, tensor in weights.items():
        assert torch.equal(tensor, expected[name]), name


def _train_records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "loss" in record]


@pytest.mark.parametrize("server", ["s3", "gs"], indirect=True)
def test_a_store_restarted_mid_epoch_does_not_stop_the_run(
    server: Store, local_weights: dict[str, torch.Tensor], tmp_path: Path, image_root: Path
) -> None:
    url = server.upload(image_root)
    proc, _, run = train_until_logged(_recipe(url), tmp_path, records=2)
    assert proc.poll() is None, proc.communicate()[1]
    server.kill()
    time.sleep(2)
    assert proc.poll() is None  # the run waits for its next batch's files
    server.start()
    assert proc.poll() is None  # and still waits through the restart (the store was down all along)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    _assert_equal(final_weights(run), local_weights)
    # The worker's retries reach the record (a shared counter); none before the restart.
    retries = [record["store_retries"] for record in _train_records(run)]
    assert retries[0] == 0 and retries[-1] > 0 and retries == sorted(retries), retries


# DALI too: its random state must be the last step's, not one past the batches it had read
# ahead when the store went (a new user's resume after such a stop differed from step 66 on).
# GCS once, on the torch loader: the loaders' side is S3's to test, the store's client GCS's.
@pytest.mark.parametrize(
    ("server", "backend"),
    [("s3", "torch"), pytest.param("s3", "dali", marks=pytest.mark.dali), ("gs", "torch")],
    indirect=["server"],
)
def test_a_store_that_stays_down_stops_the_run_at_its_last_step_and_resumes(
    server: Store,
    local_runs,
    image_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
) -> None:
    monkeypatch.setenv(storage.OUTAGE_ENV, "2")
    monkeypatch.setenv(storage.ATTEMPTS_ENV, "2")  # the quick retries: the outage budget is what is tested
    url = server.upload(image_root)
    proc, cmd, run = train_until_logged(_recipe(url, backend), tmp_path, records=2)
    server.kill()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE, err[-3000:]
    lines = [line for line in err.splitlines() if "stallfree: " in line and str(run) in line]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert f"{url}/" in lines[0] and "the store did not answer" in lines[0], lines
    assert "(still after 2 s)" in lines[0] and "--resume auto" in lines[0], lines
    assert not CLIENT_WORDS.search(err), err[-3000:]  # in our words, the endpoint named
    # The checkpoint is the last step taken: a resume trains no step twice.
    marker = json.loads((run / "preempted.json").read_text())
    state = load_checkpoint(Path(marker["checkpoint"]))
    assert state["counters"]["optimizer_steps"] == _train_records(run)[-1]["step"]
    server.start()
    _wait_until_it_serves_reads(server, image_root)
    settings.count_retry(5)  # this process's earlier work
    assert main([*cmd[cmd.index("train") :], "--resume", "auto"]) == 0
    _assert_equal(final_weights(run), local_runs(backend))
    # The resumed segment's own count: a clean run (not the retries this process made before).
    assert _train_records(run)[-1]["store_retries"] == 0


# As a loader's reader thread reads: once while the store answers (the connection is up), then,
# told to on stdin, again.
_READER = (
    "import sys\n"
    "from stallfree.data import storage\n"
    "storage.enable_direct()\n"
    "storage.read(sys.argv[1])\n"
    "print('frozen', flush=True); sys.stdin.readline()\n"
    "storage.read(sys.argv[1])\n"
)


@contextlib.contextmanager
def _reading_a_frozen_store(server: Store, image_root: Path, outage_s: int) -> Iterator[tuple[Any, str]]:
    """A reader process (budget `outage_s`, 2 attempts) whose second read of an object starts
    once the server is frozen (SIGSTOP: connections accepted, never answered): (it, the URL).
    On the way out the reader is killed if it still runs, and the server thawed."""
    server.upload(image_root)
    client = server.server.client()
    key = client.list_objects_v2(Bucket="faults", Prefix="data/train/")["Contents"][0]["Key"]
    url = f"s3://faults/{key}"
    env = {**os.environ, storage.OUTAGE_ENV: str(outage_s), storage.ATTEMPTS_ENV: "2"}
    proc = subprocess.Popen(
        [PYTHON, "-c", _READER, url],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().strip() == "frozen", proc.communicate()[1][-3000:]
    assert server.proc is not None
    os.killpg(server.proc.pid, signal.SIGSTOP)
    try:
        proc.stdin.write("\n")
        proc.stdin.flush()
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        os.killpg(server.proc.pid, signal.SIGCONT)


def test_a_store_that_hangs_ends_within_the_outage_budget(server: Store, image_root: Path) -> None:
    """A frozen store (SIGSTOP: connections accepted, never answered) must end a loader's read
    within the outage budget, as a store that refuses connections does. It waited 30 s in
    obstore, then botocore's 5 attempts of 30 s each, twice: a new user's run sat silent for
    minutes with STALLFREE_S3_OUTAGE_S=10."""
    with _reading_a_frozen_store(server, image_root, outage_s=3) as (proc, url):  # 1.5 s a request
        started = time.monotonic()
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError("a read from a frozen store still waiting after 60 s") from None
        waited = time.monotonic() - started
    assert proc.returncode != 0
    assert "StoreUnavailableError" in err and url in err and "(still after 3 s)" in err, err[-2000:]
    assert "not answering" in err, err[-2000:]  # said once when it starts, not only at the end
    # Within the budget plus one request's timeout (3 + 1.5 s), and a margin for a loaded machine.
    assert waited < 10, waited


def test_a_frozen_store_is_said_within_seconds(server: Store, image_root: Path) -> None:
    """A frozen store was silent for 40 s under the default budget (each attempt waits its whole
    timeout): a read with no answer for a few seconds says so while it still waits."""
    with _reading_a_frozen_store(server, image_root, outage_s=60) as (proc, url):  # 30 s a request
        assert proc.stderr is not None
        line = proc.stderr.readline()  # the first thing it says, long before its 30 s timeout
    assert f"{url}: no answer from the store for" in line and "waiting up to 60 s" in line, line


@pytest.mark.parametrize("server", ["s3", "gs"], indirect=True)
def test_a_listing_of_a_missing_bucket_is_no_outage(server: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """fake-gcs-server answers a listing of a bucket that does not exist with a 500, as a store
    in trouble would: after its attempts the read asks for an object there (404) and says the
    bucket is missing, instead of waiting out the outage budget for a store that answers."""
    monkeypatch.setenv(storage.OUTAGE_ENV, "30")
    monkeypatch.setenv(storage.ATTEMPTS_ENV, "2")
    url = f"{server.scheme}://no-such-bucket/data"
    with pytest.raises(storage.StoreError) as err:
        storage.locate(url).list_objects()
    assert not isinstance(err.value, storage.StoreUnavailableError), err.value
    assert str(err.value).startswith(f"{url}: no such bucket 'no-such-bucket'"), err.value
