"""Measure a model's greedy accuracy (strict and lenient) per level on held-out problems.

What: batched greedy HF `generate` over the first N held-out problems, graded by areal_mq.grading (the rule
the rewards use): strict = exactly one \\boxed{N} and it is right, lenient = the last boxed number, else the
last number in the text, is right. Prints a per-level table.

Why: the default arith mix was chosen from these numbers (the base model must be right sometimes, not always),
and it is the "before" row the RL run is compared against.

Run (about 9 minutes of CPU for 200 problems; much longer in wall time on a loaded machine):
    python -m areal_mq.data.measure_base --n 200
    python -m areal_mq.data.measure_base --n 200 --eval-name data/gsm8k_test.jsonl --json /tmp/base.json

Measured (SmolLM2-135M-Instruct from the Q4_1 GGUF, float32, greedy, batch 16, max_new_tokens 96, default
prompt "{question}\\nEnd your answer with \\boxed{N}, where N is the number.", first 200 of arith:test):

    level     n   strict  lenient   boxed  tokens truncated
    L1       39     2.6%    48.7%    5.1%    41.1     20.5%
    L2       79     0.0%    16.5%    2.5%    47.1     24.1%
    L3       82     0.0%    19.5%    0.0%    38.1      9.8%
    all     200     0.5%    24.0%    2.0%    42.3     17.5%

"boxed" counts a numeric \\boxed{...}; another 4.5% of completions end "The answer is \\boxed{N}" with a literal N.
(Measured when strict took the last box and lenient the last number; "boxed" now counts completions whose one
box holds a number.)
Bare sums/products ("What is 3 + 4?") are mostly right; the same arithmetic in words much less often.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from areal_mq.data.config import DataConfig
from areal_mq.data.dataset import load_eval_problems
from areal_mq.data.loaders import Problem
from areal_mq.data.prompts import ChatFormatter
from areal_mq.grading import grade


def generate_greedy(
    model: Any, tokenizer: Any, texts: Sequence[str], max_new_tokens: int
) -> list[tuple[str, int, bool]]:
    """(completion text, generated tokens, truncated) per chat-formatted prompt; greedy, one left-padded batch."""
    import torch

    batch = tokenizer(list(texts), return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(
            **batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
    new = out[:, batch["input_ids"].shape[1]:]
    results = []
    for row in new.tolist():
        n = next((i + 1 for i, t in enumerate(row) if t == tokenizer.eos_token_id), None)
        truncated = n is None
        n = len(row) if n is None else n
        results.append((tokenizer.decode(row[:n], skip_special_tokens=True), n, truncated))
    return results


def measure(
    model: Any,
    tokenizer: Any,
    problems: Sequence[Problem],
    *,
    batch_size: int = 16,
    max_new_tokens: int = 96,
    system_prompt: str | None = None,
    examples: Sequence[Any] = (),
    progress: bool = True,
) -> list[dict[str, Any]]:
    """One row per problem: id, level, answer, completion, tokens, truncated and the fields of grading.Grade."""
    from tqdm import tqdm

    fmt = ChatFormatter(tokenizer, system_prompt, examples)
    rows: list[dict[str, Any]] = []
    bar = tqdm(total=len(problems), desc="greedy eval", unit="problem", disable=not progress)
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        outputs = generate_greedy(model, tokenizer, [fmt.text(p) for p in chunk], max_new_tokens)
        for p, (text, n, truncated) in zip(chunk, outputs):
            rows.append({"id": p.id, "level": p.level, "answer": p.answer, "completion": text, "tokens": n,
                         "truncated": truncated, **asdict(grade(text, p.answer))})
        bar.update(len(chunk))
    bar.close()
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """{"L1": {...}, ..., "all": {"n", "strict", "lenient", "boxed_rate", "mean_tokens", "truncated"}}."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(f"L{r['level']}" if r["level"] is not None else "-", []).append(r)
    groups = dict(sorted(groups.items()))
    groups["all"] = list(rows)
    return {name: _stats(rs) for name, rs in groups.items()}


def _stats(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    n = len(rows)
    return {
        "n": n,
        "strict": sum(r["strict"] for r in rows) / n,
        "lenient": sum(r["lenient"] for r in rows) / n,
        "boxed_rate": sum(r["strict_answer"] is not None for r in rows) / n,
        "mean_tokens": sum(r["tokens"] for r in rows) / n,
        "truncated": sum(r["truncated"] for r in rows) / n,
    }


def format_table(summary: dict[str, dict[str, float]]) -> str:
    lines = [f"{'level':<6}{'n':>5}{'strict':>9}{'lenient':>9}{'boxed':>8}{'tokens':>8}{'truncated':>10}"]
    for name, s in summary.items():
        lines.append(f"{name:<6}{s['n']:>5}{s['strict']:>9.1%}{s['lenient']:>9.1%}{s['boxed_rate']:>8.1%}"
                     f"{s['mean_tokens']:>8.1f}{s['truncated']:>10.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200, help="number of held-out problems (first N in file order)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name or local directory")
    parser.add_argument("--eval-name", default="arith:test", help="'arith:test' or a JSONL path")
    parser.add_argument("--template", default=None, help="prompt template (default: the built-in math prompt)")
    parser.add_argument("--system-prompt", default=None, help="system message (default: the tokenizer's)")
    parser.add_argument("--example", nargs=2, action="append", default=[], metavar=("USER", "ASSISTANT"),
                        help="a worked example sent as earlier chat turns (repeatable)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--json", type=Path, default=None, help="write summary + per-problem rows here")
    args = parser.parse_args(argv)

    from areal_mq.engines.models import load_causal_lm, load_tokenizer, resolve_model

    cfg = DataConfig(eval_name=args.eval_name, eval_size=args.n, prompt_template=args.template,
                     system_prompt=args.system_prompt,
                     examples=[{"user": u, "assistant": a} for u, a in args.example])
    problems = load_eval_problems(cfg)
    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path)
    tokenizer.padding_side = "left"  # decoder-only batched generation needs the prompt flush right
    model = load_causal_lm(path, "float32")
    t0 = time.monotonic()
    rows = measure(model, tokenizer, problems, batch_size=args.batch, max_new_tokens=args.max_new_tokens,
                   system_prompt=args.system_prompt, examples=cfg.examples)
    summary = summarize(rows)
    elapsed = time.monotonic() - t0
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                         "seconds": elapsed, "rows": rows}, indent=1))
    print(f"model={args.model} eval={args.eval_name} n={len(problems)} greedy max_new_tokens={args.max_new_tokens} "
          f"({elapsed:.0f} s)")
    print(format_table(summary))


if __name__ == "__main__":
    main()
