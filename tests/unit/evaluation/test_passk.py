"""pass@k (Chen et al. 2021, arXiv 2107.03374, eq. 1), maj@k and the sampled evaluation (evaluation/passk.py,
evaluation/heldout.py): numbers worked by hand, the refusals, and N answers a problem through the real engine."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest

from areal_mq.config import load_config
from areal_mq.errors import ConfigError
from areal_mq.evaluation.heldout import evaluate
from areal_mq.evaluation.passk import check_ks, majority, pass_at_k, summarize_samples


def test_pass_at_k_is_chens_unbiased_estimator_worked_by_hand():
    # eq. 1: 1 - C(n-c, k) / C(n, k).  n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 = 0.7
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # k=1: c/n
    assert pass_at_k(8, 1, 8) == 1.0 and pass_at_k(8, 0, 8) == 0.0 and pass_at_k(4, 3, 2) == 1.0  # n-c < k
    # n=10, c=3, k=4: 1 - C(7,4)/C(10,4) = 1 - 35/210
    assert pass_at_k(10, 3, 4) == pytest.approx(1 - math.comb(7, 4) / math.comb(10, 4))
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)


def test_majority_counts_answers_breaks_ties_by_first_seen_and_ignores_no_answer():
    assert majority(["3", "4", "4", None]) == 1
    assert majority(["3", "4", "4", "3"]) == 0  # tie: "3" came first
    assert majority([None, None]) is None and majority([None, "7"]) == 1


def test_ks_are_checked_against_samples_and_temperature():
    assert check_ks([8, 1, 4, 4], 8, 1.0) == [1, 4, 8]
    with pytest.raises(ConfigError, match="temperature"):
        check_ks([1], 4, 0.0)
    with pytest.raises(ConfigError, match=r"eval.k \[16\]"):
        check_ks([1, 16], 8, 1.0)
    assert check_ks([1], 1, 0.0) == [1]  # the greedy default


def g(strict, answer):
    return SimpleNamespace(strict=strict, lenient=strict, strict_answer=answer, lenient_answer=answer)


def test_summary_of_two_problems_worked_by_hand():
    graded = {"a": [g(True, "5"), g(False, "6"), g(False, "6"), g(True, "5")],  # c=2 of 4, votes 5:2 6:2 -> "5"
              "b": [g(False, "1"), g(False, None), g(False, "2"), g(False, "2")]}  # c=0
    groups = {"a": [("all", "all"), ("by_level", "L1")], "b": [("all", "all"), ("by_level", "L2")]}
    out = summarize_samples(graded, groups, [1, 2, 4])
    assert out["n"] == 2 and out["mean_strict"] == pytest.approx((2 / 4 + 0) / 2)
    # pass@2 of a: 1 - C(2,2)/C(4,2) = 5/6; of b: 0
    assert out["pass@k_strict"] == pytest.approx({"1": 0.25, "2": 5 / 12, "4": 0.5})
    # maj@1: a's first is right; maj@2: tie 5/6 -> first seen "5", right; maj@4: tie -> "5", right
    assert out["maj@k_strict"] == pytest.approx({"1": 0.5, "2": 0.5, "4": 0.5})
    assert out["by_level"]["L1"]["pass@k_strict"]["2"] == pytest.approx(5 / 6)


def test_n_sampled_answers_a_problem_through_the_engine():
    cfg = load_config(None, ["model.name=tiny-random-llama", "controller.max_new_tokens=8", "eval.samples=4",
                             "eval.temperature=1.0", "eval.k=[1,4]"])
    result = evaluate(cfg, n=3, progress=False)
    pk = result["pass_at_k"]
    assert result["samples"] == 4 and result["n"] == 12 and result["problems"] == 3 and pk["n"] == 3
    for verdict in ("strict", "lenient"):
        assert pk[f"pass@k_{verdict}"]["4"] >= pk[f"pass@k_{verdict}"]["1"] == pytest.approx(pk[f"mean_{verdict}"])
    greedy = evaluate(load_config(None, ["model.name=tiny-random-llama", "controller.max_new_tokens=8"]), n=3,
                      progress=False)
    assert "pass_at_k" not in greedy and greedy["n"] == 3 and greedy["samples"] == 1


def test_the_cli_refuses_what_it_cannot_estimate_before_loading_a_model():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "areal_mq.cli", "eval", "--set", "model.name=tiny-random-llama",
                               "--n", "2", "--no-progress", *args], capture_output=True, text=True, timeout=120,
                              stdin=subprocess.DEVNULL)

    greedy_many = run("--samples", "4")
    assert greedy_many.returncode == 2 and "temperature" in greedy_many.stderr
    big_k = run("--samples", "2", "--temperature", "1", "--k", "1,3")
    assert big_k.returncode == 2 and "eval.k [3]" in big_k.stderr
    bad_k = run("--k", "1,x")
    assert bad_k.returncode == 2 and "--k '1,x'" in bad_k.stderr
    ok = run("--samples", "2", "--temperature", "1", "--k", "1,2", "--json", "--set", "controller.max_new_tokens=4")
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout.strip().splitlines()[-1])["pass_at_k"]["k"] == [1, 2]
