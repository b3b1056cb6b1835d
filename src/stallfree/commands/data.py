"""`stallfree data demo | check | pack`: its parser and its handler (the work lives in
`stallfree.data.tools`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from stallfree.log import show_progress
from stallfree.recipe import DEFAULT_MAX_PIXELS, RecipeError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `stallfree data` on the CLI's sub-parsers."""
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
    check.add_argument(
        "--endpoint-url",
        default="",
        metavar="URL",
        help="the S3 endpoint of an s3:// ROOT, as a recipe's data.endpoint_url (default: AWS_ENDPOINT_URL)",
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


def cmd_data(args: argparse.Namespace) -> int:
    """Run `stallfree data SUBCOMMAND`; the exit code."""
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
    print(f"demo data ready in {out}")
    return 0


def _data_check(args: argparse.Namespace) -> int:
    from stallfree.data.tools.check import check_dataset, summary

    report = check_dataset(
        args.root,
        endpoint_url=args.endpoint_url,
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
    return 1 if report.bad or report.bad_shards else 0
