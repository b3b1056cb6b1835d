"""`stallfree doctor`: what this machine can run, and why not, in one screen and in seconds.

Each line is OK, WARN or FAIL with the fix. FAIL means stallfree cannot do what the machine
was set up for (a GPU without a working nvJPEG decode, DALI that does not import); WARN means
a path that is unavailable here or slower than it could be (no GPU on a CPU machine).
`--json` prints the same checks as a list of {"check", "status", "detail", "fix"}.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import platform
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

OK, WARN, FAIL = "OK", "WARN", "FAIL"


@dataclass(frozen=True, slots=True)
class Check:
    """One line of the report."""

    check: str
    status: str
    detail: str
    fix: str = ""

    @classmethod
    def passed_if(cls, check: str, ok: bool, detail: str, fix: str, bad: str = FAIL) -> list[Check]:
        """The report's line of `check`: OK, else `bad` (FAIL or WARN) with its `fix`."""
        return [cls(check, OK if ok else bad, detail, "" if ok else fix)]


def _python() -> list[Check]:
    ok = sys.version_info >= (3, 10)
    return Check.passed_if("python", ok, platform.python_version(), "stallfree needs Python 3.10 or newer")


def _recipe_writer() -> list[Check]:
    try:
        importlib.import_module("tomli_w")
    except ImportError:
        return [
            Check(
                "tomli-w",
                WARN,
                "not installed: recipes are written with the built-in fallback writer",
                "pip install tomli-w",
            )
        ]
    return [Check("tomli-w", OK, "installed")]


def _torch() -> tuple[list[Check], Any]:
    try:
        torch = importlib.import_module("torch")
    except ImportError as exc:
        return [Check("torch", FAIL, f"does not import: {exc}", "pip install torch")], None
    build = torch.version.cuda or "none (CPU build)"
    return [Check("torch", OK, f"{torch.__version__}, CUDA build {build}")], torch


def _gpus(torch: Any) -> list[Check]:
    if torch is None or not torch.cuda.is_available():
        cause = (
            "this torch is a CPU build"
            if torch is not None and not torch.version.cuda
            else "no CUDA device visible"
        )
        return [
            Check(
                "gpu",
                WARN,
                f"no CUDA device ({cause}): training runs on the CPU",
                "on a GPU machine, install a CUDA build of torch; check nvidia-smi and CUDA_VISIBLE_DEVICES",
            )
        ]
    checks = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        mig = " (MIG slice)" if "MIG" in p.name else ""
        checks.append(
            Check(
                f"gpu {i}",
                OK,
                f"{p.name}{mig}, compute {p.major}.{p.minor}, {p.total_memory / 2**30:.0f} GiB",
            )
        )
    return checks


def _precision(torch: Any) -> list[Check]:
    if torch is None:
        return []
    from stallfree.train.precision import cpu_has_native_bf16, resolve_precision

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = resolve_precision("auto", device)
    note = (
        ""
        if device.type == "cuda"
        else (" (native bf16 on this CPU)" if cpu_has_native_bf16() else " (no native bf16 here)")
    )
    return [Check("precision auto", OK, f"{resolved} on {device.type}{note}")]


def _dali(torch: Any) -> tuple[list[Check], Any]:
    try:
        dali = importlib.import_module("nvidia.dali")
    except ModuleNotFoundError as exc:
        if exc.name and not exc.name.startswith("nvidia"):
            return [
                Check(
                    "dali",
                    FAIL,
                    f"installed but cannot import: missing module {exc.name!r}",
                    f"pip install {exc.name.replace('_', '-')} (into the same tree as DALI)",
                )
            ], None
        return [
            Check(
                "dali",
                WARN,
                "not installed: --loader dali is unavailable",
                "pip install 'stallfree[dali]' (nvidia-dali-cuda120), or dali-cuda130 for a CUDA 13 torch",
            )
        ], None
    except ImportError as exc:
        return [Check("dali", FAIL, f"does not import: {exc}", "reinstall DALI")], None
    flavour = _dali_flavour()
    detail = f"{dali.__version__}" + (f" ({flavour})" if flavour else "")
    torch_cuda = (torch.version.cuda or "") if torch is not None else ""
    if torch_cuda and flavour and flavour[4:6] != torch_cuda.split(".")[0]:
        return [
            Check(
                "dali",
                WARN,
                f"{detail} is built for CUDA {flavour[4:6]}, torch for CUDA {torch_cuda}",
                f"pip install nvidia-dali-cuda{torch_cuda.split('.')[0]}0",
            )
        ], dali
    return [Check("dali", OK, detail)], dali


def _dali_flavour() -> str:
    """ "cuda120" or "cuda130": which DALI wheel is installed (none: the NVIDIA container's)."""
    from importlib import metadata

    for flavour in ("cuda130", "cuda120"):
        try:
            metadata.version(f"nvidia-dali-{flavour}")
            return flavour
        except metadata.PackageNotFoundError:
            continue
    return ""


def _libraries(dali: Any) -> list[Check]:
    """nvImageCodec (every DALI decode) and nvjpeg (the GPU decode) must load."""
    if dali is None:
        return []
    checks = []
    for name, soname, fix in (
        (
            "nvimgcodec",
            "libnvimgcodec.so.0",
            "pip install nvidia-nvimgcodec-cu13 (or -cu12) into the same tree as DALI",
        ),
        (
            "nvjpeg",
            "libnvjpeg.so",
            "pip install nvidia-nvjpeg (CUDA 13) or nvidia-nvjpeg-cu12 into the same tree as DALI",
        ),
    ):
        found = _find_library(soname)
        if found is None:
            status = FAIL if name == "nvimgcodec" else WARN
            checks.append(Check(name, status, f"{soname} not found", fix))
            continue
        try:
            ctypes.CDLL(str(found))
            checks.append(Check(name, OK, f"loads: {found}"))
        except OSError as exc:
            checks.append(Check(name, FAIL, f"{found} does not load: {exc}", fix))
    return checks


def _find_library(soname: str) -> Path | None:
    """A library in the Python trees (nvidia/*/lib, DALI's own folder), else the system's."""
    stem = soname.split(".so")[0]
    for base in sys.path:
        nvidia = Path(base or ".") / "nvidia"
        if nvidia.is_dir():
            hits = sorted(
                p
                for p in nvidia.glob(f"*/**/{stem}.so*")
                if re.fullmatch(rf"{re.escape(stem)}\.so(\.\d+)*", p.name)
            )
            if hits:
                return hits[0]
    try:
        ctypes.CDLL(soname)
        return Path(soname)
    except OSError:
        return None


def _mixed_decode(torch: Any, dali: Any) -> list[Check]:
    """Decode one JPEG with DALI's `mixed` decoder and prove it ran on the GPU."""
    if dali is None or torch is None or not torch.cuda.is_available():
        return [
            Check(
                "mixed decode",
                WARN,
                "not tried (needs a CUDA device and DALI)",
                "run `stallfree doctor` on the GPU machine",
            )
        ]
    from stallfree.data.backends.dali_probe import probe_gpu_decode

    ok, detail = probe_gpu_decode()
    return Check.passed_if(
        "mixed decode", ok, detail, "install nvjpeg into DALI's tree (see the nvjpeg line)"
    )


def _shm() -> list[Check]:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return [Check("/dev/shm", WARN, "not present", "DataLoader workers need shared memory")]
    size = st.f_frsize * st.f_blocks / 2**30
    if size < 1:
        return [
            Check(
                "/dev/shm",
                WARN,
                f"{size:.2f} GiB: DataLoader workers may die with 'bus error'",
                "docker run --ipc=host (or --shm-size=16g)",
            )
        ]
    return [Check("/dev/shm", OK, f"{size:.1f} GiB")]


def _cores(torch: Any) -> list[Check]:
    from stallfree.parallel import cpu_cores, cpu_workers

    gpus = torch.cuda.device_count() if torch is not None and torch.cuda.is_available() else 0
    per = max(1, gpus)
    cores = cpu_cores()
    share = f"{cores // gpus} per GPU" if gpus else "no GPU"
    detail = (
        f"{cores} cores for this process ({share}); loader workers/threads -1 -> "
        f"{cpu_workers(-1, per)} per rank with {per} rank(s) on this node"
    )
    enough = not gpus or cores // gpus >= 4
    return Check.passed_if(
        "cpu", enough, detail, "few cores per GPU: prefer --loader dali (decode on the GPU)", WARN
    )


def _cache() -> list[Check]:
    from stallfree.data.readers.startup_check import cache_dir

    path = cache_dir()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        return [
            Check(
                "cache",
                WARN,
                f"{path} is not writable ({exc.strerror or exc}): every start checks all headers again",
                "set STALLFREE_CACHE to a writable folder",
            )
        ]
    return [Check("cache", OK, str(path))]


def diagnose() -> list[Check]:
    """Every check, in the order the report prints them."""
    checks = _python() + _recipe_writer()
    torch_checks, torch = _torch()
    dali_checks, dali = _dali(torch)
    steps: list[Callable[[], list[Check]]] = [
        lambda: torch_checks,
        lambda: _gpus(torch),
        lambda: _precision(torch),
        lambda: dali_checks,
        lambda: _libraries(dali),
        lambda: _mixed_decode(torch, dali),
        _shm,
        lambda: _cores(torch),
        _cache,
    ]
    for step in steps:
        checks += step()
    return checks


def report(checks: list[Check], as_json: bool = False) -> str:
    """The checks as one screen of text, or as JSON."""
    if as_json:
        return json.dumps([asdict(c) for c in checks], indent=1)
    lines = [
        f"{c.status:<4}  {c.check:<15} {c.detail}"
        + (f"\n      -> {c.fix}" if c.fix and c.status != OK else "")
        for c in checks
    ]
    return "\n".join(lines)
