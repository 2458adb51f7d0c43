"""The torch engine as it was before issue 42 (one contiguous KV slot of the longest length per sequence), kept
ONLY as the baseline of `benchmarks/speed/engine.py --reasoning`: paged KV (areal_mq/engines/torch/) against this, at
the same KV memory budget, in the same run. Not part of the package and not to be used outside benchmarks/.

`ContiguousEngine(model_dir, EngineConfig(kv_cache_bytes=..., max_concurrent=...))`: with kv_cache_bytes the slots
are static, each `budget / ((max_concurrent + 1) * bytes per token)` positions long; a request longer than a slot
is refused, so the baseline's concurrency at a budget is how many slots of the longest request fit.
Files are the package's engine.py, kvcache.py, forward.py, graphs.py, session.py and seq.py at commit 154af58,
with imports pointed here.
"""
from contiguous_engine.engine import TorchEngine as ContiguousEngine

__all__ = ["ContiguousEngine"]
