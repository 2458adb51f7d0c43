"""Tensor parallelism composed with FSDP2: the policy split over a 2-D (dp_shard, tp) DTensor mesh.

What: `apply_tp(lm, mesh["tp"])` splits a model's decoder layers over the mesh's `tp` dimension; fsdp.py `parallelize
(policy, mesh, dp_mesh, fsdp_cfg, precision)` composes it with FSDP2 over the data-parallel dimension(s) in place,
the way torchtitan's `parallelize_llama` does (this module needs nothing of fsdp.py; fsdp.py calls it):

    dims = ParallelDims(dp_shard=2, tp=2)         # algorithms/parallel.py: the mesh's owner
    #            tp 0   tp 1                      dims (dp_replicate, dp_shard, cp, tp), tp innermost: a TP group is
    #  dp 0  [ rank 0, rank 1 ]                   consecutive ranks (one host's GPUs under torchrun), so the
    #  dp 1  [ rank 2, rank 3 ]                   per-layer all-reduces stay on the node
    fsdp.parallelize(policy, dims.mesh(device), dims.dp_mesh(), cfg.fsdp, "fp32")

- Each decoder layer (one plan per model family, `PLANS`, keyed by `config.model_type`; Qwen2 and Llama share
  the decoder's shape): ColwiseParallel on q/k/v/gate/up (Megatron's column split: each TP rank computes
  num_attention_heads / tp query heads, num_key_value_heads / tp KV heads and intermediate / tp MLP columns, its
  local output a plain tensor), RowwiseParallel on o/down (the row split, whose partial sums are all-reduced over
  tp at the layer's output, so the residual stream is replicated: whole on every TP rank). Hugging Face's
  attention reshapes with `view(..., -1, head_dim)`, so it reads the local head count from the tensor; the GQA
  ratio (heads / KV heads) is unchanged by the split. `check_divisible` refuses a tp that does not divide the
  head counts or the MLP width, before any tensor is touched.
- Embeddings, final norm, LM head and the per-layer norms stay REPLICATED over tp (plain parameters, not DTensors
  on the tp dimension): the trainer computes token logprobs from the head's weight in chunks (algorithms/policy.py,
  logprobs.py), never through `lm_head(...)`, so a vocabulary-parallel head would need a vocab-parallel
  log-softmax there; replicated, PolicyLogprobs runs unchanged and its logits are whole on every TP rank. The cost:
  each TP rank holds (1 / dp of) the embeddings and head whole, and computes the norms and the chunked logprobs
  redundantly. No sequence parallelism on the norms (it would shard activations along the sequence and need the
  HF layer's residual adds to run on DTensors; the replicated residual is what the HF code expects).
- FSDP2 then shards every parameter over the data-parallel slice of the mesh (ParallelDims.dp_mesh: dp_shard, or
  (dp_replicate, dp_shard): HSDP x TP) with the same units, precision and offload as the fsdp
  strategy (fsdp.shard_policy): a TP weight becomes a 2-D DTensor (FSDP's dim-0 shard of the TP shard, on the
  whole mesh); a replicated one a 1-D DTensor on the dp dimension. Gradients are reduce-scattered over dp only:
  the TP ranks of one dp group see the same micro-batch.

Memory per rank (fp32 master weights, AdamW, 16 bytes a parameter): 16 x (decoder-layer parameters / (dp x tp)
+ the embeddings', head's and norms' / dp), plus one gathered decoder layer's TP shard.

How the trainer uses it (trainer.parallel.tp > 1): FsdpStrategy.build calls `fsdp.parallelize(PolicyLogprobs(lm,
...), self.parallel.mesh(device), self.parallel.dp_mesh(), cfg.fsdp, precision, train)` for the policy and the reference
model (tp 1 is exactly fsdp.shard_policy); a model built on the meta device is then filled by `loading.materialise`
as at tp 1 (it reads each rank's TP x FSDP box, `_StridedShard` included, from the checkpoint). Each rank trains its
share of the batch as ParallelDims.dp_rank says (the TP ranks of a group the same micro-batches, so only tp index 0
counts them in the step's metrics: ParallelDims.counts_metrics). The step clips with fsdp.clip_grad_norm, which
groups the gradients by mesh (DTensor refuses to stack norms across meshes, and here parameters live on two).
The rest is the fsdp strategy's as it is: AdamW (foreach and fused take the two meshes), fsdp.full_state_dict
(`full_tensor()` per parameter gathers over dp and tp) for publishing, and fsdp.save_sharded
/ load_sharded (torch.distributed.checkpoint reshards across meshes: a checkpoint written at tp 2 x dp 2 loads at
dp 4 and back, AdamW state included; the trainer's at tp 2 resumes at world 1).
Over gloo every collective TP needs works as is (RowwiseParallel's all-reduce of partial sums, ColwiseParallel's
all-reduce of its input's gradient, FSDP2's all-gather / reduce-scatter of 2-D DTensors); the one failure was the
cross-mesh stack in the gradient norm, which is why fsdp.clip_grad_norm groups by mesh.
Publishing under TP is the gathered path only: weights/sharded.py's `WeightsShard` carries each rank's (start row,
rows) of a tensor, and a RowwiseParallel weight's TP shard is a column block (Shard(1)) that no row range describes;
trainer.publish_layout auto resolves to gather under tp > 1 (TrainerConfig.sharded_publish), sharded is refused when
the config is read (parallel.refuse_under_tp, which also refuses LoRA under TP: why there), and fsdp.local_slices
refuses the layout too (WeightsFetchError).

Run: tests/integration/test_tensor_parallel.py (tp 2 x dp 2 on 4 CPU ranks over gloo against one process; the
checkpoint resharded to dp 4 and back); tests/integration/test_trainer_tp_cp.py (the Trainer at tp 2 against one
process, its checkpoint resumed at world 1).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from areal_mq.errors import ConfigError

TP = "tp"  # the mesh dimension tensor parallelism splits over (algorithms/parallel.py DIMS)


def tp_size(mesh: Any) -> int:
    """The tp degree of `mesh` (1 where it has no tp dimension)."""
    return mesh[TP].size() if TP in (mesh.mesh_dim_names or ()) else 1


# ---------------------------------------------------------------- per-family plans
def _decoder_plan() -> dict[str, Any]:
    """Megatron's split of a Llama-shaped decoder layer (paths inside the layer)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}


def _decoder_divisible(config: Any, tp: int) -> list[str]:
    """What tp does not divide in a Llama-shaped config (empty: it fits)."""
    want = {"num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            "intermediate_size": config.intermediate_size}
    return [f"{k} {v}" for k, v in want.items() if v % tp]


PLANS: dict[str, tuple[Callable[[], dict[str, Any]], Callable[[Any, int], list[str]]]] = {
    "qwen2": (_decoder_plan, _decoder_divisible),  # q/k/v biases: split with their columns
    "llama": (_decoder_plan, _decoder_divisible),
}  # model_type -> (the layer's plan, what tp must divide); both tested (tests/integration/test_tensor_parallel.py)


def _family(lm: nn.Module) -> tuple[Any, tuple]:
    config = lm.config
    kind = getattr(config, "model_type", type(lm).__name__)
    if kind not in PLANS:
        raise ConfigError(f"tensor parallelism: model type {kind!r} has no plan (supported: {', '.join(PLANS)}); "
                          "train it with tp 1 (fsdp alone), or add its plan to algorithms/tensor_parallel.py")
    return config, PLANS[kind]


def check_divisible(lm: nn.Module, tp: int) -> None:
    """A clear error when `tp` does not divide what the plan splits (attention heads, KV heads, MLP width)."""
    config, (_, divisible) = _family(lm)
    bad = divisible(config, tp)
    if bad:
        raise ConfigError(f"tensor parallelism: tp {tp} does not divide the model's {', '.join(bad)}; each TP rank "
                          f"computes whole heads: pick a tp that divides them")


def apply_tp(lm: nn.Module, mesh: Any) -> None:
    """The family's plan on every decoder layer of `lm` over the 1-D tp `mesh`, in place (ColwiseParallel /
    RowwiseParallel turn those Linear weights into DTensors Shard(0) / Shard(1) on it)."""
    from torch.distributed.tensor.parallel import parallelize_module

    (plan, _) = _family(lm)[1]
    check_divisible(lm, mesh.size())
    for layer in lm.model.layers:  # every family in PLANS lays its decoder out there
        parallelize_module(layer, mesh, plan())
