"""Device correctness of the torch engine, checked on the CPU: the model on `meta` (a second device), prefill and
decode under DeviceGuard (any op mixing devices fails), decode also with forbid_syncs (any host sync fails);
weight updates land in place on the engine's device. A plain `meta` run would not catch
`F.embedding(cpu_index, meta_weight)`; the guard does (it failed on the engine before issue 25)."""
from __future__ import annotations

import copy

import pytest
import torch

from areal_mq.engines.sampling import sample_tokens
from areal_mq.engines.torch.forward import LlamaRunner
from areal_mq.engines.torch.graphs import BucketedDecoder
from areal_mq.testing.device_guard import DeviceGuard, DeviceMismatch, HostSync

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def meta_runner(hf_tiny):
    return LlamaRunner(copy.deepcopy(hf_tiny).to("meta"), max_len=256)


def test_runner_tables_and_cache_follow_the_model(meta_runner):
    cache = meta_runner.new_cache(8, block_size=16)
    assert meta_runner.device.type == "meta" and meta_runner.cos.device.type == "meta"
    assert cache.k.device.type == "meta" and cache.k.shape[2:4] == (9, 16)  # 8 blocks + the scratch block
    table: list[int] = []
    assert cache.ensure(table, 40) and len(table) == 3 and cache.k.device.type == "meta"
    k, v = cache.read(table, 40)
    assert k.device.type == "meta" and k.shape == (2, meta_runner.n_kv, 40, meta_runner.head_dim)


def _tables(cache, lengths):
    tables = [[] for _ in lengths]
    for table, n in zip(tables, lengths):
        assert cache.ensure(table, n)
    return tables


def test_prefill_and_decode_touch_one_device_and_decode_never_syncs(meta_runner, prompts):
    cache = meta_runner.new_cache(32)
    tables = _tables(cache, [len(p) for p in prompts[:3]])
    chunks = [prompts[0][:-1], prompts[1][:-1], prompts[2][:7]]
    with DeviceGuard() as guard:
        meta_runner.extend(cache, tables, [0, 0, 0], chunks)
        logits = meta_runner.extend(cache, [tables[2]], [7], [prompts[2][7:-1]], want_logits=True)
    assert guard.ops > 0 and guard.seen_devices == {"meta"} and logits.device.type == "meta"
    positions = [len(prompts[0]) - 1, len(prompts[1]) - 1, len(prompts[2]) - 1]
    tokens = [prompts[i][-1] for i in range(3)]
    with DeviceGuard(forbid_syncs=True) as guard:
        logits = meta_runner.decode(cache, tokens, positions, tables)
    assert guard.ops > 0 and guard.seen_devices == {"meta"}
    with DeviceGuard(forbid_syncs=True):  # sampling: host-side parameter tensors beside device math, no sync
        new, logprobs = sample_tokens(logits, [0.0, 0.5, 0.0], [1.0, 0.9, 1.0], [0, 5, 0], [None] * 3)
    assert logits.shape == (3, meta_runner.vocab_size) and new.device.type == logprobs.device.type == "meta"


def test_bucketed_decode_pads_into_the_scratch_block_without_syncs(meta_runner, prompts):
    cache = meta_runner.new_cache(64, block_size=16)
    decoder = BucketedDecoder(meta_runner, cache, max_batch=6)
    assert decoder.buckets == [1, 2, 4, 6] and decoder.shape_for([3, 70, 5]) == (4, 8)  # 71 keys: 5 -> 8 blocks
    assert decoder.shape_for([3]) == (1, 4)  # at least 64 keys
    s = cache.scratch
    assert decoder.padded([7, 8, 9], [3, 4, 5], [[0], [1, 2], [3]], 4, 4) == (
        [7, 8, 9, 0], [3, 4, 5, 0], [[0, s, s, s], [1, 2, s, s], [3, s, s, s], [s, s, s, s]])
    tables = _tables(cache, [13, 13, 13])
    with DeviceGuard(forbid_syncs=True) as guard:
        logits = decoder([prompts[0][-1], prompts[1][-1], prompts[2][-1]], [10, 11, 12], tables)
    assert logits.shape == (3, meta_runner.vocab_size) and guard.seen_devices == {"meta"}


def test_the_guard_catches_a_cpu_index_and_a_sync(meta_runner):
    with pytest.raises(DeviceMismatch, match="embedding"):
        with DeviceGuard():
            torch.nn.functional.embedding(torch.tensor([1, 2]), meta_runner.embed)
    with pytest.raises(HostSync):
        with DeviceGuard(forbid_syncs=True):
            int(torch.tensor([3, 4]).max())  # what decode did every step before issue 25


def test_sampling_on_a_second_device_needs_generators_there(meta_runner):
    logits = torch.zeros(2, 8, device="meta")
    with pytest.raises(ValueError, match="generator is on cpu, the logits on meta"):
        sample_tokens(logits, [1.0, 1.0], [1.0, 1.0], [0, 0], [torch.Generator(), torch.Generator()])


def test_weight_update_copies_in_place_keeping_addresses(make_engine, hf_tiny):
    from .engine_refs import perturbed_state

    engine = make_engine()
    params = dict(engine.model.named_parameters())
    before = {k: p.data_ptr() for k, p in params.items()}
    fused = [layer.qkv_w.data_ptr() for layer in engine.runner.layers]
    state = perturbed_state(hf_tiny, seed=5)
    engine.update_weights(1, tensors=state)
    assert {k: p.data_ptr() for k, p in params.items()} == before
    assert [layer.qkv_w.data_ptr() for layer in engine.runner.layers] == fused
    q = state["model.layers.0.self_attn.q_proj.weight"]
    torch.testing.assert_close(engine.runner.layers[0].qkv_w[: q.shape[0]], q)  # the fused matrix saw it
    assert engine.runner.embed.device == engine.device == torch.device("cpu")
