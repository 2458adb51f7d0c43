"""LoRA adapter versions in the torch engine: merged into the weights from a kept copy of the base.

What: `AdapterState(model)` keeps a host copy of the base weight of every module an adapter has named (taken the
first time one names it: until then the engine's weight IS the base, since an adapter run never publishes full
weights). `stage(tensors, scaling)` checks the adapter against the model (weights/adapter.py: names, halves, ranks,
shapes) and computes W_base + scaling * B @ A per module in fp32 on the host, rounded once to the weight's dtype; it
runs on the weight fetch thread while decoding goes on, and the device never holds a second copy of the weights. `apply(staged)` is the pause: one in-place copy per
adapted weight (host to device on a GPU, like a full update's) (the HF parameters are views of the fused q/k/v and gate/up matrices, so the copies land there, at
the addresses a captured CUDA graph reads). A full update (`reset`) makes the engine's weights the new base.

Why merged, not an extra low-rank product per linear: a merged adapter decodes at exactly the full model's cost
(no extra kernels per layer and step, nothing for the CUDA graph or the batched attention to learn), and merging from
the kept base rounds once per version, exactly as a merged export does. The price is host memory for the adapted
weights' base copy (all-linear: about the model's size; on a GPU it stays on the host, not on the device) and a
merge per version (rank-r products, off the decode loop). benchmarks/speed/weights.py --lora measures the pause.

How to run: tests/unit/engines/test_torch_adapter.py.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from areal_mq.weights.adapter import MAX_RANK, check_adapter, merged


class StagedAdapter:
    """The merged weights of one adapter version, ready to copy in place (what `AdapterState.stage` returns)."""

    def __init__(self, writes: list[tuple[torch.Tensor, torch.Tensor]]):
        self.writes = writes

    def __len__(self) -> int:
        return len(self.writes)


class AdapterState:
    def __init__(self, model: torch.nn.Module, max_rank: int = MAX_RANK):
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.max_rank = max_rank
        self.base: dict[str, torch.Tensor] = {}  # weight name -> the base's values (host copy)

    def stage(self, tensors: Mapping[str, Any], scaling: float, max_rank: int | None = None) -> StagedAdapter:
        """Check and merge an adapter version (raises AdapterError, a WeightsLoadError, and changes nothing);
        `max_rank`: the rank its announcement states (WeightsReady.adapter.rank), else the engine's bound."""
        adapter = {k: v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for k, v in tensors.items()}
        bound = min(self.max_rank, max_rank or self.max_rank)
        pairs = check_adapter(adapter, {k: tuple(p.shape) for k, p in self.params.items()}, bound)
        writes = []
        with torch.no_grad():
            for module, (a, b) in pairs.items():
                name = module + ".weight"
                param = self.params[name]
                if name not in self.base:
                    self.base[name] = param.detach().to("cpu", copy=True)
                # on the host, where the base copy lives: the device never holds a second copy of the weights
                writes.append((param, merged(self.base[name], a, b, scaling).to(param.dtype)))
        return StagedAdapter(writes)

    def apply(self, staged: StagedAdapter) -> int:
        with torch.no_grad():
            for param, value in staged.writes:
                param.copy_(value)
        return len(staged.writes)

    def reset(self) -> None:
        """The engine now holds a full version: that is the base from here on."""
        self.base.clear()
