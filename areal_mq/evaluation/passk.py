"""pass@k, maj@k and mean accuracy over N sampled answers per held-out problem, as papers report them.

What: given N graded samples of each problem (evaluation/heldout.py `evaluate(..., samples=N)`),
    mean      the accuracy over all N x problems samples (what "avg@N" means in DAPO and AReaL tables)
    pass@k    the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code",
              arXiv 2107.03374, eq. 1): per problem with c correct of n samples, 1 - C(n - c, k) / C(n, k), averaged
    maj@k     majority vote over the first k samples: the most frequent extracted answer (ties: the one seen first;
              samples without an answer do not vote) is graded; averaged over problems
each strict and lenient (areal_mq/grading.py's two verdicts), overall and per level / subject / source.
Why the estimator: the plain "any of the first k correct" has a high variance and depends on the order; drawing
N >= k samples and counting c is unbiased for every k <= N at once.

    areal-mq eval --config configs/quickstart.yaml --samples 8 --temperature 1.0 --k 1,4,8 [--json]
"""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from areal_mq.errors import ConfigError


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021 eq. 1 for one problem: 1 - C(n-c, k) / C(n, k), as a running product (no big binomials)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def majority(answers: list[str | None]) -> int | None:
    """Index of the first sample carrying the most frequent non-empty answer; None when none has an answer."""
    votes = Counter(a for a in answers if a is not None)
    if not votes:
        return None
    top = max(votes.values())
    return next(i for i, a in enumerate(answers) if a is not None and votes[a] == top)


def check_ks(ks: list[int], samples: int, temperature: float) -> list[int]:
    """The k values, sorted; ConfigError naming the option when one cannot be estimated from `samples`."""
    if samples < 1:
        raise ConfigError(f"eval.samples must be >= 1, got {samples}")
    if samples > 1 and temperature <= 0:
        raise ConfigError(f"eval.samples {samples} at temperature 0: greedy answers are all the same answer; "
                          "set eval.temperature (--temperature) above 0, e.g. 1.0")
    bad = [k for k in ks if not 1 <= k <= samples]
    if bad:
        raise ConfigError(f"eval.k {bad}: each k must be between 1 and eval.samples ({samples}); "
                          f"draw at least {max(bad)} samples (--samples) or lower k")
    return sorted(set(ks)) or [1]


def summarize_samples(graded: dict[str, list[Any]], groups: dict[str, list[tuple[str, str]]], ks: list[int]) -> dict:
    """graded: problem id -> its samples' Grade (areal_mq.grading) in sample order; groups: problem id -> the
    (group, key) pairs it counts in (("all", "all") first). Returns pass@k / maj@k / mean, overall and per group."""
    acc: dict = defaultdict(lambda: defaultdict(float))
    count: dict = defaultdict(int)
    for pid, grades in graded.items():
        n = len(grades)
        row: dict[str, float] = {}
        for verdict in ("strict", "lenient"):
            ok = [bool(getattr(g, verdict)) for g in grades]
            row[f"mean_{verdict}"] = sum(ok) / n
            answers = [getattr(g, f"{verdict}_answer") for g in grades]
            for k in ks:
                row[f"pass@{k}_{verdict}"] = pass_at_k(n, sum(ok), k)
                winner = majority(answers[:k])
                row[f"maj@{k}_{verdict}"] = float(winner is not None and ok[winner])
        for group in groups[pid]:
            count[group] += 1
            for key, value in row.items():
                acc[group][key] += value

    def table(group: tuple[str, str]) -> dict:
        n = count[group] or 1
        out: dict = {"n": count[group]}
        for verdict in ("strict", "lenient"):
            out[f"mean_{verdict}"] = acc[group][f"mean_{verdict}"] / n
            out[f"pass@k_{verdict}"] = {str(k): acc[group][f"pass@{k}_{verdict}"] / n for k in ks}
            out[f"maj@k_{verdict}"] = {str(k): acc[group][f"maj@{k}_{verdict}"] / n for k in ks}
        return out

    result = {"k": ks, **table(("all", "all"))}
    for name in ("by_level", "by_subject", "by_source"):
        keys = sorted(key for g, key in count if g == name)
        if keys and (name != "by_source" or len(keys) > 1):
            result[name] = {key: table((name, key)) for key in keys}
    return result
