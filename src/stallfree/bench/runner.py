"""`stallfree bench`: the head-to-head runner. Each measurement runs in a fresh interpreter.

Loader mode iterates the loader alone; train mode runs the real Trainer on the recipe's model.
Runs are interleaved (repeat r of every backend before repeat r+1 of any) so that drift on a
noisy machine hits all backends alike, and the report takes the median of the repeats.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, cast

import torch

from stallfree.bench.limit import dali_single_thread, measure_limit, median_limit
from stallfree.bench.usage import ResourceSampler
from stallfree.bench.variants import BENCH_VARIANTS, installed_peers
from stallfree.data.loader import Batch, Loader
from stallfree.data.registry import check_data_root
from stallfree.log import LOGGER
from stallfree.parallel import DistInfo, cpu_cores
from stallfree.recipe import AugmentConfig, Recipe, apply_flags, apply_overrides, recipe_from_dict, validate
from stallfree.train.assemble import build_trainer
from stallfree.train.precision import cpu_has_native_bf16
from stallfree.train.prepare import RunContext, prepare, prepare_recipe

MODES = ("loader", "train")


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    backends: list[str] = field(
        default_factory=lambda: ["dali", "torch", "torch-naive", "synthetic", *installed_peers()]
    )
    modes: list[str] = field(default_factory=lambda: ["loader", "train"])
    repeats: int = 3
    warmup: int = 5  # batches (loader) or optimizer steps (train) not timed
    batches: int = 30  # timed batches or steps per run
    workers: list[int] = field(default_factory=list)  # torch/torch-naive sweep; [] = recipe's
    threads: list[int] = field(default_factory=list)  # dali sweep; [] = recipe's
    hw_decoder_loads: list[float] = field(default_factory=list)  # dali (nvJPEG) sweep; [] = recipe's
    limit_files: int = 200  # the limit's sample of training files ...
    limit_passes: int = 3  # ... timed this many times per repeat and path

    def validate(self) -> None:
        for name in self.backends:
            if name not in BENCH_VARIANTS:
                raise ValueError(f"unknown bench backend {name!r}; choose from {', '.join(BENCH_VARIANTS)}")
        for mode in self.modes:
            if mode not in MODES:
                raise ValueError(f"unknown bench mode {mode!r}; choose from {', '.join(MODES)}")
        if self.repeats < 1 or self.batches < 1 or self.warmup < 0:
            raise ValueError("repeats and batches must be >= 1, warmup >= 0")


def stream(loader: Loader) -> Iterator[Batch]:
    """The loader's batches without end, epoch after epoch, through as few iterators as possible:
    a warm-up and the timed window that follows it share one (a restart rebuilds DALI's
    pipeline or re-primes DataLoader workers, which is not steady-state cost)."""
    while True:
        produced = False
        for batch in loader:
            produced = True
            yield batch
        if not produced:
            raise RuntimeError("the loader produced no batches; the dataset is too small")
        loader.set_epoch(loader.epoch + 1)


def resolved(recipe: Recipe) -> RunContext:
    """The run context: `precision = auto` resolved for this machine, its device, its dataset,
    an "auto" worker/thread count measured (once: this process is one measurement)."""
    return prepare(recipe, DistInfo())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_loader(recipe: Recipe, warmup: int, batches: int) -> dict[str, Any]:
    """Iterate the train loader alone: images/s, CPU cores busy, peak PSS of the process tree."""
    ctx = resolved(recipe)
    loader = ctx.loader("train")
    batches_in = stream(loader)
    try:
        for _ in islice(batches_in, warmup):
            pass
        _sync(ctx.device)
        in_source = _source_time(loader)
        with ResourceSampler() as usage:
            started = time.perf_counter()
            for _ in islice(batches_in, batches):
                pass
            _sync(ctx.device)
            elapsed = time.perf_counter() - started
        in_source = [after - before for after, before in zip(_source_time(loader), in_source)]
    finally:
        loader.close()
    record = {
        "images_per_s": batches * ctx.recipe.train.batch_size / elapsed,
        "wall_s": elapsed,
        "cpu_cores": usage.cpu_cores,
        "peak_pss_mb": usage.peak_pss_mb,
    }
    if in_source:  # DALI calls its source on the training thread: the time it kept it there
        record["dali_source_ms_per_batch"] = 1000 * in_source[0] / max(1, in_source[1])
    return record


def _source_time(loader: Loader) -> list[float]:
    """[seconds, batches] the loader's source spent on the calling thread; [] if it keeps none."""
    if not hasattr(loader, "source_batches"):
        return []
    timed = cast(Any, loader)  # the DALI loader's counters (hasattr above)
    return [timed.source_s, timed.source_batches]


def measure_train(recipe: Recipe, warmup: int, steps: int) -> dict[str, Any]:
    """The real Trainer on the recipe's model: images/s, data-wait fraction, step time."""
    recipe = recipe.copy()
    recipe.train.accum_steps = 1  # one micro-batch per step: step time is comparable across runs
    ctx = resolved(recipe)
    loader = ctx.loader("train")
    # log_every past the window: only the closing log syncs, as in a long run.
    trainer = build_trainer(ctx, train_batches=len(loader), progress=False, log_every=warmup + steps + 1)
    batches_in = stream(loader)
    try:
        trainer.train_batches(islice(batches_in, warmup), warmup)
        trainer.totals.reset()
        with ResourceSampler() as usage:
            trainer.train_batches(islice(batches_in, steps), steps)
    finally:
        loader.close()
    t = trainer.totals
    return {
        **t.summary(),
        "step_ms": 1000 * t.wall_s / steps,
        "wall_s": t.wall_s,
        "cpu_cores": usage.cpu_cores,
        "peak_pss_mb": usage.peak_pss_mb,
    }


def measure_bare_loop(recipe: Recipe, warmup: int, steps: int) -> dict[str, Any]:
    """Forward, backward, step on one device-resident batch: the trainer's reference."""
    from stallfree.models import build_model
    from stallfree.train.precision import PrecisionPolicy

    ctx = resolved(recipe)
    recipe, device = ctx.recipe, ctx.device
    torch.manual_seed(recipe.train.seed)
    classes = ctx.num_classes
    model = build_model(recipe.model, classes).to(device)
    memory_format = torch.channels_last if recipe.train.channels_last else torch.contiguous_format
    model = model.to(memory_format=memory_format)  # type: ignore[call-overload]  # torch's stub lacks it
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    size, batch = recipe.augment.size_at(0), recipe.train.batch_size
    images = torch.randn(batch, 3, size, size, device=device).to(memory_format=memory_format)
    labels = torch.randint(0, classes, (batch,), device=device)
    policy = PrecisionPolicy(ctx.resolved.precision, device.type)
    loss_fn = torch.nn.CrossEntropyLoss()
    started = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            started = time.perf_counter()
        with policy.autocast():
            loss = loss_fn(model(images).float(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    _sync(device)
    elapsed = time.perf_counter() - started
    return {"images_per_s": steps * batch / elapsed, "step_ms": 1000 * elapsed / steps, "wall_s": elapsed}


def _child_main() -> None:
    """Entry point of a measurement process: a JSON request on stdin, a JSON result on stdout."""
    request = json.loads(sys.stdin.read())
    try:
        recipe = recipe_from_dict(request["recipe"])
        kind = request["kind"]
        measure = {"bare": measure_bare_loop, "loader": measure_loader, "train": measure_train}[kind]
        result = measure(recipe, request["warmup"], request["batches"])
    except Exception as exc:  # noqa: BLE001 - reported to the parent as a failed record
        result = {"error": f"{type(exc).__name__}: {exc}"}
    print(_RESULT_TAG + json.dumps(result), flush=True)


_RESULT_TAG = "STALLFREE_BENCH_RESULT "


# Under one lent device call (600 s) by default; STALLFREE_BENCH_TIMEOUT raises it.
CHILD_TIMEOUT_S = float(os.environ.get("STALLFREE_BENCH_TIMEOUT", "540"))


def run_isolated(
    kind: str, recipe: Recipe, warmup: int, batches: int, timeout_s: float = CHILD_TIMEOUT_S
) -> dict[str, Any]:
    """One measurement in a fresh interpreter: clean RSS, no state shared between runs.

    The child's stderr is kept in the record (`stderr`, its last lines): a successful run can
    still have said something that matters, e.g. DALI falling back to a CPU decode.
    """
    request = json.dumps({"kind": kind, "recipe": recipe.to_dict(), "warmup": warmup, "batches": batches})
    code = "from stallfree.bench.runner import _child_main; _child_main()"
    try:  # exec'd, not forked: no lock another thread holds here can reach the child
        proc = subprocess.run(
            [sys.executable, "-c", code], input=request, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout_s:.0f} s"}
    said = "\n".join(proc.stderr.strip().splitlines()[-20:])
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_RESULT_TAG):
            return {**json.loads(line[len(_RESULT_TAG) :]), **({"stderr": said} if said else {})}
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"measurement process exited with code {proc.returncode}: {tail}"}


def machine_info() -> dict[str, Any]:
    """CPU model and count, GPU, versions: what a reader needs to compare results."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "cores_available": cpu_cores(),
        "cpu_native_bf16": cpu_has_native_bf16(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
    }
    try:
        import nvidia.dali as dali

        info["dali"] = dali.__version__
    except ImportError:
        info["dali"] = None
    return info


def _has_dali() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


def _variants(backend: str, cfg: BenchConfig) -> list[tuple[str | None, list[str]]]:
    """(label, recipe overrides) for each setting of `backend` that the sweep asks for."""
    if (backend.startswith("torch") or backend.startswith("peer-")) and cfg.workers:
        return [(str(w), [f"loader.torch.workers={w}"]) for w in cfg.workers]
    if not backend.startswith("dali") or not (cfg.threads or cfg.hw_decoder_loads):
        return [(None, [])]
    out: list[tuple[str | None, list[str]]] = []
    thread_counts: list[int | None] = [*cfg.threads] or [None]
    loads: list[float | None] = [*cfg.hw_decoder_loads] or [None]
    for threads in thread_counts:
        for load in loads:
            parts = ([f"{threads}"] if threads is not None else []) + (
                [f"hw{load:g}"] if load is not None else []
            )
            label = " ".join(parts)
            sets = ([f"loader.dali.threads={threads}"] if threads is not None else []) + (
                [f"loader.dali.hw_decoder_load={load}"] if load is not None else []
            )
            out.append((label, sets))
    return out


def run_bench(recipe: Recipe, cfg: BenchConfig, progress: bool = True) -> dict[str, Any]:
    """Warm up, repeat and interleave every (mode, backend, workers); return all records."""
    cfg.validate()
    validate(recipe)
    check_data_root(recipe)
    # The device, `precision = auto` and --loader auto decided once, here, for every child. Only
    # that: an "auto" worker/thread count is measured in each child, for the backend it runs.
    decided = prepare_recipe(recipe, DistInfo()).resolved
    pinned = {"train.device": decided.device, "train.precision": decided.precision}
    recipe = apply_flags(recipe.copy(), {**pinned, "loader.backend": decided.backend})
    runs = [
        (mode, backend, knob, sets)
        for mode in cfg.modes
        for backend in cfg.backends
        for knob, sets in _variants(backend, cfg)
    ]
    records: list[dict[str, Any]] = []
    limits: list[dict[str, Any]] = []
    dali_rate = dali_single_thread(run_isolated) if _has_dali() else None
    for repeat in range(cfg.repeats):
        if recipe.data.root and "loader" in cfg.modes:
            # Interleaved too: the ceiling drifts as well.
            limits.append(
                measure_limit(recipe, sample=cfg.limit_files, passes=cfg.limit_passes, dali_rate=dali_rate)
            )
        for mode, backend, knob, sets in runs:
            variant = apply_overrides(recipe.copy(), [*BENCH_VARIANTS[backend], *sets])
            result = run_isolated(mode, variant, cfg.warmup, cfg.batches)
            record = {"backend": backend, "mode": mode, "knob": knob, "repeat": repeat, **result}
            records.append(record)
            if progress:
                LOGGER.info(_progress_line(record))
        if "train" in cfg.modes:
            result = run_isolated("bare", recipe, cfg.warmup, cfg.batches)
            records.append(
                {"backend": "bare-loop", "mode": "train", "knob": None, "repeat": repeat, **result}
            )
    return {
        "machine": machine_info(),
        "limit": median_limit(limits),
        "records": records,
        "config": {
            "repeats": cfg.repeats,
            "warmup": cfg.warmup,
            "batches": cfg.batches,
            "batch_size": recipe.train.batch_size,
            "model": recipe.model.name,
            "image_size": recipe.augment.size_at(0),
            "precision": recipe.train.precision,
            "data_root": recipe.data.root,
            "augment": augment_words(recipe.augment),
            "exact_decode": recipe.loader.torch.exact_decode,
        },
    }


def augment_words(aug: AugmentConfig) -> str:
    """The train augmentation in a few words, for the report: a policy changes every figure."""
    words = ["RandomResizedCrop + flip"]
    if aug.auto_augment == "randaugment":
        words.append(f"RandAugment n={aug.randaugment_n} m={aug.randaugment_m}/{aug.magnitude_bins}")
    elif aug.auto_augment == "trivialaugment":
        words.append(f"TrivialAugmentWide ({aug.magnitude_bins} bins)")
    if aug.random_erasing:
        words.append(f"random erasing p={aug.random_erasing}")
    if aug.mixup_alpha or aug.cutmix_alpha:
        words.append(f"mixup {aug.mixup_alpha} / CutMix {aug.cutmix_alpha} on the device")
    return ", ".join(words)


def _progress_line(record: dict[str, Any]) -> str:
    knob = f" x{record['knob']}" if record["knob"] is not None else ""
    if "error" in record:
        return f"[{record['repeat']}] {record['mode']:<6} {record['backend']}{knob}: ERROR {record['error']}"
    source = record.get("dali_source_ms_per_batch")
    return (
        f"[{record['repeat']}] {record['mode']:<6} {record['backend']}{knob}: "
        f"{record['images_per_s']:.1f} img/s"
        + (f", {source:.1f} ms/batch in DALI's source on the training thread" if source is not None else "")
    )
