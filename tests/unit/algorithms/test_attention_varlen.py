"""trainer.attention varlen (areal_mq/algorithms/attention.py): a packed micro-batch attends block by block, with
no L x L mask, and gives the sdpa path's logprobs and gradients to fp32 rounding — shared, dynamic and padded
packing, a tied and an untied model, with LoRA, and the reference model's logprobs under kl_coef.

pytest tests/unit/algorithms/test_attention_varlen.py
"""
from __future__ import annotations

import pytest
import torch

from areal_mq.algorithms.config import LoraConfig, TrainerConfig
from areal_mq.algorithms.trainer import Trainer, token_logprobs
from tests.unit.algorithms.batches import make_samples

SAMPLES = make_samples(3, n_groups=3, group_size=3, gen_len=(2, 14), vocab=1000)


@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory):
    from areal_mq.engines.shapes import build_random_model

    path = tmp_path_factory.mktemp("untied")
    build_random_model(path, "tiny-llama", tie_word_embeddings=False)
    return path


def _logprobs_and_grads(model_dir, **cfg):
    """Every micro-batch's logprobs of SAMPLES and the gradient of their sum, with the given trainer settings."""
    torch.manual_seed(0)
    trainer = Trainer(TrainerConfig(device="cpu", precision="fp32", max_tokens_per_mb=96, **cfg), model_dir)
    _, minis, _, _ = trainer.prepare(SAMPLES)
    mbs = [mb for mini in minis for mb in mini]
    logp = torch.cat([token_logprobs(trainer.model, mb, 1.0)[0] for mb in mbs])
    logp.sum().backward()
    grads = {n: p.grad.clone() for n, p in trainer.unwrapped.named_parameters() if p.grad is not None}
    trainer.close()
    return logp.detach(), grads, mbs


@pytest.mark.parametrize("packing", ["shared", "dynamic", "padded"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_varlen_equals_sdpa_in_logprobs_and_gradients(packing, tied, tiny_model_dir, untied_model_dir):
    model_dir = tiny_model_dir if tied else untied_model_dir
    want, want_grads, sdpa_mbs = _logprobs_and_grads(model_dir, packing=packing)
    got, got_grads, mbs = _logprobs_and_grads(model_dir, packing=packing, attention="varlen")
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    assert got_grads.keys() == want_grads.keys() and got_grads
    for name, g in want_grads.items():
        torch.testing.assert_close(got_grads[name], g, rtol=1e-4, atol=1e-5 * g.abs().max().item(), msg=name)
    if packing == "padded":  # padded rows keep their [B, L] padding mask under both settings
        assert all(mb.segments is None and mb.attention_mask is not None for mb in mbs)
    else:  # no mask at all: the row's blocks instead (the sdpa path's shared rows carry an L x L one)
        assert all(mb.attention_mask is None and mb.segments for mb in mbs)
        for mb in mbs:  # the blocks end where the row ends
            last = mb.segments[-1]
            assert (last[2][-1][1] if last[2] else last[1]) == mb.input_ids.shape[1]
        if packing == "shared":
            assert all(mb.attention_mask.shape[-1] == mb.input_ids.shape[1] for mb in sdpa_mbs)


def test_the_shared_row_segments_by_hand(tiny_model_dir):
    """Two groups, prompts of 3 and 4 tokens, completions of 2 and 1 and of 5 tokens: the row is
    [p_a(0:3), a1(3:5), a2(5:6), p_b(6:10), b1(10:15)]."""
    import numpy as np

    from areal_mq.algorithms.packing import SeqData, build_microbatch

    def seq(prompt, n_gen):
        tokens = np.arange(len(prompt) + n_gen, dtype=np.int64) + 10
        tokens[:len(prompt)] = prompt
        return SeqData(tokens=tokens, prompt_len=len(prompt), behav_logp=np.zeros(n_gen, np.float32),
                       versions=np.zeros(n_gen, np.int64), advantage=1.0, sample_id="s")

    a, b = [5, 6, 7], [8, 9, 10, 11]
    seqs = [seq(a, 2), seq(a, 1), seq(b, 5)]
    mb = build_microbatch(seqs, [0, 1, 2], packed=True, share_prompts=True, varlen=True)
    assert mb.segments == [(0, 3, [(3, 5), (5, 6)]), (6, 10, [(10, 15)])] and mb.attention_mask is None
    dyn = build_microbatch(seqs, [0, 1, 2], packed=True, varlen=True)
    assert dyn.segments == [(0, 5, []), (5, 9, []), (9, 18, [])]


def test_varlen_with_lora_and_the_reference_model(tiny_model_dir):
    """LoRA (the adapter's layers around the same attention) and kl_coef's reference model (built and switched like
    the policy) give the sdpa path's logprobs; the reference pass's logprobs too."""
    pytest.importorskip("peft")
    lora = LoraConfig(rank=4, alpha=8.0)
    want, _, _ = _logprobs_and_grads(tiny_model_dir, lora=lora)
    got, _, _ = _logprobs_and_grads(tiny_model_dir, lora=lora, attention="varlen")
    torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
    refs = {}
    for attention in ("sdpa", "varlen"):
        trainer = Trainer(TrainerConfig(device="cpu", precision="fp32", max_tokens_per_mb=96, kl_coef=0.1,
                                        attention=attention), tiny_model_dir)
        _, minis, _, _ = trainer.prepare(SAMPLES)
        trainer.recompute(minis)
        refs[attention] = torch.cat([mb.ref_logp for mini in minis for mb in mini])
        trainer.close()
    torch.testing.assert_close(refs["varlen"], refs["sdpa"], rtol=0, atol=2e-5)


def test_a_batch_of_packed_rows_is_refused_by_name():
    from areal_mq.algorithms.attention import varlen_attention

    q = torch.zeros(2, 2, 4, 8)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="one packed row"):
        varlen_attention(module, q, q, q, None, areal_segments=[(0, 4, [])])
    with pytest.raises(ValueError, match="cover 3 of the row's 4 columns"):
        varlen_attention(module, q[:1], q[:1], q[:1], None, areal_segments=[(0, 3, [])])
