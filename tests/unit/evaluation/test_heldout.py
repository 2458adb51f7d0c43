"""Held-out evaluation runs through the engine with more problems than slots (queueing, KV growth and
slot compaction) and grades every problem, strict and lenient."""
from areal_mq.config import load_config
from areal_mq.evaluation.heldout import evaluate


def test_evaluate_more_problems_than_slots():
    cfg = load_config(None, ["model.name=tiny-random-llama", "rollout.engine.max_concurrent=3",
                             "controller.max_new_tokens=40"])
    result = evaluate(cfg, n=10, progress=False)
    assert result["n"] == 10 and sum(v["n"] for v in result["by_level"].values()) == 10
    assert result["truncated"] == 1.0  # a random model never stops by itself within 40 tokens
