"""Micro-batch planning, and packed == unpacked: the padding-free packed micro-batches give the same loss
and gradients as running every sequence alone through the model (the real tiny Llama)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from areal_mq.algorithms.config import TrainerConfig
from areal_mq.algorithms.packing import build_microbatch, ffd_bins, lpt_partition, plan_step, samples_to_seqs
from areal_mq.algorithms.ppo import ppo_loss
from areal_mq.algorithms.trainer import token_logprobs
from tests.unit.algorithms.batches import behaviour_near_model, make_samples


def test_ffd_respects_the_budget_and_isolates_oversized():
    lengths = [7, 3, 5, 2, 9, 4, 15]
    bins = ffd_bins(range(len(lengths)), lengths, budget=10)
    assert sorted(i for b in bins for i in b) == list(range(7))
    assert [6] in bins  # 15 > budget: alone
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins if b != [6])
    # longest first, each into the first bin with room: 15 | 9 | 7 (+3 later) | 5 (+4) | 2
    assert bins == [[6], [4], [0, 1], [2, 5], [3]]


def test_lpt_balances_ranks_deterministically():
    lengths = [10, 9, 8, 7, 6, 5, 4, 3]
    parts = lpt_partition(range(8), lengths, 2)
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert abs(loads[0] - loads[1]) <= 2 and sorted(parts[0] + parts[1]) == list(range(8))
    assert parts == lpt_partition(range(8), lengths, 2)


def test_plan_covers_every_sequence_once_across_ranks_and_minibatches():
    seqs = samples_to_seqs(make_samples(1, n_groups=4), TrainerConfig())
    cfg = TrainerConfig(max_tokens_per_mb=40, ppo_n_minibatches=2)
    plans = [plan_step(seqs, cfg, world_size=2, rank=r) for r in range(2)]
    seen = [i for p in plans for mini in p.minibatches for b in mini for i in b]
    assert sorted(seen) == list(range(len(seqs)))
    assert plans[0].gen_tokens == plans[1].gen_tokens
    assert sum(plans[0].gen_tokens) == sum(s.n_gen for s in seqs)


def test_packed_row_layout():
    seqs = samples_to_seqs(make_samples(2, n_groups=1, group_size=2), TrainerConfig())
    mb = build_microbatch(seqs, [0, 1], packed=True)
    a, b = seqs
    assert mb.input_ids.shape == (1, a.length + b.length) and mb.attention_mask is None
    assert mb.position_ids[0].tolist() == list(range(a.length)) + list(range(b.length))
    assert mb.targets.tolist() == a.tokens[a.prompt_len:].tolist() + b.tokens[b.prompt_len:].tolist()


def _unpacked_reference(model, seqs, cfg, total):
    """Each sequence alone, plain forward, logprobs sliced by hand."""
    loss_sum = 0.0
    for s in seqs:
        logits = model(input_ids=torch.from_numpy(s.tokens)[None]).logits[0].float() / cfg.temperature
        logp_all = torch.log_softmax(logits[s.prompt_len - 1:-1], -1)
        logp = logp_all.gather(-1, torch.from_numpy(s.tokens[s.prompt_len:])[:, None]).squeeze(-1)
        prox = torch.from_numpy(s.prox)
        loss, _ = ppo_loss(logp, prox, torch.from_numpy(s.behav_logp), torch.full_like(logp, s.advantage),
                           total, cfg)
        loss.backward()
        loss_sum += loss.item()
    return loss_sum


def _microbatched(model, seqs, cfg, total, packed, share=False):
    loss_sum, n_mb = 0.0, 0
    for bins in plan_step(seqs, cfg).minibatches:
        for ids in bins:
            mb = build_microbatch(seqs, ids, packed=packed, pad_id=0, share_prompts=share)
            assert sorted(mb.seq_ids) == sorted(ids)
            logp, _ = token_logprobs(model, mb, cfg.temperature)
            prox = torch.from_numpy(np.concatenate([seqs[i].prox for i in mb.seq_ids]))
            loss, _ = ppo_loss(logp, prox, mb.behav_logp, mb.advantages, total, cfg)
            loss.backward()
            loss_sum += loss.item()
            n_mb += 1
    return loss_sum, n_mb


@pytest.mark.parametrize("packing", ["shared", "dynamic", "padded"])
def test_packed_equals_unpacked_loss_and_gradients(tiny_model_dir, packing):
    from areal_mq.engines.models import load_causal_lm

    cfg = TrainerConfig(temperature=0.7, max_tokens_per_mb=48, packing=packing, padded_mb_size=3)
    model = load_causal_lm(tiny_model_dir, "float32")
    samples = behaviour_near_model(make_samples(3, n_groups=3, gen_len=(1, 25)), tiny_model_dir, 0.7)
    seqs = samples_to_seqs(samples, cfg)
    rng = np.random.default_rng(0)
    for s in seqs:  # a proximal policy a bit away from the current one, so ratios get clipped
        s.prox = (s.behav_logp + 0.3 * rng.standard_normal(s.n_gen)).astype(np.float32)
    total = sum(s.n_gen for s in seqs)

    ref_loss = _unpacked_reference(model, seqs, cfg, total)
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss, n_mb = _microbatched(model, seqs, cfg, total, packed=packing != "padded", share=packing == "shared")

    assert n_mb > 1 and n_mb < len(seqs)  # really several multi-sequence micro-batches
    assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_shared_row_layout_computes_each_prompt_once():
    seqs = samples_to_seqs(make_samples(2, n_groups=2, group_size=3), TrainerConfig())
    ids = list(range(len(seqs)))
    mb = build_microbatch(seqs, ids, packed=True, share_prompts=True)
    prompts = sum(seqs[i].prompt_len for i in (0, 3))
    assert mb.n_tokens == mb.input_ids.shape[1] == prompts + sum(s.n_gen for s in seqs)
    assert mb.attention_mask.shape == (1, 1, mb.n_tokens, mb.n_tokens) and mb.attention_mask.dtype == torch.bool
    a = seqs[0]
    # the first completion continues the prompt's positions; the second starts again at the prompt length
    assert mb.position_ids[0, :a.prompt_len + a.n_gen].tolist() == list(range(a.length))
    assert mb.position_ids[0, a.length] == a.prompt_len
    m = mb.attention_mask[0, 0]
    second = a.length  # first token of the second completion: sees the prompt and itself, not completion 1
    assert m[second, :a.prompt_len].all() and not m[second, a.prompt_len:second].any() and m[second, second]
    assert not m[:a.prompt_len, a.prompt_len:].any()  # the prompt never sees completions
    # over a budget a group is split, each part with its own prompt copy
    bins = plan_step(seqs, TrainerConfig(packing="shared", max_tokens_per_mb=a.prompt_len + 2 * max(s.n_gen for s in seqs))).minibatches[0]
    assert sorted(i for b in bins for i in b) == ids and len(bins) > 1
