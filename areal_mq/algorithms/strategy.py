"""How the trainer's policy is spread over ranks: `build_strategy(cfg, accelerator, precision, device)`.

What: a strategy owns the few things that differ between data parallelism and sharding, so the trainer's step
reads the same under both (STYLE 18):
- `wrap(policy, train)`: DDP through Accelerate (`prepare_model`), or FSDP2 (areal_mq/algorithms/fsdp.py);
- `accumulate(model, last)`: the context of one micro-batch's backward (DDP skips the all-reduce but on the
  last; FSDP2 reduce-scatters every micro-batch into the sharded gradients, which keeps no unsharded gradient
  alive between micro-batches);
- `lockstep`: whether every rank must run the same number of forwards (FSDP's all-gathers are collectives per
  layer and forward: a rank with fewer micro-batches runs empty ones, or the group hangs);
- `clip(model, max_norm)`, `full_state_dict(lm, dtype, keep)` (the whole model on the ranks that `keep`; under
  FSDP every rank takes part in the gather: the named fallback of the publish path).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch


class DdpStrategy:
    """Every rank holds the whole model; gradients all-reduced once per mini-batch (Accelerate's DDP)."""

    name = "ddp"
    lockstep = False

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator

    def wrap(self, policy: torch.nn.Module, train: bool = True) -> Any:
        return self.accelerator.prepare_model(policy, device_placement=False, evaluation_mode=not train)

    def accumulate(self, model: Any, last: bool) -> Any:
        return contextlib.nullcontext() if last else self.accelerator.no_sync(model)

    def clip(self, model: Any, max_norm: float) -> torch.Tensor:
        return self.accelerator.clip_grad_norm_(model.parameters(), max_norm)

    def full_state_dict(self, lm: torch.nn.Module, dtype: str | None, keep: bool) -> dict:
        from areal_mq.weights import unique_tensors

        return unique_tensors(lm.state_dict(), dtype) if keep else {}


class FsdpStrategy:
    """FSDP2: parameters, gradients and AdamW state sharded over the ranks (areal_mq/algorithms/fsdp.py)."""

    name = "fsdp"
    lockstep = True

    def __init__(self, cfg: Any, precision: str, device: torch.device):
        self.cfg, self.precision, self.device = cfg, precision, device

    def wrap(self, policy: torch.nn.Module, train: bool = True) -> Any:
        from areal_mq.algorithms.fsdp import shard_policy

        return shard_policy(policy, self.cfg.fsdp, self.precision, self.device, train=train)

    def accumulate(self, model: Any, last: bool) -> Any:
        return contextlib.nullcontext()

    def clip(self, model: Any, max_norm: float) -> torch.Tensor:
        from areal_mq.algorithms.fsdp import clip_grad_norm

        return clip_grad_norm(list(model.parameters()), max_norm).to(self.device)  # offload: computed on the CPU

    def full_state_dict(self, lm: torch.nn.Module, dtype: str | None, keep: bool) -> dict:
        from areal_mq.algorithms.fsdp import full_state_dict

        return full_state_dict(lm, dtype, keep)


def build_strategy(cfg: Any, accelerator: Any, precision: str, device: torch.device) -> Any:
    return FsdpStrategy(cfg, precision, device) if cfg.strategy == "fsdp" else DdpStrategy(accelerator)
