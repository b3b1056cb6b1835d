"""Command line: parses arguments and dispatches; the work lives in the modules it calls."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

# Torch-free imports only: `stallfree --help` answers at once; commands import what they need.
from stallfree.bench.variants import BENCH_VARIANTS
from stallfree.data.registry import AUTO, BACKENDS
from stallfree.errors import RunDirError, StallfreeError
from stallfree.log import LOGGER, setup_logging, show_progress
from stallfree.predict import add_parser as _predict_parser
from stallfree.predict import cmd_predict
from stallfree.recipe import (
    DEFAULT_MAX_PIXELS,
    Recipe,
    RecipeError,
    apply_overrides,
    check_paths,
    load_recipe,
    validate,
)
from stallfree.version import __version__


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model from a recipe (one CPU, one GPU, or torchrun/srun)")
    p.add_argument("recipe", help="a recipe TOML, e.g. pipelines/demo.toml")
    p.add_argument("--loader", help=f"loader backend: {' | '.join([AUTO, *BACKENDS])} | module:function")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="training device")
    p.add_argument("--epochs", type=int, help="number of epochs")
    p.add_argument("--out", help="run directory (default runs/<recipe>-<loader>-<time>)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override any recipe key, e.g. --set train.batch_size=128 (repeatable)",
    )
    p.add_argument(
        "--resume",
        metavar="auto|PATH",
        help="continue from a checkpoint: 'auto' takes the newest one in OUT/checkpoints "
        "that loads (or starts fresh if there is none)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="resume even if the global batch, backend, data root, model or epoch "
        "count changed (another epoch count re-lays the LR schedule over it: "
        "the LR jumps to the new curve)",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="trace N optimizer steps after 5 warm-up steps into OUT/profile/ "
        "(Chrome trace.json and top_ops.txt)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _data_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="make a demo dataset, check every image, pack into tar shards")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    demo = data_sub.add_parser("demo", help="write the procedurally drawn demo ImageFolder")
    demo.add_argument("out", help="output folder, e.g. data/demo")
    demo.add_argument("--train-per-class", type=int, default=120)
    demo.add_argument("--val-per-class", type=int, default=30)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument(
        "--photo-like",
        action="store_true",
        help="natural-image texture, short side 333-500, ~100 KB JPEGs (for benchmarks)",
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    check = data_sub.add_parser(
        "check", help="decode every image of ROOT/{train,val}; name the bad ones; exit 1 if there are any"
    )
    check.add_argument("root", help="dataset folder with train/ and val/")
    check.add_argument("--workers", type=int, default=-1, help="decoding processes (default: cores)")
    check.add_argument(
        "--write-list", metavar="FILE", help="write the good files, one per line, for data.file_list"
    )
    check.add_argument(
        "--max-pixels",
        type=int,
        default=DEFAULT_MAX_PIXELS,
        help="refuse larger images, as data.max_pixels does",
    )
    check.add_argument("--no-progress", action="store_true", help="no progress bar")
    pack = data_sub.add_parser(
        "pack",
        help="write ROOT as WebDataset tar shards with indexes "
        'and a manifest (train with data.format = "tar")',
    )
    pack.add_argument("root", help="dataset folder with train/ and val/")
    pack.add_argument("out", help="output folder for the shards")
    pack.add_argument("--shard-size", default="256MB", help="bytes per shard, e.g. 256MB, 1GB")
    pack.add_argument("--seed", type=int, default=0, help="the train split's shuffle")
    pack.add_argument("--no-progress", action="store_true", help="no progress bar")


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _float_list(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _bench_parser(sub: argparse._SubParsersAction) -> None:
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
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="training device")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")


def _eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="the val accuracy of a checkpoint (top-1/top-5; torchrun too)")
    p.add_argument("recipe", help="the recipe the checkpoint was trained with")
    p.add_argument(
        "--checkpoint",
        required=True,
        help="a ckpt-<step>.pt file, a run directory or its checkpoints/latest (the newest)",
    )
    p.add_argument("--loader", help=f"loader backend: {' | '.join([AUTO, *BACKENDS])} | module:function")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="device")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line, last")


def _export_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="a checkpoint's weights as a state dict, TorchScript and ONNX")
    p.add_argument("checkpoint", help="a ckpt-<step>.pt, best.pt, or a run directory (its newest)")
    p.add_argument(
        "--out",
        required=True,
        help="folder for state_dict.pt, model.torchscript.pt, "
        "model.onnx (with the onnx package), export.json",
    )
    p.add_argument("--ema", action="store_true", help="export the EMA weights instead")


def _compare_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="several runs side by side: images/s, data-wait, accuracy")
    p.add_argument("runs", nargs="+", help="run directories holding summary.json")


def build_parser() -> argparse.ArgumentParser:
    """The `stallfree` argument parser."""
    parser = argparse.ArgumentParser(
        prog="stallfree",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train PyTorch image classifiers without data stalls: DALI or a tuned "
        "DataLoader by one flag,\nthe same samples and augmentation in both.",
        epilog="start here:\n"
        "  stallfree doctor                              what this machine can run\n"
        "  stallfree data demo data/demo                 a small dataset to try it on\n"
        "  stallfree train pipelines/demo.toml --loader auto --out runs/a\n"
        "  stallfree bench pipelines/bench.toml          our loaders beside the usual ones\n"
        "\n'stallfree COMMAND --help' tells more.",
    )
    parser.add_argument("--version", action="version", version=f"stallfree {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    _train_parser(sub)
    _data_parser(sub)
    _bench_parser(sub)
    _eval_parser(sub)
    _compare_parser(sub)
    _export_parser(sub)
    _predict_parser(sub)
    doctor = sub.add_parser(
        "doctor",
        help="what this machine can run (torch, GPUs, DALI, nvJPEG, "
        "/dev/shm, cores, cache): OK / WARN / FAIL with the fix",
    )
    doctor.add_argument("--json", action="store_true", help="the checks as a JSON list")
    return parser


def resolve_recipe(args: argparse.Namespace, paths: bool = False) -> Recipe:
    """Load the recipe, then apply the flags (--loader, --device, --epochs) and --set overrides;
    `paths`: check the files it names too. Torch-free, so a mistake is said at once."""
    recipe = load_recipe(args.recipe)
    overrides = list(args.overrides)
    if args.loader:
        overrides.insert(0, f"loader.backend={args.loader}")
    if args.device:
        overrides.insert(0, f"train.device={args.device}")
    if getattr(args, "epochs", None) is not None:
        overrides.insert(0, f"train.epochs={args.epochs}")
    recipe = apply_overrides(recipe, overrides)
    try:  # the rules across keys, checked here so that the message says where the recipe came from
        validate(recipe)
        if paths:  # a resumed run reads its checkpoint's weights, not model.init_from
            check_paths(recipe, weights=args.command == "train" and not args.resume)
    except RecipeError as exc:
        flags = " with its flags and --set overrides" if overrides else ""
        raise RecipeError(f"{args.recipe}{flags}: {exc}") from exc
    return recipe


def cmd_train(args: argparse.Namespace) -> int:
    recipe = resolve_recipe(args, paths=True)
    if args.resume and not args.out:
        raise RecipeError("--resume needs --out: the run directory whose checkpoints/ to resume")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not args.out:
        # A default name carries a timestamp that the ranks could compute a second apart.
        raise RecipeError("under torchrun, pass --out so that every rank writes the same run directory")
    # torch-heavy imports (seconds) only once the recipe and its paths have passed
    from stallfree.train.resume import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, StopSignal
    from stallfree.train.run import train
    from stallfree.train.slurm import maybe_requeue
    from stallfree.train.trainer import PreemptedError

    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or f"runs/{Path(args.recipe).stem}-{recipe.loader.backend}-{stamp}"
    # Slurm's SIGUSR1 ("time is nearly up") during start-up (imports, listing, checks) is kept
    # and honoured after the first step: save, then requeue; one after the run has finished is
    # only remembered (main's handler), so the job does not end "killed by signal". SIGTERM and
    # Ctrl-C during start-up stop at once: there is nothing new to save yet.
    try:
        with StopSignal((signal.SIGUSR1,)) as early:
            early.requested = early.requested or (_early_signals[0] if _early_signals else None)
            summary = train(
                recipe,
                out,
                progress=show_progress(not args.no_progress),
                resume=args.resume,
                force=args.force,
                profile_steps=args.profile,
            )
    except PreemptedError as exc:
        code = INTERRUPTED_EXIT_CODE if exc.signal == "SIGINT" else PREEMPTED_EXIT_CODE
        LOGGER.warning(
            f"{exc} ({exc.signal}); checkpoint saved in {out}/checkpoints. Resume "
            f"with --out {out} --resume auto (exit code {code})"
        )
        # Every rank has left the process group by now: the requeue cannot cut a save short.
        maybe_requeue(exc.signal, recipe.train.slurm_requeue, _rank())
        return code
    if _rank() == 0:  # the job's result, once
        print(
            f"{out}: "
            + ", ".join(
                f"{k}={_fmt(v)}"
                for k, v in summary.items()
                if k in ("images_per_s", "data_wait_frac", "val_top1", "wall_s")
            )
        )
    return 0


def cmd_data(args: argparse.Namespace) -> int:
    if args.data_command == "check":
        return _data_check(args)
    if args.data_command == "pack":
        from stallfree.data.tools.pack import pack_dataset, parse_size

        try:
            shard_bytes = parse_size(args.shard_size)
        except ValueError as exc:
            raise RecipeError(f"--shard-size {args.shard_size!r}: expected e.g. 256MB") from exc
        manifest = pack_dataset(
            args.root,
            args.out,
            shard_bytes=shard_bytes,
            seed=args.seed,
            progress=show_progress(not args.no_progress),
        )
        for split, info in manifest["splits"].items():
            print(f"{split}: {info['samples']} samples in {len(info['shards'])} shard(s)")
        print(f'wrote {args.out}; train from it with --set data.root="{args.out}" --set data.format=tar')
        return 0
    from stallfree.data.tools.demo import write_demo

    out = write_demo(
        args.out,
        train_per_class=args.train_per_class,
        val_per_class=args.val_per_class,
        seed=args.seed,
        photo_like=args.photo_like,
        progress=show_progress(not args.no_progress),
    )
    print(f"wrote demo data to {out}")
    return 0


def _data_check(args: argparse.Namespace) -> int:
    from stallfree.data.tools.check import check_dataset, summary

    report = check_dataset(
        args.root,
        workers=args.workers,
        max_pixels=args.max_pixels,
        progress=show_progress(not args.no_progress),
    )
    print(summary(report))
    if args.write_list and any("::" in str(p) for p in report.good):
        raise RecipeError(
            "--write-list is for image folders; tar shards are packed whole "
            "(fix or re-pack the shards the check names)"
        )
    if args.write_list:
        Path(args.write_list).write_text(report.clean_list())
        print(f"wrote {len(report.good)} good files to {args.write_list} (use it as data.file_list)")
    return 1 if report.bad else 0


def cmd_bench(args: argparse.Namespace) -> int:
    from stallfree.bench.report import write_report
    from stallfree.bench.run import BenchConfig, run_bench
    from stallfree.train.rundir import RunDir

    recipe = load_recipe(args.recipe)
    apply_overrides(recipe, ([f"train.device={args.device}"] if args.device else []) + args.overrides)
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


def cmd_eval(args: argparse.Namespace) -> int:
    recipe = resolve_recipe(args, paths=True)  # before torch's import: said at once
    from stallfree.train.evaluate import evaluate_checkpoint

    result = evaluate_checkpoint(recipe, args.checkpoint)
    if _rank() == 0:
        if args.json:
            print(json.dumps(result))
        else:
            print(
                f"{args.checkpoint}: top-1 {result['val_top1']:.4f}, top-5 "
                f"{result['val_top5']:.4f}, loss {result['val_loss']:.4f} on "
                f"{result['samples']} val images"
            )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from stallfree.train.export import export_checkpoint

    info = export_checkpoint(args.checkpoint, args.out, ema=args.ema)
    print(
        f"wrote {', '.join(info['written'])} to {args.out} ({info['model']}, "
        f"{info['num_classes']} classes, input {info['input']})"
    )
    for name, why in info["not_written"].items():
        print(f"not written: {name}: {why}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    rows = []
    for run in args.runs:
        path = Path(run) / "summary.json"
        if not path.is_file():
            raise RunDirError(f"{path} not found; is {run} a finished run directory?")
        rows.append((run, json.loads(path.read_text())))
    header = f"{'run':<28} {'loader':<10} {'img/s':>8} {'data-wait':>10} {'val top-1':>10} {'wall s':>8}"
    print(header)
    print("-" * len(header))
    for run, s in rows:
        print(
            f"{Path(run).name:<28} {s.get('backend', '?'):<10} {_fmt(s.get('images_per_s')):>8} "
            f"{_pct(s.get('data_wait_frac')):>10} {_fmt(s.get('val_top1')):>10} {_fmt(s.get('wall_s')):>8}"
        )
    return 0


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if value < 10 else f"{value:.1f}"
    return "-" if value is None else str(value)


def _pct(value: object) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, float) else "-"


def cmd_doctor(args: argparse.Namespace) -> int:
    from stallfree.doctor import FAIL, diagnose, report

    checks = diagnose()
    print(report(checks, as_json=args.json))
    return 1 if any(c.status == FAIL for c in checks) else 0


COMMANDS = {
    "train": cmd_train,
    "data": cmd_data,
    "bench": cmd_bench,
    "eval": cmd_eval,
    "compare": cmd_compare,
    "export": cmd_export,
    "predict": cmd_predict,
    "doctor": cmd_doctor,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `stallfree` console script."""
    # First thing: SIGUSR1 is Slurm's "time is nearly up"; its default action would kill the
    # process before `train` installs the handler that saves, e.g. while torch imports.
    signal.signal(signal.SIGUSR1, _remember_usr1)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare `stallfree`: what it does and where to start
        parser.print_help()
        return 0
    setup_logging(_rank())
    try:
        return COMMANDS[args.command](args)
    except StallfreeError as exc:
        if exc.same_on_every_rank and _local_rank() != 0:
            # The first rank of each node says it once (a node may lack what another has, so
            # not rank 0 alone). Waiting lets it do so: torchrun stops a node's ranks as soon as
            # one exits, and that rank may be a moment behind.
            time.sleep(3)
            return exc.exit_code
        hint = f" ({exc.hint})" if exc.hint else ""
        LOGGER.error(f"error: {exc}{hint}")
        return exc.exit_code


_early_signals: list[str] = []  # SIGUSR1s that came before train's own handler was in place


def _remember_usr1(signum: int, frame: object) -> None:
    _early_signals.append(signal.Signals(signum).name)


def _rank() -> int:
    """This process's rank under torchrun or srun, without importing torch."""
    from stallfree.parallel import DistInfo

    return DistInfo.from_env().rank


def _local_rank() -> int:
    """This process's rank on its node, likewise."""
    from stallfree.parallel import DistInfo

    return DistInfo.from_env().local_rank


if __name__ == "__main__":
    sys.exit(main())
