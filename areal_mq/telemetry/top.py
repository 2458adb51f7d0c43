"""`areal-mq top`: a live terminal view of a running job, from the signal bus and the brokers' stats.

What: every role and worker (alive, busy, policy version, last event), the job broker's queues and in-flight
jobs per service, the sample store (pending, leased, trained, dropped), throughput (generated and trained
tokens/s, samples stored/s), staleness (the last trainer step's per-token staleness against the bound η),
the slowest in-flight generation request, and the recent warnings.
Why: "is anything stuck, where is the backlog, how stale is what we train on?" answered in one screen
while the run goes on, instead of reading JSONL files by hand.
How: the observer key (run_dir/keys, made for tools like this) asks the job broker and the sample store for
their Stats; events come from the run's event files when the run directory is on this host (their tail fills
the first frame), else from the bus topic "events". Worker liveness: registered at the job broker (the broker drops workers
that stop beating), or an event within LIVE_S. The slowest in-flight request needs the rollout's debug events
(`--set events.level=debug`).
How to run: areal-mq top runs/quickstart            # live, Ctrl-C to leave
            areal-mq top runs/quickstart --once     # one frame (listens to the bus for --listen seconds first)
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_mq.telemetry.log import LEVELS

LIVE_S = 30.0  # a role that is not a broker worker counts as alive this long after its last event
SERVICE_ROLE = {"generate": "rollout", "reward": "reward", "agent": "agent"}
TAIL_BYTES = 256 * 1024  # of each event file, to fill the first frame


@dataclass
class Seen:
    """What the events told about one process."""

    role: str
    worker: str
    last_ts: float = 0.0
    last_event: str = ""
    version: int | None = None
    numbers: dict[str, Any] = field(default_factory=dict)  # its latest `{role}.stats` / trainer.step figures


@dataclass
class TopState:
    """Folds event records into what a frame shows; pure (no sockets), so it is tested with plain dicts."""

    procs: dict[str, Seen] = field(default_factory=dict)
    warnings: collections.deque = field(default_factory=lambda: collections.deque(maxlen=8))
    running: dict[str, tuple[float, str]] = field(default_factory=dict)  # rollout job -> (started ts, worker)
    _warned: set = field(default_factory=set)

    def feed(self, rec: dict) -> None:
        role, worker, event = str(rec.get("role", "?")), str(rec.get("worker_id", "?")), str(rec.get("event", ""))
        ts = float(rec.get("ts", 0.0))
        proc = self.procs.setdefault(f"{role}/{worker}", Seen(role, worker))
        if ts >= proc.last_ts:
            proc.last_ts, proc.last_event = ts, event
        if isinstance(rec.get("version"), int) and not event.startswith(("store.", "broker.")):
            proc.version = rec["version"]
        if event.endswith(".stats") or event == "trainer.step":
            proc.numbers = {k: v for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if event == "rollout.request_started":
            self.running[str(rec.get("job"))] = (ts, worker)
        elif event in ("rollout.request_finished", "rollout.job_failed"):
            self.running.pop(str(rec.get("job")), None)
        elif event in ("rollout.drained", "rollout.closed"):
            self.running = {j: v for j, v in self.running.items() if v[1] != worker}
        key = (ts, role, worker, event)
        if LEVELS.get(str(rec.get("level", "info")), 20) >= LEVELS["warning"] and key not in self._warned:
            self._warned.add(key)
            self.warnings.append(rec)

    def latest(self, role: str) -> Seen | None:
        """The process of `role` heard from last."""
        mine = [p for p in self.procs.values() if p.role == role]
        return max(mine, key=lambda p: p.last_ts) if mine else None


def worker_rows(state: TopState, job: dict | None, now: float) -> list[dict]:
    """One row per process: the broker's registered workers and every role the events name."""
    rows: dict[str, dict] = {}
    for wid, w in ((job or {}).get("workers") or {}).items():
        role = SERVICE_ROLE.get(w.get("service", ""), w.get("service", "?"))
        rows[f"{role}/{wid}"] = {"role": role, "worker": wid, "alive": "yes (broker)",
                                 "busy": f"{w.get('in_flight', 0)}/{w.get('capacity', 0)}", "version": None,
                                 "last": ""}
    for key, p in state.procs.items():
        if p.role in ("broker", "?"):
            continue
        age = now - p.last_ts
        row = rows.setdefault(key, {"role": p.role, "worker": p.worker, "busy": "-",
                                    "alive": "yes" if age <= LIVE_S else f"silent {age:.0f}s"})
        if p.last_event.endswith((".closed", ".finished")):
            row["alive"] = "stopped"
        row.update(version=p.version, last=f"{p.last_event} {age:.0f}s ago")
    return sorted(rows.values(), key=lambda r: (r["role"], r["worker"]))


def slowest_request(state: TopState, now: float) -> str:
    if not state.running:
        return "none in flight" if any(p.role == "rollout" for p in state.procs.values()) else "-"
    job, (ts, worker) = min(state.running.items(), key=lambda kv: kv[1][0])
    return f"job {job[:12]} on {worker}, running {now - ts:.1f}s ({len(state.running)} in flight)"


def summary_lines(state: TopState, job: dict | None, store: dict | None, bound: int) -> list[tuple[str, str]]:
    """(label, text) lines: queues, store, throughput, staleness."""
    out = []
    if job is None:
        out.append(("job broker", "unreachable"))
    else:
        queues = ", ".join(f"{s} {n}" for s, n in sorted((job.get("queued") or {}).items())) or "empty"
        out.append(("queues", f"{queues} · in flight {job.get('in_flight', 0)} · sessions {job.get('sessions', 0)}"))
    if store is None:
        out.append(("sample store", "unreachable"))
    else:
        c = store.get("counters") or {}
        out.append(("sample store", f"pending {store.get('pending', 0)} · leased {store.get('leased', 0)} · "
                                    f"put {c.get('put', 0)} · served {c.get('served', 0)} · acked {c.get('acked', 0)} "
                                    f"· dropped stale {c.get('dropped_stale', 0)}"))
    ctl, trn = state.latest("controller"), state.latest("trainer")
    gen = ctl.numbers.get("gen_tokens_per_s") if ctl else None
    tps = trn.numbers.get("tokens_per_s") if trn else None
    out.append(("throughput", f"generated {_num(gen)} tok/s · trained {_num(tps)} tok/s · step "
                              f"{_num(trn.numbers.get('step_s') if trn else None)} s"))
    if ctl:
        n = ctl.numbers
        out.append(("controller", f"v{ctl.version} · groups in flight {n.get('in_flight', '-')} · stored "
                                  f"{n.get('stored', '-')} · failed {n.get('failed', '-')} · dropped {n.get('dropped', '-')}"))
    st = (f"mean {_num(trn.numbers.get('staleness_mean'))} max {trn.numbers.get('staleness_max', '-')}"
          if trn and "staleness_mean" in trn.numbers else "no trainer step yet")
    out.append(("staleness", f"{st} (bound η = {bound}) · trainer v{trn.version if trn else '-'}"))
    if trn and "mismatch_kl" in trn.numbers:  # engine vs trainer on the same weights (docs/bigger-models.md)
        n = trn.numbers
        out.append(("precision", f"mismatch_kl {_num(n['mismatch_kl'])} · max |Δlogp| "
                                 f"{_num(n.get('mismatch_abs_max'))} · outside [½, 2] {_num(n.get('mismatch_out_frac'))}"))
    out.append(("slowest request", slowest_request(state, time.time())))
    return out


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def render(state: TopState, job: dict | None, store: dict | None, bound: int, title: str, now: float) -> Any:
    """One frame as a rich renderable."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    for label, text in summary_lines(state, job, store, bound):
        head.add_row(label, text)
    workers = Table(title="workers", title_justify="left")
    for col in ("role", "worker", "alive", "busy", "version", "last event"):
        workers.add_column(col, overflow="fold")
    for r in worker_rows(state, job, now):
        workers.add_row(r["role"], r["worker"], r["alive"], r["busy"],
                        "-" if r.get("version") is None else f"v{r['version']}", r.get("last", ""))
    warn = ["[bold]recent warnings[/bold]"]
    for rec in list(state.warnings)[-6:]:
        warn.append("  " + escape(f"{time.strftime('%H:%M:%S', time.localtime(rec.get('ts', 0)))} {rec.get('level')} "
                     f"{rec.get('role')}/{rec.get('worker_id')} {rec.get('event')} "
                    f"{str(rec.get('error') or rec.get('reason') or '')[:100]}"))
    if not state.warnings:
        warn.append("  none")
    return Group(f"[bold]areal-mq top[/bold] {title} · {time.strftime('%H:%M:%S', time.localtime(now))}",
                 head, workers, *warn)


# ---------------------------------------------------------------- sockets (the observer's view of a run)
def top_config(target: str, overrides: list[str]) -> Any:
    """The run config of `target`: a run directory (its config.yaml, as the launcher wrote it) or a YAML file."""
    from areal_mq.config import load_config
    from areal_mq.errors import ConfigError

    path = Path(target)
    if path.is_dir():
        if not (path / "config.yaml").is_file():
            raise ConfigError(f"{path} has no config.yaml: give a run directory the launcher wrote, or a YAML "
                              "run config")
        path = path / "config.yaml"
    return load_config(path, overrides)


class EventFiles:
    """New records of a local run's event files: the tail of each at the start, then what is appended.
    Preferred to the bus when the run directory is on this host: no gap between the first frame and the
    live ones, so a request that finished in between is never left looking in flight."""

    def __init__(self, run_dir: Path, tail_bytes: int = TAIL_BYTES):
        self.folder = run_dir / "events"
        self.tail_bytes = tail_bytes
        self.offsets: dict[Path, int] = {}

    def poll(self) -> list[dict]:
        from areal_mq.telemetry.tail import read_new_lines

        out: list[dict] = []
        for path in sorted(self.folder.glob("*.jsonl")):
            if path not in self.offsets:  # a partial first line is skipped by read_new_lines
                self.offsets[path] = max(0, path.stat().st_size - self.tail_bytes)
            out.extend(read_new_lines(path, self.offsets))
        return sorted(out, key=lambda r: r.get("ts", 0.0))


class Probe:
    """The observer's sockets: Stats from the job broker and the sample store, events from the bus."""

    def __init__(self, cfg: Any, stats_timeout_s: float = 2.0, files: EventFiles | None = None):
        from areal_mq.client import JobClient, SignalSubscriber, StoreClient
        from areal_mq.security import Keyring

        keys = Keyring.from_config(cfg, "observer")
        b = cfg.brokers
        self.timeout = stats_timeout_s
        self.jobs = JobClient(b.job_addr, keys=keys, heartbeat_s=b.heartbeat_s)
        self.store = StoreClient(b.store_addr, keys=keys, heartbeat_s=b.heartbeat_s)
        self.files = files
        self.bus = None if files else SignalSubscriber(b.bus_out_addr, topics=("events",), keys=keys)

    def listen(self, state: TopState, seconds: float) -> None:
        """Feed `state` the events of the next `seconds` (from the local files, else from the bus)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.files is not None:
                for rec in self.files.poll():
                    state.feed(rec)
                time.sleep(min(0.2, left))
                continue
            got = self.bus.recv(timeout=min(0.2, left))
            if got is not None:
                state.feed(got[1].msg.record)

    def stats(self) -> tuple[dict | None, dict | None]:
        """(job broker stats, store stats); None for one that did not answer in time."""
        from areal_mq.errors import ArealError

        out: list[dict | None] = []
        for client in (self.jobs, self.store):
            try:
                out.append(client.stats(timeout=self.timeout))
            except ArealError:
                out.append(None)
        if out[0] is None:  # a fresh socket next time: a late answer must not be taken for the next one
            self.jobs.close()
            from areal_mq.client import JobClient

            self.jobs = JobClient(self.jobs.address, keys=self.jobs.keys)
        return out[0], out[1]

    def close(self) -> None:
        for sock in (self.jobs, self.store, self.bus):
            if sock is not None:
                sock.close()


def run_top(cfg: Any, once: bool = False, interval_s: float = 2.0, listen_s: float = 3.0) -> int:
    """Print one frame (`once`) or refresh a live view every `interval_s` until Ctrl-C."""
    from rich.console import Console
    from rich.live import Live

    state, console = TopState(), Console()
    local = Path(cfg.run.run_dir) / "events"
    probe = Probe(cfg, files=EventFiles(local.parent) if local.is_dir() else None)
    title = f"{cfg.run.name} · {cfg.run.run_dir}"
    try:
        if once:
            probe.listen(state, listen_s if probe.bus is not None else 0.3)
            job, store = probe.stats()
            console.print(render(state, job, store, cfg.staleness_bound, title, time.time()))
            return 0 if job is not None or store is not None else 1
        with Live(console=console, auto_refresh=False, screen=False) as live:
            while True:
                job, store = probe.stats()
                live.update(render(state, job, store, cfg.staleness_bound, title, time.time()), refresh=True)
                probe.listen(state, interval_s)
    except KeyboardInterrupt:
        return 0
    finally:
        probe.close()
