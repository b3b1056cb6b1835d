"""`precision = auto`: what the device runs natively; an explicit choice is never changed."""

from __future__ import annotations

import pytest
import torch

from stallfree.train.precision import cpu_has_native_bf16, resolve_precision

CPU = torch.device("cpu")


@pytest.mark.parametrize("native, expected", [(True, "bf16"), (False, "fp32")])
def test_auto_on_cpu_follows_native_bf16(native: bool, expected: str) -> None:
    assert resolve_precision("auto", CPU, cpu_bf16=native) == expected


@pytest.mark.parametrize("explicit", ["bf16", "fp16", "fp32"])
def test_explicit_precision_is_kept(explicit: str) -> None:
    assert resolve_precision(explicit, CPU, cpu_bf16=False) == explicit


def test_cpu_flags_decide_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("platform.machine", lambda: "x86_64")
    assert cpu_has_native_bf16({"avx2", "avx512f", "avx512_bf16"})
    assert cpu_has_native_bf16({"avx2", "amx_bf16"})
    assert not cpu_has_native_bf16({"avx2", "fma", "avx512f"})  # AVX2-only EPYC, or AVX-512 without BF16


@pytest.mark.gpu
def test_auto_on_cuda_is_a_half_precision() -> None:
    assert resolve_precision("auto", torch.device("cuda")) in ("bf16", "fp16")
