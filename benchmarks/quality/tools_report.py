"""The tool task's arms side by side (issue 62 item 5): held-out accuracy per arm and seed, the training curves of the
runs behind them (against the policy version, from the trainer's `trainer.published` events), a table, a plot
and a JSON summary. Reads only.

What: each EVAL is `ARM:SEED=PATH`, PATH a result of `python -m areal_mq.evaluation.episodes ... --out PATH` (one
JSON object per line; the last line counts) for that arm and training seed; each `--curve LABEL=RUN_DIR` a run of
`areal-mq run` whose agent events give its training curve (benchmarks/quality/tools_curve.py: the fraction of right
episodes per window). Arms are named by the caller, e.g. `tool` (trained with the calculator, evaluated with it),
`tool-weights-no-tool` (the same weights, the agent without it), `no-tool` (trained and evaluated without it),
`base-tool` / `base-no-tool` (seed `-`: the base model). The table: per arm the accuracy per seed, its mean and the
fraction of episodes that called the tool; the plot: the curves (left) and every seed's held-out accuracy per arm with
the mean as a bar (right).

    python benchmarks/quality/tools_report.py ARM:SEED=PATH [...] [--curve LABEL=RUN_DIR ...] [--window 96]
        [--json PATH] [--plot PNG]
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tools_curve  # noqa: E402  (benchmarks/quality/tools_curve.py)


def parse_eval(spec: str) -> tuple[str, str, Path]:
    """`ARM:SEED=PATH` -> (arm, seed, path); a clear error for anything else."""
    head, sep, path = spec.partition("=")
    arm, colon, seed = head.rpartition(":")
    if not (sep and colon and arm and seed and path):
        raise ValueError(f"{spec!r}: expected ARM:SEED=PATH (e.g. tool:0=evals/tool-s0.jsonl)")
    return arm, seed, Path(path)


def last_record(path: Path) -> dict:
    """The last JSON object of an episodes.py --out file (a lone JSON object works too)."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: empty")
    rec = json.loads(lines[-1])
    if "acc_first" not in rec or "n" not in rec:
        raise ValueError(f"{path}: not an areal_mq.evaluation.episodes result (no acc_first / n)")
    return rec


def summary(evals: list[tuple[str, str, dict]]) -> dict:
    """Per arm, in the order first named: accuracy per seed (%), mean, n per evaluation, tool-call fraction."""
    arms: dict[str, dict] = {}
    for arm, seed, rec in evals:
        a = arms.setdefault(arm, {"seeds": [], "acc": [], "n": [], "tool_frac": [], "agent": []})
        a["seeds"].append(seed)
        a["acc"].append(round(100.0 * rec["acc_first"], 2))
        a["n"].append(rec["n"])
        a["tool_frac"].append(rec.get("tool_frac"))
        a["agent"].append((rec.get("workflow_args") or {}).get("agent"))
    for a in arms.values():
        a["mean"] = round(sum(a["acc"]) / len(a["acc"]), 2)
    return arms


def plot(arms: dict, curves: dict, window: int, path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    for label, rows in curves.items():
        left.plot([r["version"] for r in rows], [r["correct"] for r in rows], marker=".", label=label)
    left.set(xlabel="policy version when the window's last episode ended", ylabel="right, fraction of the window",
             ylim=(-0.02, 1.02), title=f"training episodes (windows of {window})")
    if curves:
        left.legend(fontsize=8)
    names = list(arms)
    for i, name in enumerate(names):
        a = arms[name]
        right.bar(i, a["mean"], color="C0", alpha=0.35)
        right.scatter([i] * len(a["acc"]), a["acc"], color="C0", zorder=3)
        right.text(i, 2, f"{a['mean']:.0f}", ha="center", fontsize=8)
    right.set_xticks(range(len(names)), names, rotation=25, ha="right", fontsize=8)
    right.set(ylabel="held-out accuracy, %", ylim=(0, 105), title="held-out (dots: seeds; bar: mean)")
    fig.suptitle("tools-arith: the calculator agent with and without its tool")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("evals", nargs="+", help="ARM:SEED=PATH, an episodes.py --out file")
    ap.add_argument("--curve", action="append", default=[], help="LABEL=RUN_DIR (repeatable)")
    ap.add_argument("--window", type=int, default=96)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        evals = [(arm, seed, last_record(path)) for arm, seed, path in map(parse_eval, args.evals)]
        curves = {}
        for spec in args.curve:
            label, sep, run_dir = spec.partition("=")
            if not (sep and label and run_dir) or not (Path(run_dir) / "events").is_dir():
                raise ValueError(f"--curve {spec!r}: expected LABEL=RUN_DIR, a run directory with events/")
            rows = tools_curve.windows(tools_curve.episodes(Path(run_dir)), args.window)
            pubs = tools_curve.published(Path(run_dir))
            curves[label] = [{**r, "version": tools_curve.version_at(pubs, r["ts"])} for r in rows]
    except (ValueError, OSError) as exc:
        ap.error(str(exc))
    arms = summary(evals)
    print(f"{'arm':<28} {'seeds':<8} {'accuracy % per seed':<22} {'mean':>6}  {'n':>5}  called")
    for name, a in arms.items():
        called = "-" if all(t is None for t in a["tool_frac"]) else " ".join(f"{t or 0:.2f}" for t in a["tool_frac"])
        print(f"{name:<28} {','.join(a['seeds']):<8} {' '.join(f'{x:.0f}' for x in a['acc']):<22} "
              f"{a['mean']:>6.1f}  {','.join(map(str, sorted(set(a['n'])))):>5}  {called}")
    report = {"command": shlex.join(["python", "benchmarks/quality/tools_report.py",
                                      *(sys.argv[1:] if argv is None else argv)]),
              "arms": arms, "curves": curves, "window": args.window,
              "plot": plot(arms, curves, args.window, args.plot) if args.plot else None}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
