"""Command line: parses arguments and dispatches; the work lives in the modules it calls."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

# Torch-free imports only: `stallfree --help` answers at once; commands import what they need.
from stallfree.commands import bench as _bench
from stallfree.commands import compare as _compare
from stallfree.commands import data as _data
from stallfree.commands import export as _export
from stallfree.commands import predict as _predict
from stallfree.commands.compare import format_figure
from stallfree.data.readers.paths import check_paths
from stallfree.data.registry import AUTO, BACKENDS, check_data_root
from stallfree.errors import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE, StallfreeError
from stallfree.log import LOGGER, setup_logging, show_progress
from stallfree.recipe import (
    DEVICES,
    Recipe,
    RecipeError,
    apply_flags,
    load_recipe,
    validate,
)
from stallfree.train.signals import remember_early_stops, start_up_stop
from stallfree.version import __version__


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model from a recipe (one CPU, one GPU, or torchrun/srun)")
    p.add_argument("recipe", help="a recipe TOML, e.g. pipelines/demo.toml")
    p.add_argument("--loader", help=f"loader backend: {' | '.join([AUTO, *BACKENDS])} | module:function")
    p.add_argument("--device", choices=DEVICES, help="training device")
    p.add_argument("--epochs", type=int, help="number of epochs")
    p.add_argument("--out", help="run directory (default runs/<recipe>-<backend it runs>-<time>)")
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
        "that loads (or starts fresh if there is none); or a ckpt-<step>.pt, or "
        "OUT/checkpoints/latest",
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


def _eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="the val accuracy of a checkpoint (top-1/top-5; torchrun too)")
    p.add_argument(
        "recipe",
        nargs="?",
        help="a recipe whose val data to read (default: the checkpoint's own recipe); its model, "
        "classes, sizes and normalisation must be the checkpoint's",
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        help="a ckpt-<step>.pt, a best.pt, checkpoints/latest (the newest) or a run directory "
        "(its best.pt, else its newest checkpoint; stderr says which)",
    )
    p.add_argument("--loader", help=f"loader backend: {' | '.join([AUTO, *BACKENDS])} | module:function")
    p.add_argument("--device", choices=DEVICES, help="device")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line, last")


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
    _data.add_parser(sub)
    _bench.add_parser(sub)
    _eval_parser(sub)
    _compare.add_parser(sub)
    _export.add_parser(sub)
    _predict.add_parser(sub)
    doctor = sub.add_parser(
        "doctor",
        help="what this machine can run (torch, GPUs, DALI, nvJPEG, "
        "/dev/shm, cores, cache): OK / WARN / FAIL with the fix",
    )
    doctor.add_argument("--json", action="store_true", help="the checks as a JSON list")
    _add_verbose(parser, False)
    return parser


_VERBOSE_HELP = "say more: debug lines, and the libraries' own words behind an error"


def _add_verbose(parser: argparse.ArgumentParser, default: object) -> None:
    """--verbose before or after any (sub)command: a sub-parser's default is SUPPRESS, so
    that it does not overwrite a --verbose given before the command."""
    parser.add_argument("--verbose", action="store_true", default=default, help=_VERBOSE_HELP)
    # argparse has no public walk over sub-parsers; these two names are stable since 3.2.
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for sub in dict.fromkeys(action.choices.values()):  # aliases repeat a parser
                _add_verbose(sub, argparse.SUPPRESS)


def resolve_recipe(args: argparse.Namespace, paths: bool = False) -> Recipe:
    """Load the recipe, then apply the flags (--loader, --device, --epochs) and --set overrides:
    the recipe as given, checked here, once; `paths`: the files it names too. Torch-free, so
    a mistake is said at once."""
    recipe = apply_flags(load_recipe(args.recipe), flag_values(args), args.overrides)
    try:  # the rules across keys, checked here so that the message says where the recipe came from
        validate(recipe)
        check_data_root(recipe)
        if paths:  # a resumed run reads its checkpoint's weights, not model.init_from
            check_paths(recipe, weights=args.command == "train" and not args.resume)
    except RecipeError as exc:
        flags = " with its flags and --set overrides" if flag_values(args) or args.overrides else ""
        raise RecipeError(f"{args.recipe}{flags}: {exc}") from exc
    return recipe


# Each flag that sets a recipe key, as its typed value (applied before the --set overrides).
_FLAG_KEYS = {"epochs": "train.epochs", "device": "train.device", "loader": "loader.backend"}


def flag_values(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given (--loader, --device, --epochs) by the recipe key each sets."""
    given = {key: getattr(args, flag, None) for flag, key in _FLAG_KEYS.items()}
    return {key: value for key, value in given.items() if value is not None}


def cmd_train(args: argparse.Namespace) -> int:
    recipe = resolve_recipe(args, paths=True)
    if args.resume and not args.out:
        raise RecipeError("--resume needs --out: the run directory whose checkpoints/ to resume")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not args.out:
        # A default name carries a timestamp that the ranks could compute a second apart.
        raise RecipeError("under torchrun, pass --out so that every rank writes the same run directory")
    # torch-heavy imports (seconds) only once the recipe and its paths have passed
    from stallfree.train.run import train
    from stallfree.train.slurm import maybe_requeue
    from stallfree.train.trainer import PreemptedError

    out = args.out  # None: train names runs/<recipe>-<the backend that runs>-<time>
    # Slurm's SIGUSR1 ("time is nearly up") during start-up is honoured after the first step:
    # save, then requeue; one after the run has finished is only remembered (main's handler).
    try:
        with start_up_stop():
            summary = train(
                recipe,
                out,
                name=Path(args.recipe).stem,
                progress=show_progress(not args.no_progress),
                resume=args.resume,
                force=args.force,
                profile_steps=args.profile,
            )
    except PreemptedError as exc:
        out = out or exc.run_dir
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
            f"{out or summary['run_dir']}: "
            + ", ".join(
                f"{k}={format_figure(k, v)}"
                for k, v in summary.items()
                if k in ("images_per_s", "data_wait_frac", "val_top1", "wall_s")
            )
        )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    # A recipe given is checked before torch's import (said at once); none: the checkpoint's own.
    recipe = resolve_recipe(args, paths=True) if args.recipe else None
    from stallfree.train.evaluate import evaluate_checkpoint

    result = evaluate_checkpoint(
        recipe, args.checkpoint, flags=flag_values(args), overrides=args.overrides, given=args.recipe or ""
    )
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


def cmd_doctor(args: argparse.Namespace) -> int:
    from stallfree.doctor import FAIL, diagnose, report

    checks = diagnose()
    print(report(checks, as_json=args.json))
    return 1 if any(c.status == FAIL for c in checks) else 0


COMMANDS = {
    "train": cmd_train,
    "data": _data.cmd_data,
    "bench": _bench.cmd_bench,
    "eval": cmd_eval,
    "compare": _compare.cmd_compare,
    "export": _export.cmd_export,
    "predict": _predict.cmd_predict,
    "doctor": cmd_doctor,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `stallfree` console script."""
    # First thing: SIGUSR1 is Slurm's "time is nearly up"; its default action would kill the
    # process before `train` installs the handler that saves, e.g. while torch imports.
    remember_early_stops()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare `stallfree`: what it does and where to start
        parser.print_help()
        return 0
    setup_logging(_rank(), verbose=args.verbose)
    try:
        return COMMANDS[args.command](args)
    except StallfreeError as exc:
        if exc.detail:  # a library's own words: under --verbose only
            LOGGER.debug(f"the error's detail: {exc.detail}")
        from stallfree.train import node_line

        if exc.same_on_every_rank and _local_rank() != 0:
            # The first rank of each node says it once (a node may lack what another has, so
            # not rank 0 alone); this rank exits once it has (node_line.py says why).
            node_line.wait_for_first_rank()
            return exc.exit_code
        hint = f" ({exc.hint})" if exc.hint else ""
        LOGGER.error(f"error: {exc}{hint}")
        if exc.same_on_every_rank:
            node_line.said()
        return exc.exit_code


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
