"""Colocated weight updates end to end (trainer.publish_mode: cuda_ipc, areal_mq/weights/ipc.py): a trainer-side
process publishes real updates of the tiny random Llama (fp32 master weights on its device, shared as bf16 through
the WeightPublisher) and a RolloutWorker with the real torch engine on the same device follows them while it decodes:
- after every version the engine's parameters are the published bf16 values bit for bit (checked by the trainer's
  blake2b checksums), copied in place (the parameters' storages never move), and the tokens after an update carry
  the new version (a long request spans every update; a request started after the last one is all of it);
- a worker of another run is refused (unknown handle set) and keeps its weights;
- the same on CUDA (`gpu` marker: skipped without one): the handle set then carries CUDA IPC handles.
Run: pytest tests/integration/test_weights_ipc.py -q
"""
from __future__ import annotations

import time

import pytest
import torch

from areal_mq.config import load_config
from areal_mq.messages import GenerateRequest, SamplingSpec
from areal_mq.testing.fakes import FakeRuntime
from areal_mq.workers.rollout import RolloutWorker

from .procs import ScriptedTrainers, next_ready

pytestmark = pytest.mark.slow

TRAINER = r"""
import json, sys, torch
from pathlib import Path
from safetensors.torch import load_file
from areal_mq.algorithms.config import TrainerConfig
from areal_mq.engines.models import resolve_model
from areal_mq.weights import WeightPublisher
from areal_mq.weights.delta import checksum

run_dir, device, last = sys.argv[1], sys.argv[2], int(sys.argv[3])
master = {}
for f in sorted(Path(resolve_model("tiny-random-llama")).glob("*.safetensors")):
    master.update({k: v.float().to(device) for k, v in load_file(str(f)).items()})
g = torch.Generator(device=device).manual_seed(0)
pub = WeightPublisher(TrainerConfig(publish_mode="cuda_ipc"), run_dir)
for version in range(1, last + 1):
    for p in master.values():  # a step of "training": every parameter changes
        p.add_(torch.randn(p.shape, generator=g, device=device), alpha=1e-2)
    ready = pub.publish(version, master)
    sums = {k: checksum(p.to(torch.bfloat16)) for k, p in master.items()}
    print(json.dumps({"ready": ready.model_dump(mode="json"), "sums": sums}), flush=True)
    if sys.stdin.readline().strip() != "next":
        break
sys.stdin.readline()  # hold the buffers until the test is done
pub.close()
"""


@pytest.fixture
def trainer(tmp_path):
    started = ScriptedTrainers(TRAINER, tmp_path)
    yield started
    started.close()


def _worker(run_dir, device):
    from areal_mq.engines import build_engine
    from areal_mq.weights.delta import checksum

    cfg = load_config(None, [f"run.run_dir={run_dir}", "model.name=tiny-random-llama", f"model.device={device}",
                             "trainer.publish_mode=cuda_ipc", "rollout.weights_timeout_s=5"])
    engine = build_engine(cfg.rollout.engine, cfg.model, seed=1, device=device)
    worker = RolloutWorker(cfg, engine, FakeRuntime("generate", "rollout-ipc", role="rollout"))

    def verified(sums):
        params = dict(engine.model.named_parameters(remove_duplicate=False))
        for k, s in sums.items():  # fp32 engine parameters holding bf16 values: back to bf16 is exact
            assert checksum(params[k].detach().to(torch.bfloat16)) == s, k
    return worker, engine, verified


def _job(job_id, tokens):
    from areal_mq.actor.runtime import Job

    return Job(job_id, GenerateRequest(prompt_ids=[5, 6, 7], sampling=SamplingSpec(
        max_new_tokens=tokens, ignore_eos=True, seed=1)))


def _tick_until(worker, done, what):
    deadline = time.monotonic() + 120
    while not done():
        assert time.monotonic() < deadline, what
        worker.on_tick()


def follow_updates(tmp_path, trainer, device):
    proc = trainer(device, 3)
    worker, engine, verified = _worker(tmp_path, device)
    ptrs = {k: p.data_ptr() for k, p in engine.model.named_parameters()}
    worker.on_job(_job("long", 200))  # decodes across every update
    for version in (1, 2, 3):
        ready, sums = next_ready(proc)
        assert ready.mode == "cuda_ipc" and ready.ipc_set and ready.version == version
        for _ in range(5):
            worker.on_tick()  # a few tokens under the previous version
        worker.on_signal(ready)
        _tick_until(worker, lambda: engine.version == version, f"version {version} not applied")
        verified(sums)
        proc.stdin.write("next\n" if version < 3 else "stop\n")
        proc.stdin.flush()
    assert {k: p.data_ptr() for k, p in engine.model.named_parameters()} == ptrs  # in place
    worker.on_job(_job("after", 8))
    _tick_until(worker, lambda: {"long", "after"} <= set(worker.rt.replies), "the requests did not finish")
    long, after = worker.rt.replies["long"], worker.rt.replies["after"]
    assert list(long.versions) == sorted(long.versions) and sorted(set(long.versions)) == [0, 1, 2, 3]
    assert set(after.versions) == {3}
    updates = worker.log.named("rollout.weights_updated")
    assert [u["version"] for u in updates] == [1, 2, 3] and all(u["mode"] == "cuda_ipc" for u in updates)
    assert all(u["torn_retries"] == 0 and u["loaded_version"] == u["version"] for u in updates)
    return ready


def test_a_trainer_process_publishes_and_the_worker_copies_in_place(tmp_path, trainer):
    ready = follow_updates(tmp_path, trainer, "cpu")
    stranger, engine, _ = _worker(tmp_path / "another-run", "cpu")
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    stranger.load(ready)
    assert engine.version == 0 and all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
    assert "unknown handle set" in stranger.log.named("rollout.weights_retry")[0]["error"]


@pytest.mark.gpu
def test_the_same_on_cuda(tmp_path, trainer):
    follow_updates(tmp_path, trainer, "cuda")
