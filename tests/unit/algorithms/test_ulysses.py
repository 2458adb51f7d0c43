"""Ulysses context parallelism (areal_mq/algorithms/ulysses.py) without a second process: the row's slicing (pad,
blocks, the target of a slice's last column), the head-count, layout and sequence-level-setting errors, and a cp
group of one rank as a no-op. The cp 2 parity with one process is tests/integration/test_ulysses.py.

pytest tests/unit/algorithms/test_ulysses.py
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from areal_mq.algorithms.packing import SeqData, build_microbatch
from areal_mq.algorithms.config import TrainerConfig
from areal_mq.algorithms.ulysses import (CpRow, all_to_all, check_heads, check_objective, reduce_cp_grads,
                                         shard_microbatch, slice_microbatch, use_ulysses)
from areal_mq.errors import ConfigError


def _seq(prompt_len, n_gen, sample="s", prompt=None, seed=0):
    rng = np.random.default_rng(seed + 31 * prompt_len + n_gen)
    tokens = rng.integers(0, 100, prompt_len + n_gen).astype(np.int64)
    if prompt is not None:
        tokens[:prompt_len] = prompt
    return SeqData(tokens, prompt_len, rng.standard_normal(n_gen).astype(np.float32), np.arange(n_gen),
                   float(n_gen), sample)


def _dynamic_row():
    """3 sequences of 7, 13 and 5 columns: 25, odd."""
    return build_microbatch([_seq(4, 3, "a"), _seq(5, 8, "b"), _seq(3, 2, "c")], [0, 1, 2], packed=True)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_slices_cover_the_padded_row_and_every_token_once(cp):
    mb = _dynamic_row()
    parts = [slice_microbatch(mb, r, cp) for r in range(cp)]
    padded = -(-25 // cp) * cp
    width = padded // cp
    row = torch.cat([p.input_ids for p in parts], dim=1)
    pos = torch.cat([p.position_ids for p in parts], dim=1)
    assert row.shape == (1, padded) and torch.equal(row[:, :25], mb.input_ids)
    assert torch.equal(pos[0, 25:], torch.arange(padded - 25))  # the pad: a block of its own from position 0
    want_blocks = [(0, 7, []), (7, 20, []), (20, 25, [])] + ([(25, padded, [])] if padded > 25 else [])
    assert all(p.segments.segments == want_blocks and p.segments.length == padded for p in parts)
    assert [p.segments.start for p in parts] == [r * width for r in range(cp)]
    assert sum(p.n_tokens for p in parts) == 25 and all(p.attention_mask is None for p in parts)
    index = torch.cat([p.segments.token_index for p in parts])
    assert torch.equal(index, torch.arange(mb.targets.numel()))  # ascending within a rank, ranks in column order
    for name in ("targets", "behav_logp", "advantages", "versions", "seq_index"):
        assert torch.equal(torch.cat([getattr(p, name) for p in parts]), getattr(mb, name)), name


@pytest.mark.parametrize("cp", [2, 3])
def test_targets_shift_before_the_split(cp):
    """Each local token is scored by a local column and its target is the row's NEXT token, even where that
    token lies on the next rank (the column 12 | 13 boundary at cp 2)."""
    mb = _dynamic_row()
    crossing = 0
    for r in range(cp):
        part = slice_microbatch(mb, r, cp)
        start, width = part.segments.start, part.input_ids.shape[1]
        cols = start + part.keep_cols[part.logit_index]  # whole-row scoring columns
        assert ((cols >= start) & (cols < start + width)).all()
        assert torch.equal(part.targets, mb.input_ids[0, cols + 1])
        crossing += int((cols == start + width - 1).sum())
    assert crossing  # some token's context ends at a slice's last column


def test_the_shared_row_keeps_its_blocks():
    prompt = np.array([5, 6, 7, 8])
    seqs = [_seq(4, 2, "p", prompt), _seq(4, 3, "p", prompt)]
    mb = build_microbatch(seqs, [0, 1], packed=True, share_prompts=True, varlen=True)  # [p 0:4, 4:6, 6:9]
    part = slice_microbatch(mb, 1, 2)
    assert part.segments.segments == [(0, 4, [(4, 6), (6, 9)]), (9, 10, [])]
    assert torch.equal(part.targets, mb.targets[part.segments.token_index])


def test_refuses_padded_and_masked_rows():
    seqs = [_seq(4, 3), _seq(5, 2, "b")]
    with pytest.raises(ConfigError, match="padded micro-batch of 2 rows"):
        slice_microbatch(build_microbatch(seqs, [0, 1], packed=False), 0, 2)
    with pytest.raises(ConfigError, match="trainer.attention varlen"):  # shared under sdpa: an L x L mask
        slice_microbatch(build_microbatch(seqs, [0, 1], packed=True, share_prompts=True), 0, 2)


@pytest.mark.parametrize("cp, bad", [(3, "num_attention_heads 4 and num_key_value_heads 2"), (4, "pick cp among")])
def test_heads_must_divide(cp, bad):
    config = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ConfigError, match=bad) as err:
        check_heads(config, cp)
    assert f"cp {cp}" in str(err.value) and "[1, 2]" in str(err.value)
    check_heads(config, 2)
    check_heads(SimpleNamespace(num_attention_heads=6, num_key_value_heads=None), 3)  # MHA: KV heads = heads


@pytest.fixture
def one_rank_group(tmp_path, monkeypatch):
    """A real gloo process group of one rank (FileStore, loopback), ended afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_a_cp_group_of_one_is_a_no_op(one_rank_group):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    mb = _dynamic_row()
    assert shard_microbatch(mb, one_rank_group) is mb
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=100, hidden_size=24, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=3, num_key_value_heads=1, attn_implementation="sdpa"))
    assert use_ulysses(model, one_rank_group) is model and model.config._attn_implementation == "sdpa"
    model(input_ids=mb.input_ids, position_ids=mb.position_ids).logits.sum().backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    reduce_cp_grads(model, one_rank_group)
    assert all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters())
    x = torch.randn(1, 4, 6, 8, requires_grad=True)  # the all-to-all of one rank: identity, forward and backward
    y = all_to_all(x, 1, 2, one_rank_group)
    (y * 2).sum().backward()
    assert torch.equal(y, x) and torch.equal(x.grad, torch.full_like(x, 2.0))


def test_no_process_group_is_a_group_of_one():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    mb = _dynamic_row()
    assert shard_microbatch(mb, None) is mb
    assert isinstance(slice_microbatch(mb, 0, 1).segments, CpRow)  # cp 1 slicing: the whole row
    assert torch.equal(slice_microbatch(mb, 0, 1).input_ids, mb.input_ids)


@pytest.mark.parametrize("setting, named", [
    ({"packing": "padded"}, "packing padded"),
    ({"packing": "shared"}, "use attention varlen"),
])
def test_what_a_slice_cannot_compute_is_refused_under_cp(setting, named):
    cfg = TrainerConfig(**{"packing": "dynamic", **setting})
    with pytest.raises(ConfigError, match=named):
        check_objective(cfg, 2)
    check_objective(cfg, 1)  # cp 1: nothing is split


@pytest.mark.parametrize("setting", [
    {"kl_coef": 0.1, "kl_in": "loss", "entropy_coef": 0.01},  # per token
    {"packing": "shared", "attention": "varlen", "loss_agg": "seq-mean-token-sum"},
    {"loss_agg": "seq-mean-token-mean"},  # the sequence-level statistics, summed over the cp group (CpSequenceSums;
    {"policy_loss": "gspo", "loss_agg": "seq-mean-token-mean"},  # tests/integration/test_ulysses_objectives.py)
    {"behav_weight_level": "sequence"},
    {"behav_weight_level": "geometric", "policy_loss": "gspo"},
    {"kl_coef": 0.1, "kl_in": "reward"},
    {"kl_coef": 0.1, "kl_in": "reward_normalized", "adv_estimator": "reinforce_pp"},  # advantages.normalize_returns
])
def test_sequence_level_objectives_train_under_cp(setting):
    check_objective(TrainerConfig(**{"packing": "dynamic", **setting}), 2)


def test_cp_sequence_sums_of_a_one_rank_group_are_the_local_ones(one_rank_group):
    """CpSequenceSums on a group of one: the local sums (sized by the micro-batch's sequences, not its tokens), the
    differentiable total's gradient passed through, nothing held by later ranks."""
    from areal_mq.algorithms.objective import LOCAL
    from areal_mq.algorithms.ulysses import ContextParallel, CpSequenceSums

    seq_index = torch.tensor([0, 0, 1, 2, 2, 2])
    x = torch.arange(6.0, requires_grad=True)
    sums = CpSequenceSums(one_rank_group, 3)
    total = sums.totals(x, seq_index)
    assert total.tolist() == [1.0, 2.0, 12.0] and total.shape == (3,)
    (total * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 2.0, 3.0, 3.0, 3.0]
    assert torch.equal(sums.later(sums.own(x.detach(), seq_index)), torch.zeros(3))
    assert ContextParallel(None).sequence_sums(_dynamic_row()) is LOCAL and LOCAL.later(total) is None


def test_the_trainers_handle_is_a_no_op_at_cp_1():
    """ContextParallel without a group (ParallelDims.cp_group at cp 1): the trainer calls it whatever the layout."""
    from areal_mq.algorithms.ulysses import ContextParallel

    off, mb = ContextParallel(None), object()
    assert off.group is None and off.shard(mb) is mb and off.attach(mb) is mb
    off.reduce_grads(None)  # nothing to sum, nothing touched
