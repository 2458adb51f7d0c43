"""Dynamic loss scaling for trainer.precision fp16, the same under DDP and FSDP2 (sharded gradients).

What: fp16 has 5 exponent bits, so small gradients underflow to 0 unless the loss is multiplied by a large scale
before backward. `LossScaler` keeps that scale: the trainer multiplies each micro-batch's loss by `scale`,
`unscale_(params)` divides the gradients (each rank its own shards: `to_local()` of a DTensor) before clipping,
and `update(norm)` looks at the global gradient norm the clip computed anyway: a non-finite norm means some
gradient overflowed on some rank, so the optimizer step is skipped, the scale halves and the step is counted as
skipped; `growth_interval` finite steps in a row double it.
Why the norm and not a separate found-inf reduction: the clip's norm is already global (FSDP: a DTensor norm
reduced over the mesh; DDP: the gradients are all-reduced before it), so every rank sees the same value and takes
the same decision without one more collective. This is what a "sharded grad scaler" must get right: a rank whose
own shard is finite still skips when another rank's is not.
Cost: `update` reads the norm back to the host once per optimizer step (the skip is a host decision); only fp16
pays it. State (`state_dict`) goes into the trainer's checkpoint.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch


class LossScaler:
    """`scale` multiplies the loss; `unscale_` and `update` run around the clip of every optimizer step."""

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 200, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, min_scale: float = 1.0):
        self.scale = float(init_scale)
        self.growth_interval, self.growth_factor = int(growth_interval), float(growth_factor)
        self.backoff_factor, self.min_scale = float(backoff_factor), float(min_scale)
        self.good_steps = 0  # finite steps since the last change of scale
        self.skipped = 0  # optimizer steps skipped for a non-finite gradient, over the run

    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Divide every gradient by `scale`, in place (a DTensor's local shard: no communication)."""
        from torch.distributed.tensor import DTensor

        inv = 1.0 / self.scale
        for p in params:
            if p.grad is not None:
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(inv)

    def update(self, norm: torch.Tensor) -> bool:
        """After the clip: True when the global gradient norm is finite (take the optimizer step), False when
        it is not (skip it). Adjusts the scale either way. Reads `norm` back to the host."""
        finite = bool(torch.isfinite(norm).item())
        if finite:
            self.good_steps += 1
            if self.good_steps >= self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
        else:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            self.skipped += 1
        return finite

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.skipped = int(state["skipped"])
