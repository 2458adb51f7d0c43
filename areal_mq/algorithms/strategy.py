"""How the trainer's policy is spread over ranks: `build_strategy(cfg, precision)`, one module per strategy.

What: a strategy owns everything that differs between data parallelism and sharding, so the trainer, the checkpoint
code and the trainer worker read the same under each and never ask which one it is (STYLE 18, 22):
- precision: `accelerate_precision` (Accelerate's mixed_precision) and `autocast` (the policy's own autocast);
- `bind(accelerator, device)`, then `build(model_path, train)` -> (Hugging Face model, wrapped policy): how the
  model is read and wrapped (DDP: whole, onto the device; FSDP: on the meta device, sharded, each rank's shards
  read from the checkpoint, areal_mq/algorithms/loading.py);
- the step: `accumulate(model, last)` (DDP skips the all-reduce but on the last micro-batch; FSDP2
  reduce-scatters every one), `lockstep` (every rank must run the same number of forwards: FSDP's all-gathers are
  collectives), `clip(model, max_norm)`;
- publishing: `full_state_dict(lm, dtype, keep)` and `gathers_collectively` (whether every rank takes part in a
  full snapshot), `publish_group(rank)` ((index, count) in the ranks that serve sharded weights, None: serves
  nothing) and `local_slices(lm, dtype)` (the slices this rank serves and where they sit: weights/sharded.py
  receives them, it never looks inside a strategy);
- checkpoints: `checkpoint_format`, `save_main(trainer, dir)` (rank 0's files; returns blobs for
  trainer_state.pt), `save_shards(trainer, shard_dir)` (collective: each rank's own files under the checkpoint's
  sharded/), `load(trainer, dir, blobs, shard_dir)`.
Adding a strategy (tensor parallelism) is one module beside ddp.py and fsdp.py and one line in STRATEGIES.
"""
from __future__ import annotations

from typing import Any



def _ddp() -> type:
    from areal_mq.algorithms.ddp import DdpStrategy

    return DdpStrategy


def _fsdp() -> type:
    from areal_mq.algorithms.fsdp import FsdpStrategy

    return FsdpStrategy


STRATEGIES = {"ddp": _ddp, "fsdp": _fsdp}  # trainer.strategy -> its class (imported when chosen)


def build_strategy(cfg: Any, precision: str) -> Any:
    """The strategy trainer.strategy names, for `precision` (trainer.precision resolved); bind() it next."""
    return STRATEGIES[cfg.strategy]()(cfg, precision)
