"""A LoRA policy through `areal-mq run` with the tiny random Llama (slow: run in CI): the trainer publishes adapter
versions over zmq (deltas between adapter versions), the rollout worker merges them mid-generation into its engine
with every token's version exact, checkpoints hold the adapter only, and the final held-out evaluation loads the
last adapter version from disk. Run: pytest tests/integration/test_lora_run.py -m slow
"""
from __future__ import annotations

import json

import pytest

from .test_e2e import _events, _run

pytestmark = pytest.mark.slow
pytest.importorskip("peft")


def test_a_lora_run_publishes_adapters_that_the_engine_merges_mid_generation(tmp_path):
    run_dir = tmp_path / "lora"
    done = _run(run_dir, "trainer.lora.rank=4", "trainer.publish_mode=zmq", "trainer.kl_coef=0.05",
                "controller.total_steps=4", "controller.max_new_tokens=96", "controller.max_staleness=2",
                "rollout.engine.max_concurrent=2", "rollout.engine.step_delay_s=0.02", evaluate=True)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == [1, 2, 3, 4] and any(m["grad_norm"] > 0 for m in metrics)
    updates = _events(run_dir, "rollout.weights_updated")
    assert {u["version"] for u in updates} >= {1, 2, 3} and all(u["applied"] == "adapter" for u in updates)
    assert all(u["tensors"] == 14.0 for u in updates)  # 2 layers x 7 linears merged, nothing else touched
    assert any(u["route"] == "delta" for u in updates), "adapter versions travel as deltas like any version"
    stored = _events(run_dir, "controller.group_stored")
    assert any(max(g["versions"]) > 0 for g in stored)
    for ckpt in (run_dir / "checkpoints").glob("step*"):
        names = {p.name for p in ckpt.iterdir()}
        assert "adapter_model.safetensors" in names and "model.safetensors" not in names
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert evals[-1]["version"] == 4
    assert (run_dir / "weights" / "v4" / "adapter.json").is_file()
