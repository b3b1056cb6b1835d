"""Timers and sinks: data-wait accounting, metrics.jsonl, summary.json, optional TensorBoard."""

from __future__ import annotations

import json
import math
import os
import threading
import time
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


class ResourceSampler:
    """CPU cores busy and peak RSS of this process and its children (loader workers), from /proc.

    A background thread samples every `interval` s; CPU time is read at enter and exit.
    """

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.cpu_cores = float("nan")
        self.peak_rss_mb = float("nan")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ResourceSampler:
        self._cpu0, self._t0 = _tree_cpu_seconds(), time.perf_counter()
        self.peak_rss_mb = _tree_rss_mb()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        wall = time.perf_counter() - self._t0
        self.cpu_cores = (_tree_cpu_seconds() - self._cpu0) / max(wall, 1e-9)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak_rss_mb = max(self.peak_rss_mb, _tree_rss_mb())


def _tree_pids(root: int | None = None) -> list[int]:
    """This process and all its descendants (Linux /proc; just this one elsewhere)."""
    pids, stack = [], [root or os.getpid()]
    while stack:
        pid = stack.pop()
        pids.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*/children"):
            try:
                stack.extend(int(c) for c in task.read_text().split())
            except OSError:
                continue
    return pids


def _tree_cpu_seconds() -> float:
    total = 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    for pid in _tree_pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
        except (OSError, IndexError, ValueError):
            continue
    return total


def _tree_rss_mb() -> float:
    total = 0
    for pid in _tree_pids():
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    break
        except OSError:
            continue
    return total / 1024


class GpuMonitor:
    """GPU utilisation and memory from NVML, when the `nvidia-ml-py` package and a GPU exist."""

    def __init__(self, index: int) -> None:
        import pynvml  # ImportError when absent: the caller skips GPU metrics

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)

    @classmethod
    def maybe(cls, device: Any) -> GpuMonitor | None:
        """A monitor for a CUDA `device`, or None (CPU, no NVML, no driver)."""
        if getattr(device, "type", None) != "cuda":
            return None
        try:
            return cls(device.index or 0)
        except Exception:  # noqa: BLE001 - NVML missing or failing only loses these metrics
            return None

    def sample(self) -> dict[str, float]:
        util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        memory = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        return {"gpu_util": util.gpu / 100, "gpu_mem_gb": memory.used / 1e9}


class Sink(Protocol):
    """Receives one metrics record (a flat dict) per log interval or validation."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends one JSON object per line and flushes, so a crash loses at most one record."""

    def __init__(self, path: str | Path) -> None:
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - closed by close()

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps({k: _finite(v) for k, v in record.items()}) + "\n")

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


def open_sinks(run_dir: Path, tensorboard: bool = True) -> list[Sink]:
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
