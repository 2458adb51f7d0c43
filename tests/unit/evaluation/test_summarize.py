"""Held-out results per level, per subject and per source (heldout.summarize, a pure function of outputs)."""
from __future__ import annotations

from types import SimpleNamespace

from areal_mq.data import Problem
from areal_mq.evaluation.heldout import summarize


def _out(pid: str, text: str, finish: str = "stop"):
    return SimpleNamespace(request_id=pid, text=text, finish_reason=finish)


def test_levels_subjects_and_sources():
    problems = [
        Problem("a", "q", "\\frac{1}{2}", 5, {"subject": "Algebra", "source": "math"}),
        Problem("b", "q", "3", 5, {"subject": "Geometry", "source": "math"}),
        Problem("c", "q", "7", None, {"subject": "Algebra", "source": "math"}),  # MATH's "Level ?"
        Problem("d", "q", "12", None, {"source": "gsm8k"}),
    ]
    outputs = [_out("a", "so \\boxed{0.5}"), _out("b", "\\boxed{4}"), _out("c", "it is 7", "length"),
               _out("d", "\\boxed{12}")]
    result = summarize(outputs, problems)
    assert (result["n"], result["strict"], result["lenient"], result["truncated"]) == (4, 0.5, 0.75, 0.25)
    assert result["by_level"] == {"L5": {"n": 2, "strict": 0.5, "lenient": 0.5}}  # no "LNone"
    assert result["by_subject"] == {"Algebra": {"n": 2, "strict": 0.5, "lenient": 1.0},
                                    "Geometry": {"n": 1, "strict": 0.0, "lenient": 0.0}}
    assert result["by_source"]["gsm8k"] == {"n": 1, "strict": 1.0, "lenient": 1.0}
    assert result["by_source"]["math"]["n"] == 3


def test_one_source_and_no_subjects_keep_todays_keys():
    problems = [Problem("p1", "q", "2", 1, {"source": "arith"}), Problem("p2", "q", "5", 2, {"source": "arith"})]
    result = summarize([_out("p1", "\\boxed{2}"), _out("p2", "\\boxed{4}")], problems)
    assert set(result) == {"n", "strict", "lenient", "truncated", "by_level"}
    assert result["by_level"] == {"L1": {"n": 1, "strict": 1.0, "lenient": 1.0},
                                  "L2": {"n": 1, "strict": 0.0, "lenient": 0.0}}
