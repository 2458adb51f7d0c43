"""The trainer worker as a real process between a real broker (store + bus) and this test, which plays
the controller (puts rewarded Samples into the store) and a rollout worker (watches WeightsReady).

- steps publish versions 1, 2, ... (disk), each written to metrics.jsonl; batches are acked only once a
  checkpoint holds them; SIGTERM finishes with a checkpoint; a restart resumes the version, republishes
  its weights and trains on without retraining anything; Control(shutdown) stops it cleanly;
- in zmq mode the published version is fetched from the live trainer process's weight server.
Run: pytest tests/integration/test_trainer_worker.py  (slow: about a minute per test on 2 busy cores)
"""
from __future__ import annotations

import json
import signal

import pytest

from areal_mq.client import SignalPublisher, SignalSubscriber, StoreClient
from areal_mq.config import load_config
from areal_mq.messages import Control, WeightsReady
from areal_mq.weights import load_published
from tests.unit.algorithms.batches import make_samples

from .conftest import broker_up
from .procs import keys, wait_for, write_config

pytestmark = pytest.mark.slow
START_S = 240  # a trainer process imports torch and loads the model: generous on a loaded machine


def _config(tmp_path, **trainer):
    extra = {"model": {"name": "tiny-random-llama"},
             "controller": {"batch_groups": 2, "total_steps": 50, "max_staleness": 1},
             "trainer": {"lr": 1e-3, "max_tokens_per_mb": 128, "checkpoint_every": 2, **trainer},
             "launcher": {"threads": {"trainer": 1}}}
    path = write_config(tmp_path, extra)
    return path, load_config(path)


def _put(store: StoreClient, version: int, tag: str) -> None:
    for s in make_samples(hash(tag) % 1000, n_groups=2, group_size=2, version=version, staleness=0):
        s.sample_id = f"{tag}-{s.sample_id}"
        store.put(s, timeout=30)


def _next_ready(sub: SignalSubscriber, version: int, timeout: float) -> WeightsReady:
    def got():
        msg = sub.recv(timeout=0.2)
        return msg[1].msg if msg and isinstance(msg[1].msg, WeightsReady) and msg[1].msg.version == version else None
    return wait_for(got, timeout, interval=0.0, what=f"WeightsReady v{version}")


def _acked(store: StoreClient) -> int:
    return store.stats()["counters"].get("acked", 0)


def _metrics(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_train_checkpoint_sigterm_resume_and_shutdown(tmp_path, procs):
    path, cfg = _config(tmp_path)
    run_dir = tmp_path / "run"
    procs.start(["broker", "--config", str(path)], "broker")
    broker_up(cfg)
    store = StoreClient(cfg.brokers.store_addr, keys=keys(cfg, "controller"))
    sub = SignalSubscriber(cfg.brokers.bus_out_addr, topics=("weights",), keys=keys(cfg))
    bus = SignalPublisher(cfg.brokers.bus_in_addr, keys=keys(cfg, "launcher"))
    try:
        trainer = procs.start(["worker", "trainer", "--config", str(path)], "trainer")
        for v in (1, 2, 3):
            _put(store, v - 1, f"a{v}")
            ready = _next_ready(sub, v, START_S if v == 1 else 120)
        assert ready.mode == "disk" and (run_dir / "weights" / "v3").is_dir()
        assert "model.embed_tokens.weight" in load_published(ready)
        wait_for(lambda: len(_metrics(run_dir)) >= 3, 30, what="metrics of step 3")  # written after publishing
        assert [m["version"] for m in _metrics(run_dir)] == [1, 2, 3]
        assert (run_dir / "checkpoints" / "step00000002").is_dir()
        stats = store.stats()  # the two batches inside checkpoint 2 are acked; batch 3 waits, leased
        assert stats["counters"]["acked"] == 4 and stats["leased"] == 2

        assert procs.stop(trainer, signal.SIGTERM, timeout=120) == 0, procs.log(trainer)[-3000:]
        assert (run_dir / "checkpoints" / "step00000003").is_dir()
        assert _acked(store) == 6

        restarted = procs.start(["worker", "trainer", "--config", str(path)], "trainer2")
        again = _next_ready(sub, 3, START_S)  # the resumed policy is republished for rollout workers
        assert again.version == 3
        _put(store, 3, "b4")
        _next_ready(sub, 4, 120)
        wait_for(lambda: len(_metrics(run_dir)) >= 4, 30, what="metrics of step 4")
        metrics = _metrics(run_dir)
        assert [m["version"] for m in metrics] == [1, 2, 3, 4]  # nothing trained twice
        for key in ("loss", "clip_frac", "behav_weight_mean", "grad_norm", "staleness_mean", "tokens_per_s",
                    "prox_recompute_s", "publish_s", "wait_s"):
            assert key in metrics[-1], key

        bus.publish("control", Control(action="shutdown", reason="test done"))
        wait_for(lambda: restarted.poll() is not None, 120, what="trainer exit on Control(shutdown)")
        assert restarted.returncode == 0, procs.log(restarted)[-3000:]
        assert (run_dir / "checkpoints" / "step00000004").is_dir()
        assert _acked(store) == 8
    finally:
        for sock in (store, sub, bus):
            sock.close()


def test_zmq_weights_are_fetched_from_the_live_trainer(tmp_path, procs):
    path, cfg = _config(tmp_path, publish_mode="zmq", publish_dtype="float32")
    procs.start(["broker", "--config", str(path)], "broker")
    broker_up(cfg)
    store = StoreClient(cfg.brokers.store_addr, keys=keys(cfg, "controller"))
    sub = SignalSubscriber(cfg.brokers.bus_out_addr, topics=("weights",), keys=keys(cfg))
    try:
        trainer = procs.start(["worker", "trainer", "--config", str(path)], "trainer")
        _put(store, 0, "z1")
        ready = _next_ready(sub, 1, START_S)
        assert ready.mode == "zmq" and ready.endpoint.startswith("tcp://127.0.0.1:")
        tensors = load_published(ready, timeout_s=60, keys=keys(cfg, "rollout"))
        assert tensors["model.embed_tokens.weight"].shape[0] == 49152
        assert procs.stop(trainer, signal.SIGTERM, timeout=120) == 0, procs.log(trainer)[-3000:]
    finally:
        store.close()
        sub.close()


def test_two_rank_worker_under_accelerate_launch(tmp_path, procs):
    """`accelerate launch --multi_gpu --num_processes 2 -m areal_mq.cli worker trainer` on CPU: rank 0 talks
    to the store and bus, both ranks train; SIGTERM (forwarded to both ranks) still ends in a checkpoint."""
    import os
    import subprocess
    import sys

    from .procs import free_ports

    path, cfg = _config(tmp_path)
    run_dir = tmp_path / "run"
    procs.start(["broker", "--config", str(path)], "broker")
    broker_up(cfg)
    store = StoreClient(cfg.brokers.store_addr, keys=keys(cfg, "controller"))
    sub = SignalSubscriber(cfg.brokers.bus_out_addr, topics=("weights",), keys=keys(cfg))
    log = open(tmp_path / "ddp-trainer.log", "wb")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_ports(1)[0]),
           "-m", "areal_mq.cli", "worker", "trainer", "--config", str(path)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})  # 2 CPU ranks, not 2 on one GPU
    try:
        _put(store, 0, "d1")
        _next_ready(sub, 1, START_S)
        _put(store, 1, "d2")
        _next_ready(sub, 2, 120)
        wait_for(lambda: (run_dir / "checkpoints" / "step00000002").is_dir(), 120, what="checkpoint 2")
        assert [json.loads(line)["version"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()][:1] == [1]
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        rng_files = sorted(p.name for p in (run_dir / "checkpoints" / "step00000002").glob("rng_rank*.pt"))
        assert rng_files == ["rng_rank0.pt", "rng_rank1.pt"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
        store.close()
        sub.close()
    text = (tmp_path / "ddp-trainer.log").read_text(errors="replace")
    assert '"world_size":2' in text.replace(" ", ""), text[-3000:]
    assert "trainer.finished" in text  # rank 0 ended cleanly after the forwarded SIGTERM
