"""Golden outputs of the torch engine: tokens, logprobs and versions of fixed-seed scenarios, recorded once.

What: `run_scenarios(make_engine, prompts, new_state)` runs a few fixed scenarios (greedy and sampled, a crowded
batch with slot compaction, chunked and shared prefill, a weight update mid-generation with recompute and keep)
and returns {scenario: {request_id: {"tokens", "logprobs", "versions", "finish"}}}. `golden_engine.json` beside
this file holds what the engine before issue 25 (dynamic KV cache, CPU-only, a host sync per decode step)
produced; test_torch_golden.py checks the current engine gives the same tokens and versions, and logprobs
within 1e-5 (the static cache attends over a longer, masked key axis: float summation order may differ).
Why: the graph-ready decode step rewrote the engine's hot path; this pins that it still computes the same thing.
How to re-record (only when a change is MEANT to alter outputs; say so in the commit):
    python -m tests.unit.engines.golden
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

GOLDEN = Path(__file__).with_name("golden_engine.json")


def _run(engine: Any, max_steps: int = 10_000, update: Callable[[int], None] | None = None) -> dict:
    outs, step = {}, 0
    while engine.has_work() and step < max_steps:
        step += 1
        if update is not None:
            update(step)
        for out in engine.step():
            outs[out.request_id] = {"tokens": out.output_ids.tolist(), "logprobs": out.logprobs.tolist(),
                                    "versions": out.versions.tolist(), "finish": out.finish_reason}
    assert not engine.has_work(), "engine did not finish"
    return outs


def run_scenarios(make_engine: Callable[..., Any], prompts: list[list[int]], new_state: dict) -> dict:
    from areal_mq.engines.base import EngineRequest
    from areal_mq.messages import SamplingSpec

    def submit_all(engine, spec_for, n=1):
        for i, p in enumerate(prompts):
            for k in range(n):
                engine.submit(EngineRequest(f"r{i}s{k}", p, spec_for(i, k)))

    result = {}
    # greedy, 3 slots for 4 prompts: slot refill and compaction; lengths differ so rows finish apart
    engine = make_engine(max_concurrent=3)
    submit_all(engine, lambda i, k: SamplingSpec(temperature=0, max_new_tokens=10 + 7 * i, ignore_eos=True))
    result["greedy_crowded"] = _run(engine)
    # sampled with top-p / top-k, engine seed (per-request streams), GRPO groups sharing prefill, small chunks
    engine = make_engine(max_concurrent=8, prefill_chunk_tokens=24)
    submit_all(engine, lambda i, k: SamplingSpec(temperature=[1.0, 0.7, 1.3, 0.9][i], top_p=[1.0, 0.9, 1.0, 0.95][i],
                                                 top_k=[0, 0, 50, 20][i], max_new_tokens=14, ignore_eos=True), n=2)
    result["sampled_groups"] = _run(engine)
    # explicit request seeds, natural EOS allowed
    engine = make_engine(max_concurrent=4)
    submit_all(engine, lambda i, k: SamplingSpec(temperature=1.0, max_new_tokens=24, seed=31 + i))
    result["seeded"] = _run(engine)
    # a weight update after step 5, recompute (chunked) and keep: versions per token, and the new weights used
    for mode in ("recompute", "keep"):
        engine = make_engine(max_concurrent=4, prefill_chunk_tokens=512, kv_on_update=mode)
        submit_all(engine, lambda i, k: SamplingSpec(temperature=0.8, max_new_tokens=16, ignore_eos=True, seed=i))

        def update(step, engine=engine):
            if step == 6:
                engine.cfg = engine.cfg.model_copy(update={"prefill_chunk_tokens": 20})
                engine.update_weights(1, tensors=new_state)
        result[f"update_{mode}"] = _run(engine, update=update)
    return result


def _record() -> None:
    import torch

    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.models import apply_chat_template, load_causal_lm, load_tokenizer, resolve_model
    from areal_mq.engines.torch.engine import TorchEngine
    from tests.unit.engines.engine_refs import perturbed_state

    torch.set_num_threads(1)
    model_dir = resolve_model("tiny-random-llama")
    tok = load_tokenizer(model_dir)
    prompts = [apply_chat_template(tok, t) for t in PROMPTS]
    new_state = perturbed_state(load_causal_lm(model_dir), seed=99)

    def make(**kw):
        return TorchEngine(model_dir, EngineConfig(**{"seed": 0, "threads": 1, **kw}), dtype="float32", tokenizer=tok)

    GOLDEN.write_text(json.dumps(run_scenarios(make, prompts, new_state)))
    print(f"wrote {GOLDEN}")


PROMPTS = ["Hi", "What is 17 * 3? Think step by step.", "Name three rivers in Europe, please.",
           "Write one sentence about a cat who learns to fly a small plane."]

if __name__ == "__main__":
    _record()
