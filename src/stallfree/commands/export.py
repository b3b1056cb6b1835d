"""`stallfree export`: its parser and its handler (the work lives in `stallfree.train.export_weights`)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `stallfree export` on the CLI's sub-parsers."""
    p = sub.add_parser(
        "export", help="a checkpoint's weights as a state dict, a torch.export program (.pt2) and ONNX"
    )
    p.add_argument(
        "checkpoint",
        help="a ckpt-<step>.pt, best.pt, checkpoints/latest or a run directory (its best.pt, else "
        "its newest checkpoint; stderr says which)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="folder for state_dict.pt, model.pt2, model.onnx (with the onnx extra) and export.json",
    )
    p.add_argument(
        "--format",
        action="append",
        choices=("pt2", "onnx"),
        default=None,
        help="write only this format beside state_dict.pt (repeat for both; default: pt2, and onnx "
        "where pip install -e '.[onnx]' installed its packages)",
    )
    p.add_argument("--ema", action="store_true", help="export the EMA weights instead")


def cmd_export(args: argparse.Namespace) -> int:
    """Export a checkpoint's weights; the exit code."""
    from stallfree.train.export_weights import export_checkpoint

    info = export_checkpoint(args.checkpoint, args.out, ema=args.ema, formats=args.format)
    print(
        f"wrote {', '.join(info['written'])} to {args.out} ({info['model']}, "
        f"{info['num_classes']} classes, input {info['input']})"
    )
    for name, why in info["not_written"].items():
        print(f"not written: {name}: {why}")
    return 0
