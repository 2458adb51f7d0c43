"""One simulated run for benchmarks/speed/scale.py: real broker, bus, store, controller, simulated trainer and swarm.

What: `run_once(settings, work_dir)` starts, on loopback, the job broker, the signal bus and the sample store as
three processes (`areal-mq broker --only job|bus|store`, so each one's CPU is its own), the real controller
(`areal-mq worker controller`), the simulated trainer (`areal-mq worker trainer` with trainer.sim.enabled) and
one swarm process with N simulated rollout workers plus the simulated reward (`areal-mq worker swarm`). While
the run goes, a probe thread sends a GenerateRequest to the swarm's `probe` service every PROBE_EVERY_S through
the job broker (dispatch latency). It waits for the trainer to finish `controller.total_steps` versions,
reads the job broker's counters, stops everything by PID and returns the figures: simulated throughput over
the first -> last training step, GPU-idle fraction, staleness counts, per-process CPU % (from /proc, real
time, over the same window), job messages/s, dispatch latency, and the swarm's own lag.
Imported by scale.py (sibling module); not a script.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402
from common import cpu_seconds, free_ports

PROBE_EVERY_S = 0.05
PROCS = ("job", "bus", "store", "controller", "swarm", "trainer")


def overrides(s: dict, run_dir: Path, ports: list[int]) -> list[str]:
    """--set flags of one run. s: n, mode, eta, scale, lengths, steps, capacity, group_size, train_devices."""
    job, bus_in, bus_out, store = ports
    batch_groups = max(1, s["n"] * s["capacity"] // s["group_size"])
    conc = batch_groups if s["eta"] == 0 else 3 * batch_groups
    sets = {
        "run.run_dir": run_dir, "run.mode": s["mode"], "controller.max_staleness": s["eta"],
        "model.name": "tiny-random-llama", "security.insecure": "true", "events.level": "warning",
        "events.console": "json", "brokers.job_port": job, "brokers.bus_in_port": bus_in,
        "brokers.bus_out_port": bus_out, "brokers.store_port": store, "brokers.max_queue": 1_000_000,
        "brokers.store_max_samples": 100_000, "rollout.engine.kind": "sim",
        "rollout.engine.max_concurrent": s["capacity"], "rollout.engine.sim.workers": s["n"],
        "rollout.engine.sim.time_scale": s["scale"], "rollout.engine.sim.lengths": s["lengths"],
        "rollout.engine.sim.reward_capacity": 4096, "trainer.sim.enabled": "true",
        "trainer.sim.devices": s["train_devices"], "trainer.sim.time_scale": s["scale"],
        "trainer.checkpoint_every": 0, "controller.group_size": s["group_size"],
        "controller.batch_groups": batch_groups, "controller.max_concurrent_groups": conc,
        "controller.max_new_tokens": 8192, "controller.total_steps": s["steps"],
        "controller.drop_uniform_groups": "false",
    }
    return [x for k, v in sets.items() for x in ("--set", f"{k}={v}")]


def start(args: list[str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "areal_mq.cli", *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def probe_loop(job_addr: str, stop: threading.Event, sent: list[int]) -> None:
    """Dispatch-latency probes: the swarm records receive time minus the send time in group_id."""
    from areal_mq.client import JobClient
    from areal_mq.messages import GenerateRequest
    from areal_mq.security import Keyring

    client = JobClient(job_addr, keys=Keyring.insecure())
    try:
        while not stop.is_set():
            due = time.monotonic() + PROBE_EVERY_S
            client.submit(GenerateRequest(prompt_ids=[1], group_id=f"probe:{time.time():.6f}"), service="probe")
            sent[0] += 1
            while (left := due - time.monotonic()) > 0:
                client.poll(left)
    finally:
        client.close()


def broker_counters(job_addr: str) -> dict:
    from areal_mq.client import JobClient
    from areal_mq.security import Keyring

    client = JobClient(job_addr, keys=Keyring.insecure())
    try:
        return client.stats(timeout=10).get("counters", {})
    finally:
        client.close()


def metrics_lines(path: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError):
        return []


def run_once(s: dict, work: Path, timeout_s: float = 600) -> dict:
    run_dir = work / f"n{s['n']}-{s['name']}"
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    ports = free_ports(4)
    sets = overrides(s, run_dir, ports)
    job_addr = f"tcp://127.0.0.1:{ports[0]}"
    procs: dict[str, subprocess.Popen] = {}
    stop = threading.Event()
    t_start = time.monotonic()
    try:
        # all at once: ZeroMQ connects before the peer binds (messages wait), so nobody waits for the brokers
        for part in ("job", "bus", "store"):
            procs[part] = start(["broker", "--only", part, *sets], run_dir / "logs" / f"{part}.log")
        for role in ("swarm", "controller", "trainer"):
            procs[role] = start(["worker", role, "--worker-id", role, *sets], run_dir / "logs" / f"{role}.log")
        sent = [0]
        threading.Thread(target=probe_loop, args=(job_addr, stop, sent), daemon=True).start()
        window = watch(s, run_dir, procs, job_addr, timeout_s)
    finally:
        stop.set()
        for group in (("controller", "swarm", "trainer"), ("store", "bus", "job")):  # clients before brokers
            for name in group:  # SIGTERM to the group at once, then wait for each (stopped by PID)
                if name in procs and procs[name].poll() is None:
                    procs[name].terminate()
            for name in group:
                if name in procs:
                    common.stop_process(procs[name], wait_s=15)
    out = report(s, run_dir, window, sent[0])
    out["phases_s"] = {"start_to_first_step": round(window["first"]["t"] - t_start, 1),
                       "first_to_last_step": round(window["last"]["t"] - window["first"]["t"], 1),
                       "stop": round(time.monotonic() - window["last"]["t"], 1)}
    return out


def watch(s: dict, run_dir: Path, procs: dict, job_addr: str, timeout_s: float) -> dict:
    """Wait for the trainer's last step; CPU and broker counters at the first and the last step."""
    path = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    first = None
    while (done := len(metrics_lines(path))) < s["steps"]:
        dead = [n for n, p in procs.items() if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"run {run_dir.name}: {'processes died: ' + str(dead) if dead else 'timed out'}; "
                               f"logs in {run_dir / 'logs'}")
        if first is None and done:
            first = snapshot(procs, job_addr)
        time.sleep(0.05)
    last = snapshot(procs, job_addr)
    return {"first": first or last, "last": last}


def snapshot(procs: dict, job_addr: str) -> dict:
    return {"t": time.monotonic(), "wall": time.time(), "cpu": {n: cpu_seconds(p.pid) for n, p in procs.items()},
            "counters": broker_counters(job_addr)}


def report(s: dict, run_dir: Path, window: dict, probes_sent: int) -> dict:
    steps = metrics_lines(run_dir / "metrics.jsonl")
    swarm = json.loads((run_dir / "swarm-swarm.json").read_text())
    first, last = window["first"], window["last"]
    real_s = max(1e-6, last["t"] - first["t"])
    cpu = {n: round(100 * (last["cpu"][n] - first["cpu"][n]) / real_s, 1) for n in PROCS if n != "trainer"}
    jobs = sum(last["counters"].get(k, 0) - first["counters"].get(k, 0) for k in ("accepted", "answered"))
    seqs = [m["seqs"] for m in steps]
    sim_window = steps[-1]["sim_t"] - steps[0]["sim_t"]
    stale: dict[str, int] = {}
    for m in steps:
        for k, v in m.items():
            if k.startswith("stale_"):
                stale[k[6:]] = stale.get(k[6:], 0) + v
    devices = s["n"] + s["train_devices"]
    train_busy = (steps[-1]["sim_busy_s"] - steps[0]["sim_busy_s"]) * s["train_devices"]
    gen_busy = busy_between(swarm["timeline"], first["wall"], last["wall"])
    return {**{k: s[k] for k in ("name", "n", "mode", "eta", "scale", "lengths", "steps", "train_devices")},
            "trained_seqs": sum(seqs), "samples_per_s": round(sum(seqs[1:]) / sim_window, 3),
            "sim_window_s": round(sim_window, 2), "real_window_s": round(real_s, 2),
            "gpu_idle": round(1 - (gen_busy + train_busy) / (devices * sim_window), 3),
            "gen_util": round(gen_busy / (s["n"] * sim_window), 3),
            "train_util": round(train_busy / (s["train_devices"] * sim_window), 3),
            "staleness": dict(sorted(stale.items(), key=lambda kv: int(kv[0]))), "cpu_pct": cpu,
            "job_msgs_per_s": round(2 * jobs / real_s, 1),
            "heartbeat_msgs_per_s": round(2 * (s["n"] + 2) / 1.0, 1),
            **dispatch(swarm["probe_log"], first["wall"], last["wall"]), "probes_sent": probes_sent,
            "swarm_lag_p99_ms": swarm["lag_p99_ms"], "swarm_completed": swarm["completed"]}


def busy_between(timeline: list, t0: float, t1: float) -> float:
    """Busy device-seconds of the swarm between wall times t0 and t1 (interpolated in its timeline)."""
    import numpy as np

    walls, busy = np.array([t for t, _ in timeline]), np.array([b for _, b in timeline])
    return float(np.interp(t1, walls, busy) - np.interp(t0, walls, busy))


def dispatch(probe_log: list, t0: float, t1: float) -> dict:
    """p50/p99 dispatch latency (ms) of the probes received between wall times t0 and t1."""
    import numpy as np

    lat = np.array([lat for wall, lat in probe_log if t0 <= wall <= t1])
    if not lat.size:
        return {"dispatch_p50_ms": None, "dispatch_p99_ms": None, "probes": 0}
    return {"dispatch_p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 2),
            "dispatch_p99_ms": round(float(np.percentile(lat, 99)) * 1e3, 2), "probes": int(lat.size)}


def log_tail(work: Path, s: dict, lines: int = 6) -> str:
    """The last lines of each process log of a run (kept in the report: the work directory is temporary)."""
    out = []
    for path in sorted((work / f"n{s['n']}-{s['name']}" / "logs").glob("*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        out += [f"{path.name}: {line[:300]}" for line in tail]
    return "\n".join(out)
