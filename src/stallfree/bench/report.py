"""The bench report: medians per (mode, backend, workers), ratios, bench.json/.md/.png."""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

_FIELDS = ("images_per_s", "data_wait_frac", "step_ms", "cpu_cores", "peak_pss_mb")


def summarise(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (mode, backend, knob): the median of each field over the repeats."""
    groups: dict[tuple[str, str, Any], list[dict[str, Any]]] = defaultdict(list)
    for record in result["records"]:
        if "error" not in record:
            groups[(record["mode"], record["backend"], record["knob"])].append(record)
    limit = (result.get("limit") or {}).get("images_per_s")
    peer = best_peer(result["records"])
    rows = []
    for (mode, backend, knob), records in groups.items():
        row: dict[str, Any] = {"mode": mode, "backend": backend, "knob": knob, "runs": len(records)}
        for name in _FIELDS:
            values = [r[name] for r in records if r.get(name) is not None]
            row[name] = statistics.median(values) if values else None
        real = mode == "loader" and backend != "synthetic"  # synthetic decodes nothing
        row["of_limit"] = row["images_per_s"] / limit if limit and real else None
        row["of_peer"] = row["images_per_s"] / peer[1] if peer and real else None
        rows.append(row)
    return rows


def best_peer(records: list[dict[str, Any]]) -> tuple[str, float] | None:
    """(name, img/s) of the fastest peer loader (median over repeats, best knob), if any ran."""
    runs: dict[tuple[str, Any], list[float]] = defaultdict(list)
    for r in records:
        if r["mode"] == "loader" and r["backend"].startswith("peer-") and "error" not in r:
            runs[(r["backend"], r["knob"])].append(r["images_per_s"])
    medians = {name: statistics.median(v) for (name, _), v in runs.items()}
    if not medians:
        return None
    name = max(medians, key=medians.__getitem__)
    return name, medians[name]


def ratios(rows: list[dict[str, Any]], limit: float | None) -> dict[str, float]:
    """The tuning targets as measured ratios (best knob of each backend)."""
    best: dict[tuple[str, str], float] = {}
    for row in rows:
        key = (row["mode"], row["backend"])
        best[key] = max(best.get(key, 0.0), row["images_per_s"] or 0.0)
    out: dict[str, float] = {}
    loader = {b: v for (m, b), v in best.items() if m == "loader"}
    if limit:
        for name in ("dali", "torch", "torch-uint8"):
            if name in loader:
                out[f"{name} loader / limit"] = loader[name] / limit
    if "torch" in loader and loader.get("torch-naive"):
        out["torch loader / torch-naive loader"] = loader["torch"] / loader["torch-naive"]
    peers = {b: v for b, v in loader.items() if b.startswith("peer-")}
    for name in ("dali", "torch"):
        if name in loader and peers.get("peer-pil"):
            out[f"{name} loader / plain DataLoader + PIL (peer-pil)"] = loader[name] / peers["peer-pil"]
        if name in loader and peers:
            fastest = max(peers, key=peers.__getitem__)
            out[f"{name} loader / fastest peer ({fastest})"] = loader[name] / peers[fastest]
    train = {b: v for (m, b), v in best.items() if m == "train"}
    if "synthetic" in train and train.get("bare-loop"):
        out["synthetic train / bare loop"] = train["synthetic"] / train["bare-loop"]
    return out


def markdown(result: dict[str, Any], rows: list[dict[str, Any]], command: str = "") -> str:
    """bench.md: machine, command, the table and the ratios."""
    machine, cfg, limit = result["machine"], result["config"], result.get("limit")
    lines = [
        "# stallfree bench",
        "",
        f"Machine: {machine['cpu']} (native bf16: "
        f"{ {True: 'yes', False: 'no'}.get(machine.get('cpu_native_bf16'), '?') }), "
        f"{machine['cores_available']} cores available, "
        f"GPU: {machine['gpu'] or 'none'}; torch {machine['torch']}, DALI {machine['dali'] or '-'}, "
        f"Python {machine['python']}.",
        f"Recipe: {cfg['model']}, batch {cfg['batch_size']}, {cfg['image_size']} px "
        f"({cfg.get('augment', 'RandomResizedCrop + flip')}), "
        f"{cfg['precision']}; data {cfg['data_root']}. Median of {cfg['repeats']} interleaved runs, "
        f"{cfg['warmup']} warm-up + {cfg['batches']} timed batches each.",
        strict_line(cfg.get("exact_decode", False)),
    ]
    if command:
        lines += ["", f"Command: `{command}`"]
    lines += [
        "",
        "| mode | backend | workers/threads | img/s | x limit | x best peer | data-wait "
        "| step ms | CPU cores | peak PSS MB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    if limit:
        single = ", ".join(f"{k} {v:.0f}/s" for k, v in limit["single_thread"].items())
        low, high = limit.get("spread", [limit["images_per_s"]] * 2)
        lines.append(
            f"| loader | **limit** ({limit.get('fastest', '?')}) | {limit['cores']} cores "
            f"| {limit['images_per_s']:.0f} ({low:.0f}-{high:.0f}) | 1.00 | | | | "
            f"| single thread: {single} |"
        )
    for row in sorted(rows, key=lambda r: (r["mode"], -(r["images_per_s"] or 0))):
        lines.append(
            f"| {row['mode']} | {row['backend']} | {row['knob'] if row['knob'] is not None else 'auto'} "
            f"| {_num(row['images_per_s'], '.0f')} | {_num(row['of_limit'], '.2f')} "
            f"| {_num(row.get('of_peer'), '.2f')} | {_pct(row['data_wait_frac'])} "
            f"| {_num(row['step_ms'], '.1f')} "
            f"| {_num(row['cpu_cores'], '.2f')} | {_num(row['peak_pss_mb'], '.0f')} |"
        )
    measured = ratios(rows, limit["images_per_s"] if limit else None)
    if measured:
        lines += ["", "Ratios (best setting of each):", ""]
        lines += [f"- {name}: **{value:.2f}**" for name, value in measured.items()]
    return "\n".join(lines + _run_notes(result["records"])) + "\n"


def _run_notes(records: list[dict[str, Any]]) -> list[str]:
    """bench.md's last sections: the warnings of runs that finished, and the failed runs."""
    lines: list[str] = []
    warned = [
        (r, line)
        for r in records
        if "error" not in r
        for line in r.get("stderr", "").splitlines()
        if re.search(r"warn|fail|fall.?back|error", line, re.IGNORECASE)
    ]
    if warned:  # e.g. DALI's "Failed to load nvjpeg": a run that "worked" on the wrong path
        lines += ["", "Warnings from runs that finished:", ""] + sorted(
            {f"- {r['mode']} {r['backend']}: {line.strip()[:200]}" for r, line in warned}
        )
    errors = [r for r in records if "error" in r]
    if errors:
        lines += ["", "Failed runs:", ""] + [f"- {r['mode']} {r['backend']}: {r['error']}" for r in errors]
    return lines


def strict_line(exact_decode: bool) -> str:
    """Whether the head-to-head was strict: the torch loaders' decode beside DALI's full one."""
    if exact_decode:
        return (
            "Strict comparison: on (`loader.torch.exact_decode`): the torch backend decodes in full, "
            "as DALI does; their train crops agree within a grey level."
        )
    return (
        "Strict comparison: off: the torch backend decodes DCT-scaled where the crop allows (faster; "
        "its small train crops differ from DALI's by several grey levels, docs/recipes.md; "
        "`--set loader.torch.exact_decode=true` turns it on)."
    )


def chart(rows: list[dict[str, Any]], limit: dict[str, Any] | None, path: Path) -> bool:
    """bench.png: images/s per backend, one panel per mode. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    modes = sorted({r["mode"] for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 3.5), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        # In loader mode synthetic decodes nothing (millions of img/s) and would flatten the bars.
        mine = sorted(
            (r for r in rows if r["mode"] == mode and not (mode == "loader" and r["backend"] == "synthetic")),
            key=lambda r: r["images_per_s"] or 0,
        )
        labels = [r["backend"] + (f" x{r['knob']}" if r["knob"] is not None else "") for r in mine]
        ax.barh(labels, [r["images_per_s"] or 0 for r in mine], color="#4c72b0")
        if limit and mode == "loader":
            ax.axvline(limit["images_per_s"], color="#c44e52", linestyle="--", label="CPU limit")
            ax.legend(loc="lower right")
        ax.set_title(f"{mode} mode")
        ax.set_xlabel("images/s (median)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(result: dict[str, Any], out_dir: str | Path, command: str = "") -> list[Path]:
    """Write bench.json, bench.md and (with matplotlib) bench.png; return what was written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = summarise(result)
    (out / "bench.json").write_text(json.dumps({**result, "summary": rows}, indent=2) + "\n")
    (out / "bench.md").write_text(markdown(result, rows, command))
    written = [out / "bench.json", out / "bench.md"]
    if chart(rows, result.get("limit"), out / "bench.png"):
        written.append(out / "bench.png")
    else:
        print("bench: matplotlib is not installed, so no bench.png; pip install 'stallfree[plot]'")
    return written


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
