"""Every script in benchmarks/ runs: each at its `--smoke` size (a few files, seconds, the real
run's code path), so a signature the scripts call that changes fails here, not in front of the
next person who reproduces a figure of benchmarks/RESULTS.md."""

from __future__ import annotations

import os
import subprocess

import pytest
from helpers import PYTHON
from s3_server import need_weed
from test_benchmarks import BENCHMARKS, SCRIPTS

# Scripts that read from a running store given by --endpoint (the AWS_* variables its keys):
# here the session's SeaweedFS, not one of their own.
ON_THE_SESSION_STORE = {"s3_latency.py", "s3_shard_reads.py"}


WITH_A_STORE_OF_THEIR_OWN = {"get_cost.py", "s3_listing.py"}  # a SeaweedFS without identities


@pytest.mark.e2e
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_runs_at_its_smoke_size(script: str, request: pytest.FixtureRequest) -> None:
    """`python benchmarks/X.py --smoke` exits 0 and prints a figure; a script without --smoke
    (argparse refuses it) fails here."""
    argv = [PYTHON, str(BENCHMARKS / script), "--smoke"]
    if script in ON_THE_SESSION_STORE:
        argv += ["--endpoint", request.getfixturevalue("s3_server").endpoint]
    if script in WITH_A_STORE_OF_THEIR_OWN:
        need_weed()  # skipped without SeaweedFS, as the session store's tests are
    # A user's keys in the environment (the session store's where set): a server of a script's
    # own must not take them for its identities.
    env = {"AWS_ACCESS_KEY_ID": "a-user-key", "AWS_SECRET_ACCESS_KEY": "a-user-secret", **os.environ}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=150, check=False, env=env)
    assert done.returncode == 0, f"{script} --smoke exited {done.returncode}:\n{done.stderr[-3000:]}"
    assert any(c.isdigit() for c in done.stdout), f"{script} --smoke printed no figure:\n{done.stdout}"


@pytest.mark.e2e
def test_gpu_check_parses() -> None:
    """benchmarks/gpu_check.sh needs a GPU to run; `bash -n` checks its syntax here."""
    subprocess.run(["bash", "-n", str(BENCHMARKS / "gpu_check.sh")], check=True)
