"""Soak: a real run under a seeded nemesis for M minutes, then an audit that nothing was lost (issue 40, part 1).

What: `areal-mq run configs/tiny.yaml` (the launcher restarts any child that dies; deltas and job deadlines on)
while a nemesis, every `--interval LO HI` seconds (default 30-90), does one of
- `kill`: kill -9 a role: rollout, reward, trainer, controller or the broker process;
- `pause`: SIGSTOP a role for `--pause LO HI` seconds (default 5-30), then SIGCONT;
- `corrupt_log`: stop the launcher, kill -9 the broker, append a torn record to the store's log, let the
  launcher restart the broker on the damaged log;
- `link_cut`: pull the network cable of a rollout or a reward host for `--pause LO HI` seconds: the brokers
  and the launcher run in a network namespace of their own, and one extra rollout worker and one extra reward
  worker each in another, joined by veth pairs (benchmarks/faults/soak_faults.py); a cut sets the host's veth down;
- `disk_full`: the run directory is a tmpfs of `--disk-mb` (the quota); the nemesis fills it to the last byte
  for `--pause LO HI` seconds, then frees it (every process meets ENOSPC: events, the store's log, weights,
  checkpoints).
`link_cut` and `disk_full` need root (namespaces, mounts); without it they are left out of the schedule and the
report says why. The schedule is drawn from `--seed` alone (reproducible): the kinds come in rounds, each round
every available kind once in a seeded order, so a short soak meets every kind. RSS and open file descriptors of
every role are sampled every `--sample-s` seconds. At the end the run is stopped with SIGTERM (workers drain and checkpoint)
and audited from its own records (the store's log, the trainer's `trainer.step` events, the rollout workers'
`rollout.weights_updated` events):
- no sample trained twice in the final lineage; every trained sample was stored; every sample the store
  acknowledged as trained was trained; every dropped sample has a reason and none was trained;
- no staleness violation in any step (`staleness_violations` of every `trainer.step`);
- every version a rollout engine loaded is one the trainer produced, and its weights are bit-identical to what
  the trainer published: the rollout workers run with `rollout.audit_weights` (after each load, the checksum of
  every tensor the engine holds, in the published dtype) and the soak reads the checksums the trainer wrote into
  each published version (run_dir/weights/vN: the full file's manifest or the delta's) while the run goes on;
- errors are named: warning and error events counted by name; Python tracebacks in the processes' output
  (the launcher's, the outside hosts', run_dir/logs) counted, with their exception lines;
- progress after every fault (recovery time: the fault to the next new trained version);
- RSS and descriptor growth per process from the end of the warm-up (first third, at most 10 min) to the end.
It prints a table of faults and recovery times, writes JSON and draws a timeline (faults against versions).

    flock /tmp/areal-heavy.lock python benchmarks/faults/soak.py --minutes 2 --interval 8 15 --pause 2 5
    python benchmarks/faults/soak.py --minutes 60 --seed 1 --interval 10 25 --json benchmarks/results/soak-60.json
(the issue's target, 40 faults of each of the 5 kinds in an hour, needs a fault every ~18 s: --interval 10 25).
"""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)

import common  # noqa: E402
import soak_faults  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("rollout", "reward", "trainer", "controller", "broker")
KINDS = ("kill", "pause", "corrupt_log", "link_cut", "disk_full")
HOSTS = ("rollout", "reward")  # the roles with a host of their own in a network namespace (link_cut)
COLORS = {"kill": "red", "pause": "orange", "corrupt_log": "purple", "link_cut": "blue", "disk_full": "green"}


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


def settings(run_dir: Path, hosts: "soak_faults.Hosts | None") -> list[str]:
    """The run's --set overrides (the launcher's and the outside hosts' workers'): deltas and job deadlines on."""
    job, bus_in, bus_out, store = common.free_ports(4)
    out = [f"run.run_dir={run_dir}", f"brokers.job_port={job}", f"brokers.bus_in_port={bus_in}",
           f"brokers.bus_out_port={bus_out}", f"brokers.store_port={store}", "brokers.heartbeat_s=0.5",
           "brokers.liveness=4", "brokers.reconnect_max_s=2", "brokers.job_deadline_s=60",
           "controller.total_steps=1000000", "launcher.on_child_death=restart", "launcher.max_restarts=10000",
           "trainer.checkpoint_every=3", "trainer.weight_deltas='on'", "trainer.keep_weight_versions=8",
           "rollout.audit_weights=true", "events.console=json"]
    if hosts is not None:  # off loopback: the brokers bind their namespace's address (CURVE keys: run_dir/keys)
        out.append(f"brokers.host={hosts.brk_addr}")
    return out


def start(run_dir: Path, cfg: Path, sets: list[str], prefix: list[str]) -> subprocess.Popen:
    cmd = [*prefix, sys.executable, "-m", "areal_mq.cli", "run", str(cfg), "--skip-eval", "--quiet",
           *[x for s in sets for x in ("--set", s)]]
    log = open(run_dir.parent / "launcher.out", "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT)


def schedule(seed: int, seconds: float, interval: tuple[float, float], pause: tuple[float, float],
             kinds: tuple[str, ...] = KINDS) -> list[dict]:
    """The nemesis's faults: (at, kind, role, how long), from the seed (and the kinds available) alone. Kinds come
    in rounds: each round every kind once, in a seeded order."""
    rng, out, t, bag = random.Random(seed), [], 0.0, []
    while True:
        t += rng.uniform(*interval)
        if t > seconds:
            return out
        if not bag:
            bag = rng.sample(kinds, len(kinds))
        kind = bag.pop()
        role = {"corrupt_log": "broker", "link_cut": rng.choice(HOSTS), "disk_full": "disk"}.get(kind) \
            or rng.choice(ROLES)
        held = kind in ("pause", "link_cut", "disk_full")
        out.append({"at_s": round(t, 2), "kind": kind, "role": role,
                    "pause_s": round(rng.uniform(*pause), 2) if held else 0.0})


class Rig:
    """What the nemesis acts on besides processes: the outside hosts in their network namespaces (link_cut) and the
    run directory's small disk (disk_full), each set up only where root allows it (`unavailable` says why not);
    and a thread that restarts an outside host's worker when it exits (the launcher restarts only its own
    children) and reads the checksums of each version the trainer publishes."""

    def __init__(self, work: Path, disk_mb: int, want: tuple[str, ...]):
        self.work, self.run_dir = work, work / "run"
        self.hosts: soak_faults.Hosts | None = None
        self.disk: soak_faults.SmallDisk | None = None
        self.outside: dict[str, subprocess.Popen] = {}
        self.restarts = {h: 0 for h in HOSTS}
        self.unavailable: dict[str, str] = {}
        self.published = soak_faults.PublishedChecksums(self.run_dir / "weights")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cmd: list[str] = []
        if "link_cut" in want:
            why = soak_faults.netns_unavailable()
            if why:
                self.unavailable["link_cut"] = why
            else:
                self.hosts = soak_faults.Hosts()
                self.hosts.up(HOSTS)
        if "disk_full" in want:
            why = soak_faults.mount_unavailable()
            if why:
                self.unavailable["disk_full"] = why
            else:
                self.disk = soak_faults.SmallDisk(self.run_dir, disk_mb)
                self.disk.mount()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.kinds = tuple(k for k in want if k not in self.unavailable)

    def start_outside(self, cfg: Path, sets: list[str]) -> None:
        """One rollout and one reward worker, each on its own host (namespace), kept running until close()."""
        if self.hosts is None:
            return
        self._cmd = ["--config", str(cfg), *[x for s in sets for x in ("--set", s)]]
        for name in HOSTS:
            self._spawn(name)
        self._thread = threading.Thread(target=self._keep, daemon=True)
        self._thread.start()

    def _spawn(self, name: str) -> None:
        cmd = [*self.hosts.exec_prefix(name), sys.executable, "-m", "areal_mq.cli", "worker", name,
               "--worker-id", f"{name}-outside", *self._cmd]
        log = open(self.work / f"{name}-outside.out", "ab")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.outside[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              cwd=ROOT, env=env)

    def _keep(self) -> None:
        while not self._stop.wait(0.2):
            self.published.scan()
            for name, proc in list(self.outside.items()):
                if proc.poll() is not None and not self._stop.is_set():
                    self.restarts[name] += 1
                    self._spawn(name)

    def scan(self) -> None:
        self.published.scan()

    def stop_outside(self) -> None:
        """SIGTERM the outside hosts' workers (they drain and hand their jobs back), by PID."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        for proc in self.outside.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a paused one must be able to act on SIGTERM
                proc.send_signal(signal.SIGTERM)
        for proc in self.outside.values():
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self, keep: Path | None) -> None:
        self.stop_outside()
        try:
            if self.disk is not None:
                self.disk.close(keep)
        finally:
            if self.hosts is not None:
                self.hosts.close()


def _send(pid: int, sig: int) -> bool:
    """Signal `pid`; False when it is already gone."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _signal_role(run_dir: Path, role: str, pid: int | None, sig: int, tries: int = 5) -> int | None:
    """Signal the role's newest live process. If it is gone before the signal (the launcher was restarting it), look
    again once a second for `tries` seconds. Returns the pid signalled, or None. (The first 60-minute soak,
    2026-11-28, ended at minute 46 with a ProcessLookupError here: the role's process exited between the lookup and
    the kill.)"""
    for _ in range(tries):
        if pid is not None and _send(pid, sig):
            return pid
        time.sleep(1.0)
        pid = live_pids(run_dir).get(role)
    return None


def inject(fault: dict, run_dir: Path, launcher: subprocess.Popen, rig: "Rig") -> dict:
    """Do one fault now; returns what was done (pid, when)."""
    pid = live_pids(run_dir).get(fault["role"])
    done = {**fault, "t": time.time(), "pid": pid, "version_before": max(trained_versions(run_dir) | {0})}
    if fault["kind"] == "link_cut":
        rig.hosts.cut(fault["role"])
        try:
            time.sleep(fault["pause_s"])
        finally:
            rig.hosts.heal(fault["role"])
        done["pid"] = rig.outside[fault["role"]].pid
        return done
    if fault["kind"] == "disk_full":
        done["filled_mb"] = round(rig.disk.fill() / 2**20, 1)
        try:
            time.sleep(fault["pause_s"])
        finally:
            rig.disk.free()
        return done
    if pid is None:
        done["skipped"] = "no live process"
        return done
    if fault["kind"] == "kill":
        done["pid"] = _signal_role(run_dir, fault["role"], pid, signal.SIGKILL)
    elif fault["kind"] == "pause":
        done["pid"] = _signal_role(run_dir, fault["role"], pid, signal.SIGSTOP)
        if done["pid"] is not None:
            time.sleep(fault["pause_s"])
            _send(done["pid"], signal.SIGCONT)
    else:  # corrupt_log: the broker dies mid-write and leaves a torn record behind
        os.kill(launcher.pid, signal.SIGSTOP)
        try:
            _send(pid, signal.SIGKILL)  # gone already: the torn tail is still written before its restart
            time.sleep(0.2)
            with open(run_dir / "store" / "samples.log", "ab") as f:
                f.write(b"SLOG" + (4096).to_bytes(4, "little") + os.urandom(37))
        finally:
            os.kill(launcher.pid, signal.SIGCONT)
    if done["pid"] is None:
        done["skipped"] = "its process was gone before the signal, and no new one within 5 s"
    return done


def sample(run_dir: Path, rig: Rig) -> dict:
    out: dict = {}
    for role, pid in live_pids(run_dir).items():
        try:
            rss = next(int(x.split()[1]) for x in open(f"/proc/{pid}/status") if x.startswith("VmRSS:")) / 1024
            out[role] = {"pid": pid, "rss_mb": round(rss, 1), "fds": len(os.listdir(f"/proc/{pid}/fd"))}
        except (OSError, StopIteration):
            continue
    return {"t": time.time(), "procs": out, "disk": rig.disk.usage() if rig.disk else None}


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
    """What the store's log says happened: puts, acks, drops (with reasons), and `done`, the ids a compaction
    summarized. A compaction keeps only the held samples, so a trained sample's put is gone after one; its id
    stays in a done record (the store only remembers ids it held), which is what the audit counts as stored."""
    from areal_mq import protocol
    from areal_mq.brokers.sample_log_reader import ReadOnlyLog

    puts, acks, drops, done = set(), set(), {}, set()
    for _o, _n, rec in ReadOnlyLog(run_dir / "store" / "samples.log").replay():
        op = rec.get("op") if isinstance(rec, dict) else None
        if op == "put":
            puts.add(protocol.decode(rec["frames"]).msg.sample_id)
        elif op == "ack":
            acks.update(rec["ids"])
        elif op == "done":  # acked or dropped before a compaction: which one, the log no longer says
            done.update(rec["ids"])
        elif op == "drop":
            drops.update({sid: rec.get("reason") for sid in rec["ids"]})
    return {"put": puts, "ack": acks, "drop": drops, "done": done}


def weights_audit(run_dir: Path, published: soak_faults.PublishedChecksums) -> dict:
    """Every engine's weights after every load (rollout.weights_audit) against what the trainer published for that
    version. Version 0 is the initial model (nothing published); a version pruned before the soak read it is
    counted as unverifiable, not as right."""
    out = {"engine_loads_verified": 0, "engine_loads_unverifiable": 0, "engine_loads_base": 0}
    wrong = []
    for rec in events(run_dir, "rollout.weights_audit"):
        if rec["version"] == 0:
            out["engine_loads_base"] += 1
            continue
        verdict = published.check(rec["version"], rec.get("checksums") or {})
        if verdict == "wrong":
            wrong.append({"worker": rec.get("worker_id"), "pid": rec.get("pid"), "version": rec["version"]})
        else:
            out[f"engine_loads_{verdict}"] += 1
    out["engine_weights_wrong"] = len(wrong)
    out["engine_weights_wrong_first"] = wrong[:5]
    out["published_versions_read"] = len(published.by_version)
    return out


def named_errors(run_dir: Path, work: Path) -> dict:
    """Warning and error events by name, and Python tracebacks in the processes' output (an error nobody named)."""
    counts: dict[str, int] = {}
    for rec in events(run_dir):
        if rec.get("level") in ("warning", "error"):
            key = f"{rec['level']}:{rec.get('event')}"
            counts[key] = counts.get(key, 0) + 1
    tracebacks, crashes = 0, {}
    for out in [*work.glob("*.out"), *(run_dir / "logs").glob("*.log")]:  # the launcher's, the children's output
        text = out.read_text(errors="replace")
        tracebacks += text.count("Traceback (most recent call last)")
        for m in re.finditer(r"^([A-Za-z_][\w.]*(?:Error|Exception)): (.{0,80})", text, re.M):
            key = f"{m.group(1)}: {m.group(2)}"
            crashes[key] = crashes.get(key, 0) + 1
    return {"by_name": dict(sorted(counts.items(), key=lambda kv: -kv[1])), "tracebacks": tracebacks,
            "exceptions": dict(sorted(crashes.items(), key=lambda kv: -kv[1])[:20])}


def checkpoint_audit(run_dir: Path, trained_by_version: dict[int, list[str]]) -> dict:
    """The trainer's own durable record, read beside its events: every sample trained into the newest checkpoint,
    in training order (checkpoints/trained_ids.jsonl up to its version; a checkpoint from before that file held
    them all in its `consumed_ids`). A second source for "trained twice", and the check on the events: a version
    whose `trainer.step` line is missing (an events file that lost lines) shows up here, not as a loss."""
    import json

    from areal_mq.algorithms.checkpoint import TRAINED_IDS, latest_checkpoint, trained_ids

    path = latest_checkpoint(run_dir / "checkpoints")
    if path is None:
        return {"checkpoint_version": None}
    state = json.loads((path / "trainer_state.json").read_text())
    consumed = (trained_ids(run_dir / "checkpoints", state["version"])
                if (run_dir / "checkpoints" / TRAINED_IDS).is_file() else list(state.get("consumed_ids", [])))
    unique = set(consumed)
    covered = {sid for v, ids in trained_by_version.items() if v <= state["version"] for sid in ids}
    return {"checkpoint_version": state["version"], "checkpoint_consumed": len(consumed),
            "checkpoint_trained_twice": len(consumed) - len(unique),
            "in_checkpoint_not_in_step_events": len(unique - covered),
            "in_step_events_not_in_checkpoint": len(covered - unique)}


def audit(run_dir: Path, published: soak_faults.PublishedChecksums, work: Path) -> dict:
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
        "trained_never_stored": len(set(trained) - log["put"] - log["done"]),
        "log_compactions": len(events(run_dir, "store.log_compacted")),
        "ids_summarized_by_compaction": len(log["done"]),
        "acked_never_trained": len(log["ack"] - set(trained)),
        "dropped_without_reason": sum(1 for r in log["drop"].values() if not r),
        "dropped_and_trained": len(set(trained) & set(log["drop"])),
        "staleness_violations": sum(int(s.get("staleness_violations", 0)) for s in last.values()),
        "loaded_unpublished_versions": sorted(loaded - set(last) - {0})[:10],
        "weights_failed": len(events(run_dir, "rollout.weights_failed")),
        "log_tail_cuts": len(events(run_dir, "store.log_tail_cut")),  # one per corrupt_log fault: the torn record
        "log_bad_records": len(events(run_dir, "store.log_record_bad")),
        **weights_audit(run_dir, published),
        **checkpoint_audit(run_dir, {v: last[v]["sample_ids"] for v in last}),
        "errors": named_errors(run_dir, work),
    }
    checks["ok"] = (checks["versions_contiguous"] and not checks["trained_twice"] and not checks["trained_never_stored"]
                    and not checks.get("checkpoint_trained_twice")
                    and not checks.get("in_step_events_not_in_checkpoint")
                    and not checks["acked_never_trained"] and not checks["dropped_without_reason"]
                    and not checks["dropped_and_trained"] and not checks["staleness_violations"]
                    and not checks["loaded_unpublished_versions"] and not checks["engine_weights_wrong"]
                    and checks["engine_loads_verified"] > 0)
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
    for f in faults:
        ax.axvline(f["t"] - t0, color=COLORS[f["kind"]], alpha=0.5, lw=1)
        if f.get("pause_s"):
            ax.axvspan(f["t"] - t0, f["t"] - t0 + f["pause_s"], color=COLORS[f["kind"]], alpha=0.1)
    for kind in sorted({f["kind"] for f in faults}):
        ax.plot([], [], color=COLORS[kind], label=kind)
    ax.set_xlabel("seconds"), ax.set_ylabel("policy version"), ax.legend(loc="upper left")
    ax.set_title("soak: faults (vertical lines) against trained versions")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args, work: Path) -> dict:
    rig = Rig(work, args.disk_mb, tuple(k for k in KINDS if k in args.kinds))
    try:
        return _run(args, work, rig)
    finally:
        rig.close(work / "run-kept" if args.work else None)


def _run(args, work: Path, rig: Rig) -> dict:
    run_dir = rig.run_dir
    seconds = args.minutes * 60
    faults_plan = schedule(args.seed, seconds, tuple(args.interval), tuple(args.pause), rig.kinds)
    cfg = ROOT / "configs" / "tiny.yaml"
    sets = settings(run_dir, rig.hosts)
    launcher = start(run_dir, cfg, sets, rig.hosts.exec_prefix(None) if rig.hosts else [])
    done, samples, t0 = [], [], time.time()
    try:
        _wait_first(run_dir, launcher)
        rig.start_outside(cfg, sets)
        t0 = time.time()
        next_sample = t0
        for fault in faults_plan + [None]:
            until = t0 + (fault["at_s"] if fault else seconds)
            while time.time() < until:
                if time.time() >= next_sample:
                    samples.append(sample(run_dir, rig))
                    next_sample += args.sample_s
                if launcher.poll() is not None:
                    tail = (work / "launcher.out").read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"the launcher exited ({launcher.returncode}); its output ends:\n{tail}")
                rig.scan()
                time.sleep(0.2)
            if fault:
                try:
                    done.append(inject(fault, run_dir, launcher, rig))
                except OSError as exc:  # a fault the rig could not inject is reported, not the end of the soak
                    done.append({**fault, "t": time.time(), "pid": None, "version_before": 0,
                                 "skipped": f"inject failed: {type(exc).__name__}: {exc}"[:300]})
        time.sleep(args.settle_s)  # the last fault's recovery
        # then until every fault has been recovered from (a training step after it), at most recover_max_s: on a
        # loaded machine a step can take longer than settle_s, and a fault is not "unrecovered" because the soak
        # stopped looking before the next step came
        deadline = time.time() + args.recover_max_s
        while time.time() < deadline and launcher.poll() is None:
            recoveries(run_dir, done)
            if all(f.get("skipped") or f["recover_s"] is not None for f in done):
                break
            rig.scan()
            time.sleep(1.0)
        samples.append(sample(run_dir, rig))
    finally:
        rig.stop_outside()
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(120)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()
    rig.scan()
    recoveries(run_dir, done)
    warm = t0 + min(600.0, seconds / 3)
    report = {"faults": done, "audit": audit(run_dir, rig.published, work), "growth": growth(samples, warm),
              "samples": samples, "launcher_rc": launcher.returncode, "seed": args.seed, "minutes": args.minutes,
              "kinds": list(rig.kinds), "kinds_unavailable": rig.unavailable, "outside_restarts": rig.restarts,
              "disk": rig.disk.usage() if rig.disk else None}
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
        if not f.get("skipped"):
            counts[f["kind"]] = counts.get(f["kind"], 0) + 1
    skipped = sum(1 for f in report["faults"] if f.get("skipped"))
    a = {k: v for k, v in report["audit"].items() if k != "errors"}
    lines += [f"faults injected: {counts}; skipped: {skipped}", "audit: " + ", ".join(f"{k} {v}" for k, v in a.items())]
    errors = report["audit"]["errors"]
    lines.append(f"named errors: {errors['by_name']}")
    lines.append(f"tracebacks in process output: {errors['tracebacks']}; exceptions: {errors['exceptions']}")
    for kind, why in report["kinds_unavailable"].items():
        lines.append(f"left out: {kind}: {why}")
    if report["disk"]:
        lines.append(f"run directory disk at the end: {report['disk']}; outside hosts restarted: "
                     f"{report['outside_restarts']}")
    for role, g in report["growth"].items():
        lines.append(f"growth {role}: RSS {g['rss_mb'][0]}->{g['rss_mb'][1]} MB ({g['rss_growth_pct']}%), "
                     f"fds {g['fds'][0]}->{g['fds'][1]} ({g['fd_growth_pct']}%), {g['samples']} samples")
    lines.append(f"command: {common.command('soak.py')}")
    return "\n".join(lines)


def main() -> int:
    parser = common.arg_parser(__doc__, "a 2-minute soak with faults every 8-15 s (what CI runs)")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--interval", type=float, nargs=2, default=[30.0, 90.0], metavar=("LO", "HI"))
    parser.add_argument("--pause", type=float, nargs=2, default=[5.0, 30.0], metavar=("LO", "HI"))
    parser.add_argument("--sample-s", type=float, default=60.0, help="RSS and descriptor sampling period.")
    parser.add_argument("--settle-s", type=float, default=30.0, help="Wait after the last fault before stopping.")
    parser.add_argument("--recover-max-s", type=float, default=180.0,
                        help="Then wait at most this long for a training step after every fault (its recovery).")
    parser.add_argument("--work", type=Path, help="Keep the run here (default: a temporary directory, deleted).")
    parser.add_argument("--plot", type=Path, help="Draw the timeline (faults against trained versions) here.")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="Fault kinds to inject.")
    parser.add_argument("--disk-mb", type=int, default=1024,
                        help="Size of the run directory's disk (a tmpfs) that disk_full fills.")
    args = parser.parse_args()
    # SIGTERM (a test's timeout, an operator) unwinds like Ctrl-C: the launcher is stopped, the outside hosts, the
    # namespaces and the small disk are removed (a SIGKILLed soak leaves them behind)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        # 2 minutes of faults every 8-15 s: at least 8 faults, so every kind at least once (kinds come in rounds).
        # No fixed settle: the wait that follows ends when every fault has been recovered from (a training step
        # after it), which is the event the settle stood for (issue 58: 20 s of CI time saved)
        args.minutes, args.interval, args.pause, args.sample_s, args.settle_s = 2.0, [8.0, 15.0], [2.0, 5.0], 10.0, 0.0
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
