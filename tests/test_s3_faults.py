"""Faults of a real S3-compatible server (SeaweedFS on loopback) during a run: a store that
restarts mid-epoch costs time, not the run, and its retries are counted in metrics.jsonl; one
that stays down stops the run in one line with a checkpoint at its last step, exit code 75, and
`--resume auto` then ends where an uninterrupted run does, bitwise."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from helpers import small_recipe, train_until_logged
from s3_server import Server, need_weed, upload_tree

from stallfree.cli import main
from stallfree.data import storage
from stallfree.data.storage import settings
from stallfree.errors import PREEMPTED_EXIT_CODE
from stallfree.train.checkpoint import load_checkpoint
from stallfree.train.run import train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def own_server(tmp_path_factory: pytest.TempPathFactory):
    """A server of this module's own, to kill (the session's is shared by other modules); the
    runs' subprocesses find it by the environment. Started once: a start costs ~5 s."""
    own = Server(need_weed(), tmp_path_factory.mktemp("weed"))
    own.start()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in own.env().items():
            patch.setenv(key, value)
        yield own
    own.kill()


@pytest.fixture
def server(own_server: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    """The module's server, running (a test that failed with it down left it so)."""
    if own_server.proc is None or own_server.proc.poll() is not None:
        own_server.start()
    return own_server


def _recipe(root: str | Path, backend: str = "torch"):
    return small_recipe(
        root,
        loader={"backend": backend, "torch": {"workers": 1}, "dali": {"threads": 1}},
        # 60 images, batch 4: 15 steps, the store killed after 2 (a second epoch only cost time).
        train={"epochs": 1, "batch_size": 4},
        optim={"name": "sgd", "lr": 0.05},
    )


def _final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(sorted((run / "checkpoints").glob("ckpt-*.pt"))[-1])["model"]


@pytest.fixture(scope="module")
def local_runs(image_root: Path, tmp_path_factory: pytest.TempPathFactory):
    """The uninterrupted run from a local copy of the same objects, per loader (made once)."""
    made: dict[str, dict[str, torch.Tensor]] = {}

    def weights(backend: str) -> dict[str, torch.Tensor]:
        if backend not in made:
            run = tmp_path_factory.mktemp(f"local-{backend}") / "run"
            train(_recipe(image_root, backend), run, progress=False)
            made[backend] = _final_weights(run)
        return made[backend]

    return weights


@pytest.fixture(scope="module")
def local_weights(local_runs) -> dict[str, torch.Tensor]:
    return local_runs("torch")


def _wait_until_it_serves_reads(server: Server, timeout: float = 60) -> None:
    """After a restart SeaweedFS lists before its volumes serve reads (a GET then answers 500
    InternalError for a while): wait for a GET to work, so the resume starts on a whole store."""
    client, deadline = server.client(), time.monotonic() + timeout
    key = client.list_objects_v2(Bucket="faults", MaxKeys=1)["Contents"][0]["Key"]
    while True:
        try:
            client.get_object(Bucket="faults", Key=key)["Body"].read()
            return
        except client.exceptions.ClientError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _assert_equal(weights: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, tensor in weights.items():
        assert torch.equal(tensor, expected[name]), name


def _train_records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [record for record in map(json.loads, lines) if "loss" in record]


def test_a_store_restarted_mid_epoch_does_not_stop_the_run(
    server: Server, local_weights: dict[str, torch.Tensor], tmp_path: Path, image_root: Path
) -> None:
    url = upload_tree(server.client(), image_root, "faults", "data")
    proc, _, run = train_until_logged(_recipe(url), tmp_path, records=2)
    assert proc.poll() is None, proc.communicate()[1]
    server.kill()
    time.sleep(2)
    assert proc.poll() is None  # the run waits for its next batch's files
    server.start()
    assert proc.poll() is None  # and still waits through the restart (the store was down all along)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    _assert_equal(_final_weights(run), local_weights)
    # The worker's retries reach the record (a shared counter); none before the restart.
    retries = [record["store_retries"] for record in _train_records(run)]
    assert retries[0] == 0 and retries[-1] > 0 and retries == sorted(retries), retries


# DALI too: its random state must be the last step's, not one past the batches it had read
# ahead when the store went (a new user's resume after such a stop differed from step 66 on).
@pytest.mark.parametrize("backend", ["torch", pytest.param("dali", marks=pytest.mark.dali)])
def test_a_store_that_stays_down_stops_the_run_at_its_last_step_and_resumes(
    server: Server,
    local_runs,
    image_root: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
) -> None:
    monkeypatch.setenv(storage.OUTAGE_ENV, "2")
    monkeypatch.setenv(storage.ATTEMPTS_ENV, "2")  # the quick retries: the outage budget is what is tested
    url = upload_tree(server.client(), image_root, "faults", "data")
    proc, cmd, run = train_until_logged(_recipe(url, backend), tmp_path, records=2)
    server.kill()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT_CODE, err[-3000:]
    lines = [line for line in err.splitlines() if "stallfree: " in line and str(run) in line]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert f"{url}/" in lines[0] and "the store did not answer" in lines[0], lines
    assert "(still after 2 s)" in lines[0] and "--resume auto" in lines[0], lines
    # The checkpoint is the last step taken: a resume trains no step twice.
    marker = json.loads((run / "preempted.json").read_text())
    state = load_checkpoint(Path(marker["checkpoint"]))
    assert state["counters"]["optimizer_steps"] == _train_records(run)[-1]["step"]
    server.start()
    _wait_until_it_serves_reads(server)
    settings.count_retry(5)  # this process's earlier work
    assert main([*cmd[cmd.index("train") :], "--resume", "auto"]) == 0
    _assert_equal(_final_weights(run), local_runs(backend))
    # The resumed segment's own count: a clean run (not the retries this process made before).
    assert _train_records(run)[-1]["store_retries"] == 0


def test_a_store_that_hangs_ends_within_the_outage_budget(server: Server, image_root: Path) -> None:
    """A frozen store (SIGSTOP: connections accepted, never answered) must end a loader's read
    within the outage budget, as a store that refuses connections does. It waited 30 s in
    obstore, then botocore's 5 attempts of 30 s each, twice: a new user's run sat silent for
    minutes with STALLFREE_S3_OUTAGE_S=10."""
    import os
    import signal
    import subprocess
    import sys

    upload_tree(server.client(), image_root, "faults", "data")
    key = server.client().list_objects_v2(Bucket="faults", Prefix="data/train/")["Contents"][0]["Key"]
    # As a loader's reader thread reads.
    reader = (
        "import sys\n"
        "from stallfree.data import storage\n"
        "storage.enable_direct()\n"
        "storage.read(sys.argv[1])  # the connection is up: the store answers once\n"
        "print('frozen', flush=True); sys.stdin.readline()\n"
        "storage.read(sys.argv[1])\n"
    )
    env = {**os.environ, storage.OUTAGE_ENV: "3", storage.ATTEMPTS_ENV: "2"}  # 1.5 s a request
    proc = subprocess.Popen(
        [sys.executable, "-c", reader, f"s3://faults/{key}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().strip() == "frozen", proc.communicate()[1][-3000:]
    assert server.proc is not None
    os.killpg(server.proc.pid, signal.SIGSTOP)
    try:
        proc.stdin.write("\n")
        proc.stdin.flush()
        started = time.monotonic()
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("a read from a frozen store still waiting after 60 s") from None
        waited = time.monotonic() - started
    finally:
        os.killpg(server.proc.pid, signal.SIGCONT)
    assert proc.returncode != 0
    assert "StoreUnavailableError" in err and f"s3://faults/{key}" in err and "(still after 3 s)" in err, err[
        -2000:
    ]
    assert "not answering" in err, err[-2000:]  # said once when it starts, not only at the end
    # Within the budget plus one request's timeout (3 + 1.5 s), and a margin for a loaded machine.
    assert waited < 10, waited


def test_a_frozen_store_is_said_within_seconds(server: Server, image_root: Path) -> None:
    """A frozen store was silent for 40 s under the default budget (each attempt waits its whole
    timeout): a read with no answer for a few seconds says so while it still waits."""
    import os
    import signal
    import subprocess
    import sys

    upload_tree(server.client(), image_root, "faults", "data")
    key = server.client().list_objects_v2(Bucket="faults", Prefix="data/train/")["Contents"][0]["Key"]
    reader = (
        "import sys\n"
        "from stallfree.data import storage\n"
        "storage.enable_direct()\n"
        "storage.read(sys.argv[1])\n"
        "print('frozen', flush=True); sys.stdin.readline()\n"
        "storage.read(sys.argv[1])\n"
    )
    env = {**os.environ, storage.OUTAGE_ENV: "60", storage.ATTEMPTS_ENV: "2"}  # 30 s a request
    proc = subprocess.Popen(
        [sys.executable, "-c", reader, f"s3://faults/{key}"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdin is not None and proc.stderr is not None
    assert proc.stdout.readline().strip() == "frozen", proc.communicate()[1][-3000:]
    assert server.proc is not None
    os.killpg(server.proc.pid, signal.SIGSTOP)
    try:
        proc.stdin.write("\n")
        proc.stdin.flush()
        line = proc.stderr.readline()  # the first thing it says, long before its 30 s timeout
    finally:
        proc.kill()
        proc.communicate()
        os.killpg(server.proc.pid, signal.SIGCONT)
    assert f"s3://faults/{key}: no answer from the store for" in line and "waiting up to 60 s" in line, line
