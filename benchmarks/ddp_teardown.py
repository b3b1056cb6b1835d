"""Stress the end of a DDP run: two gloo ranks pinned to one core that a busy loop also loads
train a few steps, leave the group with `stallfree.train.distributed.shutdown` and exit. A
rank that has not exited within `--timeout` seconds counts as a hang.

The hang this guards against: the gloo group's destructor joins its worker threads holding the
GIL while a worker still needs the GIL to free a tensor (https://github.com/pytorch/pytorch/issues/56297).

    python benchmarks/ddp_teardown.py --runs 50            # the figure in benchmarks/RESULTS.md
    python benchmarks/ddp_teardown.py --smoke              # 1 run
    python benchmarks/ddp_teardown.py --teardown bare      # barrier + destroy, the DDP model freed last

Needs `taskset` (util-linux); the ranks and the busy loop share `--core`.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HOG = "while True: pass"
# The ranks' interpreter: $PYTHON_EXEC where set (the tests' fork server), else this one.
PYTHON = os.environ.get("PYTHON_EXEC", sys.executable)


def rank_body(teardown: str) -> None:
    """One rank: DDP steps, the gathers a run starts with, then the teardown under test."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from stallfree.train import distributed

    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)))
    distributed.gather_objects({"train": (10, "digest")}, dist.get_world_size())  # as the listing check
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(16, 64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    distributed.all_reduce_sum(torch.ones(1))  # as the epoch's metrics
    distributed.gather_objects(1, dist.get_world_size())  # its tensors are Python's, freed last
    if teardown == "project":
        distributed.shutdown()
    else:  # shutdown without its pause: barrier, destroy
        dist.barrier()
        dist.destroy_process_group()
    del model, optimizer  # the reducer goes here, as at the end of `run`


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def one_run(args: argparse.Namespace, log: Path) -> str:
    """'ok', 'hang' (a rank still alive at the timeout) or 'failed' (a non-zero exit)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    env["OMP_NUM_THREADS"] = "1"
    procs = []
    with log.open("w") as out:
        for rank in (0, 1):
            command = [
                "taskset",
                "-c",
                str(args.core),
                PYTHON,
                __file__,
                "--rank-body",
                args.teardown,
            ]
            procs.append(subprocess.Popen(command, env={**env, "RANK": str(rank)}, stdout=out, stderr=out))
        deadline, outcome = time.monotonic() + args.timeout, "ok"
        for proc in procs:
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                outcome = "failed" if code != 0 and outcome == "ok" else outcome
            except subprocess.TimeoutExpired:
                outcome = "hang"
        for proc in procs:
            if proc.poll() is None:
                if args.stacks:  # the hung rank's Python and native stacks, for the log
                    subprocess.run(
                        ["py-spy", "dump", "--native", "--pid", str(proc.pid)], stdout=out, stderr=out
                    )
                proc.kill()
                proc.wait()
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--smoke", action="store_true", help="1 run")
    parser.add_argument("--teardown", choices=("project", "bare"), default="project")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a run may take")
    parser.add_argument("--core", type=int, default=0)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/ddp_teardown"))
    parser.add_argument("--stacks", action="store_true", help="py-spy dump a hung rank")
    parser.add_argument("--rank-body", choices=("project", "bare"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_body:
        rank_body(args.rank_body)
        return 0
    runs = 1 if args.smoke else args.runs
    args.logs.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still ends the busy loop
    hog = subprocess.Popen(["taskset", "-c", str(args.core), sys.executable, "-c", HOG])
    counts: dict[str, int] = {"ok": 0, "hang": 0, "failed": 0}
    start = time.monotonic()
    try:
        for i in range(runs):
            outcome = one_run(args, args.logs / f"run{i}.log")
            counts[outcome] += 1
            print(f"run {i}: {outcome}", flush=True)
    finally:
        hog.kill()
        hog.wait()
    print(
        f"teardown={args.teardown} runs={runs} {counts} "
        f"in {time.monotonic() - start:.0f} s; logs in {args.logs}"
    )
    return 0 if counts["ok"] == runs else 1


if __name__ == "__main__":
    sys.exit(main())
