"""How the trainer's policy is built and wrapped: `build_strategy(cfg, precision)`, one module per strategy.

What: trainer.parallel's degrees (areal_mq/algorithms/parallel.py `ParallelDims`: the mesh, and which rank trains,
gathers, serves and checkpoints what) choose the room, trainer.strategy after loading: ddp where every rank holds
a whole copy, fsdp where anything is split. A strategy owns everything that differs between the two rooms'
implementations, so the trainer, the checkpoint code and the trainer worker read the same under each and never ask
which one it is (STYLE 18, 22):
- precision: `accelerate_precision` (Accelerate's mixed_precision) and `autocast` (the policy's own autocast);
- `bind(accelerator, device, parallel)`, then `build(model_path, train)` -> (Hugging Face model, wrapped policy): how
  the model is read and wrapped (DDP: whole, onto the device; FSDP: on the meta device, sharded over ParallelDims'
  mesh, each rank's shards read from the checkpoint, areal_mq/algorithms/loading.py);
- the step: `accumulate(model, last)` (DDP skips the all-reduce but on the last micro-batch; FSDP2
  reduce-scatters every one), `clip(model, max_norm)` (whether every rank must run the same number of forwards is
  ParallelDims' `lockstep`);
- publishing: `full_state_dict(lm, dtype, keep)` (whether every rank takes part is ParallelDims'
  `gathers_collectively`) and `local_slices(lm, dtype)` (the slices this rank serves, by ParallelDims'
  `publish_group`, and where they sit: weights/sharded.py receives them, it never looks inside a strategy);
- checkpoints: `checkpoint_format`, `save_main(trainer, dir)` (rank 0's files; returns blobs for
  trainer_state.pt), `save_shards(trainer, shard_dir)` (collective: each rank's own files under the checkpoint's
  sharded/), `load(trainer, dir, blobs, shard_dir)`.
Adding a strategy is one module beside ddp.py and fsdp.py and one line in STRATEGIES (and in parallel.py's ROOMS).
"""
from __future__ import annotations

from typing import Any



def _ddp() -> type:
    from areal_mq.algorithms.ddp import DdpStrategy

    return DdpStrategy


def _fsdp() -> type:
    from areal_mq.algorithms.fsdp import FsdpStrategy

    return FsdpStrategy


STRATEGIES = {"ddp": _ddp, "fsdp": _fsdp}  # the room trainer.parallel needs -> its class (imported when chosen)


def build_strategy(cfg: Any, precision: str) -> Any:
    """The strategy trainer.parallel needs (trainer.strategy, resolved by parallel.map_degrees), for `precision`
    (trainer.precision resolved); bind() it next."""
    return STRATEGIES[cfg.strategy]()(cfg, precision)
