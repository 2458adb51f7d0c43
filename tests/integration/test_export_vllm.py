"""vLLM loads what `areal-mq checkpoint export` writes: a tiny Qwen2 trained one step by the real trainer, exported as
bf16 shards with an index, served by vLLM (CPU), gives the greedy tokens of the trainer's weights cast to bf16 (both
computed in float32 from those bf16 weights: vLLM's CPU bf16 kernels and HF's round differently, and a greedy token
of a random model can lose a near-tie to either rounding).
Run: pytest -m vllm tests/integration/test_export_vllm.py   (needs vLLM: bash docker/install-vllm.sh)
"""
from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm", reason="vLLM not installed: bash docker/install-vllm.sh")

import torch  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]
PROMPT = [1, 306, 4658, 278, 6593, 310, 2834, 338]
# head_dim 64 (the tiny shapes' 16 is below what vLLM's CPU attention takes)
SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)


def test_vllm_serves_the_bf16_export_with_the_trainers_greedy_tokens(tmp_path):
    from transformers import AutoModelForCausalLM

    from areal_mq.algorithms.checkpoint import save_checkpoint
    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.export import export_model
    from areal_mq.algorithms.trainer import Trainer
    from areal_mq.engines.base import EngineRequest
    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.shapes import build_random_model
    from areal_mq.engines.vllm.engine import VllmEngine
    from areal_mq.messages import SamplingSpec
    from tests.unit.algorithms.batches import make_samples

    model_dir = build_random_model(tmp_path / "model", "tiny-qwen2", seed=5, **SHAPE)
    trainer = Trainer(TrainerConfig(lr=1e-2, max_tokens_per_mb=64, seed=3), model_dir, device="cpu")
    trainer.train_step(make_samples(4, version=0, staleness=0))
    ckpt = save_checkpoint(trainer, tmp_path / "ckpt")
    state = {k: v.detach().to(torch.bfloat16).float() for k, v in trainer.unwrapped.state_dict().items()}
    done = export_model(ckpt, tmp_path / "export", dtype="bfloat16", max_shard_size="1MB")
    assert len(done.files) >= 2

    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    reference.load_state_dict(state)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                                  do_sample=False)[0, len(PROMPT):].tolist()

    # vLLM's compiled default (no enforce_eager), as a user's run starts it; the other vLLM tests run eager
    cfg = EngineConfig(kind="vllm", max_concurrent=2, seed=0, vllm={"kv_cache_space_gib": 1, "start_timeout_s": 1200})
    engine = VllmEngine(cfg, done.out, dtype="float32")
    try:
        engine.submit(EngineRequest("g", list(PROMPT), SamplingSpec(temperature=0.0, max_new_tokens=16,
                                                                    ignore_eos=True)))
        outs, deadline = [], time.monotonic() + 600
        while engine.has_work():
            assert time.monotonic() < deadline, "generation did not finish in time"
            outs += engine.step()
    finally:
        engine.close()
    assert outs[-1].output_ids.tolist() == want
