"""Reward benchmark: math-verify rewards/s directly, in 1 and 2 pool processes, and through the broker.

What it measures, in one run, on generated jobs (groups of 4 completions with fractions, decimals,
thousands separators and LaTeX, a quarter of them wrong; new strings every round and each mode in its own
processes, so math-verify's internal caches never help; the reward cache is off; every mode of a round
scores the same jobs):
  direct      math_reward called in this process, one call after another (no pool, no IPC)
  pool-1/2    a RewardExecutor with 1 or 2 pool processes, all jobs submitted at once
  routed-1/2  a JobClient -> job broker process -> `areal-mq reward serve math` process with 1 or 2 pool
              processes, a window of 8 jobs in flight
Modes alternate inside every round (the machine is shared): rates are medians over rounds, ratios the
median of per-round ratios (the two sides of a ratio ran back to back under the same load).
Pool processes run in their own sessions, so on kernels with autogroup scheduling each gets its own CPU
share (otherwise a whole session shares one, and a second process adds nothing on a busy machine).
Headline ratios (larger is better): two_vs_one_worker = pool-2 / pool-1 (target 1.6) and
routed_vs_direct = routed-1 / direct (target 0.5): the whole broker hop on one scoring process.

    python benchmarks/speed/reward.py [--quick] [--json PATH]
"""
from __future__ import annotations

import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402
from common import cpu_seconds, free_ports

from areal_mq.client import JobClient
from areal_mq.messages import RewardJob, RewardResult
from areal_mq.rewards import RewardConfig, RewardExecutor
from areal_mq.rewards.math_rewards import math_reward
from areal_mq.security import Keyring, generate_keys

TARGETS = {"two_vs_one_worker": 1.6, "routed_vs_direct": 0.5}
SIZES = {"rounds": (5, 9), "jobs": (40, 80)}  # quick, full; 4 completions per job
WINDOW = 8
MODES = ("direct", "pool-1", "pool-2", "routed-1", "routed-2")


log = common.logger("reward")


def make_jobs(n: int, rng: random.Random, tag: str) -> list[RewardJob]:
    """Groups of 4 completions of one answer in different forms; about a quarter are wrong."""
    jobs = []
    for i in range(n):
        den = rng.choice([2, 4, 5, 8, 10, 20, 25])
        num = rng.randrange(1, 50 * den)
        value = num / den
        forms = [
            rf"We add the parts and get \boxed{{\frac{{{num}}}{{{den}}}}}.",
            rf"So the result is \boxed{{{value:g}}}",
            rf"Therefore the answer is ${value:,.2f}$ in total.",
            rf"The answer is \boxed{{{value + rng.randrange(1, 9):g}}}",
        ]
        rng.shuffle(forms)
        ref = rf"\frac{{{num}}}{{{den}}}" if i % 2 else f"#### {value:,g}"
        jobs.append(RewardJob(task="math", prompt_id=f"{tag}-{i}", prompt=f"problem {num}/{den}",
                              completions=forms, reference=ref))
    return jobs


def run_direct(jobs: list[RewardJob]) -> float:
    t0 = time.perf_counter()
    for job in jobs:
        for c in job.completions:
            math_reward(job.prompt, c, job.reference)
    return time.perf_counter() - t0


def run_pool(ex: RewardExecutor, jobs: list[RewardJob], tag: str, cpu: dict | None = None) -> float:
    pids = ex.pool_pids()
    c0 = sum(cpu_seconds(p) for p in pids)
    t0 = time.perf_counter()
    futs = [ex.submit(job, job_id=f"{tag}-{i}") for i, job in enumerate(jobs)]
    results = [f.result(timeout=600) for f in futs]
    elapsed = time.perf_counter() - t0
    if cpu is not None:  # cores the pool processes got from the scheduler during this segment
        cpu.setdefault(tag.split("-", 1)[1], []).append((sum(cpu_seconds(p) for p in pids) - c0) / elapsed)
    check(results)
    return elapsed


def run_routed(client: JobClient, service: str, jobs: list[RewardJob]) -> float:
    t0 = time.perf_counter()
    todo, inflight, results = list(jobs), set(), []
    while todo or inflight:
        while todo and len(inflight) < WINDOW:
            inflight.add(client.submit(todo.pop(), service=service))
        for job_id, msg in client.poll(0.05):
            inflight.discard(job_id)
            results.append(msg)
    elapsed = time.perf_counter() - t0
    check(results)
    return elapsed


def check(results) -> None:
    for r in results:
        if not isinstance(r, RewardResult) or any(r.errors):
            raise RuntimeError(f"a benchmark job failed: {r}")


class Routed:
    """A broker and two `areal-mq reward serve math` processes (services reward-1, reward-2), stopped by PID."""

    def __init__(self, workdir: Path):
        ports = free_ports(4)
        cfg = {"run": {"name": "bench", "run_dir": str(workdir / "run")},
               "brokers": dict(zip(("job_port", "bus_in_port", "bus_out_port", "store_port"), ports)),
               "events": {"console": "off", "to_bus": False, "to_file": False},
               "reward": {"cache_size": 0, "timeout_s": 60}}
        self.config = workdir / "bench.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        generate_keys(workdir / "run" / "keys")  # CURVE on every socket, as in a run
        self.addr = f"tcp://127.0.0.1:{ports[0]}"
        self.workdir, self.procs = workdir, []
        self._start("broker", ["broker", "--config", str(self.config)])
        for n in (1, 2):
            self._start(f"reward-{n}", ["reward", "serve", "math", "--config", str(self.config),
                                        "--service", f"reward-{n}", "--processes", str(n)])
        self.client = JobClient(self.addr, keys=Keyring.load(workdir / "run" / "keys", "controller"))
        self._wait_workers()

    def _start(self, name: str, args: list[str]) -> None:
        out = open(self.workdir / f"{name}.log", "wb")
        self.procs.append(subprocess.Popen([sys.executable, "-m", "areal_mq.cli", *args], stdout=out,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))

    def _wait_workers(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args} exited with {p.returncode}; logs in {self.workdir}")
            try:
                services = {w["service"] for w in self.client.stats(timeout=10)["workers"].values()}
            except Exception:  # broker not up yet
                services = set()
            if {"reward-1", "reward-2"} <= services:
                return
            time.sleep(0.3)
        raise RuntimeError("reward servers did not register with the broker within 120 s")

    def close(self) -> None:
        self.client.close()
        for p in reversed(self.procs):
            common.stop_process(p)


def run(args, workdir: Path) -> dict:
    from tqdm import tqdm

    q = 0 if args.quick else 1
    rounds, n_jobs = SIZES["rounds"][q], SIZES["jobs"][q]
    rng = random.Random(0)
    log("starting pools, broker and reward servers")
    pools = {n: RewardExecutor(RewardConfig(processes=n, cache_size=0, timeout_s=60,
                                            tasks={"math": {"fn": "math"}})).start() for n in (1, 2)}
    routed = Routed(workdir)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    cores: dict[str, list[float]] = {}
    try:
        warm = make_jobs(4, rng, "warm")
        run_direct(warm)
        for n, ex in pools.items():
            run_pool(ex, warm, f"warm-{n}")
        for n in (1, 2):
            run_routed(routed.client, f"reward-{n}", warm)
        for r in tqdm(range(rounds), desc="rounds", file=sys.stderr):
            order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
            # the same jobs for every mode of a round: each mode runs in its own processes, so no process
            # sees a string twice (math-verify caches parses), and the modes compare on identical work
            jobs = make_jobs(n_jobs, rng, f"r{r}")
            for mode in order:
                if mode == "direct":
                    times[mode].append(run_direct(jobs))
                elif mode.startswith("pool"):
                    times[mode].append(run_pool(pools[int(mode[-1])], jobs, f"r{r}-{mode}", cores))
                else:
                    times[mode].append(run_routed(routed.client, f"reward-{mode[-1]}", jobs))
    finally:
        routed.close()
        for ex in pools.values():
            ex.close()
    rewards = n_jobs * 4
    rate = {m: rewards / statistics.median(ts) for m, ts in times.items()}
    results = [{"mode": m, "rewards_per_s": round(rate[m], 1), "rounds": len(times[m]), "rewards_per_round": rewards,
                "seconds": [round(t, 3) for t in times[m]],
                **({"pool_cores_median": round(statistics.median(cores[m]), 2)} if m in cores else {})}
               for m in MODES]
    def ratio(fast: str, slow: str) -> float:  # per round (same load), then the median over rounds
        return round(statistics.median(ts / tf for tf, ts in zip(times[fast], times[slow])), 3)

    ratios = {"two_vs_one_worker": ratio("pool-2", "pool-1"), "routed_vs_direct": ratio("routed-1", "direct"),
              "routed_two_vs_one_worker": ratio("routed-2", "routed-1"), "pool1_vs_direct": ratio("pool-1", "direct")}
    return {"benchmark": "reward", "quick": args.quick, "machine": common.machine(), "results": results,
            "ratios": ratios, "targets": dict(TARGETS)}


def table(report: dict, command: str) -> str:
    rows = [("mode", "rewards/s", "round seconds")]
    for r in report["results"]:
        cores = f"  (pool got {r['pool_cores_median']:.2f} cores)" if "pool_cores_median" in r else ""
        rows.append((r["mode"], f"{r['rewards_per_s']:,.1f}", " ".join(f"{s:.2f}" for s in r["seconds"]) + cores))
    rows += [("", "", ""), *common.ratio_rows(report)]
    return "\n".join([*common.align(rows, rule=False), f"reproduce: {command}"])


def main() -> None:
    args = common.arg_parser(__doc__).parse_args()
    report = common.timed(run, args, tmp_prefix="areal-reward-bench-")
    common.finish(report, args.json, table(report, "python benchmarks/speed/reward.py" + (" --quick" if args.quick else "")))


if __name__ == "__main__":
    main()
