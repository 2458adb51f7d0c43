"""The Prometheus exporter (areal_mq/telemetry/prometheus.py) and the launcher's port block, on real sockets.

Each test binds only 127.0.0.1 on free ports and scrapes the endpoint over HTTP, as Prometheus would.
"""
from __future__ import annotations

import socket
import sys
import time
import urllib.error
import urllib.request

import pytest
import zmq

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from areal_mq.client import JobClient  # noqa: E402
from areal_mq.config import config_from_dict  # noqa: E402
from areal_mq.errors import ConfigError  # noqa: E402
from areal_mq.launch.launcher import Launcher, assign_metrics_ports  # noqa: E402
from areal_mq.launch.ports import free_port_block  # noqa: E402
from areal_mq.messages import GenerateRequest, SamplingSpec  # noqa: E402
from areal_mq.telemetry.metrics import MetricsSinks  # noqa: E402
from areal_mq.telemetry.prometheus import (ROLE_SERIES, BrokerMetrics, Exporter, PrometheusSink,  # noqa: E402
                                           series_names)


def free_port() -> int:
    from tests.integration.procs import free_ports  # below the ephemeral range, this xdist worker's slice

    return free_ports(1)[0]


def cfg_for(tmp_path, **metrics):
    return config_from_dict({"run": {"run_dir": str(tmp_path)},
                             "metrics": {"prometheus": True, "prometheus_port": free_port(), **metrics}})


def scrape(port: int) -> dict[str, list]:
    """{sample name: [(labels, value), ...]} of one scrape."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(samples: dict, name: str, **labels) -> float:
    return next(v for lab, v in samples[name] if all(lab.get(k) == x for k, x in labels.items()))


def test_trainer_steps_become_gauges_counters_and_histograms(tmp_path):
    cfg = cfg_for(tmp_path)
    sink = PrometheusSink(cfg, "trainer", "trainer")
    try:
        sink.write(0, {"version": 1, "loss": 0.5, "entropy": 2.0, "step_s": 0.3, "tokens_per_s": 100.0,
                       "n_tokens": 40, "n_seqs": 4, "staleness_hist": [30, 10], "wait_s": 0.01, "note": "text"})
        sink.write(1, {"version": 2, "loss": 0.25, "entropy": 1.5, "step_s": 3.0, "tokens_per_s": 120.0,
                       "n_tokens": 60, "n_seqs": 4, "staleness_hist": [20, 30, 10], "wait_s": float("nan")})
        got = scrape(cfg.metrics.prometheus_port)
    finally:
        sink.close()
    assert value(got, "areal_mq_trainer_version") == 2 and value(got, "areal_mq_trainer_loss") == 0.25
    assert value(got, "areal_mq_trainer_tokens_total") == 100  # summed over steps
    assert value(got, "areal_mq_trainer_step_seconds_count") == 2
    assert value(got, "areal_mq_trainer_step_seconds_bucket", le="0.5") == 1
    assert value(got, "areal_mq_trainer_batch_wait_seconds_count") == 1  # NaN is no observation
    # tokens by versions behind, added up over steps: 50 at 0, 40 at 1, 10 at 2
    assert value(got, "areal_mq_trainer_staleness_versions_bucket", le="0.0") == 50
    assert value(got, "areal_mq_trainer_staleness_versions_bucket", le="1.0") == 90
    assert value(got, "areal_mq_trainer_staleness_versions_count") == 100
    assert value(got, "areal_mq_trainer_staleness_versions_sum") == 40 + 20
    assert value(got, "areal_mq_process_info", role="trainer", worker_id="trainer") == 1
    assert "process_cpu_seconds_total" in got
    with pytest.raises(urllib.error.URLError):  # closed: the port is free again
        urllib.request.urlopen(f"http://127.0.0.1:{cfg.metrics.prometheus_port}/metrics", timeout=2)


def test_role_stats_feed_their_series_and_nothing_reaches_the_default_registry(tmp_path):
    cfg = cfg_for(tmp_path)
    sinks = MetricsSinks.from_config(cfg, "rollout", worker_id="rollout-0")
    try:
        assert [s.name for s in sinks.sinks] == ["jsonl", "prometheus"]
        sinks.write(0, {"running": 3, "tokens": 500, "tokens_per_s": 42.5, "weight_updates": 2,
                        "update_pause_s": 0.5, "interrupted_seqs": 3, "version": 2})
        got = scrape(cfg.metrics.prometheus_port)
    finally:
        sinks.close()
    assert value(got, "areal_mq_rollout_running") == 3
    assert value(got, "areal_mq_rollout_generated_tokens_total") == 500
    assert value(got, "areal_mq_rollout_update_pause_seconds_count") == 2
    assert value(got, "areal_mq_rollout_update_pause_seconds_sum") == 0.5
    assert value(got, "areal_mq_rollout_interrupted_sequences_total") == 3
    default = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert not any(n.startswith("areal_mq") for n in default)


def test_a_taken_port_or_a_missing_package_is_a_config_error(tmp_path, monkeypatch):
    cfg = cfg_for(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", cfg.metrics.prometheus_port))
        s.listen()
        with pytest.raises(ConfigError, match=r"metrics.prometheus_port"):
            PrometheusSink(cfg, "reward")
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if the extra were not installed
    with pytest.raises(ConfigError, match=r"areal-mq\[prometheus\]"):
        MetricsSinks.from_config(cfg, "reward")


@pytest.mark.parametrize("port", [0, 65536, -1])
def test_a_port_out_of_range_is_refused_by_the_config(tmp_path, port):
    with pytest.raises(ConfigError, match="metrics.prometheus_port"):
        config_from_dict({"metrics": {"prometheus": True, "prometheus_port": port}})


def test_the_port_block_follows_start_order_and_is_checked(tmp_path):
    cfg = config_from_dict({"metrics": {"prometheus": True, "prometheus_port": 9400}})
    names = ["broker", "reward-0", "rollout-0", "trainer", "controller"]
    assert assign_metrics_ports(cfg, names, check_free=False) == dict(zip(names, range(9400, 9405)))
    overlap = config_from_dict({"metrics": {"prometheus": True, "prometheus_port": 5553}})  # 5553-5557
    with pytest.raises(ConfigError, match=r"overlaps brokers.job_port=5555, brokers.bus_in_port=5556"):
        assign_metrics_ports(overlap, names, check_free=False)
    high = config_from_dict({"metrics": {"prometheus": True, "prometheus_port": 65533}})
    with pytest.raises(ConfigError, match="past port 65535"):
        assign_metrics_ports(high, names, check_free=False)
    base = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", base))
        busy = config_from_dict({"metrics": {"prometheus": True, "prometheus_port": base}})
        with pytest.raises(ConfigError, match=f"{base} on 127.0.0.1 are in use"):
            assign_metrics_ports(busy, names[:1])


def test_the_launcher_gives_each_child_its_port_and_refuses_a_bad_block_before_starting(tmp_path):
    base = free_port_block("127.0.0.1", 6)
    cfg = config_from_dict({"run": {"run_dir": str(tmp_path / "ok")}, "security": {"insecure": True},
                            "launcher": {"rollout_workers": 2},
                            "metrics": {"prometheus": True, "prometheus_port": base}})
    launcher = Launcher(cfg)
    kids = launcher.plan(launcher.prepare())
    ports = [k.metrics_port for k in kids]
    assert [k.name for k in kids] == ["broker", "reward-0", "rollout-0", "rollout-1", "trainer", "controller"]
    assert len(set(ports)) == len(kids) and min(ports) >= base
    assert all(k.args[-2:] == ["--set", f"metrics.prometheus_port={k.metrics_port}"] for k in kids)
    bad = config_from_dict({"run": {"run_dir": str(tmp_path / "bad")}, "security": {"insecure": True},
                            "metrics": {"prometheus": True, "prometheus_port": 5552}})
    with pytest.raises(ConfigError, match="overlaps brokers.job_port"):
        Launcher(bad).prepare()
    plain = config_from_dict({"run": {"run_dir": str(tmp_path / "off")}, "security": {"insecure": True}})
    off = Launcher(plain)
    assert all("metrics.prometheus_port" not in " ".join(k.args) for k in off.plan(off.prepare()))


def test_broker_series_from_a_real_job_broker(tmp_path):
    from areal_mq.brokers.job_broker import JobBroker

    port = free_port()
    ctx = zmq.Context()
    broker = JobBroker(ctx, f"tcp://127.0.0.1:{port}", heartbeat_s=1.0, liveness=5, max_queue=10,
                       max_frame_bytes=1 << 20, log=_Quiet())
    exporter = Exporter("127.0.0.1", free_port(), "broker", "broker-job")
    metrics = BrokerMetrics(exporter, job=broker)
    broker.metrics = metrics
    exporter.start()
    client = JobClient(f"tcp://127.0.0.1:{port}")
    try:
        client.submit(GenerateRequest(prompt_ids=[1, 2], sampling=SamplingSpec(max_new_tokens=4)))
        deadline = time.monotonic() + 20
        while not broker.queues.get("generate") and time.monotonic() < deadline:
            broker.handle()
            time.sleep(0.01)
        time.sleep(0.05)
        metrics.tick(time.monotonic())
        got = scrape(exporter.port)
    finally:
        client.close()
        exporter.close()
        broker.close()
        ctx.term()
    assert value(got, "areal_mq_broker_queue_depth", service="generate") == 1
    assert value(got, "areal_mq_broker_queue_wait_seconds", service="generate") > 0
    assert value(got, "areal_mq_broker_refusals_total", reason="queue_full") == 0
    assert value(got, "areal_mq_broker_requeues_total", cause="worker_lost") == 0
    assert value(got, "areal_mq_broker_events_total", event="accepted") == 1


def test_every_role_series_is_named_by_the_conventions():
    names = series_names()
    for role, series in ROLE_SERIES.items():
        for s in series:
            assert s.name.startswith(f"areal_mq_{role}_")
            assert (s.kind in ("counter", "sum")) == s.name.endswith("_total"), s.name
    assert {"areal_mq_broker_dispatch_latency_seconds_bucket", "areal_mq_store_dropped_total",
            "areal_mq_bus_refused_total", "areal_mq_trainer_staleness_versions_bucket"} <= names


class _Quiet:
    def __getattr__(self, name):
        return lambda *a, **k: None
