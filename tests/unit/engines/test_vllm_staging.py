"""The staged update's bookkeeping (areal_mq/engines/vllm/staging.py) on plain torch modules, without vLLM.

A "processing" step stands in for vLLM's layer-wise reload: it writes new values into the live tensors, swaps a
tensor's data for another layout and replaces an attribute (as the CPU backend's packed-GEMM closure). After
_keep_and_restore the module computes exactly as before; after apply() it computes as the processing left it.
The bucket order (decoder layer by decoder layer, never split) is checked on engine.py's `buckets`.

pytest tests/unit/engines/test_vllm_staging.py
"""
from __future__ import annotations

import torch

from areal_mq.engines.vllm.engine import buckets
from areal_mq.engines.vllm.staging import TOP, _keep_and_restore, _snapshot, decoder_layers, group_order, layer_key


class Packed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 3), requires_grad=False)
        self.register_buffer("scale", torch.ones(4))
        self.kernel = lambda x: x @ self.weight.t() * self.scale

    def forward(self, x):
        return self.kernel(x)


def process(m: Packed, new_weight: torch.Tensor) -> None:
    """What a reload does to a live layer: new values in place, a new closure, a new attribute, new buffer data."""
    m.weight.data.copy_(new_weight)
    frozen = new_weight.clone()
    m.kernel = lambda x: x @ frozen.t() * 2.0
    m._processed = True
    m.scale.data = torch.full((2, 2), 3.0)  # another shape: kept as data, not copied


def test_keep_and_restore_leaves_the_old_computation_live_and_apply_installs_the_new():
    torch.manual_seed(0)
    m, x = Packed(), torch.randn(2, 3)
    weight_obj, scale_obj = m.weight, m.scale
    before = m(x).clone()
    new = torch.randn(4, 3)
    tensors, attrs = _snapshot(m)
    process(m, new)
    kept = _keep_and_restore(m, tensors, attrs, torch.device("cpu"))
    assert torch.equal(m(x), before) and not hasattr(m, "_processed")
    assert m.weight is weight_obj and m.scale is scale_obj and m.scale.shape == (4,)
    kept.apply()
    assert torch.allclose(m(x), x @ new.t() * 2.0) and m._processed
    assert m.weight is weight_obj and torch.equal(m.weight, new)  # same storage, new values
    assert m.scale.shape == (2, 2)


class NoBias(torch.nn.Module):
    """Like vLLM's linear layers without bias: `bias` registered as None and read by the forward, which an eager
    engine (vllm.enforce_eager) runs as Python every step (a compiled graph had it baked in)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 3), requires_grad=False)
        self.register_parameter("bias", None)
        self.register_buffer("extra", torch.zeros(4))

    def forward(self, x):
        out = x @ self.weight.t()
        return out if self.bias is None else out + self.bias


def test_an_entry_registered_as_none_stays_registered_while_staged_and_a_removed_tensor_goes_at_apply():
    """Found when the vLLM tests ran eager: staging deleted every None entry (`bias`) of a layer until the swap,
    so an eager forward between two buckets died with "'QKVParallelLinear' object has no attribute 'bias'"."""
    torch.manual_seed(0)
    m, x = NoBias(), torch.randn(2, 3)
    before = m(x).clone()
    tensors, attrs = _snapshot(m)
    new = torch.randn(4, 3)
    m.weight.data.copy_(new)
    del m._buffers["extra"]  # the processing removed a tensor (the new layout does without it)
    kept = _keep_and_restore(m, tensors, attrs, torch.device("cpu"))
    assert "bias" in m._parameters and m.bias is None and torch.equal(m(x), before)
    assert "extra" in m._buffers  # back for the old computation
    kept.apply()
    assert "bias" in m._parameters and m.bias is None and torch.allclose(m(x), x @ new.t())
    assert "extra" not in m._buffers  # gone in the new state, as the processing left it


def test_layer_keys_and_the_group_order():
    assert layer_key("model.layers.12.mlp.up_proj.weight") == 12
    assert layer_key("model.embed_tokens.weight") == TOP and layer_key("lm_head.weight") == TOP
    names = ["model.embed_tokens.weight", "model.layers.0.a", "model.layers.1.a", "model.layers.0.b", "model.norm.w"]
    assert group_order(names) == ["model.layers.0.a", "model.layers.0.b", "model.layers.1.a",
                                  "model.embed_tokens.weight", "model.norm.w"]


def test_decoder_layers_by_module_name():
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])
    assert sorted(decoder_layers(model)) == [0, 1, 2]
    model.vision = torch.nn.Module()
    model.vision.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2)])  # a second stack: index 0 is ambiguous
    assert sorted(decoder_layers(model)) == [1, 2]


def test_staged_buckets_never_split_a_decoder_layer():
    t = {"model.embed_tokens.weight": torch.zeros(50), "model.layers.0.a": torch.zeros(100),
         "model.layers.0.b": torch.zeros(100), "model.layers.1.a": torch.zeros(100), "model.norm.w": torch.zeros(4),
         "model.layers.1.b": torch.zeros(100)}
    got = [[n for n, _ in b] for b in buckets(t, 500, whole_layers=True)]  # 500 bytes: one layer (800) per bucket
    assert got == [["model.layers.0.a", "model.layers.0.b"], ["model.layers.1.a", "model.layers.1.b"],
                   ["model.embed_tokens.weight", "model.norm.w"]]
    assert sum(len(b) for b in buckets(t, 500)) == len(t)  # serial: the mapping's order, tensor by tensor


def test_the_failed_to_load_warning_is_quiet_for_buffer_only_modules_only(caplog):
    import logging

    from areal_mq.engines.vllm.staging import _QuietBufferOnly

    log = logging.getLogger(_QuietBufferOnly.LOGGER)
    with caplog.at_level(logging.WARNING, logger=_QuietBufferOnly.LOGGER):
        with _QuietBufferOnly({"RotaryEmbedding"}):
            log.warning("%s: Failed to load weights", "RotaryEmbedding")  # its buffers are put back: expected
            log.warning("%s: Failed to load weights", "QKVParallelLinear")  # a layer with parameters: still shown
        log.warning("%s: Failed to load weights", "RotaryEmbedding")  # outside the staging: shown
    assert [r.getMessage() for r in caplog.records] == ["QKVParallelLinear: Failed to load weights",
                                                       "RotaryEmbedding: Failed to load weights"]
