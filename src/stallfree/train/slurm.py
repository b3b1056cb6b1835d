"""Slurm: a job that saves on SIGUSR1 and puts itself back in the queue.

`#SBATCH --signal=USR1@300` (no `B:`) sends SIGUSR1 to every task of the job's steps five
minutes before the time limit. Each rank stops after the same step, rank 0 saves, and then, as
Lightning's SLURM support does, rank 0 runs `scontrol requeue $SLURM_JOB_ID`: Slurm ends this
run and starts the batch script again, whose `--resume auto` continues from that checkpoint.
(`#SBATCH --requeue` alone does not requeue a job that reached its time limit.)
"""

from __future__ import annotations

import os
import shutil
import subprocess

from stallfree.log import LOGGER


def slurm_job_id() -> str | None:
    """The Slurm job this process runs in, if any."""
    return os.environ.get("SLURM_JOB_ID") or None


def requeue(job_id: str, timeout_s: float = 60.0) -> bool:
    """`scontrol requeue JOB`; True when Slurm took it. Failures are logged, never raised: the
    checkpoint is saved either way, and the job can be resubmitted by hand."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        LOGGER.error(f"cannot requeue Slurm job {job_id}: scontrol is not on PATH; resubmit "
                     "the job (it resumes with --resume auto)")
        return False
    try:
        done = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        LOGGER.error(f"scontrol requeue {job_id} failed: {exc}; resubmit the job")
        return False
    if done.returncode != 0:
        LOGGER.error(f"scontrol requeue {job_id} failed: {done.stderr.strip() or done.returncode}"
                     "; resubmit the job (is JobRequeue enabled, or --no-requeue set?)")
        return False
    LOGGER.warning(f"requeued Slurm job {job_id}: it resumes from the checkpoint when it starts")
    return True


def maybe_requeue(signal_name: str, enabled: bool, rank: int) -> bool:
    """Rank 0, after a SIGUSR1 stop inside a Slurm job with train.slurm_requeue: requeue it."""
    job = slurm_job_id()
    if signal_name != "SIGUSR1" or not enabled or rank != 0 or job is None:
        return False
    return requeue(job)
