"""Precision policy: autocast dtype and whether a GradScaler is needed."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True, slots=True)
class PrecisionPolicy:
    """bf16 and fp16 autocast (fp16 with loss scaling); fp32 runs without autocast."""

    precision: str
    device_type: str

    def __post_init__(self) -> None:
        if self.precision not in _DTYPES:
            raise ValueError(f"precision {self.precision!r}; choose one of {', '.join(_DTYPES)}")

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
