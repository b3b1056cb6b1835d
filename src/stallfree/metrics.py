"""Timers, monitors and sinks: data-wait accounting, GPU metrics, metrics.jsonl, summary.json,
optional TensorBoard."""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class StepTimer:
    """Splits wall time into time blocked waiting for the next batch and everything else."""

    def __init__(self) -> None:
        self.wait_s = 0.0
        self._start = time.perf_counter()

    def iterate(self, iterable: Iterable[T]) -> Iterator[T]:
        """Yield from `iterable`, adding the time each `next()` blocks to `wait_s`."""
        iterator = iter(iterable)
        while True:
            t0 = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                self.wait_s += time.perf_counter() - t0
                return
            self.wait_s += time.perf_counter() - t0
            yield item

    def lap(self) -> tuple[float, float]:
        """(wall seconds, waiting seconds) since the last lap; starts a new lap."""
        now = time.perf_counter()
        wall, wait = now - self._start, self.wait_s
        self._start, self.wait_s = now, 0.0
        return wall, wait


class GpuMonitor:
    """GPU utilisation and memory of this rank's device, from NVML through torch.

    torch maps the index through CUDA_VISIBLE_DEVICES (NVML alone would measure another GPU on a
    masked host). NVML refuses some queries (MIG slices): the first failure switches the
    monitor off with one warning, and training goes on.
    """

    def __init__(self, device: Any) -> None:
        self.device = device
        self.enabled = True

    @classmethod
    def maybe(cls, device: Any) -> GpuMonitor | None:
        """A monitor for a CUDA `device`, or None (CPU)."""
        return cls(device) if getattr(device, "type", None) == "cuda" else None

    def sample(self) -> dict[str, float]:
        if not self.enabled:
            return {}
        import torch

        try:
            util = torch.cuda.utilization(self.device)
            free, total = torch.cuda.mem_get_info(self.device)  # the driver's view, no NVML
            used = total - free
            # This process's share: torch's caching allocator (DALI's own pools are not in
            # it, nor is another process's memory on a shared GPU; the device figure has both).
            mine = torch.cuda.memory_reserved(self.device)
        except Exception as exc:  # noqa: BLE001 - NVML missing or unsupported: lose only these metrics
            self.enabled = False
            warnings.warn(f"GPU metrics off: {type(exc).__name__}: {exc}", stacklevel=2)
            return {}
        return {"gpu_util": util / 100, "gpu_mem_gb": used / 1e9,
                "gpu_mem_torch_gb": mine / 1e9}


class Sink(Protocol):
    """Receives one metrics record (a flat dict) per log interval or validation."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per line and flushes, so a crash loses at most one record.

    `records` counts the lines in the file, so a checkpoint can say how many it has seen.
    """

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.records = len(path.read_text().splitlines()) if path.exists() else 0
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps({k: _finite(v) for k, v in record.items()}) + "\n")
        self.records += 1

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    """Scalars to TensorBoard, available with the `tb` extra."""

    def __init__(self, log_dir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = record.get("step", 0)
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


def open_sinks(run_dir: Path, tensorboard: bool = True) -> list[JsonlSink | Sink]:
    """metrics.jsonl always; TensorBoard when the package is importable."""
    sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl")]
    if tensorboard:
        try:
            sinks.append(TensorBoardSink(run_dir / "tb"))
        except ImportError:
            pass
    return sinks


def write_json_atomic(path: str | Path, data: dict[str, Any]) -> None:
    """Write JSON through a temporary file and rename, so readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({k: _finite(v) for k, v in data.items()}, indent=2) + "\n")
    os.replace(tmp, path)


def _finite(value: Any) -> Any:
    # JSON has no NaN/inf; null says "not measured" honestly.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
