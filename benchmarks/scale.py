"""Listing memory, listing time and time to the first batch for N samples.

Builds an ImageFolder of N files cheaply (hard links to a few hundred small JPEGs, each linked
at most 65,000 times: an inode's limit), then in a fresh process per measurement:
  * listing: seconds to resolve the dataset, and the main process's RSS growth;
  * first batch: seconds from nothing to the first batch of the torch loader (2 workers), on a
    first start (no cached header check) and a second start (cached), and each worker's RSS;
  * growth per sample: (RSS at N - RSS at the 2,000-file baseline) / (N - 2,000).
`--listing-only N` lists a `data.file_list` of N lines (ImageNet-21k's 14.2M) with no files
behind it. Results go to OUT/scale.json and a Markdown table on stdout.

    python benchmarks/scale.py --sizes 100000,1280000 --listing-only 14200000 \
        --work /tmp/scale --out benchmarks/results/scale
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
BASELINE = 2_000
SOURCES = 300  # distinct JPEGs; 1.28M links stay far below 65,000 per inode
LINKS_PER_INODE = 65_000


def _rss_mb(pid: int | str = "self") -> float:
    """Resident set size of a process, in MB (1e6 bytes), from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def make_folder(root: Path, n: int, classes: int) -> Path:
    """ROOT/train/<class>/<i>.jpg (n files) and ROOT/val/<class>/0.jpg, hard-linked."""
    import numpy as np
    from PIL import Image

    done = root / f".complete-{n}"
    if done.exists():
        return root
    src = root.parent / "sources"
    src.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    sources = []
    for i in range(SOURCES):
        path = src / f"{i}.jpg"
        if not path.exists():
            pixels = rng.integers(0, 255, (48, 64, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(path, quality=85)
        sources.append(str(path))
    if n > SOURCES * LINKS_PER_INODE:
        raise SystemExit(f"{n} files need more than {SOURCES} sources at 65,000 links each")
    for split, count in (("train", n), ("val", classes)):
        for c in range(classes):
            (root / split / f"c{c:05d}").mkdir(parents=True, exist_ok=True)
        for i in range(count):
            c = i % classes
            target = root / split / f"c{c:05d}" / f"{i:08d}.jpg"
            if not target.exists():
                os.link(sources[i % SOURCES], target)
    done.touch()
    return root


def make_file_list(root: Path, n: int, classes: int) -> Path:
    """A data.file_list of n train lines (and one val line per class), no files behind it."""
    path = root / f"list-{n}.txt"
    if path.exists():
        return path
    for split in ("train", "val"):
        for c in range(classes):
            (root / split / f"n{c:08d}").mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for i in range(n):
            c = i % classes
            f.write(f"train/n{c:08d}/n{c:08d}_{i}.JPEG\n")
        for c in range(classes):
            f.write(f"val/n{c:08d}/ILSVRC_val_{c:08d}.JPEG\n")
    return path


def _child(args: argparse.Namespace) -> None:
    """One measurement in a fresh process; prints one JSON line."""
    import torch

    from stallfree.parallel import DistInfo
    from stallfree.recipe import recipe_from_dict
    from stallfree.train.prepare import prepare_recipe

    base = _rss_mb()
    started = time.perf_counter()
    data = {"root": args.root, "file_list": args.file_list or ""}
    recipe = recipe_from_dict(
        {
            "data": data,
            "augment": {"image_size": 32, "resize_size": 36},
            "train": {"batch_size": 64, "precision": "fp32", "device": "cpu"},
            "loader": {"backend": "torch", "torch": {"workers": args.workers}},
        }
    )
    # As a run starts (train/run.py): the recipe resolved, the dataset listed once, then the loader.
    ctx = prepare_recipe(recipe, DistInfo(), torch.device("cpu")).with_dataset()
    assert ctx.dataset is not None  # data.root is set
    dataset = ctx.dataset
    listed = time.perf_counter()
    result: dict[str, Any] = {
        "n": len(dataset.splits["train"]),
        "list_s": listed - started,
        "rss_listed_mb": _rss_mb() - base,
        "listing_mb": dataset.splits["train"].nbytes() / 1e6,
    }
    if not args.list_only:
        loader = ctx.with_loader_counts().loader("train")
        checked = time.perf_counter()
        batches = iter(loader)
        next(batches)
        result |= {
            "check_s": checked - listed,
            "first_batch_s": time.perf_counter() - started,
            "rss_main_mb": _rss_mb() - base,
        }
        workers = getattr(loader.dataloader._iterator, "_workers", [])  # noqa: SLF001
        result["rss_workers_mb"] = [_rss_mb(w.pid) for w in workers]
        loader.close()
    print(json.dumps(result), flush=True)


def measure(
    root: Path, *, cache: Path, workers: int = 2, list_only: bool = False, file_list: Path | None = None
) -> dict[str, Any]:
    """Run `_child` in a fresh interpreter with STALLFREE_CACHE=cache."""
    cmd = [PYTHON, __file__, "--child", "--root", str(root), "--workers", str(workers)]
    cmd += ["--list-only"] if list_only else []
    cmd += ["--file-list", str(file_list)] if file_list else []
    env = {**os.environ, "STALLFREE_CACHE": str(cache)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"measurement failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _per_sample(big: dict[str, Any], small: dict[str, Any], key: str) -> float:
    return (big[key] - small[key]) * 1e6 / (big["n"] - small["n"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="100000", help="comma-separated sample counts")
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument(
        "--listing-only",
        type=int,
        default=0,
        metavar="N",
        help="also list a data.file_list of N lines (no files)",
    )
    p.add_argument("--list-classes", type=int, default=21_841)
    p.add_argument("--work", default="/tmp/stallfree-scale")
    p.add_argument("--out", default="")
    p.add_argument("--smoke", action="store_true", help="a few hundred files in a temp folder: seconds")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--list-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--file-list", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args)
    elif args.smoke:  # every measurement once, at sizes past one batch of 64
        with tempfile.TemporaryDirectory(prefix="scale-smoke-") as tmp:
            vars(args).update(sizes="256", classes=4, listing_only=256, list_classes=200, work=tmp)
            run(args, baseline=128)
    else:
        run(args, baseline=BASELINE)


def run(args: argparse.Namespace, baseline: int) -> None:
    """Each size's row (`baseline` first, the others' growth per sample against it), then the
    listing-only row; printed, and written to OUT/scale.json."""
    work = Path(args.work)
    rows: list[dict[str, Any]] = []
    sizes = [baseline] + [int(s) for s in args.sizes.split(",") if s]
    base: dict[str, Any] = {}
    for n in sizes:
        t0 = time.perf_counter()
        root = make_folder(work / f"folder-{n}", n, min(args.classes, n))
        made = time.perf_counter() - t0
        cache = work / f"cache-{n}-{time.time_ns()}"
        first = measure(root, cache=cache)
        second = measure(root, cache=cache)
        row = {"n": n, "make_s": made, "first": first, "second": second}
        if n == baseline:
            base = second
        else:
            row["bytes_per_sample_main"] = _per_sample(second, base, "rss_main_mb")
            row["bytes_per_sample_listing"] = _per_sample(second, base, "rss_listed_mb")
            row["bytes_per_sample_worker"] = max(
                (w - b) * 1e6 / (n - baseline)
                for w, b in zip(second["rss_workers_mb"], base["rss_workers_mb"])
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.listing_only:
        rows.append(listing_row(work / "file-list", args.listing_only, args.list_classes, baseline))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "scale.json").write_text(json.dumps(rows, indent=1) + "\n")


def listing_row(lists: Path, n: int, classes: int, baseline: int) -> dict[str, Any]:
    """A data.file_list of n lines listed (no files behind it), against one of `baseline` lines
    (or one a class, if more)."""
    t0 = time.perf_counter()
    path = make_file_list(lists, n, classes)
    made = time.perf_counter() - t0
    # The baseline names every class once at least: a class folder no line names is refused.
    small = make_file_list(lists, max(baseline, classes), classes)
    cache = lists.parent / "cache-list"
    big = measure(lists, cache=cache, list_only=True, file_list=path)
    ref = measure(lists, cache=cache, list_only=True, file_list=small)
    return {
        "n": n,
        "make_s": made,
        "listing_only": big,
        "baseline": ref,
        "bytes_per_sample_listing": _per_sample(big, ref, "rss_listed_mb"),
    }


if __name__ == "__main__":
    main()
