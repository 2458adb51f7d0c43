"""The trainer/engine precision figure (RESULTS.md "GPU stage q"): the largest behaviour weight π_prox/π_behav of
each training step, per run, beside the training reward (a 10-version running mean). At staleness 0 the weight is 1 up to numerics, so
its growth in a sync run is train/inference mismatch alone (a bf16-autocast trainer against an fp32 engine).

What: each `--run LABEL=PATH` is a run's metrics.jsonl (one JSON line per version: behav_weight_max,
behav_capped_frac, reward_mean, staleness_max, entropy); the runs' per-step series go to `--json` (so the
figure can be redrawn from the committed file with `--from-json`) and the figure to `--out`.

    python benchmarks/quality/precision_plot.py --run "GPU sync bf16 s0=/path/metrics.jsonl" ... \
        --json benchmarks/results/precision_mismatch.json --out docs/precision-mismatch.png
    python benchmarks/quality/precision_plot.py --from-json benchmarks/results/precision_mismatch.json
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

KEYS = ("behav_weight_max", "behav_capped_frac", "reward_mean", "staleness_max", "entropy")


def read_run(path: Path) -> dict:
    rows = sorted((json.loads(line) for line in path.read_text().splitlines() if line.strip()),
                  key=lambda m: m["version"])
    if not rows:
        raise SystemExit(f"{path}: no metrics lines")
    return {"version": [m["version"] for m in rows], **{k: [m.get(k) for m in rows] for k in KEYS}}


def plot(runs: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for label, r in runs.items():
        style = "-" if "sync" in label else "--"
        ax1.plot(r["version"], r["behav_weight_max"], style, label=label, lw=1.2)
        rw = r["reward_mean"]
        smooth = [sum(rw[max(0, i - 9):i + 1]) / len(rw[max(0, i - 9):i + 1]) for i in range(len(rw))]
        ax2.plot(r["version"], smooth, style, label=label, lw=1.0)
    ax1.set_yscale("log")
    ax1.set_xlabel("version")
    ax1.set_ylabel("max behaviour weight π_prox/π_behav in the step (log)")
    ax1.set_title("train/inference mismatch")
    ax2.set_xlabel("version")
    ax2.set_ylabel("training reward, mean of the last 10 versions")
    ax2.set_title("training reward")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"plot: {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", action="append", default=[], help="LABEL=PATH of a metrics.jsonl (repeatable).")
    ap.add_argument("--from-json", type=Path, help="Redraw from this file instead of --run.")
    ap.add_argument("--json", type=Path, help="Write the runs' series here.")
    ap.add_argument("--out", type=Path, default=Path("docs/precision-mismatch.png"))
    args = ap.parse_args()
    if args.from_json:
        runs = json.loads(args.from_json.read_text())["runs"]
    else:
        if not args.run:
            ap.error("give --run LABEL=PATH (one or more) or --from-json FILE")
        runs = {}
        for spec in args.run:
            label, sep, path = spec.rpartition("=")  # a label may hold "=" (η=2), a path does not
            if not sep:
                ap.error(f"--run {spec!r}: expected LABEL=PATH")
            runs[label] = read_run(Path(path))
    rows = [("run", "steps", "max weight (first / largest / last)", "capped frac (mean)", "reward (first / last)")]
    for label, r in runs.items():
        w = [x for x in r["behav_weight_max"] if x is not None]
        c = [x for x in r["behav_capped_frac"] if x is not None]
        rows.append((label, str(len(r["version"])), f"{w[0]:.2f} / {max(w):.2f} / {w[-1]:.2f}",
                     f"{sum(c) / len(c):.4f}", f"{r['reward_mean'][0]:.2f} / {r['reward_mean'][-1]:.2f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
    if args.json:
        args.json.write_text(json.dumps({"runs": runs}, indent=None))
        print(f"json: {args.json}")
    plot(runs, args.out)


if __name__ == "__main__":
    main()
