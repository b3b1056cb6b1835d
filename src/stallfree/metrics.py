"""Monitors, sinks and run totals: GPU metrics, metrics.jsonl, summary.json, optional
TensorBoard (a log interval's sums and clock: train/interval.py)."""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, cast

from stallfree.log import LOGGER


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
        return {"gpu_util": util / 100, "gpu_mem_gb": used / 1e9, "gpu_mem_torch_gb": mine / 1e9}


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


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    """A record's finite numbers other than the step: what trackers plot."""
    return {
        k: float(v)
        for k, v in record.items()
        if k != "step" and not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    }


class MlflowSink:
    """Metrics to MLflow: the server or store MLFLOW_TRACKING_URI names, else a local file
    store in RUN/mlruns (no server; `mlflow ui --backend-store-uri RUN/mlruns` shows it).

    One MLflow run per run directory: its id is kept in RUN/mlflow_run.json, and a resumed or
    requeued run continues it. Steps it already holds (logged after the checkpoint the resume
    went back to) are not logged twice.
    """

    def __init__(self, run_dir: Path, params: dict[str, Any], resumed: bool = False) -> None:
        # MLflow 3 keeps the file store only on request; it is the serverless choice here.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        self.logged: dict[str, int] = {}  # per metric, the last step the run already holds
        found = self._continue(run_dir / MLFLOW_RUN_FILE, uri) if resumed else None
        if found is not None:
            self.run_id = found
            return
        experiment = self.client.get_experiment_by_name("stallfree")
        experiment_id = (
            experiment.experiment_id if experiment is not None else self.client.create_experiment("stallfree")
        )
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        write_json_atomic(run_dir / MLFLOW_RUN_FILE, {"run_id": self.run_id, "tracking_uri": uri})
        items = [Param(k, str(v)[:500]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params a batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def _continue(self, path: Path, uri: str) -> str | None:
        """The run id this run directory started, back to RUNNING; None when there is none
        here or the store no longer has it (said, and a new MLflow run is opened)."""
        from mlflow.exceptions import MlflowException

        if not path.is_file():
            return None
        kept = json.loads(path.read_text())
        try:
            run = self.client.get_run(kept["run_id"])
        except MlflowException as exc:
            LOGGER.warning(
                f"MLflow run {kept['run_id']} ({path}) is not in {uri} ({exc}); "
                "this resume opens a new MLflow run"
            )
            return None
        self.client.update_run(run.info.run_id, status="RUNNING")
        for key in run.data.metrics:
            history = self.client.get_metric_history(run.info.run_id, key)
            self.logged[key] = max((m.step for m in history), default=-1)
        return run.info.run_id

    def write(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(record.get("step", 0))
        metrics = [
            Metric(k, v, now, step) for k, v in _numbers(record).items() if step > self.logged.get(k, -1)
        ]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


_WandbMode = Literal["online", "offline", "disabled", "shared"]  # wandb.init's `mode`


class WandbSink:
    """Metrics to Weights & Biases, offline by default (RUN/wandb; `wandb sync` uploads it);
    WANDB_MODE=online and WANDB_PROJECT as W&B reads them. A resumed run opens a new W&B run
    (`resumed` is not used yet: unlike MLflow's, W&B's continuation is not tested here)."""

    def __init__(self, run_dir: Path, params: dict[str, Any], resumed: bool = False) -> None:
        import wandb

        self.run = wandb.init(
            dir=str(run_dir),
            name=run_dir.name,
            config=params,
            project=os.environ.get("WANDB_PROJECT", "stallfree"),
            # Any other text is refused by W&B itself, naming the modes it knows.
            mode=cast(_WandbMode, os.environ.get("WANDB_MODE", "offline")),
        )

    def write(self, record: dict[str, Any]) -> None:
        self.run.log(_numbers(record), step=int(record.get("step", 0)))

    def close(self) -> None:
        self.run.finish()


# train.trackers name -> (its sink, the package that sink needs)
TRACKERS: dict[str, tuple[type[MlflowSink | WandbSink], str]] = {
    "mlflow": (MlflowSink, "mlflow-skinny"),
    "wandb": (WandbSink, "wandb"),
}
MLFLOW_RUN_FILE = "mlflow_run.json"  # in the run directory: the MLflow run a resume continues


def open_sinks(
    run_dir: Path,
    tensorboard: bool = True,
    trackers: tuple[str, ...] = (),
    params: dict[str, Any] | None = None,
) -> list[JsonlSink | Sink]:
    """metrics.jsonl always; TensorBoard when the package is importable (else one warning with
    the install command); the trackers asked for (train.trackers), given the flattened recipe
    as their run's parameters."""
    jsonl = JsonlSink(run_dir / "metrics.jsonl")
    sinks: list[Sink] = [jsonl]
    if tensorboard:
        try:
            sinks.append(TensorBoardSink(run_dir / "tb"))
        except (ImportError, OSError) as exc:
            # Said once, at the start: a missing tb/ found after a long run is a lost curve.
            LOGGER.warning(
                f"TensorBoard: no {run_dir / 'tb'} for this run ({type(exc).__name__}: "
                f"{exc}); install it with pip install -e '.[tb]' (make installs it); "
                "metrics.jsonl has every record"
            )
    # A resume has kept metrics records (RunDir.start cut them back to its checkpoint's): the
    # trackers continue their runs. A start from scratch opens new ones.
    resumed = jsonl.records > 0
    for name in trackers:
        sinks.append(TRACKERS[name][0](run_dir, params or {}, resumed=resumed))
    return sinks


class SinkSet:
    """The run's sinks, handed to the Trainer when it is built and opened when the run directory
    is written (after every start-up check passed): before that, records go nowhere."""

    def __init__(self, sinks: list[Sink] | None = None) -> None:
        self.sinks: list[Sink] = list(sinks or [])

    def open(
        self, run_dir: Path, trackers: tuple[str, ...] = (), params: dict[str, Any] | None = None
    ) -> None:
        self.sinks += open_sinks(run_dir, trackers=trackers, params=params)

    def write(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)

    @property
    def records(self) -> int:
        """Lines in metrics.jsonl (what a checkpoint records it has seen); 0 without one."""
        return next((s.records for s in self.sinks if isinstance(s, JsonlSink)), 0)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


@dataclass(slots=True)
class Totals:
    """Images, wall time and data-wait over the logged intervals of a run (or a bench window)."""

    images: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0

    def add(self, record: dict[str, Any], wait: float) -> None:
        self.images += record["images"]
        self.wall_s += record["interval_s"]
        self.wait_s += wait

    def reset(self) -> None:
        self.images, self.wall_s, self.wait_s = 0, 0.0, 0.0

    def state_dict(self) -> dict[str, float]:
        """The sums, for a checkpoint: a resumed run's summary counts every segment."""
        return {"images": self.images, "wall_s": self.wall_s, "wait_s": self.wait_s}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.images = int(state["images"])
        self.wall_s, self.wait_s = float(state["wall_s"]), float(state["wait_s"])

    def summary(self) -> dict[str, float]:
        nan = float("nan")
        return {
            "images_per_s": self.images / self.wall_s if self.wall_s else nan,
            "data_wait_frac": self.wait_s / self.wall_s if self.wall_s else nan,
        }


def interval_line(record: dict[str, Any]) -> str:
    """One log interval as a plain line for a file: step, epoch, loss, lr, speed, data-wait."""
    skipped = f", skipped {record['skipped_samples']} samples" if "skipped_samples" in record else ""
    return (
        f"step {record['step']} epoch {record['epoch']}: loss {record['loss']:.4f}, "
        f"lr {record['lr']:.4g}, {record['images_per_s']:.1f} img/s, data-wait "
        f"{100 * record['data_wait_frac']:.1f}%, skipped steps {record['skipped_steps']}"
        f"{skipped}"
    )


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
