"""What CURVE costs: the same traffic with CURVE on and off, side by side in one run.

What it measures (two real broker processes on free loopback ports, one with CURVE and the run's ZAP
allow-list, one plaintext, each with its own echo worker process from benchmarks/speed/broker_peers.py):
  1. small jobs (GenerateRequest with 512 tokens, 512-token reply) routed through the broker: round trips/s,
     rounds alternating curve/plain; the ratio is the median of the per-pair ratios;
  2. 64 MiB jobs routed through the broker: MB/s, alternating;
  3. a policy's weights from the trainer's WeightServer to a fetcher (fetch_weights, as a rollout worker
     does in zmq mode): the tensor sizes of SmolLM2-135M in bf16 (~270 MB; --quick: a quarter), MB/s,
     alternating curve/plain;
  4. the handshake: time from connect to the first answered stats request, curve vs plain.
Each ratio is curve / plain (larger is better; 1.0 = free).

    python benchmarks/speed/security.py [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402
from broker import LARGE_WINDOW, MIB, WINDOW, Cluster, Pipe, log

from areal_mq.client import JobClient
from areal_mq.security import Keyring
from areal_mq.weights import WeightServer, fetch_weights

TARGETS = {"curve_vs_plain_small_jobs": 0.5, "curve_vs_plain_64mib_jobs": 0.25, "curve_vs_plain_weights": 0.25}
SIZES = {"rounds": (3, 6), "small_jobs": (2000, 10000), "large_jobs": (3, 6), "weight_fraction": (0.25, 1.0),
         "handshakes": (5, 20)}
SMOLLM2_PARAMS = 134_515_008  # SmolLM2-135M (tied embeddings): 30 layers of 576 wide, vocab 49,152


def model_like_tensors(fraction: float) -> dict[str, torch.Tensor]:
    """bf16 tensors shaped like SmolLM2-135M's (one embedding + 30 layers), scaled by `fraction`."""
    layers = max(1, int(30 * fraction))
    out = {"model.embed_tokens.weight": torch.randn(int(49152 * fraction), 576, dtype=torch.bfloat16)}
    for i in range(layers):
        for name, shape in (("self_attn.q_proj", (576, 576)), ("self_attn.k_proj", (192, 576)),
                            ("self_attn.v_proj", (192, 576)), ("self_attn.o_proj", (576, 576)),
                            ("mlp.gate_proj", (1536, 576)), ("mlp.up_proj", (1536, 576)),
                            ("mlp.down_proj", (576, 1536))):
            out[f"model.layers.{i}.{name}.weight"] = torch.randn(*shape, dtype=torch.bfloat16)
    return out


def alternate_clusters(clusters: dict, tokens: int, rounds: int, jobs: int, window: int, what: str) -> dict:
    """Routed pipeline rounds, alternating curve/plain: per-mode median rate and per-pair ratios."""
    import zmq

    ctx = zmq.Context.instance()
    pipes = {m: Pipe(ctx, c.job_addr, tokens, c.keys("controller")) for m, c in clusters.items()}
    rates: dict[str, list[float]] = {m: [] for m in clusters}
    try:
        for pipe in pipes.values():
            pipe.pipeline(min(100, jobs), window)  # warm-up
        for r in range(rounds):
            for mode in (("curve", "plain") if r % 2 == 0 else ("plain", "curve")):
                rate, _ = pipes[mode].pipeline(jobs, window)
                rates[mode].append(rate)
                log(f"{what} round {r + 1}/{rounds} {mode}: {rate:,.1f} round trips/s")
    finally:
        for pipe in pipes.values():
            pipe.close()
    return {"payload_bytes": tokens * 4, "jobs_per_round": jobs, "window": window,
            "pair_ratios": [c / p for c, p in zip(rates["curve"], rates["plain"])],
            **{m: {"round_trips_s": float(np.median(v)), "rounds": v} for m, v in rates.items()}}


def weights_transfer(keys_dir: Path, rounds: int, fraction: float) -> dict:
    tensors = model_like_tensors(fraction)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    servers = {"curve": WeightServer(keys=Keyring.load(keys_dir, "trainer")), "plain": WeightServer()}
    fetchers = {"curve": Keyring.load(keys_dir, "rollout"), "plain": None}
    readies = {m: s.publish(1, tensors) for m, s in servers.items()}
    rates: dict[str, list[float]] = {m: [] for m in servers}
    try:
        for mode in servers:
            fetch_weights(readies[mode], timeout_s=300, keys=fetchers[mode])  # warm-up
        for r in range(rounds):
            for mode in (("curve", "plain") if r % 2 == 0 else ("plain", "curve")):
                t0 = time.perf_counter()
                got = fetch_weights(readies[mode], timeout_s=300, keys=fetchers[mode])
                rates[mode].append(nbytes / 1e6 / (time.perf_counter() - t0))
                assert len(got) == len(tensors)
                log(f"weights round {r + 1}/{rounds} {mode}: {rates[mode][-1]:,.0f} MB/s")
    finally:
        for s in servers.values():
            s.close()
    return {"bytes": nbytes, "tensors": len(tensors), "pair_ratios": [c / p for c, p in zip(rates["curve"], rates["plain"])],
            **{m: {"mb_s": float(np.median(v)), "rounds": v} for m, v in rates.items()}}


def handshakes(clusters: dict, n: int) -> dict:
    """Connect, then one stats request answered: the cost of the CURVE handshake plus ZAP, per connection."""
    out: dict[str, list[float]] = {m: [] for m in clusters}
    for _ in range(n):
        for mode, c in clusters.items():
            t0 = time.perf_counter()
            client = JobClient(c.job_addr, keys=c.keys("observer"))
            try:
                client.stats(timeout=30)
            finally:
                client.close()
            out[mode].append((time.perf_counter() - t0) * 1000)
    return {m: {"median_ms": float(np.median(v)), "all_ms": v} for m, v in out.items()}


def table(report: dict, command: str) -> str:
    small, large, weights, hs = report["results"]
    r = report["ratios"]
    rows = [("traffic", "curve", "plain", "curve/plain", "target"),
            ("small jobs routed, round trips/s", f"{small['curve']['round_trips_s']:,.0f}",
             f"{small['plain']['round_trips_s']:,.0f}", f"{r['curve_vs_plain_small_jobs']:.3f}", ">= 0.50"),
            ("64 MiB jobs routed, MB/s", f"{large['curve']['round_trips_s'] * 64 * MIB / 1e6:,.0f}",
             f"{large['plain']['round_trips_s'] * 64 * MIB / 1e6:,.0f}", f"{r['curve_vs_plain_64mib_jobs']:.3f}",
             ">= 0.25"),
            (f"weights ({weights['bytes'] / 1e6:,.0f} MB bf16), MB/s", f"{weights['curve']['mb_s']:,.0f}",
             f"{weights['plain']['mb_s']:,.0f}", f"{r['curve_vs_plain_weights']:.3f}", ">= 0.25"),
            ("connect + first answer, ms", f"{hs['curve']['median_ms']:.2f}", f"{hs['plain']['median_ms']:.2f}",
             "-", "-")]
    return "\n".join([*common.align(rows), f"command: {command}"])


def run(args: argparse.Namespace, workdir: Path) -> dict:
    q = 0 if args.quick else 1
    size = {k: v[q] for k, v in SIZES.items()}
    clusters = {}
    try:
        for mode in ("curve", "plain"):
            (workdir / mode).mkdir()
            clusters[mode] = c = Cluster(workdir / mode, profile=False, secure=mode == "curve")
            c.start_peer("echo", ["echo", c.job_addr, c.direct_addr, "--heartbeat-s", "1.0"])
            c.wait_workers(lambda w: "bench-echo" in w, f"{mode} echo worker registered")
        small = alternate_clusters(clusters, 512, size["rounds"], size["small_jobs"], WINDOW, "small jobs")
        large = alternate_clusters(clusters, 64 * MIB // 4, size["rounds"], size["large_jobs"], LARGE_WINDOW,
                                   "64 MiB jobs")
        hs = handshakes(clusters, size["handshakes"])
    finally:
        for c in clusters.values():
            c.close()
    weights = weights_transfer(clusters["curve"].keys_dir, size["rounds"], size["weight_fraction"])
    ratios = {"curve_vs_plain_small_jobs": float(np.median(small["pair_ratios"])),
              "curve_vs_plain_64mib_jobs": float(np.median(large["pair_ratios"])),
              "curve_vs_plain_weights": float(np.median(weights["pair_ratios"]))}
    import zmq

    return {"benchmark": "security", "quick": args.quick,
            "machine": common.machine(pyzmq=zmq.__version__, libzmq=zmq.zmq_version(), curve=zmq.has("curve")),
            "results": [{"name": "small_jobs", **small}, {"name": "large_jobs_64mib", **large},
                        {"name": "weights_transfer", **weights}, {"name": "handshake", **hs}],
            "ratios": ratios, "targets": TARGETS}


def main() -> None:
    args = common.arg_parser(__doc__).parse_args()
    report = common.timed(run, args, tmp_prefix="areal-security-bench-")
    common.finish(report, args.json, table(report, common.command("security.py")))


if __name__ == "__main__":
    main()
