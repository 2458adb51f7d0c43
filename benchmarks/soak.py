"""Soak: a real run under a seeded nemesis for M minutes, then an audit that nothing was lost (issue 40, part 1).

What: `areal-mq run configs/tiny.yaml` (the launcher restarts any child that dies; deltas and job deadlines on)
while a nemesis, every `--interval LO HI` seconds (default 30-90), does one of
- `kill`: kill -9 a role: rollout, reward, trainer, controller or the broker process;
- `pause`: SIGSTOP a role for `--pause LO HI` seconds (default 5-30), then SIGCONT;
- `corrupt_log`: stop the launcher, kill -9 the broker, append a torn record to the store's log, let the
  launcher restart the broker on the damaged log.
The schedule is drawn from `--seed` alone (reproducible). RSS and open file descriptors of every role are
sampled every `--sample-s` seconds. At the end the run is stopped with SIGTERM (workers drain and checkpoint)
and audited from its own records (the store's log, the trainer's `trainer.step` events, the rollout workers'
`rollout.weights_updated` events):
- no sample trained twice in the final lineage; every trained sample was stored; every sample the store
  acknowledged as trained was trained; every dropped sample has a reason and none was trained;
- no staleness violation in any step (`staleness_violations` of every `trainer.step`);
- every version a rollout engine loaded is one the trainer produced (the weights themselves are checked
  against the trainer's checksums when they load: weights/delta.py);
- progress after every fault (recovery time: the fault to the next new trained version);
- RSS and descriptor growth per process from the end of the warm-up (first third, at most 10 min) to the end.
It prints a table of faults and recovery times, writes JSON and draws a timeline (faults against versions).

    flock /tmp/areal-heavy.lock python benchmarks/soak.py --minutes 3 --interval 8 15 --pause 2 5
    python benchmarks/soak.py --minutes 60 --seed 1 --json benchmarks/results/soak-60.json

Not (yet) in the nemesis: cutting a host's link in a network namespace, and filling the run directory's disk
(docs/faults.md lists what is covered where).
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("rollout", "reward", "trainer", "controller", "broker")
KINDS = ("kill", "pause", "corrupt_log")


def events(run_dir: Path, name: str | None = None) -> list[dict]:
    from areal_mq.telemetry.tail import read_events

    return read_events(run_dir, name)


def trained_versions(run_dir: Path) -> set[int]:
    return {r["version"] for r in events(run_dir, "trainer.step")}


def live_pids(run_dir: Path) -> dict[str, int]:
    """The newest live process of each role (from its own events: every line names its pid)."""
    out: dict[str, int] = {}
    for rec in events(run_dir):
        role, pid = rec.get("role"), rec.get("pid")
        if role in ROLES and pid and os.path.exists(f"/proc/{pid}"):
            out[role] = int(pid)
    return out


def start(run_dir: Path, cfg: Path) -> subprocess.Popen:
    job, bus_in, bus_out, store = common.free_ports(4)
    sets = [f"run.run_dir={run_dir}", f"brokers.job_port={job}", f"brokers.bus_in_port={bus_in}",
            f"brokers.bus_out_port={bus_out}", f"brokers.store_port={store}", "brokers.heartbeat_s=0.5",
            "brokers.liveness=4", "brokers.reconnect_max_s=2", "brokers.job_deadline_s=60",
            "controller.total_steps=1000000", "launcher.on_child_death=restart", "launcher.max_restarts=10000",
            "trainer.checkpoint_every=3", "trainer.weight_deltas='on'", "events.console=json"]
    cmd = [sys.executable, "-m", "areal_mq.cli", "run", str(cfg), "--skip-eval", "--quiet",
           *[x for s in sets for x in ("--set", s)]]
    log = open(run_dir.parent / "launcher.out", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def schedule(seed: int, seconds: float, interval: tuple[float, float], pause: tuple[float, float]) -> list[dict]:
    """The nemesis's faults: (at, kind, role, pause length), from the seed alone."""
    rng, out, t = random.Random(seed), [], 0.0
    while True:
        t += rng.uniform(*interval)
        if t > seconds:
            return out
        kind = rng.choice(KINDS)
        out.append({"at_s": round(t, 2), "kind": kind, "role": "broker" if kind == "corrupt_log" else rng.choice(ROLES),
                    "pause_s": round(rng.uniform(*pause), 2) if kind == "pause" else 0.0})


def inject(fault: dict, run_dir: Path, launcher: subprocess.Popen) -> dict:
    """Do one fault now; returns what was done (pid, when)."""
    pid = live_pids(run_dir).get(fault["role"])
    done = {**fault, "t": time.time(), "pid": pid, "version_before": max(trained_versions(run_dir) | {0})}
    if pid is None:
        done["skipped"] = "no live process"
        return done
    if fault["kind"] == "kill":
        os.kill(pid, signal.SIGKILL)
    elif fault["kind"] == "pause":
        os.kill(pid, signal.SIGSTOP)
        time.sleep(fault["pause_s"])
        os.kill(pid, signal.SIGCONT)
    else:  # corrupt_log: the broker dies mid-write and leaves a torn record behind
        os.kill(launcher.pid, signal.SIGSTOP)
        try:
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.2)
            with open(run_dir / "store" / "samples.log", "ab") as f:
                f.write(b"SLOG" + (4096).to_bytes(4, "little") + os.urandom(37))
        finally:
            os.kill(launcher.pid, signal.SIGCONT)
    return done


def sample(run_dir: Path) -> dict:
    out = {}
    for role, pid in live_pids(run_dir).items():
        try:
            rss = next(int(x.split()[1]) for x in open(f"/proc/{pid}/status") if x.startswith("VmRSS:")) / 1024
            out[role] = {"pid": pid, "rss_mb": round(rss, 1), "fds": len(os.listdir(f"/proc/{pid}/fd"))}
        except (OSError, StopIteration):
            continue
    return {"t": time.time(), "procs": out}


def growth(samples: list[dict], warm_until: float) -> dict:
    """Per role: RSS and descriptor growth (%) of the same process from the first sample after warm-up to the last."""
    out = {}
    for role in ROLES:
        series = [(s["t"], s["procs"][role]) for s in samples if role in s["procs"] and s["t"] >= warm_until]
        if not series:
            continue
        last_pid = series[-1][1]["pid"]
        same = [p for _, p in series if p["pid"] == last_pid]
        first, last = same[0], same[-1]
        out[role] = {"samples": len(same), "rss_mb": [first["rss_mb"], last["rss_mb"]], "fds": [first["fds"], last["fds"]],
                     "rss_growth_pct": round(100 * (last["rss_mb"] - first["rss_mb"]) / first["rss_mb"], 1),
                     "fd_growth_pct": round(100 * (last["fds"] - first["fds"]) / max(first["fds"], 1), 1)}
    return out


def store_log(run_dir: Path) -> dict:
    from areal_mq import protocol
    from areal_mq.brokers.sample_log_reader import ReadOnlyLog

    puts, acks, drops = set(), set(), {}
    for _o, _n, rec in ReadOnlyLog(run_dir / "store" / "samples.log").replay():
        op = rec.get("op") if isinstance(rec, dict) else None
        if op == "put":
            puts.add(protocol.decode(rec["frames"]).msg.sample_id)
        elif op in ("ack", "done"):
            acks.update(rec["ids"])
        elif op == "drop":
            drops.update({sid: rec.get("reason") for sid in rec["ids"]})
    return {"put": puts, "ack": acks, "drop": drops}


def audit(run_dir: Path) -> dict:
    last: dict[int, dict] = {}
    for step in events(run_dir, "trainer.step"):
        last[step["version"]] = step  # a resumed trainer redoes versions: the last one counts
    trained = [sid for v in sorted(last) for sid in last[v]["sample_ids"]]
    log = store_log(run_dir)
    loaded = {r["version"] for r in events(run_dir, "rollout.weights_updated")}
    checks = {
        "versions_trained": len(last),
        "versions_contiguous": sorted(last) == list(range(1, len(last) + 1)),
        "trained_twice": len(trained) - len(set(trained)),
        "trained_never_stored": len(set(trained) - log["put"]),
        "acked_never_trained": len(log["ack"] - set(trained)),
        "dropped_without_reason": sum(1 for r in log["drop"].values() if not r),
        "dropped_and_trained": len(set(trained) & set(log["drop"])),
        "staleness_violations": sum(int(s.get("staleness_violations", 0)) for s in last.values()),
        "loaded_unpublished_versions": sorted(loaded - set(last) - {0})[:10],
        "weights_failed": len(events(run_dir, "rollout.weights_failed")),
        "log_tail_cuts": len(events(run_dir, "store.log_tail_cut")),  # one per corrupt_log fault: the torn record
        "log_bad_records": len(events(run_dir, "store.log_record_bad")),
    }
    checks["ok"] = (checks["versions_contiguous"] and not checks["trained_twice"] and not checks["trained_never_stored"]
                    and not checks["acked_never_trained"] and not checks["dropped_without_reason"]
                    and not checks["dropped_and_trained"] and not checks["staleness_violations"]
                    and not checks["loaded_unpublished_versions"])
    return checks


def recoveries(run_dir: Path, faults: list[dict]) -> None:
    steps = [(r["ts"], r["version"]) for r in events(run_dir, "trainer.step")]
    for f in faults:
        end = f["t"] + f.get("pause_s", 0.0)
        nxt = next((ts for ts, v in steps if ts > end and v > f["version_before"]), None)
        f["recover_s"] = round(nxt - f["t"], 2) if nxt else None


def plot(run_dir: Path, faults: list[dict], t0: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [(r["ts"] - t0, r["version"]) for r in events(run_dir, "trainer.step")]
    fig, ax = plt.subplots(figsize=(10, 4))
    if steps:
        ax.plot([s[0] for s in steps], [s[1] for s in steps], ".", ms=3, label="trained version")
    colors = {"kill": "red", "pause": "orange", "corrupt_log": "purple"}
    for f in faults:
        ax.axvline(f["t"] - t0, color=colors[f["kind"]], alpha=0.5, lw=1)
    for kind, color in colors.items():
        ax.plot([], [], color=color, label=kind)
    ax.set_xlabel("seconds"), ax.set_ylabel("policy version"), ax.legend(loc="upper left")
    ax.set_title("soak: faults (vertical lines) against trained versions")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args, work: Path) -> dict:
    run_dir = work / "run"
    seconds = args.minutes * 60
    faults_plan = schedule(args.seed, seconds, tuple(args.interval), tuple(args.pause))
    launcher = start(run_dir, ROOT / "configs" / "tiny.yaml")
    done, samples = [], []
    try:
        _wait_first(run_dir, launcher)
        t0 = time.time()
        next_sample = t0
        for fault in faults_plan + [None]:
            until = t0 + (fault["at_s"] if fault else seconds)
            while time.time() < until:
                if time.time() >= next_sample:
                    samples.append(sample(run_dir))
                    next_sample += args.sample_s
                if launcher.poll() is not None:
                    raise RuntimeError(f"the launcher exited ({launcher.returncode}); see {work / 'launcher.out'}")
                time.sleep(0.2)
            if fault:
                done.append(inject(fault, run_dir, launcher))
        time.sleep(args.settle_s)  # the last fault's recovery
        samples.append(sample(run_dir))
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(120)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()
    recoveries(run_dir, done)
    warm = t0 + min(600.0, seconds / 3)
    report = {"faults": done, "audit": audit(run_dir), "growth": growth(samples, warm), "samples": samples,
              "launcher_rc": launcher.returncode, "seed": args.seed, "minutes": args.minutes}
    if args.plot:
        plot(run_dir, done, t0, args.plot)
    return report


def _wait_first(run_dir: Path, launcher: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and launcher.poll() is None:
        if (run_dir / "events").exists() and trained_versions(run_dir):
            return
        time.sleep(0.5)
    out = (run_dir.parent / "launcher.out").read_text(errors="replace")[-3000:]
    raise RuntimeError(f"no training step (launcher exit {launcher.poll()}); its output ends:\n{out}")


def table(report: dict) -> str:
    rows = [("at_s", "fault", "role", "pause_s", "version", "recover_s")]
    for f in report["faults"]:
        rows.append((f["at_s"], f["kind"], f["role"], f["pause_s"] or "-", f["version_before"],
                     f.get("skipped") or (f["recover_s"] if f["recover_s"] is not None else "NONE")))
    lines = common.align(rows)
    counts: dict[str, int] = {}
    for f in report["faults"]:
        counts[f["kind"]] = counts.get(f["kind"], 0) + 1
    a = report["audit"]
    lines += [f"faults: {counts}", "audit: " + ", ".join(f"{k} {v}" for k, v in a.items())]
    for role, g in report["growth"].items():
        lines.append(f"growth {role}: RSS {g['rss_mb'][0]}->{g['rss_mb'][1]} MB ({g['rss_growth_pct']}%), "
                     f"fds {g['fds'][0]}->{g['fds'][1]} ({g['fd_growth_pct']}%), {g['samples']} samples")
    lines.append(f"command: {common.command('soak.py')}")
    return "\n".join(lines)


def main() -> int:
    parser = common.arg_parser(__doc__, "a 3-minute soak with faults every 8-15 s (what CI runs)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--interval", type=float, nargs=2, default=[30.0, 90.0], metavar=("LO", "HI"))
    parser.add_argument("--pause", type=float, nargs=2, default=[5.0, 30.0], metavar=("LO", "HI"))
    parser.add_argument("--sample-s", type=float, default=60.0, help="RSS and descriptor sampling period.")
    parser.add_argument("--settle-s", type=float, default=30.0, help="Wait after the last fault before stopping.")
    parser.add_argument("--work", type=Path, help="Keep the run here (default: a temporary directory, deleted).")
    parser.add_argument("--plot", type=Path, help="Draw the timeline (faults against trained versions) here.")
    args = parser.parse_args()
    if args.quick:
        args.minutes, args.interval, args.pause, args.sample_s, args.settle_s = 3.0, [8.0, 15.0], [2.0, 5.0], 10.0, 20.0
    if args.work:
        args.work.mkdir(parents=True, exist_ok=True)
        report = common.timed(run, args, args.work)
    else:
        report = common.timed(run, args, tmp_prefix="soak-")
    report.update(benchmark="soak", quick=bool(args.quick), machine=common.machine(), results=report["faults"],
                  ratios={}, targets={"lost": 0, "duplicates": 0, "staleness_violations": 0, "growth_pct_below": 10})
    common.finish(report, args.json, table(report))
    recovered = all(f.get("skipped") or f["recover_s"] is not None for f in report["faults"])
    return 0 if report["audit"]["ok"] and recovered else 1


if __name__ == "__main__":
    sys.exit(main())
