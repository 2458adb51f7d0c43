"""Read one `areal-mq run` directory into benchmark figures; the e2e table and the accuracy-vs-time plot.

Used by benchmarks/speed/e2e.py (not a benchmark by itself). Times are wall-clock seconds:
- `ready`: when the last of controller, trainer and rollout engine reported ready (events/*.jsonl), i.e.
  when the system could start generating; the plot's x axis starts there (version 0 = base model);
- the training window runs from the first to the last training step (metrics.jsonl `time`): it holds
  steps 2..N in full, so samples/s = samples trained in steps 2..N / (t_N - t_1). Startup (imports,
  model loading) and the first batch's pipeline fill are the same work in every mode and are left out;
  the whole-run figure (subprocess start to exit) is reported next to it.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402

from areal_mq.telemetry.plots import controller_events

READY_EVENTS = ("controller.started", "trainer.started", "rollout.engine_ready")


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ready_time(run_dir: Path) -> float:
    """Wall time at which every process needed to generate and train had reported ready."""
    seen: dict[str, float] = {}
    for path in (run_dir / "events").glob("*.jsonl"):
        for rec in read_jsonl(path):
            if rec.get("event") in READY_EVENTS:
                seen[rec["event"]] = max(seen.get(rec["event"], 0.0), float(rec["ts"]))
    missing = [e for e in READY_EVENTS if e not in seen]
    if missing:
        raise RuntimeError(f"{run_dir}/events has no {', '.join(missing)} event: did every process start? "
                           f"See {run_dir}/logs/")
    return max(seen.values())


def summarize_run(run_dir: Path, started_ts: float, wall_s: float) -> dict:
    """Throughput, staleness and reward figures of a finished run (metrics.jsonl + events)."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    if len(metrics) < 2:
        raise RuntimeError(f"{run_dir}/metrics.jsonl has {len(metrics)} training steps; need at least 2")
    ready = ready_time(run_dir)
    t_first, t_last = metrics[0]["time"], metrics[-1]["time"]
    window = t_last - t_first
    samples = sum(m["n_seqs"] for m in metrics)
    window_samples = samples - metrics[0]["n_seqs"]
    return {
        "steps": len(metrics), "samples": samples, "run_wall_s": wall_s, "startup_s": ready - started_ts,
        "ready_to_last_step_s": t_last - ready, "train_window_s": window,
        "samples_per_s": window_samples / window,
        "samples_per_s_from_ready": samples / (t_last - ready),
        "samples_per_s_whole_run": samples / wall_s,
        "trainer_busy": sum(m["step_s"] + m.get("publish_s", 0.0) for m in metrics[1:]) / window,
        "trainer_wait_s_mean": sum(m.get("wait_s", 0.0) for m in metrics[1:]) / (len(metrics) - 1),
        "step_s_mean": sum(m["step_s"] for m in metrics) / len(metrics),
        "staleness_mean": sum(m["staleness_mean"] for m in metrics) / len(metrics),
        "staleness_max": max(m["staleness_max"] for m in metrics),
        "gen_tokens": sum(m["n_gen_tokens"] for m in metrics),
        "groups_dropped": len(controller_events(run_dir, "controller.group_dropped")),
        "reward_first": metrics[0]["reward_mean"], "reward_last": metrics[-1]["reward_mean"],
        "curve": [{"version": m["version"], "t": m["time"] - ready, "reward_mean": m["reward_mean"]}
                  for m in metrics],
        "ready_ts": ready,
    }


def version_time(summary: dict, version: int) -> float:
    """Seconds after `ready` at which `version` was published (0 for the base model)."""
    if version == 0:
        return 0.0
    for point in summary["curve"]:
        if point["version"] == version:
            return point["t"]
    raise KeyError(f"version {version} not in the run's metrics")


def plot(results: list[dict], base: dict, out: Path) -> Path:
    """Held-out accuracy (strict solid, lenient dashed) and batch reward against wall time, one line per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, rew) = plt.subplots(1, 2, figsize=(12, 4.8))
    for i, r in enumerate(results):
        color = f"C{i}"
        points = [(0.0, base)] + [(e["t"], e) for e in r["evals"]]
        xs = [t / 60 for t, _ in points]
        acc.plot(xs, [e["strict"] for _, e in points], "o-", color=color, label=f"{r['label']} strict")
        acc.plot(xs, [e["lenient"] for _, e in points], "s--", color=color, alpha=0.7, label=f"{r['label']} lenient")
        for (t, e) in points[1:]:
            acc.annotate(f"v{e['version']}", (t / 60, e["strict"]), fontsize=7, color=color)
        rew.plot([p["t"] / 60 for p in r["curve"]], [p["reward_mean"] for p in r["curve"]], ".-", color=color,
                 label=r["label"])
    acc.set(title=f"Held-out accuracy (n={base['n']}, greedy) vs wall time", xlabel="minutes since system ready",
            ylabel="accuracy", ylim=(0, 1))
    acc.legend(fontsize=7)
    rew.set(title="Training batch reward vs wall time", xlabel="minutes since system ready", ylabel="mean reward")
    rew.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def table(report: dict, command: str) -> str:
    modes = [r for r in report["results"] if r.get("kind") == "mode"]
    setup = next(r for r in report["results"] if r.get("kind") == "setup")
    cols = lambda fn: [fn(r) for r in modes]  # noqa: E731
    acc = lambda key: cols(lambda r: f"{r['final'][key]:.1%}")  # noqa: E731
    rows = [("metric", *[r["label"] for r in modes]),
            ("threads rollout/trainer", *cols(lambda r: f"{r['threads']['rollout']}/{r['threads']['trainer']}")),
            ("trained samples (seqs)", *cols(lambda r: str(r["samples"]))),
            ("whole run wall s", *cols(lambda r: f"{r['run_wall_s']:.0f}")),
            ("startup s (launch->ready)", *cols(lambda r: f"{r['startup_s']:.0f}")),
            ("first->last step s", *cols(lambda r: f"{r['train_window_s']:.1f}")),
            ("samples/s first->last step", *cols(lambda r: f"{r['samples_per_s']:.3f}")),
            ("samples/s ready->last step", *cols(lambda r: f"{r['samples_per_s_from_ready']:.3f}")),
            ("samples/s whole run", *cols(lambda r: f"{r['samples_per_s_whole_run']:.3f}")),
            ("trainer busy share", *cols(lambda r: f"{r['trainer_busy']:.0%}")),
            ("groups dropped (uniform reward)", *cols(lambda r: str(r.get("groups_dropped", "-")))),
            ("staleness mean/max", *cols(lambda r: f"{r['staleness_mean']:.2f}/{r['staleness_max']}")),
            (f"held-out strict (n={setup['eval_n']})", *acc("strict")),
            (f"held-out lenient (n={setup['eval_n']})", *acc("lenient")),
            ("load avg during run", *cols(lambda r: f"{r['loadavg_during']:.1f}"))]
    ratio_rows = [("ratio", "value", "target", "met")]
    for name, value in report["ratios"].items():
        target = report["targets"].get(name)
        met = "-" if target is None else common.met(value, target)
        ratio_rows.append((name, f"{value:.2f}", f">= {target}" if target is not None else "(none)", met))
    notes = [f"base model: strict {setup['base']['strict']:.1%} lenient {setup['base']['lenient']:.1%}; "
             f"model {setup['model']}, {setup['total_steps']} steps x {setup['batch_groups']} groups x "
             f"{setup['group_size']} seqs; eval after the runs on the final weights",
             "threads: torch threads per process as in the table (--sync-threads / --async-threads); "
             "controller and reward 1 each; all processes share the same 2 cores",
             "ratios: samples/s first->last training step (samples of steps 2..N / (t_N - t_1)) over the mean of "
             f"the sync runs ({setup['sync_samples_per_s_mean']:.3f}/s; "
             f"{' and '.join(r['label'] for r in modes if r['mode'] == 'sync')})",
             f"plot: {setup['plot']}"]
    return "\n".join([*common.align(rows), "", *common.align(ratio_rows), *notes, f"command: {command}"])
