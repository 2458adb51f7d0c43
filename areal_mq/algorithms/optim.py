"""AdamW and the learning-rate schedule (linear warmup, then constant / linear / cosine decay).

What: `build_optimizer(model, cfg)` and `build_scheduler(optimizer, cfg)`. The schedule is a pure
function of the optimizer-step count (`lr_factor`), so resuming restores it exactly from the
scheduler's state dict. The scheduler is deliberately NOT passed through `accelerator.prepare`:
Accelerate's wrapper steps it once per process, which would make a 2-rank run decay twice as fast
as a 1-rank run on the same batches.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from areal_mq.algorithms.config import TrainerConfig

if TYPE_CHECKING:
    import torch


def lr_factor(step: int, cfg: TrainerConfig) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based: the first update uses step 0)."""
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if cfg.lr_schedule == "constant":
        return 1.0
    span = max(1, cfg.decay_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio
    if cfg.lr_schedule == "linear":
        return 1.0 - (1.0 - floor) * progress
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: "torch.nn.Module", cfg: TrainerConfig) -> "torch.optim.Optimizer":
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps, weight_decay=cfg.weight_decay
    )


def build_scheduler(optimizer: "torch.optim.Optimizer", cfg: TrainerConfig):
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
