"""`areal-mq plot RUN_DIR`: reward, held-out accuracy, staleness and throughput against wall time (PNG).

Reads run_dir/metrics.jsonl (one line per training step, written by the trainer), run_dir/eval.jsonl
(held-out evaluations, each pinned to a policy version) and the controller's events; writes
run_dir/plots/training.png.
"""
from __future__ import annotations

import json
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def controller_events(run_dir: Path, *names: str) -> list[dict]:
    """The controller's events of the given names (run_dir/events/controller*.jsonl), in time order."""
    rows: list[dict] = []
    for path in sorted((Path(run_dir) / "events").glob("controller*.jsonl")):
        rows.extend(r for r in read_jsonl(path) if r.get("event") in names)
    return sorted(rows, key=lambda r: r.get("ts", 0))


def controller_stats(run_dir: Path) -> list[dict]:
    return controller_events(run_dir, "controller.stats")


def group_rewards(run_dir: Path) -> list[dict]:
    """Every finished group's mean reward with its time: stored and dropped ones (the trained batches miss
    the dropped ones, so only this shows how the rollout policy does)."""
    return [r for r in controller_events(run_dir, "controller.group_stored", "controller.group_dropped")
            if "reward_mean" in r]


def staleness_histogram(metrics: list[dict]) -> list[int]:
    """Sum of the per-step `staleness_hist` lists (tokens at staleness 0, 1, ...); [] for older runs."""
    total: list[int] = []
    for m in metrics:
        for k, c in enumerate(m.get("staleness_hist") or []):
            total.extend([0] * (k + 1 - len(total)))
            total[k] += c
    return total


def generation_rate(ctl: list[dict], t0: float) -> tuple[list[float], list[float]]:
    """Windowed generation rate from successive controller.stats (cumulative average for old runs)."""
    if not all("gen_tokens" in c for c in ctl):
        return [(c["ts"] - t0) / 60 for c in ctl], [c.get("gen_tokens_per_s") for c in ctl]
    xs, ys = [], []
    for a, b in zip(ctl, ctl[1:]):
        if b["ts"] > a["ts"]:
            xs.append((b["ts"] - t0) / 60)
            ys.append((b["gen_tokens"] - a["gen_tokens"]) / (b["ts"] - a["ts"]))
    return xs, ys


def rolling_mean(values: list, window: int) -> list[float]:
    """Mean of the last `window` values at each point (fewer at the start); None values are skipped."""
    out = []
    for i in range(len(values)):
        xs = [v for v in values[max(0, i - window + 1): i + 1] if v is not None]
        out.append(sum(xs) / len(xs) if xs else float("nan"))
    return out


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    ctl = controller_stats(run_dir)
    if not metrics and not evals:
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl or eval.jsonl to plot")
    t0 = min([m["time"] for m in metrics if "time" in m] + [e["time"] for e in evals] or [0])
    minutes = lambda rows, key="time": [(r[key] - t0) / 60 for r in rows]  # noqa: E731
    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))
    rewards = [m.get("reward_mean") for m in metrics]
    ax[0, 0].plot(minutes(metrics), rewards, marker=".", alpha=0.45, label="trained batch reward")
    groups = group_rewards(run_dir)
    if len(groups) >= 8:  # one group is one prompt: the trend is only visible averaged
        ax[0, 0].plot(minutes(groups, "ts"), rolling_mean([g["reward_mean"] for g in groups], 20), lw=2,
                      label="all generated groups (mean of last 20)")
    elif len(rewards) >= 4:
        ax[0, 0].plot(minutes(metrics), rolling_mean(rewards, 5), lw=2, label="mean of last 5 batches")
    ax[0, 0].set(title="Reward (sampled at the training temperature)", xlabel="minutes", ylabel="mean reward")
    ax[0, 0].legend(fontsize=8)
    # an evaluation is drawn when its version was published (it finishes later, often in the background)
    published = {m["version"]: m["time"] for m in metrics if "version" in m and "time" in m}
    eval_x = [((published.get(e.get("version"), e["time"]) if e.get("version") else t0) - t0) / 60 for e in evals]
    for key, style, what in (("strict", "o-", "answer in \\boxed{}"), ("lenient", "s--", "last number")):
        ax[0, 1].plot(eval_x, [e[key] for e in evals], style, label=f"{key} ({what})")
    for x, e in zip(eval_x, evals):
        ax[0, 1].annotate(f"v{e.get('version', 0)}", (x, e["strict"]), fontsize=8)
    ax[0, 1].set(title="Held-out accuracy (at the version's publish time)", xlabel="minutes", ylabel="accuracy", ylim=(0, 1))
    ax[0, 1].legend(fontsize=8)
    hist = staleness_histogram(metrics)
    if hist:  # every trained token of the run, by how many versions its policy lagged the trained one
        ax[1, 0].bar(range(len(hist)), hist, color="tab:blue")
        mean = sum(k * c for k, c in enumerate(hist)) / max(1, sum(hist))
        ax[1, 0].set(title=f"Per-token staleness, all trained tokens (mean {mean:.2f})", xlabel="versions behind",
                     ylabel="tokens", xticks=range(len(hist)))
    else:
        ax[1, 0].plot(minutes(metrics), [m.get("staleness_mean") for m in metrics], marker=".", label="mean")
        ax[1, 0].plot(minutes(metrics), [m.get("staleness_max") for m in metrics], marker=".", label="max")
        ax[1, 0].set(title="Per-token staleness (versions)", xlabel="minutes")
        ax[1, 0].legend(fontsize=8)
    ax[1, 1].plot(minutes(metrics), [m.get("tokens_per_s") for m in metrics], marker=".", label="training tok/s")
    if ctl:
        ax[1, 1].plot(*generation_rate(ctl, t0), label="generation tok/s")
    ax[1, 1].set(title="Throughput", xlabel="minutes", ylabel="tokens/s")
    ax[1, 1].legend(fontsize=8)
    ax[0, 0].legend(fontsize=8)
    fig.suptitle(f"areal-mq run {run_dir.name}")
    fig.tight_layout()
    out = Path(out) if out else run_dir / "plots" / "training.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
