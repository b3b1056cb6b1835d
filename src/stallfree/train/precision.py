"""Precision policy: which autocast dtype runs natively here, and whether a GradScaler is needed."""

from __future__ import annotations

import contextlib
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# CPU flags that mean bf16 matmuls run in hardware; without them autocast emulates bf16 and
# runs several times slower than fp32 (7.6x measured on an AVX2-only EPYC).
_X86_BF16_FLAGS = {"avx512_bf16", "amx_bf16"}


def cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (x86 `flags`, ARM `Features`); empty elsewhere."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_has_native_bf16(flags: set[str] | None = None) -> bool:
    """AVX512-BF16 or AMX on x86; the BF16 extension on ARM (flag `bf16`)."""
    flags = cpu_flags() if flags is None else flags
    if platform.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in flags
    return bool(flags & _X86_BF16_FLAGS)


def cuda_has_native_bf16(device: torch.device) -> bool:
    """Ampere (compute capability 8.0) and newer run bf16 in hardware."""
    return torch.cuda.get_device_capability(device)[0] >= 8


def resolve_precision(requested: str, device: torch.device, *, cpu_bf16: bool | None = None) -> str:
    """`auto` -> what `device` runs natively; an explicit choice is returned unchanged.

    CUDA: bf16 from Ampere on, else fp16 (with GradScaler). CPU: bf16 with native bf16
    instructions, else fp32. `cpu_bf16` overrides the CPU probe (for tests).
    """
    if requested != "auto":
        return requested
    if device.type == "cuda":
        return "bf16" if cuda_has_native_bf16(device) else "fp16"
    native = cpu_has_native_bf16() if cpu_bf16 is None else cpu_bf16
    return "bf16" if device.type == "cpu" and native else "fp32"


@dataclass(frozen=True, slots=True)
class PrecisionPolicy:
    """bf16 and fp16 autocast (fp16 with loss scaling); fp32 runs without autocast."""

    precision: str
    device_type: str

    def __post_init__(self) -> None:
        if self.precision not in _DTYPES:
            raise ValueError(
                f"precision {self.precision!r}; resolve 'auto' first, or choose one of {', '.join(_DTYPES)}"
            )

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.precision]

    @property
    def needs_scaler(self) -> bool:
        # fp16's 5-bit exponent underflows small gradients; bf16 has fp32's range.
        return self.precision == "fp16"

    def autocast(self) -> contextlib.AbstractContextManager[object]:
        """`torch.autocast` for this device (the non-deprecated, device-generic API)."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """An enabled scaler only for fp16; a disabled one is a no-op in the same code path."""
        return torch.amp.GradScaler(self.device_type, enabled=self.needs_scaler)
