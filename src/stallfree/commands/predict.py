"""`stallfree predict`: its parser and its handler (the work lives in `stallfree.predictor`)."""

from __future__ import annotations

import argparse
import itertools

from stallfree.predictor import (
    SOME_FAILED_EXIT_CODE,
    PredictError,
    Prediction,
    Predictor,
    image_paths,
    no_images_reason,
    pick_checkpoint,
    skipped_line,
)
from stallfree.recipe import DEVICES


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `stallfree predict` on the CLI's sub-parsers."""
    p = sub.add_parser(
        "predict",
        help="the top-k class names of images, from a checkpoint or run directory",
        description="Predict the top-k class names and probabilities of each image with a "
        "checkpoint's weights, through the run's own validation transform. A RUN directory means "
        "its checkpoints/best.pt, else its newest checkpoint (the first line on stderr says which). "
        f"Exit code 0 when every image was predicted, {SOME_FAILED_EXIT_CODE} when some could not "
        "be read (each is named in one line; the others are still predicted), 2 on bad arguments.",
    )
    p.add_argument(
        "checkpoint", metavar="CHECKPOINT_OR_RUN", help="a ckpt-*.pt, a best.pt or a run directory"
    )
    p.add_argument(
        "inputs", nargs="+", metavar="IMAGE_OR_FOLDER", help="images, or folders searched for images"
    )
    p.add_argument("--top-k", type=int, default=5, help="classes per image (default 5, at most all)")
    p.add_argument("--json", action="store_true", help="one JSON object per image on stdout")
    p.add_argument("--batch-size", type=int, default=32, help="images per forward pass (default 32)")
    p.add_argument(
        "--device", default="auto", choices=DEVICES, help="cuda, cpu or auto (default: cuda when available)"
    )
    p.add_argument("--ema", action="store_true", help="use the checkpoint's EMA weights")


def cmd_predict(args: argparse.Namespace) -> int:
    """Run `stallfree predict`; 0 when every image was predicted."""
    from stallfree.log import LOGGER
    from stallfree.parallel import DistInfo
    from stallfree.train.distributed import resolve_device

    if args.top_k < 1 or args.batch_size < 1:
        raise PredictError("--top-k and --batch-size must be at least 1")
    path, why = pick_checkpoint(args.checkpoint)
    paths, empty, skipped = image_paths(args.inputs)
    if not paths:
        raise PredictError(f"{', '.join(empty)}: {no_images_reason()}; pass images or folders holding them")
    if skipped:
        LOGGER.warning(skipped_line(skipped))
    LOGGER.info(f"predicting with {path} ({why})")
    predictor = Predictor(path, resolve_device(args.device, DistInfo()), ema=args.ema)
    failed = 0
    empties = [Prediction(folder, error=no_images_reason()) for folder in empty]
    for result in itertools.chain(empties, predictor.predict(paths, args.top_k, args.batch_size)):
        if result.error:
            failed += 1
            if not args.json:
                LOGGER.error(f"error: {result.path}: {result.error}")
                continue
        print(result.as_json() if args.json else result.as_line(), flush=True)
    if failed:
        LOGGER.error(f"{failed} input(s) could not be predicted (named above)")
    return SOME_FAILED_EXIT_CODE if failed else 0
