"""Staged weight updates inside a vLLM worker: each bucket is made ready while generation goes on, the swap is a copy.

What: `Stage` holds one incoming version in a vLLM worker process. `Stage.add(tensors, last)` takes one bucket of
checkpoint tensors (whole decoder layers: the sender never splits one, engine.py `buckets`) and turns every
decoder layer in it into its processed kernel form — vLLM's own layer-wise reload (initialize, `load_weights`,
finalize, the loader vLLM uses at start-up, repacking included) run on that layer alone — then puts the layer's
old values back, so the requests decoding meanwhile keep computing with the old version. The new values (and any
object the processing replaced, e.g. the CPU backend's packed-GEMM closures) are kept on the host. The tensors of
no decoder layer (embedding, final norm, LM head) are held until the last bucket and processed together then.
`Stage.swap()`, run while generation is paused, only copies the kept values into the live tensors and sets the
kept objects: no transfer, no unpacking, no repacking inside the pause.

Why: the serial path (`areal_load_packed`) moves every bucket through vLLM's RPC and repacks every layer while
generation is paused; here the pause holds only the copy. Generation does stall during each bucket's RPC (the
worker runs RPCs between steps), for one bucket's work: `engine.vllm.weight_bucket_mb` bounds it.

Memory: the worker keeps one processed copy of the model on the host until the swap (the price of swapping
without repacking in the pause), plus the old values of one decoder layer on its device while that layer is
processed; the sender keeps at most `engine.vllm.stage_buckets_in_flight` packed buckets.

When a layer cannot be found by name (a checkpoint whose tensors carry no `layers.N.`, or a model with two stacks
of `layers`), its tensors are kept as they are and loaded by vLLM's whole-model layer-wise reload inside the swap,
as the serial path does: correct, only slower.

How to run: not directly; worker.py's `areal_stage_packed` / `areal_swap_staged` call it in the worker process.
"""
from __future__ import annotations

import logging
import re
import time
from typing import Any, Iterable

LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a checkpoint tensor of decoder layer N
MODULE_RE = re.compile(r"(?:^|\.)layers\.(\d+)$")  # the vLLM module of decoder layer N
TOP = -1  # the group of tensors outside every decoder layer
_TORCH_STATE = frozenset({"_parameters", "_buffers", "_modules"})


def layer_key(name: str) -> int:
    """The decoder layer a checkpoint tensor belongs to, or TOP."""
    match = LAYER_RE.search(name)
    return int(match.group(1)) if match else TOP


def decoder_layers(model: Any) -> dict[int, Any]:
    """{N: module} of the model's decoder layers; an index found twice (two stacks) is left out."""
    found: dict[int, list[Any]] = {}
    for name, module in model.named_modules():
        match = MODULE_RE.search(name)
        if match:
            found.setdefault(int(match.group(1)), []).append(module)
    return {n: mods[0] for n, mods in found.items() if len(mods) == 1}


class _Kept:
    """One module's new state, made while its old state stayed live: values to copy in, objects to set."""

    def __init__(self, module: Any, values: dict, objects: dict, absent: set, dropped: set = frozenset()):
        self.module, self.values, self.objects, self.absent = module, values, objects, absent
        self.dropped = dropped  # (kind, name) of tensors the processing removed: gone in the new state too

    def apply(self) -> None:
        m = self.module
        for (kind, name), (same, value) in self.values.items():
            if same:  # from pinned host memory on CUDA: asynchronous, ordered before the next decode step
                getattr(m, kind)[name].data.copy_(value, non_blocking=value.is_pinned())
            else:
                getattr(m, kind)[name].data = value
        for (kind, name), obj in self.objects.items():
            if kind == "__dict__":
                m.__dict__[name] = obj
            else:
                getattr(m, kind)[name] = obj
        for name in self.absent:
            m.__dict__.pop(name, None)
        for kind, name in self.dropped:
            getattr(m, kind).pop(name, None)


def _snapshot(module: Any) -> tuple[dict, dict]:
    """(tensor objects and a clone of their values, the module's other attributes) of one module. An entry
    registered as None (a linear layer without bias: `_parameters["bias"] = None`) is kept as (None, None): the
    module's forward reads it (`self.bias`), so it must stay registered while the layer is processed."""
    tensors = {}
    for kind in ("_parameters", "_buffers"):
        for name, t in getattr(module, kind).items():
            tensors[(kind, name)] = (t, None if t is None else t.detach().clone())
    attrs = {k: v for k, v in module.__dict__.items() if k not in _TORCH_STATE}
    return tensors, attrs


def _host_copy(t: Any, host: Any) -> Any:
    """A host copy of a tensor's values; pinned when it lives on a GPU, so the swap's copy back is fast."""
    import torch

    out = torch.empty(t.shape, dtype=t.dtype, device=host, pin_memory=t.is_cuda)
    out.copy_(t.detach())
    return out


def _keep_and_restore(module: Any, tensors: dict, attrs: dict, host: Any) -> _Kept:
    """Take the module's new state (values to the host), then put its old state back."""
    values, objects, absent, dropped = {}, {}, set(), set()
    for kind in ("_parameters", "_buffers"):
        table = getattr(module, kind)
        for name, now in list(table.items()):
            old = tensors.get((kind, name))
            if now is None and old is not None and old[0] is None:
                continue  # None before and after: nothing to keep
            if old is not None and old[0] is not None and now is old[0]:
                same = now.shape == old[1].shape and now.dtype == old[1].dtype
                values[(kind, name)] = (same, _host_copy(now, host) if same else now.data)
                if same:
                    now.data.copy_(old[1])
                else:  # the processing gave the tensor new data of another shape (a packed layout)
                    now.data = old[1]
            else:
                objects[(kind, name)] = now
                if old is None:
                    del table[name]
                else:
                    table[name] = old[0]  # None included: the old forward reads it (eager: vLLM's enforce_eager)
        for (k, name), (old_t, _) in tensors.items():  # entries the processing removed: back for the old forward
            if k == kind and name not in table:
                table[name] = old_t
                if old_t is not None:
                    dropped.add((kind, name))
    for name, value in list(module.__dict__.items()):
        if name in _TORCH_STATE:
            continue
        if name not in attrs:
            objects[("__dict__", name)] = value
            del module.__dict__[name]
        elif value is not attrs[name]:
            objects[("__dict__", name)] = value
            module.__dict__[name] = attrs[name]
    absent = {name for name in attrs if name not in module.__dict__}
    for name in absent:
        module.__dict__[name] = attrs[name]
    return _Kept(module, values, objects, absent, dropped)


class Stage:
    """One version being staged in a vLLM worker (module docstring). `worker` is vLLM's worker object."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.kept: list[_Kept] = []
        self.top: list[tuple[str, Any]] = []  # tensors outside every decoder layer, processed at the last bucket
        self.raw: list[tuple[str, Any]] = []  # tensors no layer was found for: loaded in the swap
        self.tensors = 0
        self.stage_s = 0.0

    def add(self, tensors: list[tuple[str, Any]], last: bool) -> None:
        """Process the decoder layers of one bucket (and, at the last, the rest); old values stay live."""
        start = time.perf_counter()
        model = self.worker.model_runner.get_model()
        layers = decoder_layers(model)
        groups: dict[int, list[tuple[str, Any]]] = {}
        for name, t in tensors:
            groups.setdefault(layer_key(name), []).append((name, t))
        self.top.extend(groups.pop(TOP, []))
        for key, group in groups.items():
            if key in layers:
                self._process(model, [layers[key]], group)
            else:
                self.raw.extend(group)
        if last and self.top:
            covered = {id(m) for layer in layers.values() for m in layer.modules()}
            outside = [m for m in model.modules() if id(m) not in covered and _has_tensors(m)]
            self._process(model, outside, self.top)
            self.top = []
        self.tensors += len(tensors)
        self.stage_s += time.perf_counter() - start

    def _process(self, model: Any, roots: list[Any], group: list[tuple[str, Any]]) -> None:
        import torch
        from vllm.model_executor.model_loader.reload.layerwise import (finalize_layerwise_reload,
                                                                       initialize_layerwise_reload)

        modules = list({id(m): m for root in roots for m in root.modules()}.values())
        before = [(m, *_snapshot(m)) for m in modules]
        container = torch.nn.ModuleList(roots)  # the reload walks container.modules(): these layers only
        config = self.worker.vllm_config
        try:
            with _QuietBufferOnly({type(m).__name__ for m in modules if not _has_params(m)}):
                initialize_layerwise_reload(container)
                try:
                    model.load_weights(iter(group))
                finally:
                    finalize_layerwise_reload(container, config.model_config)
        finally:  # whatever happened, the live model computes with its old values again
            host = torch.device("cpu")
            self.kept.extend(_keep_and_restore(m, tensors, attrs, host) for m, tensors, attrs in before)

    def swap(self) -> int:
        """Copy every kept value into the live model (generation is paused); load leftovers the serial way."""
        import torch

        for kept in self.kept:
            kept.apply()
        device = getattr(self.worker, "device", None)
        if device is not None and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the pinned sources are freed after this returns
        if self.raw or self.top:
            self.worker.model_runner.reload_weights(weights_iterator=iter(self.raw + self.top))
        return self.tensors


class _QuietBufferOnly(logging.Filter):
    """Drops vLLM's "X: Failed to load weights" warning for modules that hold buffers only (a decoder layer's shared
    rotary embedding: no checkpoint tensor, its buffers are put back as they were), once per layer staged; the
    warning for a module with parameters still shows."""

    LOGGER = "vllm.model_executor.model_loader.reload.layerwise"

    def __init__(self, names: set[str]):
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not ("Failed to load weights" in str(record.msg) and args and args[0] in self.names)

    def __enter__(self) -> None:
        logging.getLogger(self.LOGGER).addFilter(self)

    def __exit__(self, *exc: Any) -> None:
        logging.getLogger(self.LOGGER).removeFilter(self)


def _has_params(module: Any) -> bool:
    return any(t is not None for t in module._parameters.values())


def _has_tensors(module: Any) -> bool:
    return any(t is not None for t in list(module._parameters.values()) + list(module._buffers.values()))


def group_order(names: Iterable[str]) -> list[str]:
    """Names ordered decoder layer by decoder layer (in order of first appearance), the rest last."""
    order: dict[int, list[str]] = {}
    for name in names:
        order.setdefault(layer_key(name), []).append(name)
    top = order.pop(TOP, [])
    return [n for key in order for n in order[key]] + top
