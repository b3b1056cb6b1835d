"""The start-up header check's rate on 1, 2, ... cores: files a second, and per core.

Lists an ImageFolder of N hard-linked JPEGs (benchmarks/scale.py's `make_folder`), then checks
every header as a rank's start does (`check_pool.check_headers`: one core checks in its own
process, more start that many worker interpreters), each worker count in a fresh process, and
the fast walk's pieces alone (read the first 4 KiB; walk them) on the first 20,000 files.

    python benchmarks/header_rate.py --n 100000 --workers 1,2 --work /tmp/scale
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _cpu_s(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def _child(root: str, workers: int) -> dict[str, float]:
    from stallfree.data.readers import check_pool
    from stallfree.data.readers.factory import resolve_dataset
    from stallfree.data.readers.fast_headers import jpeg_verdict, read_head
    from stallfree.recipe import recipe_from_dict

    listing = resolve_dataset(recipe_from_dict({"data": {"root": root}}).data).splits["train"]
    n = len(listing)
    check_pool.IN_PROCESS_BELOW = 0  # the pool even for a small --smoke tree
    t, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    found = check_pool.check_headers(listing.iter_paths(), n, 10**8, workers, progress=False)
    seconds = time.perf_counter() - t
    main_cpu = _cpu_s(resource.getrusage(resource.RUSAGE_SELF)) - _cpu_s(cpu)
    workers_cpu = _cpu_s(resource.getrusage(resource.RUSAGE_CHILDREN))  # ended workers, all of it
    if found:
        raise SystemExit(f"{len(found)} bad files in a tree of good ones: {found[:3]}")
    sample = [listing.path(i) for i in range(min(n, 20_000))]
    t = time.perf_counter()
    heads = [read_head(p, 4096) for p in sample]
    read_us = (time.perf_counter() - t) / len(sample) * 1e6
    t = time.perf_counter()
    verdicts = [jpeg_verdict(h, 10**8) for h in heads]
    walk_us = (time.perf_counter() - t) / len(sample) * 1e6
    assert not any(verdicts)  # every one passed by the walk alone
    return {
        "workers": workers,
        "n": n,
        "seconds": seconds,
        "files_per_s": n / seconds,
        "us_per_file_core": seconds / n * 1e6 * workers,
        # CPU time, which a busy machine does not stretch as it does wall time: on idle cores
        # the check takes about max(main, workers / count) seconds.
        "cpu_main_s": main_cpu,
        "cpu_workers_s": workers_cpu,
        "cpu_us_per_file": (main_cpu + workers_cpu) / n * 1e6,
        "read_us": read_us,
        "walk_us": walk_us,
        "load": os.getloadavg()[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    p.add_argument("--work", default="/tmp/stallfree-scale")
    p.add_argument("--smoke", action="store_true", help="2,000 files in a temp folder: seconds")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], int(args.child[1]))), flush=True)
        return
    sys.path.insert(0, str(HERE))
    import scale

    with tempfile.TemporaryDirectory(prefix="header-rate-") as tmp:
        n, work = (2_000, Path(tmp)) if args.smoke else (args.n, Path(args.work))
        root = scale.make_folder(work / f"folder-{n}", n, min(1000, n))
        rows = []
        for workers in (int(w) for w in args.workers.split(",")):
            cmd = [sys.executable, __file__, "--child", str(root), str(workers)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"measurement failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(rows[-1]), flush=True)
        if len(rows) > 1:
            print(f"speed-up {rows[-1]['workers']} / {rows[0]['workers']} workers: "
                  f"{rows[-1]['files_per_s'] / rows[0]['files_per_s']:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
