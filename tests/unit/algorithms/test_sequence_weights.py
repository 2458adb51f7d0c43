"""Sequence-level behaviour weights (trainer.behav_weight_level sequence / geometric) against values by hand,
and the sequence index every micro-batch layout carries for them.

Two sequences: tokens 0-1 are sequence 0, tokens 2-3 sequence 1, with the token log weights of
test_ppo_loss.py (prox - behav = -0.3, 0, ln 3, 0.1). Sequence 0's weight is e^-0.3 (sum) or e^-0.15 (mean),
sequence 1's is 3·e^0.1 (sum) or sqrt(3·e^0.1) (mean).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from areal_mq.algorithms.config import TrainerConfig
from areal_mq.algorithms.packing import build_microbatch, samples_to_seqs
from areal_mq.algorithms.ppo import behaviour_weight, ppo_loss, sequence_log_weight
from tests.unit.algorithms.batches import make_samples
from tests.unit.algorithms.test_ppo_loss import ADV, BEHAV, EPS_HIGH, EPS_LOW, PROX, THETA

SEQ = [0, 0, 1, 1]
LOG_W = [p - b for p, b in zip(PROX, BEHAV)]


def _t(xs, dtype=torch.float64):
    return torch.tensor(xs, dtype=dtype)


def _cfg(**kw) -> TrainerConfig:
    return TrainerConfig(**{"eps_clip_low": EPS_LOW, "eps_clip_high": EPS_HIGH, "behav_weight_cap": None, **kw})


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_every_token_gets_its_sequences_weight(level):
    agg = sum if level == "sequence" else (lambda xs: sum(xs) / len(xs))
    expected = [math.exp(agg(LOG_W[:2]))] * 2 + [math.exp(agg(LOG_W[2:]))] * 2
    weight, raw, keep, capped = behaviour_weight(_t(PROX), _t(BEHAV), _cfg(behav_weight_level=level),
                                                 _t(SEQ, torch.long))
    assert weight.tolist() == pytest.approx(expected) and raw.tolist() == pytest.approx(expected)
    assert keep.all() and not capped.any()


def test_the_loss_is_the_token_loss_with_the_sequence_weight_and_the_cap_acts_on_it():
    theta = _t(THETA).requires_grad_(True)
    loss, stats = ppo_loss(theta, _t(PROX), _t(BEHAV), _t(ADV), 4, _cfg(behav_weight_level="sequence",
                                                                       behav_weight_cap=2.0),
                           seq_index=_t(SEQ, torch.long))
    w = [math.exp(-0.3)] * 2 + [2.0] * 2  # sequence 1's 3·e^0.1 truncated at 2
    r = [math.exp(t - p) for t, p in zip(THETA, PROX)]
    by_hand = sum(-wi * min(ri * a, min(max(ri, 1 - EPS_LOW), 1 + EPS_HIGH) * a)
                  for wi, ri, a in zip(w, r, ADV)) / 4
    assert loss.item() == pytest.approx(by_hand)
    assert stats.capped.item() == 2 and stats.weight_max.item() == pytest.approx(3 * math.exp(0.1))


def test_token_level_is_unchanged_and_needs_no_sequence_index():
    weight, *_ = behaviour_weight(_t(PROX), _t(BEHAV), _cfg())
    assert weight.tolist() == pytest.approx([math.exp(x) for x in LOG_W])


def test_a_sequence_level_without_the_index_is_refused():
    with pytest.raises(ValueError, match="seq_index"):
        behaviour_weight(_t(PROX), _t(BEHAV), _cfg(behav_weight_level="sequence"))
    with pytest.raises(ValueError, match="seq_index"):
        behaviour_weight(_t(PROX), _t(BEHAV), _cfg(behav_weight_level="sequence"), _t([0, 1], torch.long))


def test_the_validator_refuses_a_sequence_level_without_the_correction():
    with pytest.raises(ValidationError, match="behav_weight_level"):
        TrainerConfig(behav_weight_level="sequence", behav_correction=False)
    with pytest.raises(ValidationError):
        TrainerConfig(behav_weight_level="per-episode")


@pytest.mark.parametrize("packed,share", [(True, False), (False, False), (True, True)])
def test_every_layout_marks_each_trained_token_with_its_sequence(packed, share):
    seqs = samples_to_seqs(make_samples(3, n_groups=2, group_size=3), TrainerConfig())
    ids = list(range(len(seqs)))
    mb = build_microbatch(seqs, ids, packed=packed, share_prompts=share)
    order = mb.seq_ids  # the shared layout groups the completions of one prompt
    expected = np.repeat(np.arange(len(order)), [len(seqs[i].train_idx) for i in order])
    assert mb.seq_index.tolist() == expected.tolist()
    for k, i in enumerate(order):  # the behaviour logprobs of sequence k are those of seqs[order[k]]
        got = mb.behav_logp[mb.seq_index == k].numpy()
        np.testing.assert_allclose(got, seqs[i].behav_logp[seqs[i].train_idx], rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_sequence_weights_on_cuda_do_not_wait_for_the_device(level):
    """No value goes back to the host: a sync here would stall every micro-batch of the trainer."""
    log_w = torch.tensor([0.1, -0.2, 0.3, 0.5, -0.1], device="cuda")
    seq_index = torch.tensor([0, 0, 1, 1, 1], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = sequence_log_weight(log_w, seq_index, level)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = sequence_log_weight(log_w.cpu(), seq_index.cpu(), level)
    torch.testing.assert_close(got.cpu(), want)


def test_sequence_weights_of_an_empty_micro_batch_are_empty():
    got = sequence_log_weight(torch.zeros(0), torch.zeros(0, dtype=torch.long), "geometric")
    assert got.shape == (0,)
