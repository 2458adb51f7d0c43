"""Data-parallel training under `accelerate launch` (2 CPU processes, gloo) matches one process.

The test launches THIS file as the training script on 2 ranks; each rank gets the same batch, trains
only its share (balanced packed micro-batches) and rank 0 writes the all-reduced gradient of the step,
then both ranks run full train_steps and write their parameters and metrics. The test compares the
gradient with the single-process one on the same batch, and the ranks' parameters with each other.

The ranks run with CUDA_VISIBLE_DEVICES="" (gloo on the CPU wherever the test runs) and the in-test single
process is pinned to the CPU too, so the comparison is fp32 against fp32 (rtol 1e-4).
Run: pytest tests/integration/test_trainer_ddp.py   (about 40 s on 2 cores, marked slow)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CFG = dict(lr=1e-3, max_tokens_per_mb=64, seed=3, grad_clip=None, ppo_n_minibatches=2)


def _batch(i: int):
    from tests.unit.algorithms.batches import make_samples

    return make_samples(20 + i, n_groups=3, group_size=3, version=i, staleness=1)


def _first_gradient(trainer) -> dict:
    """Gradient of the first mini-batch of batch 0 (after DDP's all-reduce)."""
    _, minis, gen_tokens, _ = trainer.prepare(_batch(0))
    trainer.recompute(minis)
    trainer.backward_minibatch(minis[0], gen_tokens[0])
    grads = {n: p.grad.detach().clone() for n, p in trainer.unwrapped.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    return grads


def run_rank(out: Path) -> None:
    """Body of each launched rank."""
    import torch

    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.trainer import Trainer
    from areal_mq.engines.models import resolve_model

    torch.set_num_threads(1)
    trainer = Trainer(TrainerConfig(**CFG), resolve_model("tiny-random-llama"))
    rank = trainer.rank
    grads = _first_gradient(trainer)
    metrics = [trainer.train_step(_batch(i)) for i in range(2)]
    params = {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters()}
    torch.save({"grads": grads, "params": params, "world": trainer.world_size}, out / f"rank{rank}.pt")
    (out / f"metrics{rank}.json").write_text(json.dumps(metrics))


def _free_port() -> int:
    from tests.integration.procs import free_ports  # below the ephemeral range, this xdist worker's slice

    return free_ports(1)[0]


@pytest.mark.slow
def test_two_rank_step_equals_single_process(tmp_path):
    import torch

    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.trainer import Trainer
    from areal_mq.engines.models import resolve_model

    resolve_model("tiny-random-llama")  # build the cache once, outside the ranks
    # CUDA hidden: on a GPU machine both ranks would otherwise take the one GPU (this test is about gloo on CPU)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_ip", "127.0.0.1", "--main_process_port", str(_free_port()),
           __file__, str(tmp_path)]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, output[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", map_location="cpu") for r in range(2)]
    assert ranks[0]["world"] == 2 == ranks[1]["world"]

    torch.set_num_threads(1)
    single = Trainer(TrainerConfig(**CFG), resolve_model("tiny-random-llama"), device="cpu")
    assert single.world_size == 1
    expected = _first_gradient(single)
    for name, grad in expected.items():
        torch.testing.assert_close(ranks[0]["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=name)
        assert torch.equal(ranks[0]["grads"][name], ranks[1]["grads"][name]), name
    for name, p in ranks[0]["params"].items():  # DDP keeps the replicas identical
        assert torch.equal(p, ranks[1]["params"][name]), name
    m0 = json.loads((tmp_path / "metrics0.json").read_text())
    m1 = json.loads((tmp_path / "metrics1.json").read_text())
    assert [m["loss"] for m in m0] == [m["loss"] for m in m1]  # metrics are reduced over ranks
    single_metrics = single.train_step(_batch(0))
    assert m0[0]["loss"] == pytest.approx(single_metrics["loss"], rel=1e-4, abs=1e-6)
    assert m0[0]["n_gen_tokens"] == single_metrics["n_gen_tokens"]


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    try:
        run_rank(Path(sys.argv[1]))
    finally:
        from tests.integration.procs import end_process_group

        end_process_group()
