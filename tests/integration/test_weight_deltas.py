"""Weight deltas end to end: a trainer-like process publishes 50 real updates of the tiny random Llama (AdamW
steps on fp32 master weights, published as bf16 through the zmq WeightPublisher, deltas on by default) and a
RolloutWorker with the real torch engine follows them, each version fetched as its delta while the engine has
sequences to decode, and applied through Engine.update_weights:
- after every version the worker's held weights have the trainer's checksums and the engine's parameters equal
  them (bf16 upcast to fp32, bit for bit); the update event reports engine_pause_s and transfer_s apart;
- a second worker that skips three versions catches up through the chain of deltas or the full version,
  whichever is fewer bytes, logged with the reason;
- a delta corrupted on the wire makes the worker fetch the full version, logged (rollout.weights_fallback);
- the trainer process killed: the fetch fails within its deadline, the engine keeps serving the last verified
  version, and a restarted trainer's full version is loaded again bit-identically.
Run: pytest tests/integration/test_weight_deltas.py -q
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from areal_mq.config import load_config
from areal_mq.messages import GenerateRequest, SamplingSpec
from areal_mq.testing.fakes import FakeRuntime
from areal_mq.workers.rollout import RolloutWorker

from .procs import ScriptedTrainers, next_ready

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]

TRAINER = r"""
import json, sys, torch
from pathlib import Path
from safetensors.torch import load_file
from areal_mq.algorithms.config import TrainerConfig
from areal_mq.engines.models import resolve_model
from areal_mq.weights import WeightPublisher
from areal_mq.weights.delta import checksum

run_dir, first, last, corrupt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
master = {}
for f in sorted(Path(resolve_model("tiny-random-llama")).glob("*.safetensors")):
    master.update(load_file(str(f)))
g = torch.Generator().manual_seed(first)
m = {k: torch.zeros_like(v) for k, v in master.items()}
v2 = {k: torch.zeros_like(v) for k, v in master.items()}
pub = WeightPublisher(TrainerConfig(publish_mode="zmq"), run_dir)
for version in range(first, last + 1):
    for k, p in master.items():  # one AdamW step (lr 1e-4, wd 0.01) on a random gradient
        grad = torch.randn(p.shape, generator=g)
        m[k].mul_(0.9).add_(grad, alpha=0.1)
        v2[k].mul_(0.999).addcmul_(grad, grad, value=0.001)
        p.mul_(1 - 1e-4 * 0.01).addcdiv_(m[k], v2[k].sqrt().add_(1e-8), value=-1e-4)
    ready = pub.publish(version, master)
    if version == corrupt:
        with pub.server._lock:
            for frames in pub.server._delta[version][1].frames:
                frames[1] = bytes(len(frames[1].tobytes() if hasattr(frames[1], "tobytes") else frames[1]))
    sums = {k: checksum(p.to(torch.bfloat16)) for k, p in master.items()}
    print(json.dumps({"ready": ready.model_dump(mode="json"), "sums": sums}), flush=True)
    if sys.stdin.readline().strip() != "next":
        break
sys.stdin.readline()  # hold the server until the test is done
"""


@pytest.fixture
def trainers(tmp_path):
    started = ScriptedTrainers(TRAINER, tmp_path)
    yield started
    started.close()


def _worker(tmp_path):
    from areal_mq.engines import build_engine
    from areal_mq.weights.delta import checksum

    cfg = load_config(None, [f"run.run_dir={tmp_path}", "model.name=tiny-random-llama",
                             "rollout.weights_timeout_s=5"])
    engine = build_engine(cfg.rollout.engine, cfg.model, seed=1)
    worker = RolloutWorker(cfg, engine, FakeRuntime("generate", "rollout-deltas", role="rollout"))

    def verified(sums):
        held = worker.catchup.held
        assert {k: checksum(t) for k, t in held.items()} == sums  # bit-identical to what the trainer published
        params = dict(engine.model.named_parameters())
        for k, t in held.items():
            assert torch.equal(params[k].detach().cpu(), t.to(params[k].dtype)), k
    return worker, engine, verified


def _follow(worker, ready):
    """Hand `ready` to the worker as the bus would, and tick until the engine runs that version."""
    worker.on_signal(ready)
    deadline = time.monotonic() + 60
    while worker.engine.version != ready.version:
        assert time.monotonic() < deadline, f"version {ready.version} not applied"
        worker.on_tick()


def test_fifty_updates_arrive_as_deltas_bit_identical(tmp_path, trainers):
    proc = trainers(1, 50, 30)  # first, last, corrupt
    worker, engine, verified = _worker(tmp_path)
    lagging, _, lag_verified = _worker(tmp_path)
    worker.on_job(_job("long"))  # the engine decodes while deltas arrive
    for version in range(1, 51):
        ready, sums = next_ready(proc)
        assert ready.version == version and (ready.base == version - 1 if version > 1 else ready.base == -1)
        _follow(worker, ready)
        verified(sums)
        if version % 4 == 1:  # the second worker misses three versions out of four
            _follow(lagging, ready)
            lag_verified(sums)
        proc.stdin.write("next\n" if version < 50 else "stop\n")
        proc.stdin.flush()
    updates = worker.log.named("rollout.weights_updated")
    routes = [u["route"] for u in updates]
    assert routes[0] == "full" and routes[29] == "full" and routes.count("delta") == 48
    assert all(u["engine_pause_s"] <= u["transfer_s"] for u in updates)
    # the engine held each delta's base, so it wrote only the changed elements (and stayed bit-identical above)
    assert all(u["applied"] == "patches" for u in updates if u["route"] == "delta")
    assert all(u["fetched_bytes"] < u["full_bytes"] / 2 for u in updates if u["route"] == "delta")
    fallback = worker.log.named("rollout.weights_fallback")
    assert [f["version"] for f in fallback] == [30] and fallback[0]["reason"] in ("checksum", "corrupt")
    lag = lagging.log.named("rollout.weights_updated")
    # three deltas from its own version, or the full version, whichever is fewer bytes (v33's chain runs
    # through the corrupt v30); never more than the full version
    assert len(lag) == 13 and all(u["route"] in ("chain", "full") for u in lag[1:])
    assert all(u["fetched_bytes"] <= u["full_bytes"] for u in lag[1:])
    assert [f["reason"] for f in lagging.log.named("rollout.weights_fallback")] == ["base"] * (len(lag) - 1)


def _job(job_id):
    from areal_mq.actor.runtime import Job

    return Job(job_id, GenerateRequest(prompt_ids=[5, 6, 7], sampling=SamplingSpec(
        max_new_tokens=400, ignore_eos=True, seed=1)))


def test_a_killed_trainer_fails_the_fetch_then_a_restarted_one_is_loaded(tmp_path, trainers):
    proc = trainers(1, 3, -1)
    worker, engine, verified = _worker(tmp_path)
    for version in (1, 2):
        ready, sums = next_ready(proc)
        worker.load(ready)
        verified(sums)
        proc.stdin.write("next\n")
        proc.stdin.flush()
    ready, _ = next_ready(proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    t0 = time.monotonic()
    worker.load(ready)  # the server is gone: a clear failure within the deadline, a retry scheduled
    assert time.monotonic() - t0 < 15 and engine.version == 2 and worker.retry_load is not None
    assert "trainer may have died" in worker.log.named("rollout.weights_retry")[0]["error"]
    verified(sums)  # still exactly version 2
    restarted = trainers(4, 4, -1)  # a new server: its first version has no delta, the worker takes it in full
    ready, sums = next_ready(restarted)
    worker.load(ready)
    verified(sums)
    assert worker.log.named("rollout.weights_updated")[-1]["route"] == "full"


# ---------------------------------------------------------------- elastic catch-up (issue 26 item 5)
def _run_config(tmp_path, steps: int):
    """configs/tiny.yaml on loopback with CURVE keys: disk publishing with deltas on and a single full snapshot
    (full_every past the run), bf16 at lr 1e-6, so that a worker starting at version N needs v1 + N-1 deltas."""
    import yaml

    from tests.integration.procs import write_config

    base = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    run_dir = tmp_path / "run"
    extra = {**base,
             "run": {"seed": 0, "mode": "async"},
             "security": {"keys_dir": str(run_dir / "keys")},
             "rollout": {"engine": {"max_concurrent": 4, "step_delay_s": 0.05}, "weights_timeout_s": 30.0},
             "controller": {**base["controller"], "total_steps": steps},
             "trainer": {**base["trainer"], "publish_mode": "disk", "weight_deltas": "on", "full_every": 1000,
                         "publish_dtype": "bfloat16", "lr": 1e-6, "keep_weight_versions": 2,
                         "checkpoint_every": 1000},
             "launcher": {"threads": {"rollout": 1, "trainer": 1, "reward": 1, "controller": 1}}}
    return write_config(tmp_path, extra)


def _events(run_dir, name, **match):
    from tests.integration.test_chaos import _events as read

    return [e for e in read(run_dir, name) if all(e.get(k) == v for k, v in match.items())]


@pytest.mark.timeout(600)
def test_a_worker_started_mid_run_catches_up_from_the_last_full_version(tmp_path):
    """A rollout worker started mid-run, with a key made for it then, loads the current version as v1 (the only
    full snapshot) plus the chain of deltas since, verified, before its first job; its tokens carry that version."""
    from areal_mq.config import load_config
    from tests.integration.procs import Procs, wait_for

    cfg_path = _run_config(tmp_path, steps=60)
    cfg = load_config(cfg_path)
    run_dir = Path(cfg.run.run_dir)
    procs = Procs(tmp_path)
    one = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

    def worker(role, wid, *sets):
        args = ["worker", role, "--config", str(cfg_path), "--worker-id", wid]
        for s in sets:
            args += ["--set", s]
        return procs.start(args, wid, env=one)

    try:
        procs.start(["broker", "--config", str(cfg_path)], "broker", env=one)
        worker("reward", "reward-0")
        worker("trainer", "trainer")
        worker("controller", "controller")
        worker("rollout", "rollout-1")
        wait_for(lambda: any(e["version"] >= 4 for e in _events(run_dir, "trainer.step")), 300, interval=0.5,
                 what="version 4 on disk")
        subprocess.run([sys.executable, "-m", "areal_mq.cli", "keys", "generate", cfg.security.keys_dir,
                        "--name", "rollout-late"], check=True, capture_output=True, timeout=60)
        at_start = max(e["version"] for e in _events(run_dir, "trainer.step"))
        worker("rollout", "rollout-late", "security.key_name=rollout-late", "events.level=debug")
        first = wait_for(lambda: (_events(run_dir, "rollout.request_finished", worker_id="rollout-late") or [None])[0],
                         240, interval=0.5, what="the late worker's first finished sequence")
    finally:
        procs.stop_all()
    loaded = _events(run_dir, "rollout.weights_updated", worker_id="rollout-late")[0]
    started = _events(run_dir, "rollout.request_started", worker_id="rollout-late")[0]
    assert loaded["version"] >= at_start >= 4 and loaded["ts"] <= started["ts"]
    assert loaded["route"] == "full+chain", loaded  # v1 in full, then the deltas 2..N: no other full exists
    assert 0 < loaded["fetched_bytes"] and loaded["full_bytes"] > 0
    fallback = _events(run_dir, "rollout.weights_fallback", worker_id="rollout-late")
    assert fallback and fallback[0]["reason"] == "base" and fallback[0]["version"] == loaded["version"]
    assert not _events(run_dir, "rollout.weights_retry", worker_id="rollout-late")
    # its first tokens carry the version it caught up to (or a newer one loaded since: never an older one)
    assert started["version"] >= loaded["version"]
    assert min(first["versions"]) >= loaded["version"], (first, loaded)
    assert (run_dir / "weights" / "v1" / "model.safetensors").is_file()
    assert not (run_dir / "weights" / f"v{loaded['version']}" / "model.safetensors").exists()
