"""The tool task's training curve from a run's agent events: per window of episodes, how many were right, called
the calculator, had a call read as a bare argument (tool_family prompted_bare) or a malformed call, and how many
were trained as exact token sequences (issue 62 items 3 and 5).

What: reads RUN_DIR/events/agent-*.jsonl (`agent.episode_done`: correct_at, tool_calls, tool_repairs, tool_errors,
exact_turns, chat_calls), in the order the episodes ended, windows of `--window` episodes; prints a table, writes
JSON and a PNG (fractions against episodes ended).

    python benchmarks/quality/tools_curve.py RUN_DIR [--window 48] [--json PATH] [--plot PNG]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from areal_mq.telemetry.tail import read_events  # merged by time, a line cut by a stop skipped

KEYS = ("correct", "called", "bare", "malformed", "exact")


def episodes(run_dir: Path) -> list[dict]:
    """The run's ended episodes, oldest first."""
    return read_events(run_dir, "agent.episode_done")


def published(run_dir: Path) -> list[tuple[float, int]]:
    """(ts, version) of each weights version the trainer published, oldest first."""
    return [(float(ev.get("ts", 0.0)), ev["version"]) for ev in read_events(run_dir, "trainer.published")
            if isinstance(ev.get("version"), int)]


def version_at(pubs: list[tuple[float, int]], ts: float) -> int:
    """The newest version published at or before `ts` (0: the base weights)."""
    return max((v for t, v in pubs if t <= ts), default=0)


def windows(rows: list[dict], size: int) -> list[dict]:
    """Fractions per window of `size` episodes (the last window may be shorter; an empty run gives none)."""
    out = []
    for start in range(0, len(rows), size):
        part = rows[start:start + size]
        n = len(part)
        out.append({"episodes": start + n, "n": n, "ts": part[-1].get("ts", 0.0),
                    "correct": sum(e.get("correct_at", 0) >= 1 for e in part) / n,
                    "called": sum(e.get("tool_calls", 0) > 0 for e in part) / n,
                    "bare": sum(e.get("tool_repairs", 0) > 0 for e in part) / n,
                    "malformed": sum(e.get("tool_errors", 0) > 0 for e in part) / n,
                    "exact": sum(e.get("exact_turns", -1) == e.get("chat_calls", 0) for e in part) / n})
    return out


def plot(rows: list[dict], path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r["episodes"] for r in rows]
    for key in KEYS:
        ax.plot(xs, [r[key] for r in rows], marker="o", label=key)
    ax.set(xlabel="episodes ended", ylabel="fraction of the window", ylim=(-0.02, 1.02),
           title="tools-arith training: the calculator agent")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--window", type=int, default=48)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.window < 1:
        ap.error("--window must be >= 1")
    if not (args.run_dir / "events").is_dir():
        ap.error(f"{args.run_dir}: no events/ folder (a run directory of `areal-mq run`)")
    rows = windows(episodes(args.run_dir), args.window)
    print("episodes  " + "  ".join(f"{k:>9}" for k in KEYS))
    for r in rows:
        print(f"{r['episodes']:>8}  " + "  ".join(f"{r[k]:>9.3f}" for k in KEYS))
    report = {"run_dir": str(args.run_dir), "window": args.window, "rows": rows,
              "plot": plot(rows, args.plot) if rows and args.plot else None}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
