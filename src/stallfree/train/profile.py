"""`train --profile N`: a torch.profiler trace of N optimizer steps after a warm-up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

WARMUP_STEPS = 5  # skip start-up (worker spawn, cuDNN autotuning, allocator growth)


class StepProfiler:
    """Context manager; call `step()` after each optimizer step. A no-op when steps == 0."""

    def __init__(self, out_dir: Path, steps: int, device: torch.device, rank: int = 0) -> None:
        self.out_dir, self.steps, self.device = out_dir, steps if rank == 0 else 0, device
        self._prof: Any = None

    def __enter__(self) -> StepProfiler:
        if self.steps > 0:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(
                activities=activities,
                record_shapes=True,
                schedule=schedule(wait=WARMUP_STEPS, warmup=1, active=self.steps, repeat=1),
                on_trace_ready=self._write,
            )
            self._prof.__enter__()
        return self

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def __exit__(self, *exc: object) -> None:
        if self._prof is not None:
            self._prof.__exit__(None, None, None)

    def _write(self, prof: Any) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.out_dir / "trace.json"))
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=30)
        (self.out_dir / "top_ops.txt").write_text(table + "\n")
