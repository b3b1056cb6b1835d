"""CUDA-facing code paths: what a CPU can check of them, and `gpu` tests for the rest."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import small_recipe

from stallfree.data.backends.prefetch import DevicePrefetcher
from stallfree.errors import DeviceError
from stallfree.metrics import GpuMonitor
from stallfree.parallel import DistInfo
from stallfree.train.checkpoint import rng_state, set_rng_state
from stallfree.train.distributed import local_cuda_index

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def _reference(images: torch.Tensor) -> torch.Tensor:
    """Normalised NCHW float32, computed the plain way."""
    x = images.permute(0, 3, 1, 2).float() / 255
    return (x - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


def _uint8_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, 256, (4, 16, 16, 3), dtype=torch.uint8, generator=g), torch.arange(4))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
def test_prefetcher_normalises_like_the_reference(
    device: str, dtype: torch.dtype, channels_last: bool
) -> None:
    images, labels = _uint8_batch()
    prefetcher = DevicePrefetcher(torch.device(device), MEAN, STD, dtype, channels_last)
    batches = list(prefetcher([(images.pin_memory() if device == "cuda" else images, labels)]))
    out = batches[0]
    assert out.images.device.type == device and out.images.dtype == dtype
    assert out.images.is_contiguous(
        memory_format=torch.channels_last if channels_last else torch.contiguous_format
    )
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.allclose(out.images.float().cpu(), _reference(images), atol=tolerance)
    assert torch.equal(out.labels.cpu(), labels)


@pytest.mark.parametrize(
    "local_rank, local_world, visible, expected",
    [
        (3, 8, 8, 3),  # torchrun, every GPU visible: LOCAL_RANK
        (3, 4, 1, 0),  # Slurm --gpus-per-task=1: one visible GPU per task
        (0, 1, 2, 0),
    ],
)
def test_local_rank_maps_into_the_visible_devices(
    local_rank: int, local_world: int, visible: int, expected: int
) -> None:
    info = DistInfo(
        rank=local_rank, world_size=local_world, local_rank=local_rank, local_world_size=local_world
    )
    assert local_cuda_index(info, visible) == expected


def test_a_rank_without_a_gpu_is_a_clear_error() -> None:
    info = DistInfo(rank=3, world_size=4, local_rank=3, local_world_size=4)
    with pytest.raises(DeviceError, match="LOCAL_RANK 3 has no CUDA device: only 2 visible"):
        local_cuda_index(info, 2)


def test_gpu_monitor_switches_off_after_its_first_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def unsupported(device: object) -> int:
        calls.append(device)
        raise RuntimeError("NVML: querying device utilization rates is not currently supported")

    monkeypatch.setattr(torch.cuda, "utilization", unsupported)
    monitor = GpuMonitor(torch.device("cuda", 0))
    with pytest.warns(UserWarning, match="GPU metrics off.*not currently supported"):
        assert monitor.sample() == {}
    assert monitor.sample() == {} and len(calls) == 1  # off: no second query, no second warning


def test_rng_state_holds_only_this_ranks_cuda_device() -> None:
    state = rng_state(torch.device("cpu"))
    assert isinstance(state["cuda"], torch.Tensor) and state["cuda"].numel() == 0
    # A checkpoint written on a GPU host restores on a host with fewer (or no) GPUs.
    state["cuda"] = torch.zeros(16, dtype=torch.uint8)
    set_rng_state(state, torch.device("cpu"))


@pytest.mark.dali
def test_dali_memory_errors_are_not_reported_as_bad_files(
    image_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from helpers import build_loader

    loader = build_loader(
        small_recipe(image_root, loader={"backend": "dali"}), "train", device=torch.device("cpu")
    )

    def out_of_memory() -> object:
        raise RuntimeError("CUDA error: out of memory (cudaErrorMemoryAllocation)")

    monkeypatch.setattr(loader, "_build", out_of_memory)
    with pytest.raises(RuntimeError, match="out of memory") as info:
        next(iter(loader))
    assert type(info.value) is RuntimeError  # unchanged: the trainer's OOM advice applies


@pytest.mark.gpu
def test_gpu_precision_auto_and_cudnn_benchmark(image_root: Path, tmp_path: Path) -> None:
    from stallfree.train.run import train

    recipe = small_recipe(image_root, train={"device": "cuda", "precision": "auto", "batch_size": 16})
    summary = train(recipe, tmp_path / "run", progress=False)
    assert summary["precision"] in ("bf16", "fp16") and summary["device"].startswith("cuda")
    assert torch.backends.cudnn.benchmark


@pytest.mark.parametrize("in_worker", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_worker_normalisation_equals_the_device_one(
    monkeypatch: pytest.MonkeyPatch, in_worker: bool, channels_last: bool
) -> None:
    """A CPU run normalises in the workers (into shared memory there): the same numbers and
    layout as the GPU path's batch normalisation."""
    import numpy as np

    import stallfree.data.backends.prefetch as prefetch
    from stallfree.data.backends.prefetch import Normaliser, NormalisingCollate, collate_uint8

    monkeypatch.setattr(prefetch, "get_worker_info", lambda: object() if in_worker else None)
    rng = np.random.default_rng(0)
    items = [(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8), i) for i in range(5)]
    images, labels = NormalisingCollate(MEAN, STD, channels_last)(items)
    expected = Normaliser(MEAN, STD, torch.float32, channels_last)(collate_uint8(items)[0])
    assert torch.allclose(images, expected, atol=1e-6) and images.shape == (5, 3, 12, 10)
    assert images.is_contiguous(
        memory_format=torch.channels_last if channels_last else torch.contiguous_format
    )
    assert images.is_shared() == in_worker and labels.tolist() == [0, 1, 2, 3, 4]
