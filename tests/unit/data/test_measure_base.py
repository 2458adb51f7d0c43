"""The measurement module: grading/summary logic, and one real greedy pass with the tiny random Llama."""
from __future__ import annotations

import pytest

from areal_mq.data import DataConfig, load_eval_problems
from areal_mq.data.measure_base import format_table, measure, summarize


def _row(level, strict, lenient, boxed, tokens=10, truncated=False):
    return {"level": level, "strict": strict, "lenient": lenient, "strict_answer": boxed, "tokens": tokens,
            "truncated": truncated, "completion": "", "answer": "1", "id": "x"}


def test_summarize_per_level_and_all():
    rows = [_row(1, True, True, "3"), _row(1, False, True, None, 20, True), _row(2, False, False, None)]
    s = summarize(rows)
    assert list(s) == ["L1", "L2", "all"]
    assert s["L1"] == {"n": 2, "strict": 0.5, "lenient": 1.0, "boxed_rate": 0.5, "mean_tokens": 15.0, "truncated": 0.5}
    assert s["all"]["n"] == 3 and s["all"]["lenient"] == pytest.approx(2 / 3)
    table = format_table(s)
    assert table.splitlines()[0].split() == ["level", "n", "strict", "lenient", "boxed", "tokens", "truncated"]
    assert "50.0%" in table


def test_measure_runs_real_greedy_generation():
    from areal_mq.engines.models import load_causal_lm, load_tokenizer, resolve_model

    path = resolve_model("tiny-random-llama")
    tokenizer = load_tokenizer(path)
    tokenizer.padding_side = "left"
    problems = load_eval_problems(DataConfig(eval_size=3))
    rows = measure(load_causal_lm(path), tokenizer, problems, batch_size=2, max_new_tokens=4, progress=False)
    assert [r["id"] for r in rows] == [p.id for p in problems]
    for r in rows:
        assert 1 <= r["tokens"] <= 4 and isinstance(r["completion"], str)
        assert r["strict"] in (True, False) and r["lenient"] in (True, False)
