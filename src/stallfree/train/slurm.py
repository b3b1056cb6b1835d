"""Slurm: a job that saves on SIGUSR1 and puts itself back in the queue.

`#SBATCH --signal=USR1@300` (no `B:`) sends SIGUSR1 to every task of the job's steps five
minutes before the time limit. Each rank stops after the same step, rank 0 saves, and then, as
Lightning's SLURM support does, rank 0 runs `scontrol requeue $SLURM_JOB_ID`: Slurm ends this
run and starts the batch script again, whose `--resume auto` continues from that checkpoint.
(`#SBATCH --requeue` alone does not requeue a job that reached its time limit.)
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess

from stallfree.errors import StallfreeError
from stallfree.log import LOGGER


class NodeListError(StallfreeError, ValueError):
    """A Slurm node list that cannot be expanded."""


def slurm_job_id() -> str | None:
    """The Slurm job this process runs in, if any."""
    return os.environ.get("SLURM_JOB_ID") or None


def requeue(job_id: str, timeout_s: float = 60.0) -> bool:
    """`scontrol requeue JOB`; True when Slurm took it. Failures are logged, never raised: the
    checkpoint is saved either way, and the job can be resubmitted by hand. Said before it is
    asked: Slurm's SIGTERM to this very task may come before scontrol returns."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        LOGGER.error(
            f"cannot requeue Slurm job {job_id}: scontrol is not on PATH; resubmit "
            "the job (it resumes with --resume auto)"
        )
        return False
    LOGGER.warning(f"requeueing Slurm job {job_id}: it resumes from the checkpoint when it starts")
    try:
        done = subprocess.run(
            [scontrol, "requeue", job_id], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        LOGGER.error(f"scontrol requeue {job_id} failed: {exc}; resubmit the job")
        return False
    if done.returncode != 0:
        LOGGER.error(
            f"scontrol requeue {job_id} failed: {done.stderr.strip() or done.returncode}"
            "; resubmit the job (is JobRequeue enabled, or --no-requeue set?)"
        )
        return False
    return True


def maybe_requeue(signal_name: str, enabled: bool, rank: int) -> bool:
    """Rank 0, after a SIGUSR1 stop inside a Slurm job with train.slurm_requeue: requeue it."""
    job = slurm_job_id()
    if signal_name != "SIGUSR1" or not enabled or rank != 0 or job is None:
        return False
    return requeue(job)


def hostnames(nodelist: str, timeout_s: float = 10.0) -> list[str]:
    """The hosts of a Slurm node list, as `scontrol show hostnames` gives them where it runs
    (Slurm's own rules), else as `expand_nodelist` reads them."""
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            # Without a readable slurm.conf scontrol retries for a minute: hence the timeout.
            done = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=timeout_s,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            LOGGER.debug(f"scontrol show hostnames {nodelist}: {exc}; parsing it here")
        else:
            names = done.stdout.split()
            # A list scontrol cannot read is said on stdout with exit status 0.
            if done.returncode == 0 and names and "Invalid hostlist" not in done.stdout:
                return names
    return expand_nodelist(nodelist)


_BRACKET = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a node list the way Slurm does: "rack[1-2]-n[01-02],gpu7" -> rack1-n01,
    rack1-n02, rack2-n01, rack2-n02, gpu7. Commas and spaces outside brackets separate hosts;
    each bracket holds comma-separated numbers or low-high ranges, zero-padded to the low
    bound's digits; several brackets multiply, the leftmost outermost; order and repeats kept."""
    hosts: list[str] = []
    for name in _split_top_level(nodelist):
        pieces: list[list[str]] = []
        at = 0
        for match in _BRACKET.finditer(name):
            pieces += [[name[at : match.start()]], _expand_ranges(match.group(1), nodelist)]
            at = match.end()
        tail = name[at:]
        if "[" in tail or "]" in tail:
            raise NodeListError(f"node list {nodelist!r}: unbalanced brackets in {name!r}")
        hosts += ["".join(parts) for parts in itertools.product(*pieces, [tail])]
    return hosts


def _split_top_level(nodelist: str) -> list[str]:
    """Host expressions: split at commas and spaces outside brackets."""
    names, depth, current = [], 0, ""
    for char in nodelist:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            raise NodeListError(f"node list {nodelist!r}: unbalanced brackets")
        if depth == 0 and char in ", \t\n":
            names.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise NodeListError(f"node list {nodelist!r}: unbalanced brackets")
    return [name for name in [*names, current] if name]


def _expand_ranges(text: str, nodelist: str) -> list[str]:
    """A bracket's contents, "01-03,7" -> 01, 02, 03, 7 (padded to the low bound's width)."""
    out: list[str] = []
    for part in text.split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None or (match.group(2) and int(match.group(2)) < int(match.group(1))):
            raise NodeListError(
                f"node list {nodelist!r}: [{text}] is not numbers and low-high ranges, e.g. [01-04,7]"
            )
        low, high = match.group(1), match.group(2) or match.group(1)
        out += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return out


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "rack[1-2]-node[01-04]" -> "rack1-node01"."""
    return hostnames(nodelist)[0]


def slurm_rendezvous(env: dict[str, str] | None = None) -> dict[str, str]:
    """MASTER_ADDR and MASTER_PORT for an srun step: its first node, and a port from the job
    id (the same for every task, and for the job when it is requeued) unless already set."""
    env = dict(os.environ if env is None else env)
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "localhost"
    return {
        "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodes),
        "MASTER_PORT": env.get("MASTER_PORT") or str(20_000 + int(env.get("SLURM_JOB_ID", "0")) % 20_000),
    }
