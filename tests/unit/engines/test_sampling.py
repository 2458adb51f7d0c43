"""Batched sampling: greedy, top-k/top-p truncation, per-row random streams, logprob convention."""
from __future__ import annotations

import torch

from areal_mq.engines.sampling import sample_tokens


def gens(*seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))


def test_greedy_and_logprob_before_truncation():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    tokens, logp = sample_tokens(logits, [0.0, 0.7, 2.0], [1.0, 1.0, 0.5], [0, 1, 1], [None, *gens(1, 2)])
    assert tokens.tolist() == logits.argmax(-1).tolist()  # greedy row, and top_k=1 rows
    expected = [torch.log_softmax(logits[i] / t, -1)[tokens[i]] for i, t in enumerate([1.0, 0.7, 2.0])]
    torch.testing.assert_close(logp, torch.stack(expected))


def test_top_p_and_top_k_restrict_the_support():
    n = 2000
    logits = LOGITS.expand(n, 4)
    g = gens(3)[0]
    top_p, _ = sample_tokens(logits, [1.0] * n, [0.7] * n, [0] * n, [g] * n)
    assert set(top_p.tolist()) == {0, 1}  # mass before token 2 is 0.8 >= 0.7
    top_k, _ = sample_tokens(logits, [1.0] * n, [1.0] * n, [3] * n, [g] * n)
    assert set(top_k.tolist()) == {0, 1, 2}


def test_frequencies_follow_the_distribution():
    n = 4000
    tokens, logp = sample_tokens(LOGITS.expand(n, 4), [1.0] * n, [1.0] * n, [0] * n, gens(11) * n)
    freq = torch.bincount(tokens, minlength=4).float() / n
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.03, rtol=0)
    torch.testing.assert_close(logp, LOGITS[0, tokens])


def test_each_row_uses_only_its_own_stream():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    alone, _ = sample_tokens(logits[1:2], [1.0], [0.9], [0], gens(42))
    together, _ = sample_tokens(logits, [0.5, 1.0, 1.5], [1.0, 0.9, 1.0], [0, 0, 5], gens(7, 42, 9))
    assert together[1] == alone[0]
