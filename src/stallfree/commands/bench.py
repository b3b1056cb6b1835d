"""`stallfree bench`: its parser and its handler (the work lives in `stallfree.bench`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stallfree.bench.variants import BENCH_VARIANTS
from stallfree.recipe import DEVICES, RecipeError, apply_flags, load_recipe


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _float_list(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `stallfree bench` on the CLI's sub-parsers."""
    p = sub.add_parser("bench", help="measure the loaders (ours and the usual ones) and training speed")
    p.add_argument("recipe", help="a recipe TOML, e.g. pipelines/bench.toml")
    p.add_argument(
        "--backends",
        help=f"comma-separated: {', '.join(BENCH_VARIANTS)} (default: dali, torch, "
        "torch-naive, synthetic and the peers installed here)",
    )
    p.add_argument("--mode", default="loader,train", help="comma-separated: loader, train")
    p.add_argument("--out", default="runs/bench", help="folder for bench.json, bench.md, bench.png")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no per-run progress lines (they are timestamped off a terminal)",
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per setting; the median is reported")
    p.add_argument("--warmup", type=int, default=5, help="untimed batches before each run")
    p.add_argument("--batches", type=int, default=30, help="timed batches (or steps) per run")
    p.add_argument("--workers", type=_int_list, default=[], help="torch worker sweep, e.g. 1,2,3")
    p.add_argument("--threads", type=_int_list, default=[], help="dali thread sweep, e.g. 1,2,3")
    p.add_argument(
        "--hw-decoder-load",
        type=_float_list,
        default=[],
        metavar="LOADS",
        help="dali nvJPEG hardware-decoder share sweep, e.g. 0.12,0.65,0.9",
    )
    p.add_argument("--device", choices=DEVICES, help="training device")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")


def cmd_bench(args: argparse.Namespace) -> int:
    """Run the benchmark and write its report; the exit code."""
    from stallfree.bench.report import write_report
    from stallfree.bench.runner import BenchConfig, run_bench
    from stallfree.train.rundir import RunDir

    flags = {"train.device": args.device} if args.device else {}
    recipe = apply_flags(load_recipe(args.recipe), flags, args.overrides)
    config = BenchConfig(
        modes=[m for m in args.mode.split(",") if m],
        repeats=args.repeats,
        warmup=args.warmup,
        batches=args.batches,
        workers=args.workers,
        threads=args.threads,
        hw_decoder_loads=args.hw_decoder_load,
    )
    if args.backends:
        config.backends = [b for b in args.backends.split(",") if b]
    try:
        config.validate()
    except ValueError as exc:
        raise RecipeError(str(exc)) from exc
    RunDir(args.out).check_writable()  # now, not after the whole benchmark
    result = run_bench(recipe, config, progress=not args.no_progress)
    written = write_report(result, args.out, command="stallfree " + " ".join(sys.argv[1:]))
    print((Path(args.out) / "bench.md").read_text())
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
