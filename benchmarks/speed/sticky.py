"""Sticky-routing benchmark: multi-turn episodes through the real job broker and real rollout worker processes,
with sessions (sticky routing + the torch engine's session KV) and without, side by side in one run.

What it measures: a multi-turn client runs episodes (turn k+1's prompt = turn k's prompt + its output + a short
feedback text, as a retry workflow does), `--concurrent` episodes at once (twice the workers' slots, so turns
queue at the broker as under a busy controller), against one broker and `--workers` rollout workers (torch
engine, `session_kv_max_tokens` on). Rounds alternate between the two modes:
  - sticky: every turn carries the episode's session: the broker routes it to the worker that served the
    previous turn and that worker prefills only the new suffix;
  - plain: the same turns without a session (today's routing: least loaded worker, full prefill).
Both modes sample the same tokens (same per-turn seeds, ignore_eos: every turn generates --max-new tokens).
Per episode: latency (first submit to last answer), prompt tokens, prefill tokens saved (the engine's
per-result stats), and how many turns after the first ran on the previous turn's worker. The headline ratio
is plain/sticky mean episode latency (> 1: sticky is faster).

    python benchmarks/speed/sticky.py [--quick] [--json PATH] [--model NAME] [--workers 2] [--turns 4]

--quick: the tiny random model, 3 short turns, one round per mode (under a minute on 2 cores); full: SmolLM2-135M.
Processes are stopped by PID; everything binds 127.0.0.1 and speaks CURVE, as a real run does.
"""
from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402
from common import free_ports

from areal_mq.client import JobClient
from areal_mq.messages import Error, GenerateRequest, SamplingSpec
from areal_mq.security import Keyring, generate_keys

TARGETS = {"plain_vs_sticky_episode_latency": 1.0}
SIZES = {  # quick, full
    "model": ("tiny-random-llama", "smollm2-135m-instruct"), "turns": (3, 4), "max_new": (16, 48),
    "episodes": (16, 32), "rounds": (1, 2),
}
FEEDBACK = "\nThat is not right. Check your arithmetic and answer again."
ROUND_TIMEOUT_S = 600.0
log = common.logger("sticky")


@dataclass
class Episode:
    """One multi-turn episode of the client: its growing prompt and what each turn cost."""

    index: int
    session: str
    prompt: list[int]
    started: float
    turn: int = 0
    prompt_tokens: int = 0
    saved: int = 0
    workers: list[str] = field(default_factory=list)


class Cluster:
    """One broker and `n` rollout worker processes on free loopback ports; each stopped by PID."""

    def __init__(self, workdir: Path, model: str, n: int, capacity: int):
        job, bus_in, bus_out, store = free_ports(4)
        run_dir = workdir / "run"
        generate_keys(run_dir / "keys")
        cfg = {"run": {"name": "sticky-bench", "run_dir": str(run_dir)},
               "brokers": {"job_port": job, "bus_in_port": bus_in, "bus_out_port": bus_out, "store_port": store,
                           "heartbeat_s": 0.5, "liveness": 10},
               "model": {"name": model},
               "rollout": {"engine": {"max_concurrent": capacity, "threads": 1, "seed": 0,
                                      "session_kv_max_tokens": 65536, "session_kv_ttl_s": 300.0}},
               "events": {"console": "off", "to_bus": False}}
        self.workdir, self.procs = workdir, {}
        self.config = workdir / "sticky.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.job_addr, self.keys_dir = f"tcp://127.0.0.1:{job}", run_dir / "keys"
        self._start("broker", ["broker"])
        for i in range(n):
            self._start(f"rollout-{i}", ["worker", "rollout", "--worker-id", f"rollout-{i}"])

    def _start(self, name: str, args: list[str]) -> None:
        with open(self.workdir / f"{name}.log", "wb") as out:  # the child keeps its own copy of the descriptor
            self.procs[name] = subprocess.Popen([sys.executable, "-m", "areal_mq.cli", *args, "--config",
                                                 str(self.config)], stdout=out, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL)

    def client(self) -> JobClient:
        return JobClient(self.job_addr, keys=Keyring.load(self.keys_dir, "controller"), heartbeat_s=0.5)

    def broker_stats(self, client: JobClient) -> dict:
        return client.stats(10.0)

    def wait_workers(self, client: JobClient, n: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [name for name, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited early; see the logs in {self.workdir}")
            if sum(w["service"] == "generate" for w in self.broker_stats(client).get("workers", {}).values()) >= n:
                return
            time.sleep(0.5)
        raise TimeoutError(f"{n} rollout workers did not register in {timeout:.0f} s; see {self.workdir}")

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            common.stop_process(proc, wait_s=20.0)


def problems(tokenizer, n: int) -> list[list[int]]:
    """n chat-templated arithmetic questions (prompts of ~40-60 tokens)."""
    from areal_mq.engines.models import apply_chat_template

    return [apply_chat_template(tokenizer, f"What is {17 + 7 * i} * {23 + 3 * i} - {i * 11}? "
                                           "Think step by step, then give the final number.") for i in range(n)]


def run_round(client: JobClient, prompts: list[list[int]], feedback: list[int], args, sticky: bool,
              tag: str) -> list[dict]:
    """All episodes of one round (at most args.concurrent at once); one record per finished episode."""
    todo = list(enumerate(prompts))[::-1]
    running: dict[str, Episode] = {}
    done: list[dict] = []

    def submit(ep: Episode) -> None:
        sampling = SamplingSpec(temperature=1.0, max_new_tokens=args.max_new, ignore_eos=True,
                                seed=ep.index * 100 + ep.turn)
        msg = GenerateRequest(prompt_ids=ep.prompt, sampling=sampling, session=ep.session if sticky else "")
        running[client.submit(msg, service="generate")] = ep

    deadline = time.monotonic() + ROUND_TIMEOUT_S
    while todo or running:
        while todo and len(running) < args.concurrent:
            i, prompt = todo.pop()
            submit(Episode(i, f"{tag}-ep{i}", list(prompt), time.monotonic()))
        for job_id, msg in client.poll(0.2):
            ep = running.pop(job_id, None)
            if ep is None:
                continue
            if isinstance(msg, Error):
                raise RuntimeError(f"turn {ep.turn} of episode {ep.index} failed: [{msg.code}] {msg.message}")
            ep.prompt_tokens += len(ep.prompt)
            ep.saved += int(msg.stats.get("prefill_tokens_saved", 0))
            ep.workers.append(msg.worker_id)
            ep.turn += 1
            if ep.turn < args.turns:
                ep.prompt = ep.prompt + msg.output_ids.tolist() + feedback
                submit(ep)
            else:
                same = sum(a == b for a, b in zip(ep.workers, ep.workers[1:]))
                done.append({"latency_s": time.monotonic() - ep.started, "prompt_tokens": ep.prompt_tokens,
                             "saved": ep.saved, "same_worker_turns": same, "later_turns": len(ep.workers) - 1})
        if time.monotonic() > deadline:
            raise TimeoutError(f"round {tag} did not finish in {ROUND_TIMEOUT_S:.0f} s")
    return done


def summarize(episodes: list[dict], counters: dict) -> dict:
    lat = np.array([e["latency_s"] for e in episodes])
    prompt = sum(e["prompt_tokens"] for e in episodes)
    saved = sum(e["saved"] for e in episodes)
    later = sum(e["later_turns"] for e in episodes)
    return {"episodes": len(episodes), "latency_mean_s": round(float(lat.mean()), 3),
            "latency_p50_s": round(float(np.median(lat)), 3), "latency_p90_s": round(float(np.quantile(lat, 0.9)), 3),
            "prompt_tokens_per_episode": round(prompt / len(episodes), 1),
            "prefill_saved_per_episode": round(saved / len(episodes), 1),
            "prefill_saved_fraction": round(saved / max(1, prompt), 3),
            "same_worker_turn_fraction": round(sum(e["same_worker_turns"] for e in episodes) / max(1, later), 3),
            "broker": counters}


def broker_counters(before: dict, after: dict) -> dict:
    keys = ("sticky_hits", "sticky_parked", "sticky_expired", "sticky_fallbacks")
    b, a = before.get("counters", {}), after.get("counters", {})
    return {k: a.get(k, 0) - b.get(k, 0) for k in keys}


def run(args, workdir: Path) -> dict:
    from areal_mq.engines.models import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model))
    feedback = tokenizer.encode(FEEDBACK, add_special_tokens=False)
    prompts = problems(tokenizer, args.episodes)
    cluster = Cluster(workdir, args.model, args.workers, args.capacity)
    client = cluster.client()
    try:
        cluster.wait_workers(client, args.workers)
        log(f"{args.workers} rollout workers up ({args.model}); {args.rounds} round(s) per mode")
        run_round(client, prompts[:2], feedback, args, sticky=False, tag="warmup")
        per_mode: dict[str, list] = {"sticky": [], "plain": []}
        counters = {"sticky": {}, "plain": {}}
        for r in range(args.rounds):
            for mode in (("sticky", "plain") if r % 2 == 0 else ("plain", "sticky")):
                before = cluster.broker_stats(client)
                t0 = time.monotonic()
                eps = run_round(client, prompts, feedback, args, sticky=mode == "sticky", tag=f"r{r}-{mode}")
                per_mode[mode] += eps
                delta = broker_counters(before, cluster.broker_stats(client))
                counters[mode] = {k: counters[mode].get(k, 0) + v for k, v in delta.items()}
                log(f"round {r + 1} {mode}: {len(eps)} episodes in {time.monotonic() - t0:.1f} s, mean latency "
                    f"{np.mean([e['latency_s'] for e in eps]):.2f} s, saved {sum(e['saved'] for e in eps)} tokens")
    finally:
        client.close()
        cluster.stop()
    results = [{"mode": m, **summarize(per_mode[m], counters[m])} for m in ("sticky", "plain")]
    sticky, plain = results
    return {"benchmark": "sticky", "quick": args.quick,
            "machine": common.torch_machine(model=args.model, workers=args.workers, capacity=args.capacity),
            "settings": {k: getattr(args, k) for k in ("turns", "max_new", "episodes", "concurrent", "rounds")},
            "results": results,
            "ratios": {"plain_vs_sticky_episode_latency": round(plain["latency_mean_s"] / sticky["latency_mean_s"], 3)},
            "targets": dict(TARGETS)}


def table(report: dict) -> str:
    s, p = report["results"]
    rows = [("metric", "sticky", "plain"),
            ("episode latency mean / p50 / p90, s", *(f"{r['latency_mean_s']:.2f} / {r['latency_p50_s']:.2f} / "
                                                      f"{r['latency_p90_s']:.2f}" for r in (s, p))),
            ("prompt tokens per episode", s["prompt_tokens_per_episode"], p["prompt_tokens_per_episode"]),
            ("prefill tokens saved per episode", s["prefill_saved_per_episode"], p["prefill_saved_per_episode"]),
            ("prefill saved fraction", s["prefill_saved_fraction"], p["prefill_saved_fraction"]),
            ("later turns on the previous turn's worker", s["same_worker_turn_fraction"], p["same_worker_turn_fraction"]),
            ("broker sticky hits / parked / expired / fallbacks",
             *("{sticky_hits} / {sticky_parked} / {sticky_expired} / {sticky_fallbacks}".format(**r["broker"])
               for r in (s, p)))]
    lines = common.align(rows) + [""] + common.align(common.ratio_rows(report))
    st = report["settings"]
    lines.append(f"{report['machine']['model']}, {report['machine']['workers']} workers x capacity "
                 f"{report['machine']['capacity']}, {st['episodes']} episodes x {st['turns']} turns x {st['max_new']} "
                 f"new tokens per round, {st['concurrent']} at once, {st['rounds']} round(s) per mode")
    lines.append(f"command: {common.command('sticky.py')}")
    return "\n".join(lines)


def main() -> None:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--model", help="Model name or path (quick: tiny-random-llama, full: smollm2-135m-instruct).")
    parser.add_argument("--workers", type=int, default=2, help="Rollout worker processes.")
    parser.add_argument("--capacity", type=int, default=4, help="Sequences each worker decodes at once.")
    parser.add_argument("--turns", type=int, help="Turns per episode.")
    parser.add_argument("--max-new", type=int, help="Tokens generated per turn.")
    parser.add_argument("--episodes", type=int, help="Episodes per round.")
    parser.add_argument("--concurrent", type=int,
                        help="Episodes at once (default: 2 x workers x capacity, so turns queue at the broker as "
                             "they do under a controller that keeps the workers busy).")
    parser.add_argument("--rounds", type=int, help="Rounds per mode (alternating).")
    args = parser.parse_args()
    q = 0 if args.quick else 1
    for name, sizes in SIZES.items():
        if getattr(args, name) is None:
            setattr(args, name, sizes[q])
    args.concurrent = args.concurrent or 2 * args.workers * args.capacity
    report = common.timed(run, args, tmp_prefix="sticky-bench-")
    common.finish(report, args.json, table(report))


if __name__ == "__main__":
    main()
