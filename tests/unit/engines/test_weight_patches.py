"""Weight patches: the engine writes only the elements a verified delta changed, and ends up with exactly the
parameters a full load of the new version gives (bf16 published, fp32 engine: the same upcast)."""
from __future__ import annotations

import pytest
import torch

from areal_mq.errors import WeightsLoadError
from areal_mq.weights.delta import DeltaError, changed_elements


def published(engine, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """The engine's weights as a trainer would publish them (one tensor per tied group, in `dtype`)."""
    seen, out = set(), {}
    for name, p in engine.model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            out[name] = p.detach().to(dtype).clone()
    return out


def step(tensors: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    """A small update: `frac` of each tensor's elements moved (as bf16 RL steps move a few percent)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        flat = t.float().reshape(-1).clone()
        hit = torch.rand(flat.numel(), generator=g) < frac
        flat[hit] += 0.01 * torch.randn(int(hit.sum()), generator=g)
        out[name] = flat.reshape(t.shape).to(t.dtype)
    return out


def params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def test_patches_give_what_a_full_load_gives_and_keep_storage(make_engine):
    patched, loaded = make_engine(), make_engine()
    v0 = published(patched)
    patched.update_weights(0, tensors=v0)
    loaded.update_weights(0, tensors=v0)
    ptrs = {n: p.data_ptr() for n, p in patched.model.named_parameters()}
    held = v0
    for v in range(1, 6):
        new = step(held, 0.02, seed=v)
        patches = changed_elements(held, new)
        assert 0 < sum(len(pos) for pos, _ in patches.values()) < 0.05 * sum(t.numel() for t in new.values())
        timings = patched.update_weights(v, patches=patches)
        loaded.update_weights(v, tensors=new)
        assert patched.version == v and timings["tensors"] == sum(len(pos) for pos, _ in patches.values())
        a, b = params(patched), params(loaded)
        assert all(torch.equal(a[n].view(torch.int32), b[n].view(torch.int32)) for n in a), f"v{v} differs"
        held = new
    assert ptrs == {n: p.data_ptr() for n, p in patched.model.named_parameters()}  # in place: same storage


def test_changed_elements_are_bits(make_engine):
    a = {"w": torch.tensor([0.0, 1.0, float("nan"), 2.0])}
    b = {"w": torch.tensor([-0.0, 1.0, float("nan"), 3.0])}
    positions, values = changed_elements(a, b)["w"]
    assert positions.tolist() == [0, 3] and torch.equal(values, torch.tensor([-0.0, 3.0]))
    assert changed_elements(a, a) == {}
    with pytest.raises(DeltaError, match="different tensors"):
        changed_elements(a, {"v": b["w"]})
    with pytest.raises(DeltaError, match="held torch.float32"):
        changed_elements(a, {"w": b["w"].to(torch.bfloat16)})


@pytest.mark.parametrize("patches, match", [
    ({"nope.weight": (torch.tensor([0]), torch.tensor([1.0]))}, "does not have"),
    ({"model.norm.weight": (torch.tensor([0, 1]), torch.tensor([1.0]))}, "2 positions for 1 values"),
    ({"model.norm.weight": (torch.tensor([10 ** 9]), torch.tensor([1.0]))}, "writes outside"),
    ({"model.norm.weight": (torch.tensor([-1]), torch.tensor([1.0]))}, "writes outside"),
])
def test_bad_patches_change_nothing(make_engine, patches, match):
    engine = make_engine()
    before, version = params(engine), engine.version
    good = {"model.layers.0.mlp.up_proj.weight": (torch.tensor([0]), torch.tensor([5.0]))}
    with pytest.raises(WeightsLoadError, match=match):
        engine.update_weights(version + 1, patches={**good, **patches})
    after = params(engine)
    assert engine.version == version and all(torch.equal(before[n], after[n]) for n in before)


def test_a_tied_tensor_patched_under_both_names_is_refused(make_engine):
    engine = make_engine()
    names = [n for n, _ in engine.model.named_parameters(remove_duplicate=False)]
    if "lm_head.weight" not in names or "model.embed_tokens.weight" not in names:
        pytest.skip("the tiny model has no tied embedding")
    one = (torch.tensor([0]), torch.tensor([1.0]))
    with pytest.raises(WeightsLoadError, match="tied tensor twice"):
        engine.update_weights(1, patches={"lm_head.weight": one, "model.embed_tokens.weight": one})


def test_a_non_contiguous_parameter_is_patched_through_its_strides():
    from areal_mq.engines.torch.weights import patch_weights_in_place

    m = torch.nn.Linear(4, 6)
    m.weight = torch.nn.Parameter(torch.zeros(4, 6).t())  # a 6x4 view, as a fused tensor's slice can be
    assert not m.weight.is_contiguous()
    patch_weights_in_place(m, {"weight": (torch.tensor([0, 5, 23]), torch.tensor([1.0, 2.0, 3.0]))})
    flat = m.weight.detach().reshape(-1)
    assert flat[[0, 5, 23]].tolist() == [1.0, 2.0, 3.0] and float(flat.sum()) == 6.0


def test_staged_patches_give_the_same_weights_and_are_bound_to_their_model(make_engine):
    from areal_mq.engines.torch.weights import patch_weights_in_place, stage_patches

    staged_engine, plain_engine, other = make_engine(), make_engine(), make_engine()
    v0 = published(staged_engine)
    patches = changed_elements(v0, step(v0, 0.02, seed=5))
    staged = stage_patches(staged_engine.model, patches)  # what the rollout worker does on its fetch thread
    assert params(staged_engine).keys() and all(w[2].dtype == w[0].dtype for w in staged.writes)
    assert patch_weights_in_place(staged_engine.model, staged) == patch_weights_in_place(plain_engine.model, patches)
    for name, p in params(plain_engine).items():
        assert torch.equal(params(staged_engine)[name], p), name
    before = params(other)
    with pytest.raises(WeightsLoadError, match="staged for another model"):
        patch_weights_in_place(other.model, staged)
    assert all(torch.equal(before[n], p) for n, p in params(other).items())
