"""`areal-mq top`'s pure parts: events folded into a state, worker rows, summary lines, one rendered frame."""
import io
import json
from pathlib import Path

import pytest

from areal_mq.errors import ConfigError
from areal_mq.telemetry.top import EventFiles, TopState, render, slowest_request, summary_lines, top_config, worker_rows

JOB = {"workers": {"rollout-0": {"service": "generate", "capacity": 8, "in_flight": 3, "tasks": []}},
       "queued": {"generate": 5, "reward": 0}, "in_flight": 3, "sessions": 0, "counters": {}}
STORE = {"pending": 2, "leased": 4, "done": 10, "counters": {"put": 16, "served": 14, "acked": 10}}


def ev(ts, event, role, worker, level="info", **kw):
    return {"ts": ts, "event": event, "role": role, "worker_id": worker, "level": level, **kw}


def state():
    st = TopState()
    for rec in [
        ev(100.0, "controller.stats", "controller", "controller", version=4, in_flight=2, stored=9, failed=0,
           dropped=1, gen_tokens_per_s=120.5),
        ev(101.0, "rollout.request_started", "rollout", "rollout-0", "debug", job="jA", version=4),
        ev(102.0, "rollout.request_started", "rollout", "rollout-0", "debug", job="jB", version=4),
        ev(103.0, "rollout.request_finished", "rollout", "rollout-0", "debug", job="jA"),
        ev(104.0, "trainer.step", "trainer", "trainer", version=5, staleness_mean=0.75, staleness_max=1,
           tokens_per_s=900.0, step_s=0.4),
        ev(105.0, "controller.retry", "controller", "controller", "warning", reason="[queue_full] busy"),
        ev(105.0, "controller.retry", "controller", "controller", "warning", reason="[queue_full] busy"),  # again
        ev(10.0, "reward.closed", "reward", "reward-old"),
    ]:
        st.feed(rec)
    return st


def test_events_fold_into_versions_requests_and_deduplicated_warnings():
    st = state()
    assert st.procs["controller/controller"].version == 4
    assert st.procs["trainer/trainer"].version == 5
    assert st.procs["trainer/trainer"].numbers["tokens_per_s"] == 900.0
    assert list(st.running) == ["jB"]
    assert len(st.warnings) == 1
    assert slowest_request(st, 110.0) == "job jB on rollout-0, running 8.0s (1 in flight)"


def test_worker_rows_join_the_broker_and_the_events():
    rows = {r["worker"]: r for r in worker_rows(state(), JOB, now=110.0)}
    assert rows["rollout-0"]["alive"] == "yes (broker)" and rows["rollout-0"]["busy"] == "3/8"
    assert rows["rollout-0"]["version"] == 4
    assert rows["trainer"]["alive"] == "yes" and rows["trainer"]["busy"] == "-"
    assert rows["reward-old"]["alive"] == "stopped"
    rows = {r["worker"]: r for r in worker_rows(state(), None, now=200.0)}
    assert rows["trainer"]["alive"] == "silent 96s" and "rollout-0" in rows


def test_summary_lines_show_queues_store_throughput_staleness():
    lines = dict(summary_lines(state(), JOB, STORE, bound=2))
    assert lines["queues"].startswith("generate 5, reward 0 · in flight 3")
    assert "pending 2 · leased 4 · put 16" in lines["sample store"]
    assert "generated 120 tok/s" in lines["throughput"] and "trained 900 tok/s" in lines["throughput"]
    assert lines["staleness"].startswith("mean 0.75 max 1 (bound η = 2) · trainer v5")
    down = dict(summary_lines(TopState(), None, None, bound=1))
    assert down["job broker"] == "unreachable" and down["sample store"] == "unreachable"
    assert down["staleness"].startswith("no trainer step yet")


def test_one_frame_renders_everything():
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=160).print(render(state(), JOB, STORE, 2, "tiny", now=110.0))
    text = buf.getvalue()
    for part in ("areal-mq top", "queues", "rollout-0", "3/8", "trainer", "recent warnings", "[queue_full] busy"):
        assert part in text


def test_event_files_start_at_the_tail_then_follow(tmp_path):
    folder = tmp_path / "events"
    folder.mkdir()
    path = folder / "rollout-r0.jsonl"
    path.write_text("".join(json.dumps(ev(i, "x", "rollout", "r0", n="y" * 50)) + "\n" for i in range(100)))
    files = EventFiles(tmp_path, tail_bytes=400)
    first = files.poll()
    assert 0 < len(first) < 10 and first[-1]["ts"] == 99  # the tail only, the partial first line skipped
    with open(path, "a") as f:
        f.write(json.dumps(ev(100, "x", "rollout", "r0")) + "\n")
    assert [r["ts"] for r in files.poll()] == [100]


def test_top_config_needs_a_run_dir_with_its_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.yaml"):
        top_config(str(tmp_path), [])
    with pytest.raises(ConfigError, match="not found"):
        top_config(str(tmp_path / "missing.yaml"), [])
    tiny = Path(__file__).resolve().parents[3] / "configs" / "tiny.yaml"
    cfg = top_config(str(tiny), ["run.run_dir=/tmp/x"])
    assert cfg.run.run_dir == "/tmp/x"


def test_precision_line_shows_the_engine_trainer_mismatch_once_a_step_reports_it():
    assert "precision" not in dict(summary_lines(state(), JOB, STORE, bound=2))  # no staleness-0 tokens measured
    st = state()
    st.feed(ev(106.0, "trainer.step", "trainer", "trainer", version=6, staleness_mean=0.5, staleness_max=1,
               mismatch_kl=0.0123, mismatch_abs_max=0.9, mismatch_out_frac=0.25))
    line = dict(summary_lines(st, JOB, STORE, bound=2))["precision"]
    assert line == "mismatch_kl 0.0123 · max |Δlogp| 0.9 · outside [½, 2] 0.25"
