"""Prometheus metrics from every process: one /metrics endpoint per process, off by default.

What: `Exporter` serves one process's own CollectorRegistry (never the library's global default registry) with
`prometheus_client.start_http_server` on `metrics.prometheus_host:port`. What it serves is fed by what each
component already computes; nothing here reads a live table from the HTTP thread:
  - a role (rollout, reward, controller, agent, trainer): `PrometheusSink`, one of the metrics sinks
    (areal_mq/telemetry/metrics.py). The role loop's StatsReport hands it every periodic `role.stats()`; the
    trainer hands it every step's metrics. ROLE_SERIES says which key becomes which series;
  - the brokers (job broker, signal bus, sample store): `BrokerMetrics.tick(now)`, called from the broker's own
    poll loop, snapshots their `stats()` at most once a second; the job broker also calls `delivered` and
    `answered` (the dispatch latency and job time histograms) where those events happen.
Labels stay bounded: a service name (the broker routes at most `brokers.max_services`), a counter's or a drop
reason's name from the code, never a job id or text a peer chose. Every process also serves `process_*` (CPU,
memory) and `areal_mq_process_info{role, worker_id, run}`.
Why: operators ask "is anything stuck, where is the backlog, how stale is what we train on" while a run is on;
the JSONL files answer after the fact, a Prometheus scrape answers now (docker/grafana/ has the dashboard).
How:
    areal-mq run configs/quickstart.yaml --set metrics.prometheus=true --set metrics.prometheus_port=9400
    curl -s 127.0.0.1:9400/metrics | grep areal_mq_broker   # the launcher prints each process's address
Needs `pip install 'areal-mq[prometheus]'`; without it a run asking for it stops at start with a ConfigError.
"""
from __future__ import annotations

import math
import numbers
import threading
from typing import Any, Iterable, Mapping, NamedTuple

from areal_mq.errors import ConfigError

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
JOB_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
SNAPSHOT_EVERY_S = 1.0  # brokers: the longest a scrape's figures lag the broker's tables


class Series(NamedTuple):
    """One series of a role, fed from the key `key` of the dicts its sink is given.
    kind: gauge (the last value), counter (the value is already a running total), sum (a running total of the
    values given: one per trainer step), histogram (each value is one observation, `buckets`), counts (a list
    of counts by integer value, added up: the trainer's tokens by staleness), summary (`key` is a running sum
    of seconds and `count_key` the running count)."""
    name: str
    kind: str
    key: str
    help: str
    buckets: tuple = ()
    count_key: str = ""


ROLE_SERIES: dict[str, tuple[Series, ...]] = {
    "controller": (
        Series("areal_mq_controller_version", "gauge", "version", "Newest policy version the controller has seen."),
        Series("areal_mq_controller_groups_in_flight", "gauge", "in_flight", "Groups admitted and not yet settled."),
        Series("areal_mq_controller_admission_blocked_by_eta", "gauge", "eta_blocked",
               "1 while the staleness bound η stops admission (admitted groups reached (η + v + 1) · batch_groups)."),
        Series("areal_mq_controller_groups_submitted_total", "counter", "submitted", "Groups admitted."),
        Series("areal_mq_controller_groups_stored_total", "counter", "stored", "Groups put into the sample store."),
        Series("areal_mq_controller_groups_failed_total", "counter", "failed", "Groups dropped after retries failed."),
        Series("areal_mq_controller_groups_dropped_total", "counter", "dropped", "Groups dropped (uniform rewards)."),
        Series("areal_mq_controller_generated_tokens_total", "counter", "gen_tokens", "Tokens generated for it."),
        Series("areal_mq_controller_reward_mean", "gauge", "reward_mean", "Mean reward of the last 200 completions."),
    ),
    "rollout": (
        Series("areal_mq_rollout_version", "gauge", "version", "Policy version the engine generates with."),
        Series("areal_mq_rollout_running", "gauge", "running", "Generation jobs this worker holds."),
        Series("areal_mq_rollout_waiting", "gauge", "waiting", "Sequences waiting for an engine slot."),
        Series("areal_mq_rollout_occupancy_ratio", "gauge", "occupancy", "Jobs held / capacity."),
        Series("areal_mq_rollout_tokens_per_second", "gauge", "tokens_per_s", "Decode throughput (recent window)."),
        Series("areal_mq_rollout_generated_tokens_total", "counter", "tokens", "Tokens generated."),
        Series("areal_mq_rollout_kv_tokens", "gauge", "kv_tokens", "Tokens held in the KV cache."),
        Series("areal_mq_rollout_weight_updates_total", "counter", "weight_updates", "Weight updates applied."),
        Series("areal_mq_rollout_interrupted_sequences_total", "counter", "interrupted_seqs",
               "Sequences in flight when a weight update interrupted them (they go on under the new weights)."),
        Series("areal_mq_rollout_recomputed_tokens_total", "counter", "recompute_tokens",
               "KV tokens recomputed after weight updates."),
        Series("areal_mq_rollout_update_pause_seconds", "summary", "update_pause_s",
               "Time decoding paused to load new weights (sum and count of updates).", count_key="weight_updates"),
    ),
    "reward": (
        Series("areal_mq_reward_jobs_total", "counter", "answered", "Reward jobs answered."),
        Series("areal_mq_reward_jobs_in_flight", "gauge", "in_flight", "Reward jobs being scored."),
        Series("areal_mq_reward_calls_total", "counter", "calls", "Reward function calls."),
        Series("areal_mq_reward_timeouts_total", "counter", "timeouts", "Reward calls killed at reward.timeout_s."),
        Series("areal_mq_reward_crashes_total", "counter", "crashes", "Reward pool processes that died in a call."),
        Series("areal_mq_reward_exceptions_total", "counter", "exceptions", "Reward calls that raised."),
        Series("areal_mq_reward_sandbox_refusals_total", "counter", "sandbox_refusals",
               "Completions the code sandbox stopped (network, write, read, syscall or process limit refused)."),
    ),
    "agent": (
        Series("areal_mq_agent_episodes_total", "counter", "done", "Episodes finished."),
        Series("areal_mq_agent_episodes_failed_total", "counter", "failed", "Episodes failed."),
        Series("areal_mq_agent_turns_total", "counter", "turns", "Turns taken."),
        Series("areal_mq_agent_episodes_in_flight", "gauge", "in_flight", "Episodes running."),
    ),
    "trainer": (
        Series("areal_mq_trainer_version", "gauge", "version", "Policy version after the last step."),
        Series("areal_mq_trainer_step_seconds", "histogram", "step_s", "Time of one training step.",
               STEP_BUCKETS),
        Series("areal_mq_trainer_batch_wait_seconds", "histogram", "wait_s",
               "Time the trainer waited for a batch before a step.", STEP_BUCKETS),
        Series("areal_mq_trainer_tokens_per_second", "gauge", "tokens_per_s", "Training throughput of the last step."),
        Series("areal_mq_trainer_tokens_total", "sum", "n_tokens", "Tokens trained on."),
        Series("areal_mq_trainer_samples_total", "sum", "n_seqs", "Sequences trained on."),
        Series("areal_mq_trainer_staleness_versions", "counts", "staleness_hist",
               "Trained generated tokens by how many versions their policy lagged the trained one."),
        Series("areal_mq_trainer_staleness_mean", "gauge", "staleness_mean", "Mean staleness of the last batch."),
        Series("areal_mq_trainer_loss", "gauge", "loss", "Policy loss of the last step."),
        Series("areal_mq_trainer_entropy", "gauge", "entropy", "Mean token entropy of the last step."),
        Series("areal_mq_trainer_grad_norm", "gauge", "grad_norm", "Gradient norm of the last step."),
        Series("areal_mq_trainer_reward_mean", "gauge", "reward_mean", "Mean reward of the last batch."),
        Series("areal_mq_trainer_mismatch_kl", "gauge", "mismatch_kl", "Engine vs trainer on the same weights: "
               "mean k3 KL(engine || trainer) over the last step's staleness-0 tokens (precision, not policy)."),
        Series("areal_mq_trainer_mismatch_abs_max", "gauge", "mismatch_abs_max",
               "Largest |log p_trainer - log p_engine| over the last step's staleness-0 tokens."),
        Series("areal_mq_trainer_mismatch_out_frac", "gauge", "mismatch_out_frac",
               "Fraction of the last step's staleness-0 tokens whose p_trainer / p_engine leaves [1/2, 2]."),
    ),
}

# The brokers' series (labels in braces); BrokerMetrics builds them from its snapshot.
BROKER_SERIES: dict[str, str] = {
    "areal_mq_broker_queue_depth": "Jobs waiting in a service's queue {service}.",
    "areal_mq_broker_queue_wait_seconds": "Age of the oldest job waiting in a service's queue since it was "
                                          "accepted {service} (0: none waits).",
    "areal_mq_broker_workers": "Workers registered for a service {service}.",
    "areal_mq_broker_capacity": "Slots announced by a service's workers {service}.",
    "areal_mq_broker_in_flight": "Jobs held by a service's workers {service}.",
    "areal_mq_broker_sessions": "Multi-turn sessions the broker routes sticky.",
    "areal_mq_broker_requeues_total": "Jobs put back in a queue {cause}: worker_lost (lost or disconnected with "
                                      "the job), deadline (unanswered when its lease ended).",
    "areal_mq_broker_refusals_total": "Messages and jobs refused {reason}.",
    "areal_mq_broker_events_total": "The job broker's counters {event} (its Stats 'counters').",
    "areal_mq_broker_dispatch_latency_seconds": "From a job accepted to its delivery to a worker {service}.",
    "areal_mq_broker_job_seconds": "From a job accepted to its answer forwarded to the client {service}.",
    "areal_mq_bus_published_total": "Publications the signal bus forwarded.",
    "areal_mq_bus_refused_total": "Publications the signal bus refused (topic, role or content).",
    "areal_mq_store_pending": "Samples waiting to be served.",
    "areal_mq_store_leased": "Samples served and not yet acknowledged.",
    "areal_mq_store_waiters": "GetBatch requests waiting.",
    "areal_mq_store_log_bytes": "Size of the sample store's log file.",
    "areal_mq_store_dropped_total": "Samples dropped {reason}.",
    "areal_mq_store_events_total": "The sample store's counters {event} (its Stats 'counters').",
}
# job broker counter -> refusal reason (the Error code or what was refused)
REFUSALS = {"forbidden": "forbidden", "refused": "bad_message", "queue_full": "queue_full",
            "too_many_services": "no_service", "no_worker_for_task": "no_worker_for_task",
            "bad_replies": "bad_reply", "bad_frames": "bad_frames", "deadline_failed": "deadline_failed"}


def load() -> Any:
    """The prometheus_client module, or a ConfigError saying which extra to install."""
    from areal_mq.errors import require_extra

    pc = require_extra("prometheus_client", "prometheus")
    require_extra("prometheus_client.core", "prometheus")  # the metric families custom collectors yield (pc.core)
    return pc


def series_names() -> set[str]:
    """Every series name the exporter can serve, with the suffixes Prometheus adds (for dashboards and tests)."""
    names = {"areal_mq_process_info"}
    hist = {"areal_mq_broker_dispatch_latency_seconds", "areal_mq_broker_job_seconds"}
    for name in BROKER_SERIES:
        names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} if name in hist else {name}
    for series in ROLE_SERIES.values():
        for s in series:
            if s.kind in ("histogram", "counts"):
                names |= {f"{s.name}_bucket", f"{s.name}_sum", f"{s.name}_count"}
            elif s.kind == "summary":
                names |= {f"{s.name}_sum", f"{s.name}_count"}
            else:
                names.add(s.name)
    return names


# ---------------------------------------------------------------- the endpoint
class Exporter:
    """One process's registry and HTTP endpoint. `add(collector)` registers what it serves; `start()` binds."""

    def __init__(self, host: str, port: int, role: str, worker_id: str = "", run: str = ""):
        self.pc = pc = load()
        self.host, self.port = host, port
        self.registry = pc.CollectorRegistry()
        pc.ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes
        info = pc.Info("areal_mq_process", "Which process serves this endpoint.", registry=self.registry)
        info.info({"role": role, "worker_id": worker_id or role, "run": run})
        self.server: Any = None

    @classmethod
    def from_config(cls, cfg: Any, role: str, worker_id: str = "") -> "Exporter":
        return cls(cfg.metrics.prometheus_host, cfg.metrics.prometheus_port, role, worker_id, cfg.run.name)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def add(self, collector: Any) -> Any:
        self.registry.register(collector)
        return collector

    def start(self) -> "Exporter":
        try:
            self.server, _ = self.pc.start_http_server(self.port, addr=self.host, registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"cannot serve Prometheus metrics on {self.host}:{self.port} ({exc}); set "
                              "metrics.prometheus_port (or metrics.prometheus_host) to a free one, or "
                              "metrics.prometheus: false") from None
        return self

    def close(self) -> None:
        server, self.server = self.server, None
        if server is not None:
            server.shutdown()
            server.server_close()


def _number(value: Any) -> float | None:
    """A finite number (bools count as 0/1) as a float, else None."""
    return float(value) if isinstance(value, numbers.Real) and math.isfinite(value) else None


class _Buckets:
    """Cumulative histogram counts over fixed upper bounds (a +Inf bucket last)."""

    def __init__(self, bounds: Iterable[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float, n: int = 1) -> None:
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += n
        self.sum += value * n

    def family(self, pc: Any, name: str, help: str) -> Any:
        cumulative, total = [], 0
        for bound, count in zip([*(str(float(b)) for b in self.bounds), "+Inf"], self.counts):
            total += count
            cumulative.append((bound, total))
        return pc.core.HistogramMetricFamily(name, help, buckets=cumulative, sum_value=self.sum)


class RoleCollector:
    """A role's series (ROLE_SERIES) from the dicts `update` is given; `collect` runs on the HTTP thread and
    reads only what `update` stored, under a lock."""

    def __init__(self, pc: Any, series: tuple[Series, ...]):
        self.pc, self.series = pc, series
        self.lock = threading.Lock()
        self.values: dict[str, float] = {}
        self.hists = {s.name: _Buckets(s.buckets) for s in series if s.kind == "histogram"}
        self.counts: dict[str, list[int]] = {s.name: [] for s in series if s.kind == "counts"}

    def update(self, metrics: Mapping[str, Any]) -> None:
        with self.lock:
            for s in self.series:
                raw = metrics.get(s.key)
                if s.kind == "counts":
                    if isinstance(raw, (list, tuple)):
                        acc = self.counts[s.name]
                        acc.extend([0] * (len(raw) - len(acc)))
                        for i, c in enumerate(raw):
                            acc[i] += int(c)
                    continue
                value = _number(raw)
                if value is None:
                    continue
                if s.kind == "histogram":
                    self.hists[s.name].observe(value)
                elif s.kind == "sum":
                    self.values[s.name] = self.values.get(s.name, 0.0) + value
                else:
                    self.values[s.name] = value
                    if s.kind == "summary":
                        self.values[s.count_key] = _number(metrics.get(s.count_key)) or 0.0

    def describe(self) -> list:
        return []  # series appear once their first figure arrives

    def collect(self) -> Iterable[Any]:
        core = self.pc.core
        with self.lock:
            for s in self.series:
                if s.kind == "histogram":
                    if sum(self.hists[s.name].counts):
                        yield self.hists[s.name].family(self.pc, s.name, s.help)
                elif s.kind == "counts":
                    acc = self.counts[s.name]
                    if acc:
                        b = _Buckets(range(len(acc)))
                        for lag, n in enumerate(acc):
                            b.observe(lag, n)
                        yield b.family(self.pc, s.name, s.help)
                elif s.name in self.values:
                    v = self.values[s.name]
                    if s.kind == "gauge":
                        yield core.GaugeMetricFamily(s.name, s.help, value=v)
                    elif s.kind == "summary":
                        yield core.SummaryMetricFamily(s.name, s.help, count_value=self.values[s.count_key],
                                                       sum_value=v)
                    else:
                        yield core.CounterMetricFamily(s.name, s.help, value=v)


class PrometheusSink:
    """A metrics sink (areal_mq/telemetry/metrics.py): the role's endpoint, fed by every `write`."""

    name = "prometheus"

    def __init__(self, cfg: Any, role: str, worker_id: str = "", log: Any = None):
        self.exporter = Exporter.from_config(cfg, role, worker_id)
        self.collector = self.exporter.add(RoleCollector(self.exporter.pc, ROLE_SERIES.get(role, ())))
        self.exporter.start()
        if log is not None:
            log.info("metrics.prometheus", url=self.exporter.url)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.collector.update(metrics)

    def close(self) -> None:
        self.exporter.close()


# ---------------------------------------------------------------- brokers
class BrokerMetrics:
    """The brokers' series. `tick(now)` (the broker's poll loop) snapshots the components' stats at most every
    SNAPSHOT_EVERY_S; `delivered` / `answered` (the job broker) observe the latency histograms."""

    def __init__(self, exporter: Exporter, job: Any = None, bus: Any = None, store: Any = None):
        self.exporter, self.pc = exporter, exporter.pc
        self.job, self.bus, self.store = job, bus, store
        self.snapshot: dict = {}  # replaced whole by tick (the HTTP thread only ever reads a finished one)
        self.next_at = 0.0
        self.latency = self.pc.Histogram("areal_mq_broker_dispatch_latency_seconds",
                                         BROKER_SERIES["areal_mq_broker_dispatch_latency_seconds"], ["service"],
                                         buckets=LATENCY_BUCKETS, registry=exporter.registry)
        self.job_time = self.pc.Histogram("areal_mq_broker_job_seconds", BROKER_SERIES["areal_mq_broker_job_seconds"],
                                          ["service"], buckets=JOB_BUCKETS, registry=exporter.registry)
        exporter.add(self)

    def delivered(self, assignments: list, now: float) -> None:
        for job, _ in assignments:
            self.latency.labels(job.service).observe(max(0.0, now - job.queued_at))

    def answered(self, job: Any, now: float) -> None:
        self.job_time.labels(job.service).observe(max(0.0, now - job.queued_at))

    def tick(self, now: float) -> None:
        if now < self.next_at:
            return
        self.next_at = now + SNAPSHOT_EVERY_S
        snap: dict = {}
        if self.job is not None:
            snap["job"] = self._job_snapshot(now)
        if self.bus is not None:
            snap["bus"] = {"published": self.bus.forwarded, "refused": self.bus.refused}
        if self.store is not None:
            s = self.store.stats()
            snap["store"] = {k: s[k] for k in ("pending", "leased", "waiters", "log_bytes", "counters")}
        self.snapshot = snap

    def _job_snapshot(self, now: float) -> dict:
        job = self.job
        s = job.stats()
        per: dict[str, dict[str, float]] = {}
        for w in s["workers"].values():
            d = per.setdefault(w["service"], {"workers": 0, "capacity": 0, "in_flight": 0})
            d["workers"] += 1
            d["capacity"] += w["capacity"]
            d["in_flight"] += w["in_flight"]
        wait = {}
        for service, queue in job.queues.items():
            head = job.jobs.get(queue[0]) if queue else None
            wait[service] = max(0.0, now - head.queued_at) if head is not None else 0.0
        return {"queued": s["queued"], "wait": wait, "per": per, "sessions": s["sessions"],
                "counters": s["counters"]}

    def describe(self) -> list:
        return []

    def collect(self) -> Iterable[Any]:
        core, snap = self.pc.core, self.snapshot
        if "job" in snap:
            yield from self._job_families(core, snap["job"])
        if "bus" in snap:
            yield core.CounterMetricFamily("areal_mq_bus_published_total", BROKER_SERIES["areal_mq_bus_published_total"],
                                           value=snap["bus"]["published"])
            yield core.CounterMetricFamily("areal_mq_bus_refused_total", BROKER_SERIES["areal_mq_bus_refused_total"],
                                           value=snap["bus"]["refused"])
        if "store" in snap:
            st = snap["store"]
            for key in ("pending", "leased", "waiters", "log_bytes"):
                name = f"areal_mq_store_{key}"
                yield core.GaugeMetricFamily(name, BROKER_SERIES[name], value=st[key])
            counters = st["counters"]
            # "stale" is always there, so a dashboard's query has a series before the first drop
            reasons = {"stale": 0, **{k[len("dropped_"):]: v for k, v in counters.items() if k.startswith("dropped_")}}
            dropped = core.CounterMetricFamily("areal_mq_store_dropped_total",
                                               BROKER_SERIES["areal_mq_store_dropped_total"], labels=["reason"])
            for reason, value in sorted(reasons.items()):
                dropped.add_metric([reason], value)
            events = core.CounterMetricFamily("areal_mq_store_events_total",
                                              BROKER_SERIES["areal_mq_store_events_total"], labels=["event"])
            for key, value in sorted(counters.items()):
                events.add_metric([key], value)
            yield dropped
            yield events

    def _job_families(self, core: Any, j: dict) -> Iterable[Any]:
        def by_service(name: str, values: Mapping[str, float]) -> Any:
            fam = core.GaugeMetricFamily(name, BROKER_SERIES[name], labels=["service"])
            for service, value in sorted(values.items()):
                fam.add_metric([service], value)
            return fam

        yield by_service("areal_mq_broker_queue_depth", j["queued"])
        yield by_service("areal_mq_broker_queue_wait_seconds", j["wait"])
        for key in ("workers", "capacity", "in_flight"):
            yield by_service(f"areal_mq_broker_{key}", {s: d[key] for s, d in j["per"].items()})
        yield core.GaugeMetricFamily("areal_mq_broker_sessions", BROKER_SERIES["areal_mq_broker_sessions"],
                                     value=j["sessions"])
        counters = j["counters"]
        requeues = core.CounterMetricFamily("areal_mq_broker_requeues_total",
                                            BROKER_SERIES["areal_mq_broker_requeues_total"], labels=["cause"])
        requeues.add_metric(["worker_lost"], counters.get("requeued", 0))
        requeues.add_metric(["deadline"], counters.get("deadline_requeued", 0))
        yield requeues
        refusals = core.CounterMetricFamily("areal_mq_broker_refusals_total",
                                            BROKER_SERIES["areal_mq_broker_refusals_total"], labels=["reason"])
        totals: dict[str, float] = {}
        for key, reason in REFUSALS.items():
            totals[reason] = totals.get(reason, 0) + counters.get(key, 0)
        for reason, value in sorted(totals.items()):
            refusals.add_metric([reason], value)
        yield refusals
        events = core.CounterMetricFamily("areal_mq_broker_events_total", BROKER_SERIES["areal_mq_broker_events_total"],
                                          labels=["event"])
        for key, value in sorted(counters.items()):
            events.add_metric([key], value)
        yield events


def broker_metrics(cfg: Any, components: str, job: Any = None, bus: Any = None, store: Any = None,
                   log: Any = None) -> BrokerMetrics | None:
    """The broker process's endpoint when `metrics.prometheus` is on (else None), started."""
    if not cfg.metrics.prometheus:
        return None
    exporter = Exporter.from_config(cfg, "broker", f"broker-{components}")
    metrics = BrokerMetrics(exporter, job, bus, store)
    exporter.start()
    if log is not None:
        log.info("metrics.prometheus", url=exporter.url)
    return metrics

