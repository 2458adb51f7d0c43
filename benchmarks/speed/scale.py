"""Scale by simulation (issue 17): sync vs async RL at 8 to 1,024 simulated rollout workers, real infrastructure.

What it measures: for each number of rollout workers N (simulated GPUs: areal_mq/sim/engine.py, the
named timing model r1-1.5b-h800-roofline and completion lengths lognormal-8k, both in areal_mq/sim/timing.py)
and each mode — sync, async η = 1, 2, 4, 8 — one run of the real job broker, signal bus and sample store (three
processes), the real controller, the simulated trainer (trainer.sim, N/3 training devices: generation is 3/4
of the devices, the paper's kind of split) and one swarm process hosting the N workers (workers/swarm.py).
Every mode trains the same number of samples (steps x N x 4 sequences; each worker runs 4 at once). Reported
per run: simulated samples/s over the first -> last training step, the async/sync ratio, GPU-idle fraction
(simulated devices waiting, generation and training), staleness of the trained sequences, and in REAL time:
CPU % of the job broker, store, bus, controller and swarm processes (/proc), job messages/s through the
broker, p50/p99 dispatch latency (probe jobs client -> broker -> worker, measured in the swarm: an upper
bound, it includes the swarm's own loop) and the swarm's lag (how late a due simulated event was handled).
Virtual time runs `scale` real seconds per simulated second, chosen per N so the real message rate stays
within what this machine's processes can carry; infrastructure costs are real-time figures beside it.
Headline: `async_vs_sync_samples_per_s_64` (async η=2 over sync at N = 64; target 2.5).

--balance: the generation:training split (areal_mq/balance.py) — for three length distributions, sweep the
split in the zero-infrastructure model (areal_mq/sim/des.py), and compare the best with the split the
recommendation reaches when followed from the paper's 3/4 (see scale_balance.py).

    python benchmarks/speed/scale.py --quick          # N = 64: sync and async η=2 (< 1 minute)
    python benchmarks/speed/scale.py [--sizes 8,64,256,1024] [--etas 1,2,4,8] [--json PATH] [--plot PNG]
    python benchmarks/speed/scale.py --balance [--quick]
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402  (sibling modules of this script)
import scale_run  # noqa: E402

CAPACITY, GROUP = 4, 4  # sequences each simulated worker decodes at once; sequences per prompt
SCALE = {8: 0.02, 64: 0.06, 256: 0.15, 1024: 0.4}  # real s per simulated s (keeps ~300-700 jobs/s real)
TARGETS = {"async_vs_sync_samples_per_s_64": 2.5, "broker_cpu_pct_1024": 50.0, "dispatch_p99_ms_1024": 10.0}
log = common.logger("scale")


def settings(n: int, eta: int, steps: int, lengths: str) -> dict:
    return {"name": "sync" if eta == 0 else f"async_eta{eta}", "n": n, "mode": "sync" if eta == 0 else "async",
            "eta": eta, "scale": SCALE.get(n, round(0.0005 * n, 4)), "lengths": lengths, "steps": steps,
            "capacity": CAPACITY, "group_size": GROUP, "train_devices": max(1, n // 3)}


def run_all(sizes: list[int], etas: list[int], steps: int, lengths: str, work: Path,
            partial: Path | None = None) -> list[dict]:
    """Every (N, mode) run in turn; a failed run is recorded with its error (and its log tail) and the rest go
    on; with `partial`, the results so far are written there after each run."""
    from tqdm import tqdm

    plan = [settings(n, eta, steps, lengths) for n in sizes for eta in [0, *etas]]
    results = []
    with tqdm(plan, desc="scale runs", unit="run", file=sys.stderr) as bar:
        for s in bar:
            bar.set_postfix_str(f"N={s['n']} {s['name']}")
            try:
                r = scale_run.run_once(s, work)
            except RuntimeError as exc:
                log(f"N={s['n']} {s['name']} FAILED: {exc}\n{scale_run.log_tail(work, s)}")
                results.append({**s, "error": str(exc), "log_tail": scale_run.log_tail(work, s)})
                continue
            log(f"N={s['n']:>4} {s['name']:<10} {r['samples_per_s']:8.2f} samples/s  idle {r['gpu_idle']:.2f}  "
                f"broker {r['cpu_pct']['job']}%  p99 {r['dispatch_p99_ms']} ms  real {r['real_window_s']} s")
            results.append(r)
            common.save({"partial": True, "results": results}, partial)
    return results


def ratios(results: list[dict]) -> dict:
    out = {}
    sync = {r["n"]: r["samples_per_s"] for r in results if r["eta"] == 0 and "error" not in r}
    for r in results:
        if r["eta"] and sync.get(r["n"]) and "error" not in r:
            r["vs_sync"] = round(r["samples_per_s"] / sync[r["n"]], 3)
    for r in results:
        if r["eta"] == 2 and "vs_sync" in r:
            out[f"async_vs_sync_samples_per_s_{r['n']}"] = r["vs_sync"]
    return out


def table(report: dict) -> str:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="scale by simulation: sync vs async (simulated GPUs, real brokers/controller/store)")
    for col in ("N", "mode", "samples/s", "vs sync", "GPU idle", "staleness", "broker CPU", "msgs/s",
                "p99 dispatch ms", "ctl CPU", "store CPU", "swarm lag p99 ms"):
        t.add_column(col, justify="right")
    for r in report["results"]:
        if "error" in r:
            t.add_row(str(r["n"]), r["name"], "failed", *[""] * 8, r["error"][:40])
            continue
        stale = " ".join(f"{k}:{v}" for k, v in r["staleness"].items())
        t.add_row(str(r["n"]), r["name"], f"{r['samples_per_s']:.2f}", f"{r.get('vs_sync', 1.0):.2f}",
                  f"{r['gpu_idle']:.0%}", stale, f"{r['cpu_pct']['job']}%", f"{r['job_msgs_per_s']:.0f}",
                  str(r["dispatch_p99_ms"]), f"{r['cpu_pct']['controller']}%", f"{r['cpu_pct']['store']}%",
                  str(r["swarm_lag_p99_ms"]))
    console = Console(record=True, width=160, file=sys.stdout)
    console.print(t)
    lines = common.align(common.ratio_rows(report))
    lines.append(f"timing model {report['settings']['timing']}, lengths {report['settings']['lengths']} "
                 f"(areal_mq/sim/timing.py)\ncommand: {common.command('scale.py')}")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for eta in sorted({r["eta"] for r in report["results"]}):
        rows = [r for r in report["results"] if r["eta"] == eta and "error" not in r]
        label = "sync" if eta == 0 else f"async η={eta}"
        a.plot([r["n"] for r in rows], [r["samples_per_s"] for r in rows], marker="o", label=label)
        b.plot([r["n"] for r in rows], [r["cpu_pct"]["job"] for r in rows], marker="o", label=label)
    for ax, ylabel in ((a, "trained samples / simulated s"), (b, "job broker CPU % (real time)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("simulated rollout workers N")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    a.set_yscale("log")
    fig.suptitle("areal-mq scale by simulation (timing r1-1.5b-h800-roofline, lengths lognormal-8k)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = common.arg_parser(__doc__, "N = 64, sync and async η=2, 4 steps: under a minute on 2 cores.")
    parser.add_argument("--sizes", default="8,64,256,1024", help="Comma list of N (rollout workers).")
    parser.add_argument("--etas", default="1,2,4,8", help="Comma list of η for the async modes.")
    parser.add_argument("--steps", type=int, default=4, help="Training steps per mode (the same in --quick).")
    parser.add_argument("--lengths", default="lognormal-8k", help="Length distribution (areal_mq/sim/timing.py).")
    parser.add_argument("--plot", type=Path, default=None, help="PNG of samples/s and broker CPU against N.")
    parser.add_argument("--balance", action="store_true", help="Sweep the generation:training split instead.")
    args = parser.parse_args()
    if args.balance:
        import scale_balance

        scale_balance.main(args)
        return
    sizes = [64] if args.quick else [int(x) for x in args.sizes.split(",")]
    etas = [2] if args.quick else [int(x) for x in args.etas.split(",")]
    steps = 4 if args.quick else args.steps
    with tempfile.TemporaryDirectory(prefix="areal-scale-") as tmp:
        partial = args.json.with_suffix(".partial.json") if args.json else None
        report = common.timed(lambda: {"results": run_all(sizes, etas, steps, args.lengths, Path(tmp), partial)})
    report.update(benchmark="scale", quick=args.quick, machine=common.machine(),
                  settings={"sizes": sizes, "etas": etas, "steps": steps, "capacity": CAPACITY, "group_size": GROUP,
                            "timing": "r1-1.5b-h800-roofline", "lengths": args.lengths, "time_scale": SCALE})
    report["ratios"] = ratios(report["results"])
    big = [r for r in report["results"] if r["n"] == max(sizes) and "error" not in r]
    report["observed"] = {f"broker_cpu_pct_{max(sizes)}": max((r["cpu_pct"]["job"] for r in big), default=None),
                          f"dispatch_p99_ms_{max(sizes)}": max((r["dispatch_p99_ms"] or 0 for r in big), default=None)}
    report["targets"] = {k: v for k, v in TARGETS.items() if k in report["ratios"]}
    report["targets_other"] = {k: v for k, v in TARGETS.items() if k not in report["ratios"]}
    if args.plot:
        plot(report, args.plot)
    common.finish(report, args.json, table(report))


if __name__ == "__main__":
    main()
