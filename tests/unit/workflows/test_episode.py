"""Per-token bookkeeping of multi-turn episodes: the loss mask is "generated tokens only", environment tokens
carry version -1 and never reach the loss, staleness counts generated tokens, single-turn is unchanged."""
from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from areal_mq.algorithms.config import TrainerConfig
from areal_mq.algorithms.packing import build_microbatch, plan_step, samples_to_seqs
from areal_mq.messages import EpisodeResult, Sample, SeqSample
from areal_mq import protocol
from areal_mq.workflows.episode import Episode, EpisodeTooLong

PROMPT = [1, 2, 3, 4]
TURNS = [([10, 11, 12], [3, 3, 4]), ([20, 21], [4, 4]), ([30, 31, 32, 33], [5, 5, 5, 6])]
ENV = [[90, 91], [92]]


def three_turn_episode() -> Episode:
    ep = Episode(list(PROMPT))
    for k, (ids, versions) in enumerate(TURNS):
        ep.add_generated(ids, [-0.5 - i for i in range(len(ids))], versions)
        if k < len(ENV):
            ep.add_env(ENV[k])
    return ep


def test_trace_of_a_hand_built_three_turn_episode():
    seq = three_turn_episode().to_seq(reward=0.5)
    assert seq.output_ids.tolist() == [10, 11, 12, 90, 91, 20, 21, 92, 30, 31, 32, 33]
    assert seq.loss_mask.tolist() == [1, 1, 1, 0, 0, 1, 1, 0, 1, 1, 1, 1]
    assert seq.versions.tolist() == [3, 3, 4, -1, -1, 4, 4, -1, 5, 5, 5, 6]
    assert seq.logprobs[seq.loss_mask == 0].tolist() == [0.0, 0.0, 0.0]
    assert Sample(sample_id="g", seqs=[seq]).oldest_version() == 3  # -1 of the environment is not a version


@pytest.mark.parametrize("packing", ["shared", "dynamic", "padded"])
def test_the_loss_trains_exactly_the_generated_tokens(packing):
    ep_a, ep_b = three_turn_episode(), three_turn_episode()
    ep_b.segments[0].ids[0] = 13  # a second episode of the same prompt, so the group has two sequences
    sample = Sample(sample_id="g", seqs=[ep_a.to_seq(1.0), ep_b.to_seq(0.0)])
    cfg = TrainerConfig(packing=packing, max_tokens_per_mb=4096)
    seqs = samples_to_seqs([sample], cfg)
    plan = plan_step(seqs, cfg)
    generated = [t for ids, _ in TURNS for t in ids]
    assert plan.gen_tokens == [2 * len(generated)]  # the loss normalises by generated tokens only
    mb = build_microbatch(seqs, plan.minibatches[0][0], packing != "padded", share_prompts=packing == "shared")
    order = mb.seq_ids
    want = [t for i in order for t in ([13] + generated[1:] if i == 1 else generated)]
    assert mb.targets.tolist() == want
    assert (mb.versions >= 0).all() and len(mb.behav_logp) == len(want)
    # packed one after another: every target is predicted by the column just before it in the input row
    flat_inputs = mb.input_ids.reshape(-1)
    kept = mb.keep_cols[mb.logit_index % len(mb.keep_cols)]
    if packing == "dynamic":
        assert (flat_inputs[kept + 1] == mb.targets).all()


def test_single_turn_samples_are_unchanged_without_a_mask():
    seq = SeqSample(prompt_ids=[1, 2], output_ids=[5, 6, 7], logprobs=[-1, -1, -1], versions=[0, 0, 1], reward=1.0)
    assert seq.loss_mask is None
    (s,) = samples_to_seqs([Sample(sample_id="g", seqs=[seq, seq.model_copy(update={"reward": 0.0})])],
                           TrainerConfig())[:1]
    assert s.train_idx.tolist() == [0, 1, 2] and s.n_train == 3


@pytest.mark.parametrize("mask, versions, why", [
    ([1, 0], [0, -1, -1], "entries for"),                # one entry per output token
    ([1, 2, 0], [0, 0, -1], "must be 0"),                 # 0/1 only
    ([1, 1, 0], [0, -1, -1], "versions >= 0"),            # a trained token needs a real version
    ([1, 0, 0], [0, 3, -1], "version -1"),                # an environment token has none
])
def test_bad_loss_masks_are_refused(mask, versions, why):
    with pytest.raises(ValidationError, match=why):
        SeqSample(prompt_ids=[1], output_ids=[5, 6, 7], logprobs=[0, 0, 0], versions=versions, reward=0.0,
                  loss_mask=mask)


def test_episode_result_round_trips_the_wire_and_all_env_sequences_are_skipped():
    seq = three_turn_episode().to_seq(0.5, info={"attempts": 3})
    back = protocol.decode(protocol.encode(EpisodeResult(seq=seq, turns=3))).msg
    assert back.seq.loss_mask.tolist() == seq.loss_mask.tolist() and back.seq.info == {"attempts": 3}
    env_only = SeqSample(prompt_ids=[1], output_ids=[5], logprobs=[0], versions=[-1], reward=0.0, loss_mask=[0])
    assert samples_to_seqs([Sample(sample_id="g", seqs=[env_only, seq])], TrainerConfig())[0].n_train == 9


def test_an_episode_over_its_token_budget_is_refused():
    ep = Episode([1], max_tokens=4)
    ep.add_generated([5, 6, 7], [0, 0, 0], [0, 0, 0])
    with pytest.raises(EpisodeTooLong):
        ep.add_env([8, 9])
    with pytest.raises(ValueError, match=">= 0"):
        ep.add_generated([5], [0], [-1])
