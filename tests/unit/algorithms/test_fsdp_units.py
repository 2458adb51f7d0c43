"""The FSDP2 units of the sharded policy (areal_mq/algorithms/fsdp.py shard_policy, issue 59 item 3): an untied model's
input embeddings and its final norm + LM head get units of their own (the root keeps nothing vocabulary-sized), a
tied model keeps them in the root, the PEFT-wrapped base (trainer.lora) is found the same way, and the new layout
computes the same loss and gradients as the old one (everything in the root) at world 1 over gloo.
The 2-rank parity is tests/integration/test_trainer_fsdp.py and test_trainer_hsdp.py.
Run: pytest tests/unit/algorithms/test_fsdp_units.py"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]


def _tiny(kind: str):
    from transformers import AutoModelForCausalLM

    from areal_mq.engines.shapes import hf_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_config(kind))


def test_an_untied_model_gives_embeddings_and_norm_plus_head_their_own_units_a_tied_one_leaves_them_to_the_root():
    from areal_mq.algorithms import lora
    from areal_mq.algorithms.fsdp import vocab_units

    qwen2 = _tiny("tiny-qwen2")  # untied
    embed, group = vocab_units(qwen2)
    assert embed is qwen2.model.embed_tokens and group == [qwen2.model.norm, qwen2.lm_head]
    assert vocab_units(_tiny("tiny-llama")) == (None, [])  # tied: one Parameter in embed_tokens and lm_head
    wrapped = lora.attach(_tiny("tiny-qwen2"), lora.LoraConfig(rank=4, alpha=8), torch.float32)
    base = wrapped.get_base_model()  # what FsdpStrategy.build puts in PolicyLogprobs under trainer.lora
    embed, group = vocab_units(base)
    assert embed is base.model.embed_tokens and group == [base.model.norm, base.lm_head]


def test_at_world_1_the_units_are_fsdp_modules_and_loss_and_gradients_match_the_old_root_layout():
    """In a child process (it makes a one-rank gloo group): the same seeded tiny Qwen2 sharded both ways, one forward
    and backward of the policy's logprobs each; the loss and every gradient are equal."""
    code = """
import torch
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM
from areal_mq.algorithms import fsdp
from areal_mq.algorithms.config import FsdpConfig
from areal_mq.algorithms.policy import PolicyLogprobs
from areal_mq.engines.shapes import hf_config

def run(root_units):
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(hf_config("tiny-qwen2"))
    pol = fsdp.shard_policy(PolicyLogprobs(lm, chunk_mb=0.5), FsdpConfig(), "fp32", torch.device("cpu"),
                            root_units=root_units)
    units = [isinstance(m, FSDPModule) for m in (lm.model.embed_tokens, lm.model.norm, lm.lm_head)]
    own = {n for n, _ in pol.named_parameters()} - {n for layer in lm.model.layers for n, _ in layer.named_parameters()}
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 49152, (1, 40), generator=g)
    logp, _ = pol(ids, torch.arange(40)[None], None, torch.arange(40), torch.arange(39), ids[0, 1:], 1.0)
    loss = -logp.mean()
    loss.backward()
    grads = {n: p.grad.full_tensor().clone() for n, p in pol.named_parameters()}
    return units, loss.item(), grads

new_units, new_loss, new_grads = run(True)
old_units, old_loss, old_grads = run(False)
assert new_units == [True, True, True] and old_units == [False, False, False], (new_units, old_units)
assert new_loss == old_loss, (new_loss, old_loss)
assert new_grads.keys() == old_grads.keys()
bad = [n for n in new_grads if not torch.equal(new_grads[n], old_grads[n])]
assert not bad, bad[:5]
print("same", len(new_grads))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
                               "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and "same" in proc.stdout, (proc.stdout[-2000:], proc.stderr[-3000:])


def test_clip_grad_norm_scales_the_gradients_it_reports_and_leaves_small_ones_alone():
    """fsdp.clip_grad_norm (every fsdp/tp/cp trainer's clip) returns the norm before clipping and scales the
    parameters' .grad to max_norm: it once handed the gradients themselves to clip_grads_with_norm_, which takes
    parameters, so nothing was ever clipped while the reported norm looked right."""
    from areal_mq.algorithms.fsdp import clip_grad_norm

    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.full((3,), 3.0), torch.full((4,), 4.0)  # norm sqrt(27 + 64)
    before = (27.0 + 64.0) ** 0.5
    norm = clip_grad_norm([a, b], 1.0)
    assert abs(float(norm) - before) < 1e-5
    after = torch.cat([a.grad, b.grad]).norm()
    assert abs(float(after) - 1.0) < 1e-4, f"gradients not clipped: norm {float(after)}"
    assert torch.allclose(a.grad, torch.full((3,), 3.0 / before), atol=1e-5)
    small = torch.nn.Parameter(torch.zeros(2))
    small.grad = torch.tensor([0.3, 0.4])
    assert abs(float(clip_grad_norm([small], 1.0)) - 0.5) < 1e-6
    assert torch.allclose(small.grad, torch.tensor([0.3, 0.4]))  # below max_norm: unchanged
    big = torch.nn.Parameter(torch.zeros(2))
    big.grad = torch.tensor([30.0, 40.0])
    assert abs(float(clip_grad_norm([big], float("inf"))) - 50.0) < 1e-4
    assert torch.allclose(big.grad, torch.tensor([30.0, 40.0]))  # inf: report only
