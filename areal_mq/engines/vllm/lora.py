"""LoRA adapter versions in `engine: vllm` (trainer.lora): vLLM's LoRA API, one adapter slot swapped in place.

What: a LoRA run publishes only the adapter of each version (WeightsReady.adapter, docs/protocol.md). vLLM serves it
with its own LoRA layers (the base weights never change), started with `lora_args`: LoRA on, one adapter slot
(max_loras 1) of rank `vllm_rank(vllm.max_lora_rank)`. `AdapterSlot` owns the files:
- `stage(tensors, scaling, max_rank)` (the rollout worker's fetch thread, while decoding goes on): checks the adapter
  against the base (weights/adapter.py: names, halves, ranks, shapes), its rank against the engine's and the
  announced one, and every target against the linears vLLM serves LoRA on for this model; then writes it as a PEFT
  directory (adapter_model.safetensors + adapter_config.json, what vLLM's LoRA loader reads) under vllm.lora_dir,
  which the run's config check puts inside the run directory. Returns a StagedAdapter; raises AdapterError (a
  WeightsLoadError) naming the problem, having written nothing.
- `request(version, staged)`: the LoRARequest `areal-v<version>` for the slot (SLOT_ID) with load_inplace, which
  the engine hands to AsyncLLM.add_lora while generation is paused and drained (engine.py `_update`).
- `hold` / `release`: each running request holds the directory of the version it was submitted with (vLLM keys its
  prefix cache on the path and reloads an evicted adapter from it); a superseded version's directory is deleted
  once no request holds it, so at most (versions in flight + 1) directories exist and vLLM holds one adapter.

Why one slot swapped in place, and not a new adapter id per version: a vLLM request's adapter is fixed when it is
submitted, so moving in-flight sequences to a new id means aborting and resubmitting each continuation (a fresh
random stream for seeded sampling, stop strings cut at the seam, the KV always recomputed). Swapping the slot's
weights in place (vLLM's `load_inplace`, loaded and checked before the old one is evicted) moves every sequence at one
step boundary, inside the same pause/drain/relabel/resume as a full update: the tokens before carry the old version,
the ones after the new, kv_on_update is honoured, and vLLM's own weight_versions spans tell the same story. The slot
starts with a zero adapter (B = 0: exactly the base), so every request carries it from the first token on and a
first adapter also reaches sequences already running. max_loras stays 1: the engine never serves two versions at
once (TRL keeps staleness + 2 adapters because its requests keep the version they started with).

How to run: unit tests in tests/unit/engines/test_vllm_lora.py; against vLLM: tests/integration/test_vllm_lora.py.
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from areal_mq.errors import ConfigError
from areal_mq.weights.adapter import AdapterError, check_adapter

SLOT_ID = 1  # the one adapter id every request names (vLLM ids start at 1)
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 accepts (LoRAConfig)
PEFT_PREFIX = "base_model.model."  # as algorithms/lora.py (kept here so this module imports without torch/peft)
ADAPTER_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


def adapter_name(version: int) -> str:
    """The name vLLM serves version `version`'s adapter under (docs/protocol.md)."""
    return f"areal-v{version}"


def vllm_rank(rank: int) -> int:
    """vLLM's max_lora_rank for adapters of rank <= `rank`: the smallest value vLLM accepts at or above it."""
    for r in VLLM_RANKS:
        if r >= rank:
            return r
    raise ConfigError(f"LoRA rank {rank} is above {VLLM_RANKS[-1]}, the largest vLLM 0.32 serves; "
                      "lower trainer.lora.rank or use engine.kind torch")


def lora_args(max_rank: int) -> dict[str, Any]:
    """AsyncEngineArgs fields that turn vLLM's LoRA on with one slot able to hold rank `max_rank`."""
    r = vllm_rank(max_rank)
    return {"enable_lora": True, "max_loras": 1, "max_cpu_loras": 1, "max_lora_rank": r}


@dataclass
class StagedAdapter:
    """One adapter version written as a PEFT directory, ready for AsyncLLM.add_lora."""

    path: str
    rank: int
    modules: int


class AdapterSlot:
    """The adapter versions' directories for one engine (module docstring). Thread-safe: `stage` runs on the rollout
    worker's fetch thread, the rest on the engine's loop thread."""

    def __init__(self, lora_dir: str | os.PathLike, max_rank: int, base_shapes: Mapping[str, tuple[int, ...]]):
        if not str(lora_dir):
            raise ConfigError("rollout.engine.vllm.lora_dir is empty: a LoRA run's adapter versions are written there "
                              "for vLLM (the run's config check sets <run_dir>/vllm-lora)")
        self.root = Path(lora_dir).expanduser().resolve() / f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.max_rank = max_rank
        self.base_shapes = dict(base_shapes)
        self.targets: frozenset[str] | None = None  # leaf linears vLLM serves LoRA on (set once vLLM is up)
        self.current: str | None = None  # the directory the slot holds now
        self._refs: Counter[str] = Counter()
        self._staged: set[str] = set()  # written, not yet swapped in or discarded: never pruned
        self._lock = threading.Lock()
        self._count = 0

    # ------------------------------------------------------------ staging
    def stage(self, tensors: Mapping[str, Any], scaling: float, max_rank: int | None = None) -> StagedAdapter:
        """Check the adapter and write it as a PEFT directory (module docstring); AdapterError changes nothing."""
        import torch

        adapter = {k: v if isinstance(v, torch.Tensor) else torch.as_tensor(v) for k, v in tensors.items()}
        bound = min(self.max_rank, max_rank or self.max_rank)
        pairs = check_adapter(adapter, self.base_shapes, bound)
        if not pairs:
            raise AdapterError("the adapter names no module")
        leaves = sorted({m.rsplit(".", 1)[-1] for m in pairs})
        if self.targets is not None:
            bad = [t for t in leaves if t not in self.targets]
            if bad:
                raise AdapterError(f"the adapter targets {bad}, which vLLM serves no LoRA on for this model (it does "
                                   f"on {sorted(self.targets)}): train with trainer.lora.target_modules among those, "
                                   "or use engine.kind torch")
        rank = int(next(iter(pairs.values()))[0].shape[0])
        return self._write(adapter, rank, scaling, leaves, len(pairs))

    def zero(self, targets: Iterable[str]) -> StagedAdapter:
        """A rank-1 adapter with B = 0 on one linear vLLM serves: exactly the base (what the slot starts with)."""
        import torch

        wanted = set(targets)
        for name, shape in sorted(self.base_shapes.items()):
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and len(shape) == 2 and module.rsplit(".", 1)[-1] in wanted:
                out, inp = shape
                halves = {f"{module}.lora_A.weight": torch.zeros(1, inp),
                          f"{module}.lora_B.weight": torch.zeros(out, 1)}
                return self._write(halves, 1, 1.0, [module.rsplit(".", 1)[-1]], 1)
        raise ConfigError(f"vLLM serves LoRA on {sorted(wanted)} for this model, none of which is a weight of it")

    def _write(self, adapter: Mapping[str, Any], rank: int, scaling: float, leaves: list[str],
               modules: int) -> StagedAdapter:
        from safetensors.torch import save_file

        with self._lock:
            self._count += 1
            final = self.root / f"a{self._count:06d}"
        tmp = final.with_name(final.name + ".partial")
        tmp.mkdir(parents=True, exist_ok=False)
        try:
            save_file({PEFT_PREFIX + k: v.detach().to("cpu").contiguous() for k, v in adapter.items()},
                      str(tmp / ADAPTER_FILE), metadata={"format": "pt"})
            # vLLM scales B @ A by lora_alpha / r (PEFT's rule): alpha = scaling * r gives the announced alpha / rank
            config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scaling * rank,
                      "target_modules": leaves, "bias": "none", "lora_dropout": 0.0, "use_rslora": False,
                      "use_dora": False}
            (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=1))
            with self._lock:
                self._staged.add(str(final))
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            with self._lock:
                self._staged.discard(str(final))
            raise
        return StagedAdapter(str(final), rank, modules)

    # ------------------------------------------------------------ swapping and pruning
    def request(self, version: int, staged: StagedAdapter, inplace: bool) -> Any:
        """The LoRARequest naming `staged` as version `version` in the slot (`inplace`: for add_lora, replacing it)."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(adapter_name(version), SLOT_ID, staged.path, load_inplace=inplace)

    def swapped(self, staged: StagedAdapter) -> None:
        """The slot now holds `staged`: the previous version's directory goes once no request holds it."""
        with self._lock:
            self.current = staged.path
            self._staged.discard(staged.path)
        self._prune()

    def discard(self, staged: StagedAdapter) -> None:
        """A staged version that will not be served (vLLM refused it)."""
        with self._lock:
            self._staged.discard(staged.path)
            if staged.path == self.current:
                return
        shutil.rmtree(staged.path, ignore_errors=True)

    def hold(self, path: str) -> None:
        with self._lock:
            self._refs[path] += 1

    def release(self, path: str) -> None:
        with self._lock:
            self._refs[path] -= 1
            if self._refs[path] <= 0:
                del self._refs[path]
        self._prune()

    def _prune(self) -> None:
        with self._lock:
            keep = set(self._refs) | self._staged | {self.current}
            gone = [d for d in self.dirs() if str(d) not in keep and not d.name.endswith(".partial")]
        for d in gone:
            shutil.rmtree(d, ignore_errors=True)

    def dirs(self) -> list[Path]:
        return sorted(self.root.iterdir()) if self.root.is_dir() else []

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def base_shapes(model_dir: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a model directory's safetensors files, read from their headers (no tensor loaded)."""
    from safetensors import safe_open

    from areal_mq.engines.vllm.worker import safetensors_files

    out: dict[str, tuple[int, ...]] = {}
    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                out[name] = tuple(handle.get_slice(name).get_shape())
    return out
