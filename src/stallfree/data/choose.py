"""`--loader auto`: the fallback chain, decided once per run and said in its start line.

On a GPU, `dali` with nvJPEG when a one-image `mixed` decode really runs there; else `dali`
decoding on the CPU where this rank has the cores for it; on a CPU run, `CPU_CHOICE`; otherwise
`torch`, which needs nothing beyond torch and Pillow. Both backends follow the same sample order
and augmentation recipe, so the choice changes speed, not what is trained on (a random crop's
pixels differ, their distribution does not; val pixels agree within 2 grey levels, test_dali).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import torch

from stallfree.data.registry import AUTO, BACKENDS
from stallfree.log import LOGGER
from stallfree.parallel import DistInfo, cpu_workers
from stallfree.recipe import LoaderConfig

# A GPU whose nvJPEG path fails gets DALI decoding on the CPU only with this many cores: its
# CPU decode needs threads to keep a GPU busy, and with fewer the torch backend's workers do as
# well (a judgement, not a measurement: no GPU has been lent to measure where the two cross).
_DALI_CPU_MIN_CORES = 4
# The CPU run's loader. Measured in `stallfree bench` (benchmarks/RESULTS.md, 2-core EPYC,
# loader mode): dali 492 and torch 457 img/s, within that VM's +-10% run-to-run spread; torch
# held 299 MB against DALI's 544, needs no extra package, and refuses a JPEG with corrupt
# entropy data that DALI decodes to garbled pixels without an error. On a CPU the model's
# compute dominates a step anyway (train-mode data-wait 0.2-1.1% for both in RESULTS.md's
# 2-core Xeon run; 4.3% dali and 2.7% torch in the 48 px demo on the EPYC).
CPU_CHOICE = "torch"


@lru_cache(maxsize=1)
def _dali_problem() -> str | None:
    """Why DALI cannot be used here, or None when it imports."""
    try:
        importlib.import_module("nvidia.dali")
        importlib.import_module("nvidia.dali.plugin.pytorch")
    except Exception as exc:  # noqa: BLE001 - any import failure means "not DALI"
        return f"DALI does not import ({type(exc).__name__}: {exc})"
    return None


@lru_cache(maxsize=4)
def _gpu_decode_problem(device_index: int) -> str | None:
    """Why nvJPEG decode does not run on this GPU, or None when a one-image probe did (the probe
    `stallfree doctor` runs: DALI falls back to the CPU with only a warning)."""
    from stallfree.data.backends.dali_probe import probe_gpu_decode

    with torch.cuda.device(device_index):
        ok, said = probe_gpu_decode()
    return None if ok else said


@dataclass(frozen=True, slots=True)
class Choice:
    """What `--loader auto` decided on one device: the backend, DALI's decode (`"cpu"` when
    nvJPEG fails but the cores suffice) and why, for the run's start line."""

    backend: Literal["dali", "torch"]
    why: str
    dali_decode: Literal["auto", "cpu"] = "auto"


def choose_backend(device: torch.device, local_world_size: int = 1) -> Choice:
    """The backend `--loader auto` takes on `device` (its nvJPEG probe runs on that GPU)."""
    dali_problem = _dali_problem()
    if device.type == "cuda":
        if dali_problem is None:
            gpu_problem = _gpu_decode_problem(device.index or 0)
            if gpu_problem is None:
                return Choice("dali", "DALI decodes on this GPU (nvJPEG probe passed)")
            cores = cpu_workers(-1, local_world_size)
            if cores >= _DALI_CPU_MIN_CORES:
                return Choice(
                    "dali",
                    f"nvJPEG failed ({gpu_problem}); DALI decodes on {cores} CPU cores "
                    "and augments on the GPU",
                    dali_decode="cpu",
                )
            return Choice(
                "torch",
                f"nvJPEG failed ({gpu_problem}) and {cores} core(s) per rank "
                f"are under {_DALI_CPU_MIN_CORES} for DALI's CPU decode",
            )
        return Choice("torch", f"no GPU decode: {dali_problem}")
    if CPU_CHOICE == "dali" and dali_problem is None:
        return Choice("dali", "CPU run: DALI's CPU graph measured fastest here")
    if CPU_CHOICE == "dali":
        return Choice("torch", f"CPU run: {dali_problem}")
    return Choice(
        "torch",
        "CPU run: torch measured within the spread of DALI's CPU graph, in "
        "about half the memory (benchmarks/RESULTS.md)",
    )


def resolve_auto(
    loader: LoaderConfig, device: torch.device, dist: DistInfo, *, say: bool = False
) -> LoaderConfig:
    """`loader` with `backend = "auto"` (or a wrapper's "auto", synthetic-decode's) decided for
    `device`: a copy, that the backend is resolved from; `loader` itself keeps "auto" (the run's
    Resolved record says what it became). `say`: log the choice and its reason (rank 0 of a run)."""
    entry = BACKENDS.get(loader.backend)
    wrapped_auto = entry is not None and entry.wraps and getattr(loader, entry.wraps) == AUTO
    if loader.backend != AUTO and not wrapped_auto:
        return loader
    # Through the module attribute, so that a test's stand-in is the one asked.
    choice: Choice = sys.modules[__name__].choose_backend(device, dist.local_world_size)
    # nvJPEG failed on this GPU: DALI decodes on the CPU
    dali = dataclasses.replace(loader.dali, decode="cpu") if choice.dali_decode == "cpu" else loader.dali
    if wrapped_auto:
        assert entry is not None
        wrapped: dict[str, Any] = {entry.wraps: choice.backend}
        return dataclasses.replace(loader, dali=dali, **wrapped)
    if say and dist.rank == 0:
        LOGGER.info(f"--loader auto: {choice.backend} ({choice.why})")
    return dataclasses.replace(loader, backend=choice.backend, dali=dali)
