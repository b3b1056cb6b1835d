"""Loader throughput with a per-read latency injected into `read_bytes`.

A network filesystem answers a read in ~2 ms, an object store in ~20: this sleeps that long in
every `read_bytes` call (the one function every stallfree read of a file's bytes goes through),
then measures `stallfree bench --mode loader`'s figure (`measure_loader`) on each backend.

    PYTHONPATH=src .venv/bin/python benchmarks/read_latency.py DATA --delays 0,2,20 --out out.json
    PYTHONPATH=src .venv/bin/python benchmarks/read_latency.py --smoke   # 20 demo images, seconds

Run it with another checkout's src/ on PYTHONPATH to measure that code (the "before" column).
What it does not see: PIL's own opens by path (the old DALI source's header check opened each
file a second time that way), which a real network filesystem would also make wait.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# The interpreter of the child processes: $PYTHON_EXEC where set (torchrun's variable; the tests
# point it at their fork server, whose children start with torch imported), else this one.
PYTHON = os.environ.get("PYTHON_EXEC", sys.executable)


def install_delay(seconds: float) -> None:
    """Make every stallfree module's `read_bytes` sleep `seconds` first (forked workers inherit it)."""
    import importlib

    from stallfree.data.readers import headers

    # Imported now, so that their `read_bytes` names exist to be patched (DALI: where installed).
    for name in ("transforms.decode", "backends.torch_backend", "backends.dali_backend"):
        try:
            importlib.import_module(f"stallfree.data.{name}")
        except Exception:  # noqa: BLE001 - DALI not installed: its backend is not measured
            pass

    original = headers.read_bytes

    def delayed(path: str, limit: int | None = None) -> bytes:
        time.sleep(seconds)
        return original(path, limit)

    patched = []
    for name, module in list(sys.modules.items()):
        if name.startswith("stallfree") and getattr(module, "read_bytes", None) is original:
            module.read_bytes = delayed  # type: ignore[attr-defined]
            patched.append(name)
    if "stallfree.data.backends.torch_backend" not in patched:  # else every figure is undelayed
        raise SystemExit("read_latency.py: the torch backend no longer reads through headers.read_bytes")
    dali = sys.modules.get("stallfree.data.backends.dali_backend")
    if dali is not None:
        dali.DaliLoader._feed = _timed(dali.DaliLoader._feed)  # noqa: SLF001 - measured from outside


# Time of each call into DALI's source (its generator's next()), on the thread that calls it:
# the same figure for any version of the code, warm-up batches included.
SOURCE_CALLS: list[float] = []


def _timed(feed: Any) -> Any:
    from stallfree.train.interval import StepTimer

    def timed(self: Any) -> Any:
        timer = StepTimer()  # its wait: the time blocked in next(), the end's call not counted
        for item in timer.iterate(feed(self)):
            SOURCE_CALLS.append(timer.lap()[1])  # this call's alone
            yield item

    return timed


def measure(
    data: Path,
    backend: str,
    workers: int,
    batch: int,
    batches: int,
    io_depth: int | str = "auto",
    size: int = 96,
) -> dict[str, Any]:
    """One `measure_loader` run: images/s (and DALI's time in its source, where it reports it)."""
    from stallfree.bench.runner import measure_loader
    from stallfree.recipe import recipe_from_dict

    recipe = recipe_from_dict(
        {
            "data": {"root": str(data)},
            "augment": {"image_size": size, "resize_size": round(size * 8 / 7)},
            "model": {"name": "small_cnn"},
            "train": {"batch_size": batch, "precision": "fp32", "device": "cpu"},
            "loader": {
                "backend": backend,
                "io_depth": int(io_depth) if str(io_depth).isdigit() else io_depth,
                "torch": {"workers": workers},
                "dali": {"threads": workers},
            },
        }
    )
    return measure_loader(recipe, warmup=2, batches=batches)


def main() -> None:
    """Parse, inject the delay, measure each backend; print and write one JSON line per run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data", type=Path, nargs="?", help="an ImageFolder (not with --smoke)")
    parser.add_argument("--delays", default="0,2,20", help="ms per read, comma-separated")
    parser.add_argument("--backends", default="torch,dali")
    parser.add_argument("--workers", type=int, default=2, help="torch workers, DALI threads")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--delay-ms", type=float, default=None, help=argparse.SUPPRESS)  # one child run
    parser.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="20 demo images in a temp folder, 1 ms")
    args = parser.parse_args()
    if args.smoke:
        from stallfree.data.tools.demo import write_demo

        with tempfile.TemporaryDirectory(prefix="read-latency-smoke-") as tmp:
            data = write_demo(Path(tmp) / "demo", train_per_class=2, val_per_class=1, progress=False)
            vars(args).update(data=data, delays="1", batch=8, batches=2)
            run(args)
        return
    if args.data is None:
        parser.error("DATA is required (or --smoke)")
    if args.delay_ms is not None:  # a child: one delay, one backend, in a fresh process
        install_delay(args.delay_ms / 1000)
        result = measure(args.data, args.backend, args.workers, args.batch, args.batches)
        if SOURCE_CALLS:
            result["source_ms_per_call"] = 1000 * sum(SOURCE_CALLS) / len(SOURCE_CALLS)
        print(json.dumps({"backend": args.backend, "delay_ms": args.delay_ms, **result}))
        return
    run(args)


def run(args: argparse.Namespace) -> None:
    """Each (delay, backend) in a fresh process; one JSON line each, and the rows to --out."""
    rows = []
    for delay in [float(d) for d in args.delays.split(",")]:
        for backend in args.backends.split(","):
            child = [PYTHON, __file__, str(args.data), "--delay-ms", str(delay), "--backend", backend]
            child += [
                "--workers",
                str(args.workers),
                "--batch",
                str(args.batch),
                "--batches",
                str(args.batches),
            ]
            out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
