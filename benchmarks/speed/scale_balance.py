"""`python benchmarks/speed/scale.py --balance`: does following the split recommendation reach the best split?

What: for three completion-length distributions (lognormal-8k-narrow, lognormal-8k, lognormal-8k-heavy from
areal_mq/sim/timing.py; timing model r1-1.5b-h800-roofline), with D devices in all and async η=2:
  1. sweep: simulate every generation:training split (generation devices from D/4 to D-1) and keep the best
     throughput;
  2. follow: start from the paper's 3/4 split, simulate, feed the run's live figures (generated tokens/s,
     trained samples/s, generation and trainer busy shares) to areal_mq/balance.recommend_split, move to the
     recommended split, repeat until it stays (at most FOLLOW_ROUNDS);
and report followed/best throughput (target >= 0.9, i.e. within 10 %). The runs use the zero-infrastructure
model (areal_mq/sim/des.py: the real SimEngine and can_admit, no sockets), because a sweep of real-process runs
would take hours on this machine; benchmarks/speed/scale.py's main mode measures what infrastructure adds.
Imported by scale.py (sibling module).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402

LENGTHS = ("lognormal-8k-narrow", "lognormal-8k", "lognormal-8k-heavy")
FOLLOW_ROUNDS = 4
log = common.logger("scale-balance")


def simulate(lengths: str, gen: int, total: int, steps: int) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from areal_mq.sim.des import plan
    from areal_mq.sim.timing import length_model, timing_model
    from areal_mq.workers.controller_admission import can_admit

    return plan(admit=can_admit, n_workers=gen, capacity=4, timing=timing_model("r1-1.5b-h800-roofline"),
                lengths=length_model(lengths), batch_groups=total // 2, group_size=4, eta=2, steps=steps,
                train_devices=total - gen, prompt_len=128, max_concurrent_groups=10 ** 6)


def follow(lengths: str, total: int, steps: int) -> tuple[int, list[int], dict]:
    from areal_mq.balance import recommend_split

    gen, path = round(0.75 * total), []
    for _ in range(FOLLOW_ROUNDS):
        path.append(gen)
        r = simulate(lengths, gen, total, steps)
        split = recommend_split(gen_devices=gen, train_devices=total - gen, gen_tokens_per_s=r["gen_tokens"] / r["sim_s"],
                                tokens_per_sample=r["gen_tokens"] / r["completed"],
                                trained_samples_per_s=r["samples_per_s"], gen_busy=r["gen_utilization"],
                                train_busy=r["train_utilization"], eta=2)
        if split.gen_devices == gen or split.gen_devices in path:
            break
        gen = split.gen_devices
    return gen, path, simulate(lengths, gen, total, steps)


def run(quick: bool) -> dict:
    from tqdm import tqdm

    total, steps = (16, 6) if quick else (32, 10)
    results = []
    for lengths in tqdm(LENGTHS, desc="length distributions", file=sys.stderr):
        sweep = {g: simulate(lengths, g, total, steps)["samples_per_s"] for g in range(total // 4, total)}
        best = max(sweep, key=sweep.get)
        gen, path, followed = follow(lengths, total, steps)
        results.append({"lengths": lengths, "devices": total, "best_gen": best, "best_samples_per_s": sweep[best],
                        "followed_gen": gen, "path": path, "followed_samples_per_s": followed["samples_per_s"],
                        "paper_split_samples_per_s": sweep[round(0.75 * total)],
                        "followed_vs_best": round(followed["samples_per_s"] / sweep[best], 3),
                        "sweep": {str(g): round(v, 4) for g, v in sweep.items()}})
        log(f"{lengths}: best {best}/{total} gen, followed {path} -> {gen}, ratio {results[-1]['followed_vs_best']}")
    return {"results": results, "settings": {"devices": total, "steps": steps, "eta": 2, "capacity": 4}}


def main(args) -> None:
    report = common.timed(run, args.quick)
    report.update(benchmark="scale", mode="balance", quick=args.quick, machine=common.machine())
    worst = min(r["followed_vs_best"] for r in report["results"])
    report["ratios"] = {"followed_vs_best_split_samples_per_s_min": worst}
    report["targets"] = {"followed_vs_best_split_samples_per_s_min": 0.9}
    rows = [("lengths", "best gen/total", "samples/s best", "3/4 split", "followed path", "samples/s followed", "ratio")]
    for r in report["results"]:
        rows.append((r["lengths"], f"{r['best_gen']}/{r['devices']}", f"{r['best_samples_per_s']:.3f}",
                     f"{r['paper_split_samples_per_s']:.3f}", "->".join(map(str, r["path"])),
                     f"{r['followed_samples_per_s']:.3f}", f"{r['followed_vs_best']:.3f}"))
    lines = common.align(rows) + [""] + common.align(common.ratio_rows(report))
    lines.append(f"command: {common.command('scale.py')}")
    common.finish(report, args.json, "\n".join(lines))
