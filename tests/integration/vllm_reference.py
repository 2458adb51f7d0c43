"""Hugging Face reference computations for the vLLM engine tests (imported by test_vllm_*.py).

What: a float32 HF copy of the model whose weights can be swapped between the original (A) and a
perturbed set (B), and the per-token behaviour logprobs such a model assigns to a generated
sequence — either with one set of weights throughout, or with the KV of a prefix computed by one
set and the rest by another (what vLLM's kv_on_update="keep" does).
Why: the engine's logprobs, versions and post-update tokens are checked against an independent
forward pass, not against vLLM itself.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def perturbed_weights(model_dir: Path, out_dir: Path, scale: float = 0.3, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights B: every decoder-layer projection plus seeded noise of `scale` x its std; saved to out_dir."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    out = {}
    for name, w in weights.items():
        if ".layers." in name and name.endswith("proj.weight"):
            noise = torch.randn(w.shape, generator=gen, dtype=torch.float32) * w.float().std() * scale
            w = (w.float() + noise).to(w.dtype)
        out[name] = w.contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_dir / "model.safetensors"))
    return out


class HFReference:
    """A float32 HF causal LM with swappable weights."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        state = {k: v.float() for k, v in weights.items()}
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        assert not unexpected, unexpected
        assert all("lm_head" in m for m in missing), missing  # tied to the embedding

    @torch.no_grad()
    def logprobs(self, prompt: list[int], output: list[int], temperature: float,
                 weights: dict, switch_weights: dict | None = None, switch_at: int | None = None) -> tuple:
        """(logprob of each output token, logprob of the argmax at each position) under log_softmax(logits/T).

        With switch_weights: positions before prompt+switch_at-1 are encoded by `weights`, the rest by
        `switch_weights` attending to that stale KV (the first token sampled after the switch is
        predicted from the last pre-switch token, whose KV is computed after the switch).
        """
        ids = torch.tensor([prompt + output])
        temp = temperature if temperature > 0 else 1.0
        self.load(weights)
        if switch_weights is None:
            logits = self.model(ids).logits[0]
        else:
            cut = len(prompt) + switch_at - 1
            first = self.model(ids[:, :cut], use_cache=True)
            self.load(switch_weights)
            second = self.model(ids[:, cut:], past_key_values=first.past_key_values).logits[0]
            logits = torch.cat([first.logits[0], second])
        lp = torch.log_softmax(logits.float() / temp, dim=-1)[len(prompt) - 1 : len(prompt) + len(output) - 1]
        picked = lp.gather(1, torch.tensor(output)[:, None])[:, 0]
        return picked.numpy(), lp.max(dim=-1).values.numpy()
