"""Broker benchmark: job round trips through the real job broker vs a direct DEALER<->ROUTER echo.

What it measures, in one run, on free loopback ports (all peers are real processes):
  1. small jobs (GenerateRequest: ~280 B header + 512 int32 tokens; reply: a 512-token GenerateResult):
     round trips/s with a windowed pipeline, routed (client DEALER -> broker process -> echo worker process)
     and direct (client DEALER -> the same echo worker process's own ROUTER), rounds alternating; the
     headline ratio is the median of the routed/direct ratios of each alternating pair of rounds;
  2. latency p50/p99 of paced jobs at half of the routed peak, routed and direct at the same offered load
     (in segments, each re-measuring the peak first, because a shared machine's speed drifts);
  3. 64 MiB jobs, routed vs direct, MB/s;
  4. the sample store: a producer puts Samples whose three arrays are 64 MiB each while a consumer gets and
     acks them: MB/s through the store (durable log write included);
  5. the broker process's CPU share with 1,000 connected workers that only heartbeat (vs idle), their
     heartbeat answer times, and routed throughput while they are connected.
The broker runs as `python -m areal_mq.cli broker --config ...`; the echo worker and the swarm are
benchmarks/speed/broker_peers.py (raw pyzmq + msgpack, so the peers cost as little as possible).

    python benchmarks/speed/broker.py [--quick] [--json PATH] [--profile] [--workers 1000] [--security curve|off]

Every socket uses CURVE, as a real run does (`--security off`: plaintext; benchmarks/speed/security.py compares
the two side by side).

`--quick` finishes in under a minute on 2 cores; `--profile` runs the broker under cProfile and prints its
hot spots. The table at the end has each figure next to its target; benchmarks/RESULTS.md records runs.
"""
from __future__ import annotations

import argparse
import json
import pstats
import subprocess
import sys
import time
import uuid
from pathlib import Path

import msgpack
import numpy as np
import yaml
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402
from common import cpu_seconds, free_ports, met

from areal_mq import protocol
from areal_mq.client import JobClient
from areal_mq.messages import GenerateRequest, SamplingSpec
from areal_mq.security import Keyring, generate_keys

HERE = Path(__file__).resolve().parent
TARGETS = {"routed_vs_direct_throughput": 0.4, "store_mb_s": 500.0, "routed_p99_ms_at_half_peak": 5.0,
           "broker_cpu_share_1000_workers": 0.5}
SIZES = {  # quick, full
    "small_rounds": (3, 5), "small_jobs": (3000, 20000), "latency_segments": (2, 5), "latency_jobs": (1500, 4000),
    "large_rounds": (2, 3), "large_jobs": (4, 10), "store_samples": (2, 5), "cpu_window_s": (4.0, 15.0),
}
WINDOW, LARGE_WINDOW = 64, 2
# The CLI under cProfile with a CPU clock: on a shared machine a wall-clock profile charges preemption to
# whichever call happened to be running (usually a socket send), which hides the real hot spots.
PROFILED_CLI = """
import cProfile, runpy, sys, time
out, sys.argv = sys.argv[1], ["areal-mq", *sys.argv[2:]]
prof = cProfile.Profile(time.process_time)
prof.enable()
try:
    runpy.run_module("areal_mq.cli", run_name="__main__")
except SystemExit:
    pass
finally:
    prof.disable()
    prof.dump_stats(out)
"""
MIB = 1024 * 1024


log = common.logger("broker")


class Cluster:
    """The broker and peer processes of one benchmark run; every one is stopped by PID."""

    def __init__(self, workdir: Path, profile: bool, secure: bool = True):
        job, bus_in, bus_out, store, self.direct_port = free_ports(5)
        self.workdir, self.procs, self.profile_path = workdir, {}, None
        self.keys_dir = workdir / "run" / "keys" if secure else None
        if secure:
            generate_keys(self.keys_dir)
        cfg = {"run": {"name": "bench", "run_dir": str(workdir / "run")},
               "brokers": {"job_port": job, "bus_in_port": bus_in, "bus_out_port": bus_out, "store_port": store,
                           "heartbeat_s": 1.0, "liveness": 5},
               "security": {"insecure": not secure},
               "events": {"console": "off", "to_bus": False}}
        self.config = workdir / "broker.yaml"
        self.config.write_text(yaml.safe_dump(cfg))
        self.job_addr, self.store_addr = f"tcp://127.0.0.1:{job}", f"tcp://127.0.0.1:{store}"
        self.direct_addr = f"tcp://127.0.0.1:{self.direct_port}"
        argv = [sys.executable, "-m", "areal_mq.cli"]
        if profile:
            self.profile_path = workdir / "broker.prof"
            argv = [sys.executable, "-c", PROFILED_CLI, str(self.profile_path)]
        self.start("broker", [*argv, "broker", "--config", str(self.config)])
        self.wait_workers(lambda w: True, "broker up")

    def start(self, name: str, argv: list[str]) -> subprocess.Popen:
        out = open(self.workdir / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(argv, stdout=out if name != "swarm" else subprocess.PIPE,
                                            stderr=out, stdin=subprocess.DEVNULL)
        return self.procs[name]

    def start_peer(self, name: str, args: list[str]) -> subprocess.Popen:
        keys = ["--keys", str(self.keys_dir)] if self.keys_dir else []
        return self.start(name, [sys.executable, str(HERE / "broker_peers.py"), *args, *keys])

    def keys(self, role: str) -> Keyring:
        """The identity a benchmark client speaks with (plaintext when the cluster is insecure)."""
        return Keyring.load(self.keys_dir, role) if self.keys_dir else Keyring.insecure(role)

    def cpu_snapshot(self) -> np.ndarray:
        """CPU seconds so far of the broker, the echo worker and this (client) process."""
        return np.array([cpu_seconds(self.procs["broker"].pid), cpu_seconds(self.procs["echo"].pid),
                         time.process_time()])

    def stats(self) -> dict:
        client = JobClient(self.job_addr, keys=self.keys("observer"))
        try:
            return client.stats(timeout=30)
        finally:
            client.close()

    def wait_workers(self, predicate, what: str, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}; see {self.workdir}/{name}.log")
            workers = self.stats()["workers"]
            if predicate(workers):
                return workers
            time.sleep(0.2)
        raise RuntimeError(f"timed out waiting for: {what}")

    def stop(self, name: str) -> str:
        proc = self.procs.pop(name, None)
        if proc is None:
            return ""
        common.stop_process(proc)
        return proc.stdout.read().decode() if proc.stdout else ""

    def close(self) -> None:
        for name in list(self.procs)[::-1]:
            self.stop(name)


# ---------------------------------------------------------------- the client side of a round trip
class Pipe:
    """A DEALER sending GenerateRequest-shaped jobs (real protocol frames) and timing their answers."""

    def __init__(self, ctx: zmq.Context, address: str, tokens: int, keys: Keyring | None = None,
                 server: str = "broker"):
        self.sock = ctx.socket(zmq.DEALER)
        if keys is not None:
            keys.client(self.sock, server)
        for opt, val in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0)):
            self.sock.setsockopt(opt, val)
        self.sock.connect(address)
        job = GenerateRequest(prompt_ids=np.arange(tokens, dtype=np.int32) % 49152, group_id="bench-g0",
                              sampling=SamplingSpec(max_new_tokens=64, temperature=1.0), sample_index=3)
        frames = protocol.encode(job, service="bench")
        self.template, self.payload = msgpack.unpackb(frames[0]), frames[1]
        self.header_bytes, self.large = len(frames[0]), tokens * 4 > 65536
        self.prefix, self.count = uuid.uuid4().hex[:8], 0

    def send(self) -> str:
        self.count += 1
        self.template["id"] = job_id = f"{self.prefix}{self.count:024x}"
        self.sock.send_multipart([msgpack.packb(self.template), self.payload], copy=not self.large)
        return job_id

    def receive(self, sent_at: dict, out: list) -> None:
        """Every answer waiting now: append its latency (s) to `out`."""
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            now = time.perf_counter()
            head = msgpack.unpackb(frames[0])
            if head["kind"] != "generate_result":
                raise RuntimeError(f"unexpected answer {head['kind']}: {head.get('body')}")
            out.append(now - sent_at.pop(head["reply_to"]))

    def pipeline(self, n: int, window: int) -> tuple[float, np.ndarray]:
        """n jobs with up to `window` in flight: (round trips/s, latencies)."""
        sent_at, lats, sent, t0 = {}, [], 0, time.perf_counter()
        while len(lats) < n:
            while len(sent_at) < window and sent < n:
                sent_at[self.send()] = time.perf_counter()
                sent += 1
            if not self.sock.poll(60_000):
                raise RuntimeError(f"no answer for 60 s with {len(sent_at)} jobs in flight")
            self.receive(sent_at, lats)
        return n / (time.perf_counter() - t0), np.array(lats)

    def paced(self, n: int, rate: float) -> np.ndarray:
        """n jobs at a fixed offered rate (open loop); latency from each job's actual send."""
        sent_at, lats, sent, interval = {}, [], 0, 1.0 / rate
        due = time.perf_counter()
        while len(lats) < n:
            now = time.perf_counter()
            while sent < n and due <= now:
                sent_at[self.send()] = time.perf_counter()
                sent, due = sent + 1, due + interval
            if self.sock.poll(0):
                self.receive(sent_at, lats)
            elif sent < n:
                time.sleep(min(max(due - now, 0), 0.0002))  # 0.2 ms resolution, no busy spin
            elif not self.sock.poll(30_000):
                raise RuntimeError("no answer for 30 s")
        return np.array(lats)

    def close(self) -> None:
        self.sock.close(0)


# ---------------------------------------------------------------- phases
def pct(lats: np.ndarray, q: float) -> float:
    return float(np.percentile(lats, q) * 1000) if len(lats) else float("nan")


def alternate(cluster: Cluster, tokens: int, rounds: int, jobs: int, window: int, what: str) -> dict:
    """Alternating routed/direct pipeline rounds: median rates, and the routed/direct ratio of each pair."""
    ctx = zmq.Context.instance()
    me = cluster.keys("controller")
    pipes = {"routed": Pipe(ctx, cluster.job_addr, tokens, me),
             "direct": Pipe(ctx, cluster.direct_addr, tokens, me, "echo")}
    rates: dict[str, list[float]] = {"routed": [], "direct": []}
    lats: dict[str, list] = {"routed": [], "direct": []}
    cpu = {m: np.zeros(3) for m in rates}  # broker, echo worker, client CPU seconds
    try:
        for mode, pipe in pipes.items():
            pipe.pipeline(min(200, jobs), window)  # warm-up: connections, caches
        for r in range(rounds):
            for mode in (("routed", "direct") if r % 2 == 0 else ("direct", "routed")):
                c0 = cluster.cpu_snapshot()
                rate, lat = pipes[mode].pipeline(jobs, window)
                cpu[mode] += cluster.cpu_snapshot() - c0
                rates[mode].append(rate)
                lats[mode].append(lat)
                log(f"{what} round {r + 1}/{rounds} {mode}: {rate:,.1f} round trips/s")
    finally:
        header_bytes = pipes["routed"].header_bytes
        for pipe in pipes.values():
            pipe.close()
    out = {"header_bytes": header_bytes, "payload_bytes": tokens * 4, "window": window, "jobs_per_round": jobs,
           # routed/direct of each alternating pair of rounds; its median is robust to the machine's drift
           "pair_ratios": [r / d for r, d in zip(rates["routed"], rates["direct"])]}
    for mode in rates:
        all_lat = np.concatenate(lats[mode])
        per_rt = cpu[mode] / (jobs * rounds) * 1e6
        out[mode] = {"round_trips_s": float(np.median(rates[mode])), "rounds": rates[mode],
                     "p50_ms": pct(all_lat, 50), "p99_ms": pct(all_lat, 99),
                     "cpu_us_per_round_trip": dict(zip(("broker", "echo_worker", "client"), per_rt.round(1).tolist()))}
    return out


def latency_at_half_peak(cluster: Cluster, segments: int, jobs: int) -> dict:
    """Paced jobs at half of the routed peak, routed and direct at the same offered load.

    The machine is shared and its speed drifts, so the run is split into segments: each one first measures
    the routed peak afresh (a short pipeline burst), then runs both modes (alternating order) at half of it.
    """
    ctx = zmq.Context.instance()
    me = cluster.keys("controller")
    pipes = {"routed": Pipe(ctx, cluster.job_addr, 512, me), "direct": Pipe(ctx, cluster.direct_addr, 512, me, "echo")}
    lats: dict[str, list] = {"routed": [], "direct": []}
    rates = []
    try:
        for seg in range(segments):
            peak, _ = pipes["routed"].pipeline(max(1000, jobs // 2), WINDOW)
            rates.append(peak / 2)
            for mode in (("routed", "direct") if seg % 2 == 0 else ("direct", "routed")):
                lats[mode].append(pipes[mode].paced(jobs, peak / 2))
            log(f"latency segment {seg + 1}/{segments} at {peak / 2:,.0f}/s: routed p99 "
                f"{pct(lats['routed'][-1], 99):.2f} ms, direct p99 {pct(lats['direct'][-1], 99):.2f} ms")
    finally:
        for pipe in pipes.values():
            pipe.close()
    out = {"offered_rate": float(np.median(rates)), "offered_rates": rates, "jobs_per_segment": jobs}
    for mode, parts in lats.items():
        lat = np.concatenate(parts)
        out[mode] = {"p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99), "max_ms": pct(lat, 100),
                     "segment_p99_ms": [pct(part, 99) for part in parts]}
    return out


def store_throughput(cluster: Cluster, samples: int) -> dict:
    """A producer thread puts Samples while this thread gets (and acks) them: bytes through the store / time."""
    import threading

    from areal_mq.client import StoreClient
    from areal_mq.messages import Sample, SeqSample

    n = 64 * MIB // 4
    seq = SeqSample(prompt_ids=np.arange(16, dtype=np.int32), output_ids=np.arange(n, dtype=np.int32), reward=1.0,
                    logprobs=np.full(n, -0.5, np.float32), versions=np.zeros(n, np.int32))
    nbytes = sum(a.nbytes for a in (seq.prompt_ids, seq.output_ids, seq.logprobs, seq.versions))
    put_s, errors = [], []

    def produce() -> None:
        client = StoreClient(cluster.store_addr, keys=cluster.keys("controller"), heartbeat_s=1.0)
        try:
            for _ in range(samples):
                t = time.perf_counter()
                client.put(Sample(sample_id=f"bench-{uuid.uuid4().hex}", seqs=[seq]), timeout=300)
                put_s.append(time.perf_counter() - t)
        except Exception as exc:  # reported by the consumer side
            errors.append(exc)
        finally:
            client.close()

    consumer, get_s = StoreClient(cluster.store_addr, keys=cluster.keys("trainer"), heartbeat_s=1.0), []
    producer = threading.Thread(target=produce, name="store-producer")
    t0 = time.perf_counter()
    producer.start()
    try:
        for _ in range(samples):
            t = time.perf_counter()
            batch = consumer.get_batch(1, version=0, wait_s=60, timeout=300)
            got = batch.samples[0].seqs[0] if batch.samples else None
            if got is None or len(got.output_ids) != n or int(got.output_ids[-1]) != n - 1:
                raise RuntimeError(f"store returned a wrong or no sample (producer errors: {errors})")
            get_s.append(time.perf_counter() - t)
            consumer.ack(batch, timeout=300)
        total_s = time.perf_counter() - t0
    finally:
        producer.join(300)
        consumer.close()
    mb = nbytes * samples / 1e6
    res = {"sample_mb": nbytes / 1e6, "samples": samples, "store_mb_s": mb / total_s,
           "put_mb_s": mb / sum(put_s), "get_mb_s": mb / sum(get_s)}
    log(f"sample store: {res['store_mb_s']:,.0f} MB/s through (put {res['put_mb_s']:,.0f} MB/s, "
        f"get incl. waiting {res['get_mb_s']:,.0f} MB/s)")
    return res


def swarm_cpu(cluster: Cluster, workers: int, window_s: float, jobs: int) -> dict:
    broker_pid = cluster.procs["broker"].pid
    c0, t0 = cpu_seconds(broker_pid), time.monotonic()
    time.sleep(window_s)
    idle = (cpu_seconds(broker_pid) - c0) / (time.monotonic() - t0)
    cluster.start_peer("swarm", ["swarm", cluster.job_addr, "--workers", str(workers), "--heartbeat-s", "1.0"])
    t_reg = time.monotonic()
    cluster.wait_workers(lambda w: sum(1 for x in w.values() if x["service"] == "idle") >= workers,
                         f"{workers} swarm workers registered", timeout=120)
    log(f"{workers} workers registered in {time.monotonic() - t_reg:.1f} s")
    time.sleep(1.0)
    c0, t0 = cpu_seconds(broker_pid), time.monotonic()
    time.sleep(window_s)
    loaded = (cpu_seconds(broker_pid) - c0) / (time.monotonic() - t0)
    still = sum(1 for x in cluster.stats()["workers"].values() if x["service"] == "idle")
    pipe = Pipe(zmq.Context.instance(), cluster.job_addr, 512, cluster.keys("controller"))
    try:
        rate, _ = pipe.pipeline(jobs, WINDOW)
    finally:
        pipe.close()
    swarm = json.loads(cluster.stop("swarm").strip().splitlines()[-1])
    log(f"broker CPU: idle {idle:.1%}, {workers} heartbeating workers {loaded:.1%}; "
        f"{still} still registered; routed with them connected {rate:,.0f}/s")
    return {"workers": workers, "cpu_share_idle": idle, "cpu_share": loaded, "window_s": window_s,
            "still_registered": still, "routed_round_trips_s_with_workers": rate, "heartbeats": swarm}


# ---------------------------------------------------------------- report
def machine() -> dict:
    return common.machine(pyzmq=zmq.__version__, libzmq=zmq.zmq_version(), msgpack=".".join(map(str, msgpack.version)))


def build_report(quick: bool, small: dict, lat: dict, large: dict, store: dict, swarm: dict,
                 security: str = "curve") -> dict:
    ratio = float(np.median(small["pair_ratios"]))
    large_mb = {m: large[m]["round_trips_s"] * large["payload_bytes"] / 1e6 for m in ("routed", "direct")}
    results = [
        {"name": "small_jobs", **small},
        {"name": "latency_at_half_peak", **lat, "target_routed_p99_ms": TARGETS["routed_p99_ms_at_half_peak"]},
        {"name": "large_jobs_64mib", **large, "routed_mb_s": large_mb["routed"], "direct_mb_s": large_mb["direct"]},
        {"name": "sample_store_64mib_arrays", **store, "target_mb_s": TARGETS["store_mb_s"]},
        {"name": "heartbeat_swarm", **swarm, "target_cpu_share": TARGETS["broker_cpu_share_1000_workers"]},
    ]
    return {"benchmark": "broker", "quick": quick, "machine": machine(), "results": results, "security": security,
            "ratios": {"routed_vs_direct_throughput": ratio},
            "targets": {"routed_vs_direct_throughput": TARGETS["routed_vs_direct_throughput"]}}


def table(report: dict, command: str) -> str:
    small, lat, large, store, swarm = report["results"]
    ratio = report["ratios"]["routed_vs_direct_throughput"]
    rows = [("metric", "routed", "direct", "ratio / value", "target", "met"),
            ("small jobs, round trips/s", f"{small['routed']['round_trips_s']:,.0f}",
             f"{small['direct']['round_trips_s']:,.0f}", f"{ratio:.3f}", ">= 0.40", met(ratio, 0.4)),
            (f"p50 / p99 ms at ~{lat['offered_rate']:,.0f}/s (half peak)",
             f"{lat['routed']['p50_ms']:.2f} / {lat['routed']['p99_ms']:.2f}",
             f"{lat['direct']['p50_ms']:.2f} / {lat['direct']['p99_ms']:.2f}", f"{lat['routed']['p99_ms']:.2f} ms",
             "< 5 ms", met(lat["routed"]["p99_ms"], 5.0, False)),
            ("64 MiB jobs, MB/s", f"{large['routed_mb_s']:,.0f}", f"{large['direct_mb_s']:,.0f}",
             f"{np.median(large['pair_ratios']):.3f}", "-", "-"),
            ("sample store put->get, MB/s", "-", "-", f"{store['store_mb_s']:,.0f}", ">= 500",
             met(store["store_mb_s"], 500.0)),
            (f"broker CPU, {swarm['workers']} heartbeating workers", "-", "-",
             f"{swarm['cpu_share']:.1%} (idle {swarm['cpu_share_idle']:.1%})", "< 50%",
             met(swarm["cpu_share"], 0.5, False))]
    extra = [f"heartbeat answers p50/p99 {swarm['heartbeats']['rtt_p50_ms']:.2f}/"
             f"{swarm['heartbeats']['rtt_p99_ms']:.2f} ms; {swarm['still_registered']}/{swarm['workers']} still "
             f"registered; routed with them connected {swarm['routed_round_trips_s_with_workers']:,.0f}/s",
             f"store put {store['put_mb_s']:,.0f} MB/s, get (incl. waiting) {store['get_mb_s']:,.0f} MB/s; "
             "routed p99 per latency segment (ms): "
             + ", ".join(f"{v:.2f}" for v in lat["routed"]["segment_p99_ms"])]
    cpu = "; ".join(f"{m}: " + ", ".join(f"{k} {v:.0f}" for k, v in small[m]["cpu_us_per_round_trip"].items())
                    for m in ("routed", "direct"))
    return "\n".join([*common.align(rows), *extra, f"CPU us per small round trip ({cpu})", f"command: {command}"])


def print_profile(path: Path, top: int = 25) -> None:
    stats = pstats.Stats(str(path), stream=sys.stderr)
    stats.sort_stats("tottime").print_stats(top)


def run(args: argparse.Namespace, workdir: Path) -> dict:
    q = 0 if args.quick else 1
    size = {k: v[q] for k, v in SIZES.items()}
    cluster = Cluster(workdir, args.profile, secure=args.security == "curve")
    try:
        cluster.start_peer("echo", ["echo", cluster.job_addr, cluster.direct_addr, "--heartbeat-s", "1.0"])
        cluster.wait_workers(lambda w: "bench-echo" in w, "echo worker registered")
        small = alternate(cluster, 512, size["small_rounds"], size["small_jobs"], WINDOW, "small jobs")
        lat = latency_at_half_peak(cluster, size["latency_segments"], size["latency_jobs"])
        large = alternate(cluster, 64 * MIB // 4, size["large_rounds"], size["large_jobs"], LARGE_WINDOW, "64 MiB jobs")
        store = store_throughput(cluster, size["store_samples"])
        swarm = swarm_cpu(cluster, args.workers, size["cpu_window_s"], size["small_jobs"])
    finally:
        cluster.close()
    if cluster.profile_path and cluster.profile_path.exists():
        print_profile(cluster.profile_path)
    return build_report(args.quick, small, lat, large, store, swarm, args.security)


def main() -> None:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--profile", action="store_true", help="Run the broker under cProfile; print hot spots.")
    parser.add_argument("--workers", type=int, default=1000, help="Heartbeating workers in the CPU phase.")
    parser.add_argument("--security", choices=("curve", "off"), default="curve",
                        help="CURVE on every socket (as in a run), or plaintext.")
    args = parser.parse_args()
    report = common.timed(run, args, tmp_prefix="areal-broker-bench-")
    common.finish(report, args.json, table(report, common.command("broker.py")))


if __name__ == "__main__":
    main()
