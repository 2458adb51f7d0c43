"""The multi-turn result plot (README "Multi-turn episodes"): held-out accuracy at the first attempt and within
two attempts, base vs trained, beside the training reward per version.

Run: python benchmarks/quality/multiturn_plot.py --evals runs/multiturn/episode_evals.jsonl \
        --metrics runs/multiturn/metrics.jsonl --out docs/multiturn-training.png
`--evals` holds one JSON line per `python -m areal_mq.evaluation.episodes ... --out FILE` (workflow
multi_turn_retry; weights "base" and the trained directory).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--evals", required=True)
    ap.add_argument("--metrics", required=True)
    ap.add_argument("--out", default="docs/multiturn-training.png")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(l) for l in Path(args.evals).read_text().splitlines() if l.strip()]
    rows = [r for r in rows if r["workflow"] == "multi_turn_retry"]
    base = next(r for r in rows if r["weights"] == "base")
    trained = [r for r in rows if r["weights"] != "base"][-1]
    metrics = [json.loads(l) for l in Path(args.metrics).read_text().splitlines() if l.strip()]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    labels = ["first attempt", "within two attempts"]
    for k, (name, r) in enumerate([("base", base), (f"trained v{metrics[-1]['version']}", trained)]):
        vals = [100 * r["acc_first"], 100 * r["acc_within"]]
        bars = ax1.bar([x + 0.38 * k for x in range(2)], vals, width=0.36, label=name)
        ax1.bar_label(bars, fmt="%.1f")
    ax1.set_xticks([0.19, 1.19], labels)
    ax1.set_ylabel(f"held-out accuracy, % (n={base['n']}, greedy)")
    ax1.set_title("multi_turn_retry (K=2), SmolLM2-135M")
    ax1.legend(loc="upper left")
    ax1.set_ylim(0, 100 * max(base['acc_within'], trained['acc_within']) * 1.3 + 1)
    ax2.plot([m["version"] for m in metrics], [m["reward_mean"] for m in metrics], marker="o", ms=3)
    ax2.set_xlabel("policy version")
    ax2.set_ylabel("episode reward (trained batches)")
    ax2.set_title("training reward (1.0 first try, 0.5 second)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
