"""Independent references for the engine tests: plain HF forward passes, no engine code involved."""
from __future__ import annotations

import torch


@torch.no_grad()
def full_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Behaviour logprobs of `output` after `prompt` from one fresh full forward pass."""
    ids = torch.tensor([prompt + output])
    logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / scale, dim=-1)
    return logp.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)


@torch.no_grad()
def greedy_continue(model, context: list[int], n: int) -> list[int]:
    """n greedy tokens after `context`, recomputing the full forward pass every token."""
    ids = list(context)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(context):]


@torch.no_grad()
def greedy_keep_kv(old_model, new_model, context: list[int], n: int) -> list[int]:
    """Greedy tokens when the KV of context[:-1] came from old_model and everything after from new_model
    (what `kv_on_update: keep` must produce), using HF's own KV cache."""
    out = old_model(torch.tensor([context[:-1]]), use_cache=True)
    past, last, produced = out.past_key_values, context[-1], []
    for _ in range(n):
        step = new_model(torch.tensor([[last]]), past_key_values=past, use_cache=True)
        past, last = step.past_key_values, int(step.logits[0, -1].argmax())
        produced.append(last)
    return produced


def perturbed_state(model, seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """A different but same-shaped full state dict (old weights + seeded noise); tied tensors once."""
    gen = torch.Generator().manual_seed(seed)
    return {k: v.detach().clone() + scale * v.detach().std() * torch.randn(v.shape, generator=gen)
            for k, v in model.named_parameters()}


def model_with(model, state: dict[str, torch.Tensor]):
    """A deep copy of `model` carrying `state` (plain load_state_dict; tied weights stay tied)."""
    import copy

    other = copy.deepcopy(model)
    missing, unexpected = other.load_state_dict(state, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing), (missing, unexpected)
    return other
