"""A real tiny run with `metrics.prometheus=true`: every process's /metrics endpoint is scraped while it runs.

The run (configs/tiny.yaml through `areal-mq run`, as tests/integration/test_e2e.py does) is started in the
background; the launcher prints one `prometheus: NAME URL` line per process; each endpoint is polled until the
trainer reports version >= 1 and every process shows its series (by name, with values that say work happened);
then the run is stopped by PID (SIGTERM: checkpoint and stop, as Ctrl-C) and no endpoint answers any more.
Slow: python -m pytest -q tests/integration/test_prometheus.py -m slow
"""
from __future__ import annotations

import http.client
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from areal_mq.launch.ports import free_port_block

from .test_e2e import ROOT, _sets

pytestmark = pytest.mark.slow
prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

# role -> series that must be there (sample names), and checks on values once the trainer is past version 1
SERIES = {
    "broker": {"areal_mq_broker_queue_depth", "areal_mq_broker_queue_wait_seconds", "areal_mq_broker_workers",
               "areal_mq_broker_in_flight", "areal_mq_broker_requeues_total", "areal_mq_broker_refusals_total",
               "areal_mq_broker_dispatch_latency_seconds_bucket", "areal_mq_broker_job_seconds_count",
               "areal_mq_bus_published_total", "areal_mq_bus_refused_total", "areal_mq_store_pending",
               "areal_mq_store_leased", "areal_mq_store_dropped_total", "areal_mq_store_log_bytes"},
    "controller": {"areal_mq_controller_groups_in_flight", "areal_mq_controller_admission_blocked_by_eta",
                   "areal_mq_controller_version", "areal_mq_controller_groups_stored_total"},
    "rollout": {"areal_mq_rollout_running", "areal_mq_rollout_tokens_per_second",
                "areal_mq_rollout_generated_tokens_total", "areal_mq_rollout_interrupted_sequences_total",
                "areal_mq_rollout_update_pause_seconds_count"},
    "trainer": {"areal_mq_trainer_step_seconds_bucket", "areal_mq_trainer_tokens_per_second",
                "areal_mq_trainer_version", "areal_mq_trainer_staleness_versions_bucket", "areal_mq_trainer_loss",
                "areal_mq_trainer_entropy", "areal_mq_trainer_tokens_total"},
    "reward": {"areal_mq_reward_jobs_total", "areal_mq_reward_timeouts_total",
               "areal_mq_reward_sandbox_refusals_total"},
}


def scrape(url: str) -> dict[str, list] | None:
    """{sample name: [(labels, value)]}, or None while the endpoint does not answer.

    An HTTP error counts as not answering too: the launcher prints the URLs before each child listens, and a
    connect to a loopback port in the ephemeral range that nothing listens on yet can meet itself (TCP
    simultaneous open), so the "reply" is the request echoed (`BadStatusLine: GET /metrics HTTP/1.1`). The loop
    retries, and an endpoint that never answers still fails the test below."""
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException):
        return None
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def total(samples: dict, name: str, **labels) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def role_of(samples: dict) -> str:
    (labels, _), = samples["areal_mq_process_info"]
    return labels["role"]


def ready(samples: dict) -> bool:
    """This process shows all its series, with figures that say the run got going."""
    role = role_of(samples)
    if not SERIES[role] <= set(samples):
        return False
    return {
        "broker": lambda: total(samples, "areal_mq_broker_dispatch_latency_seconds_count", service="generate") > 0
        and total(samples, "areal_mq_bus_published_total") > 0 and total(samples, "areal_mq_store_log_bytes") > 0,
        "trainer": lambda: total(samples, "areal_mq_trainer_version") >= 1
        and total(samples, "areal_mq_trainer_staleness_versions_count") > 0,
        "rollout": lambda: total(samples, "areal_mq_rollout_generated_tokens_total") > 0,
        "reward": lambda: total(samples, "areal_mq_reward_jobs_total") > 0,
        "controller": lambda: total(samples, "areal_mq_controller_groups_submitted_total") > 0,
    }[role]()


def test_every_process_serves_its_series_while_the_run_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    base = free_port_block("127.0.0.1", 5)  # broker, reward-0, rollout-0, trainer, controller
    log = tmp_path / "launcher.log"
    cmd = [sys.executable, "-m", "areal_mq.cli", "run", str(ROOT / "configs" / "tiny.yaml"), "--skip-eval",
           "--quiet", *_sets(run_dir, "metrics.prometheus=true", f"metrics.prometheus_port={base}",
                             "controller.total_steps=400")]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        urls: dict[str, str] = {}
        seen: dict[str, dict] = {}
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            urls = dict(re.findall(r"prometheus: (\S+)\s+(http://\S+/metrics)", log.read_text()))
            if len(urls) == 5:
                seen = {name: s for name, url in urls.items() if (s := scrape(url)) is not None}
                if len(seen) == 5 and all(ready(s) for s in seen.values()):
                    break
            time.sleep(1.0)
        text = log.read_text()
        assert proc.poll() is None, f"the run ended early:\n{text[-3000:]}"
        assert sorted(urls) == ["broker", "controller", "reward-0", "rollout-0", "trainer"], text[-3000:]
        assert sorted(int(u.rsplit(":", 1)[1].split("/")[0]) for u in urls.values()) == list(range(base, base + 5))
        missing = {name: sorted(SERIES[role_of(s)] - set(s)) for name, s in seen.items()}
        assert len(seen) == 5 and not any(missing.values()), f"series missing: {missing}; answered: {sorted(seen)}"
        assert all(ready(s) for s in seen.values()), {n: role_of(s) for n, s in seen.items() if not ready(s)}
        assert {name: role_of(s) for name, s in seen.items()} == {
            "broker": "broker", "controller": "controller", "reward-0": "reward", "rollout-0": "rollout",
            "trainer": "trainer"}
        # labels stay bounded: services and reasons, never a job id
        broker = seen["broker"]
        assert {lab["service"] for lab, _ in broker["areal_mq_broker_queue_depth"]} <= {"generate", "reward"}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the launcher checkpoints and stops every child
            try:
                proc.wait(180)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    assert proc.returncode in (0, 130), log.read_text()[-3000:]
    assert all(scrape(url) is None for url in urls.values()), "an endpoint outlived its process"
