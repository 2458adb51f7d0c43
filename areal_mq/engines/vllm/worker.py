"""vLLM worker extension: in-place weight reload from a safetensors file or directory.

What: `WeightSyncExtension` is mixed into vLLM's worker class (vLLM's `worker_extension_cls`), so its
methods run inside the vLLM worker process and are reached with `collective_rpc(method, args=...)`
(in process: `AsyncLLM.collective_rpc`; on a server: `POST /collective_rpc`).

Why: on vLLM's CPU backend the linear layers are repacked into kernel layouts at load time, so
calling `model.load_weights` on the live model fails and editing parameter tensors in place is silently
ignored. The worker's own `reload_weights(weights_iterator=...)` re-runs the loader's layer-wise
processing and does work (~0.5 s for a 135M model). Tensors cannot be arguments of collective_rpc
(and a server's /collective_rpc takes only strings), so the weights travel as a path; the caller
stages in-memory tensors as one safetensors file in /dev/shm first.

How to run: not directly. Start vLLM with `worker_extension_cls="areal_mq.engines.vllm.worker.
WeightSyncExtension"` (engine: vllm does this) or `--worker-extension-cls` on a server.
This module must import without vLLM: only the worker process, which has vLLM, calls into it.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

EXTENSION_CLS = "areal_mq.engines.vllm.worker.WeightSyncExtension"
RELOAD_METHOD = "areal_reload_safetensors"


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of a weights path: the file itself, or every *.safetensors in a directory.

    Raises FileNotFoundError naming the path when there is nothing to load.
    """
    p = Path(path)
    if p.is_file():
        return [p]
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no safetensors weights at {p} (expected a .safetensors file or a directory of them)")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """Yield (name, tensor) from each file in turn, one tensor in memory at a time."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


class WeightSyncExtension:
    """Methods added to vLLM's worker (self is the worker: it has reload_weights and model_runner)."""

    def areal_reload_safetensors(self, path: str) -> dict[str, Any]:
        """Reload every weight found at `path` in place; return {"tensors": n, "load_s": seconds}."""
        files = safetensors_files(path)
        count = 0

        def counted() -> Iterator[tuple[str, Any]]:
            nonlocal count
            for item in iter_safetensors(files):
                count += 1
                yield item

        start = time.perf_counter()
        self.reload_weights(weights_iterator=counted())  # type: ignore[attr-defined]
        return {"tensors": count, "load_s": time.perf_counter() - start}
