"""Engine vs trainer numerics on the real SmolLM2-135M-Instruct weights: mismatch_kl per precision pair.

What it measures, in one run: for each (rollout engine dtype, trainer precision) pair, the embedded torch engine
samples G answers (temperature 1) to chat-templated arithmetic prompts at version 0, and a fresh trainer at the
same weights runs one step on them; the step's own metrics give what every user's metrics.jsonl shows:
  mismatch_kl        mean k3 estimate of KL(engine || trainer) over staleness-0 tokens,
  mismatch_abs_max   the largest |log p_trainer - log p_engine|,
  mismatch_out_frac  the fraction of tokens whose ratio lies outside IcePop's [1/2, 2] band,
  behav_weight_max   the largest behaviour weight exp(trainer - engine) the loss saw.
Pairs: fp32/fp32 (the CPU default), bf16/bf16 (`auto` under a bfloat16 engine), bf16 engine / fp32 trainer
(the mismatch `auto` avoids); with --fp16 also float16/fp16 (this CPU computes fp16 ~40x slower than fp32:
off by default). Ratios: `bf16_vs_fp32_mismatch_kl` (how much more the bf16 pair disagrees than fp32) and, with
--fp16, `bf16_vs_fp16_mismatch_kl` (what fp16 buys over bf16).

    python benchmarks/quality/mismatch.py [--quick] [--fp16] [--json PATH]
"""
from __future__ import annotations

import argparse
import sys
import json
import os
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402

PAIRS = [("float32", "fp32"), ("bfloat16", "bf16"), ("bfloat16", "fp32")]
KEYS = ("mismatch_kl", "mismatch_abs_max", "mismatch_out_frac", "behav_weight_max")
log = common.logger("mismatch")


def prompts(tokenizer, n: int) -> list[list[int]]:
    import numpy as np

    from areal_mq.engines.models import apply_chat_template

    rng = np.random.default_rng(0)
    return [apply_chat_template(tokenizer, f"What is {a} + {b}? Put the final answer in \\boxed{{}}.")
            for a, b in rng.integers(10, 100, (n, 2))]


def generate(model_dir: Path, dtype: str, prompt_ids: list[list[int]], group: int, max_new: int):
    from areal_mq.engines.base import EngineRequest
    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.torch.engine import TorchEngine
    from areal_mq.messages import Sample, SamplingSpec, SeqSample

    engine = TorchEngine(model_dir, EngineConfig(dtype=dtype), seed=0, device="cpu")
    for i, p in enumerate(prompt_ids):
        for k in range(group):
            engine.submit(EngineRequest(f"p{i}-{k}", p, SamplingSpec(temperature=1.0, max_new_tokens=max_new,
                                                                     seed=i * group + k)))
    outs = {}
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id] = o
    engine.close()
    samples = []
    for i, p in enumerate(prompt_ids):
        seqs = [SeqSample(prompt_ids=outs[f"p{i}-{k}"].prompt_ids, output_ids=outs[f"p{i}-{k}"].output_ids,
                          logprobs=outs[f"p{i}-{k}"].logprobs, versions=outs[f"p{i}-{k}"].versions,
                          reward=float(k % 2)) for k in range(group)]
        samples.append(Sample(sample_id=f"s{i}", prompt_id=f"p{i}", seqs=seqs))
    return samples


def measure(model_dir: Path, engine_dtype: str, precision: str, args) -> dict:
    import torch

    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.trainer import Trainer
    from areal_mq.engines.models import load_tokenizer

    t0 = time.perf_counter()
    samples = generate(model_dir, engine_dtype, prompts(load_tokenizer(model_dir), args.prompts), args.group,
                       args.max_new)
    gen_s = time.perf_counter() - t0
    torch.manual_seed(0)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # each pair its own mixed precision
    trainer = Trainer(TrainerConfig(precision=precision, lr=1e-9, checkpoint_every=0), model_dir, device="cpu")
    m = trainer.train_step(samples)
    row = {"engine_dtype": engine_dtype, "trainer_precision": precision, **{k: m[k] for k in KEYS},
           "tokens": int(m["n_gen_tokens"]), "generate_s": round(gen_s, 1)}
    log(f"{engine_dtype}/{precision}: mismatch_kl {row['mismatch_kl']:.3g} over {row['tokens']} tokens")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 prompts x 2 answers of 16 tokens")
    parser.add_argument("--fp16", action="store_true", help="also float16 engine / fp16 trainer (slow on CPU)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.prompts, args.group, args.max_new = (4, 2, 16) if args.quick else (8, 4, 64)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from areal_mq.engines.models import resolve_model

    torch.set_num_threads(min(2, os.cpu_count() or 1))
    model_dir = resolve_model("smollm2-135m-instruct")
    pairs = PAIRS + ([("float16", "fp16")] if args.fp16 else [])
    rows = [measure(model_dir, e, p, args) for e, p in pairs]
    by = {(r["engine_dtype"], r["trainer_precision"]): r for r in rows}
    kl = {k: r["mismatch_kl"] for k, r in by.items()}
    ratios = {"bf16_vs_fp32_mismatch_kl": kl[("bfloat16", "bf16")] / max(kl[("float32", "fp32")], 1e-30)}
    if ("float16", "fp16") in kl:  # what fp16 buys over bf16 (arXiv 2510.26788)
        ratios["bf16_vs_fp16_mismatch_kl"] = kl[("bfloat16", "bf16")] / max(kl[("float16", "fp16")], 1e-30)
    report = {"benchmark": "mismatch", "quick": args.quick, "machine": common.torch_machine(device="cpu"),
              "model": "smollm2-135m-instruct", "prompts": args.prompts, "group": args.group,
              "max_new_tokens": args.max_new, "results": rows,
              "ratios": {k: float(f"{v:.3g}") for k, v in ratios.items()}}
    table = [("engine / trainer", *KEYS, "tokens")] + [
        (f"{r['engine_dtype']} / {r['trainer_precision']}", *(f"{r[k]:.3g}" for k in KEYS), r["tokens"])
        for r in rows]
    print("\n".join(common.align(table)))
    print("\n" + "  ".join(f"{k} {v}" for k, v in report["ratios"].items()) + "\n"
          f"reproduce: python benchmarks/quality/mismatch.py{' --quick' if args.quick else ''}{' --fp16' if args.fp16 else ''}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
