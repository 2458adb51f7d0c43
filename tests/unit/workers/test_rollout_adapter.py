"""A LoRA version (WeightsReady.adapter) through the rollout worker's real load path: published on disk, read by
the catch-up, merged by the torch engine from its base; an engine that takes no adapters refuses it by name."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from areal_mq.config import load_config  # noqa: E402
from areal_mq.messages import WeightsAdapter  # noqa: E402
from areal_mq.testing import FakeRuntime  # noqa: E402
from areal_mq.weights.adapter import merge  # noqa: E402
from areal_mq.weights.disk import publish_disk  # noqa: E402
from areal_mq.workers.rollout import RolloutWorker  # noqa: E402

from .test_rollout_worker_logic import FakeEngine  # noqa: E402


def _adapter(model, rank=2):
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, p in model.named_parameters():
        if name.endswith(("q_proj.weight", "down_proj.weight")):
            module = name.removesuffix(".weight")
            out[module + ".lora_A.weight"] = torch.randn(rank, p.shape[1], generator=g) * 0.2
            out[module + ".lora_B.weight"] = torch.randn(p.shape[0], rank, generator=g) * 0.2
    return out


def _worker(tmp_path, engine):
    cfg = load_config(None, [f"run.run_dir={tmp_path}"])
    rt = FakeRuntime("generate", "rollout-test", role="rollout")
    return RolloutWorker(cfg, engine, rt), rt


def test_an_adapter_version_on_disk_is_merged_by_the_torch_engine(tmp_path):
    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.models import resolve_model
    from areal_mq.engines.torch.engine import TorchEngine

    engine = TorchEngine(resolve_model("tiny-random-llama"), EngineConfig(seed=0, threads=1))
    base = {k: v.detach().clone() for k, v in engine.model.named_parameters()}
    adapter = _adapter(engine.model)
    ready = publish_disk(tmp_path / "weights", 1, adapter).model_copy(
        update={"adapter": WeightsAdapter(rank=2, alpha=4.0, target_modules=["q_proj", "down_proj"])})
    worker, rt = _worker(tmp_path, engine)
    worker.load(ready)
    assert engine.version == 1
    want = merge(base, adapter, 2.0)
    params = dict(engine.model.named_parameters())
    assert len(want) == 4 and all(torch.equal(params[k], v) for k, v in want.items())
    untouched = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(params[untouched], base[untouched])
    (updated,) = [f for _, e, f in rt.log.records if e == "rollout.weights_updated"]
    assert updated["version"] == 1 and updated["tensors"] == 4.0


def test_an_engine_without_adapters_refuses_an_adapter_version_by_name(tmp_path):
    engine = FakeEngine()
    adapter = {"m.lora_A.weight": torch.zeros(2, 3), "m.lora_B.weight": torch.zeros(3, 2)}
    ready = publish_disk(tmp_path / "weights", 1, adapter).model_copy(
        update={"adapter": WeightsAdapter(rank=2, alpha=4.0)})
    worker, rt = _worker(tmp_path, engine)
    worker.load(ready)
    assert engine.version == 0 and engine.loads == []
    errors = [f["error"] for _, e, f in rt.log.records if e in ("rollout.weights_retry", "rollout.weights_failed")]
    assert errors and "takes no adapters" in errors[0]


def test_an_adapter_of_another_base_costs_that_version_not_the_worker(tmp_path):
    """WeightsAdapter.base_checksum against the engine's own base (lora.base_identity of the directory it started
    from, computed once): another base is refused by name and the worker keeps its weights; its own is merged."""
    from areal_mq.algorithms.lora import base_identity
    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.models import resolve_model
    from areal_mq.engines.torch.engine import TorchEngine
    from areal_mq.workers import rollout

    assert rollout.WEIGHTS_LOAD_ATTEMPTS > 1  # a base mismatch is final at the first attempt whatever the limit
    engine = TorchEngine(resolve_model("tiny-random-llama"), EngineConfig(seed=0, threads=1))
    base = {k: v.detach().clone() for k, v in engine.model.named_parameters()}
    adapter = _adapter(engine.model)
    worker, rt = _worker(tmp_path, engine)
    ours = base_identity(engine.model_dir)["sha256"]
    for version, named in ((1, "0" * 64), (2, ours)):
        ready = publish_disk(tmp_path / "weights", version, adapter).model_copy(update={"adapter": WeightsAdapter(
            rank=2, alpha=4.0, target_modules=["q_proj", "down_proj"], base_checksum=named)})
        worker.load(ready)
        if version == 1:
            assert engine.version == 0
            assert all(torch.equal(p, base[k]) for k, p in engine.model.named_parameters())
            (failed,) = [f for _, e, f in rt.log.records if e == "rollout.weights_failed"]
            assert "is refused" in failed["error"] and ours[:16] in failed["error"] and failed["attempts"] == 1
            assert not [e for _, e, _ in rt.log.records if e == "rollout.weights_retry"] and worker.retry_load is None
    assert engine.version == 2 and worker.catchup._base == ours
    params = dict(engine.model.named_parameters())
    assert all(torch.equal(params[k], v) for k, v in merge(base, adapter, 2.0).items())


def test_an_evaluation_refuses_an_adapter_of_another_base_and_merges_its_own(tmp_path):
    """load_version_dir (areal-mq eval, periodic evaluations): the same base check as the rollout worker's, before
    anything is merged; an adapter that names no base is merged as before."""
    from areal_mq.algorithms.lora import base_identity
    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.models import resolve_model
    from areal_mq.engines.torch.engine import TorchEngine
    from areal_mq.errors import WeightsBaseMismatch
    from areal_mq.weights.disk import load_version_dir

    engine = TorchEngine(resolve_model("tiny-random-llama"), EngineConfig(seed=0, threads=1))
    base = {k: v.detach().clone() for k, v in engine.model.named_parameters()}
    adapter = _adapter(engine.model)
    ours = base_identity(engine.model_dir)["sha256"]
    for version, named in ((1, "0" * 64), (2, ours), (3, "")):
        publish_disk(tmp_path / "weights", version, adapter, keep=5, adapter=WeightsAdapter(
            rank=2, alpha=4.0, target_modules=["q_proj", "down_proj"], base_checksum=named))
    with pytest.raises(WeightsBaseMismatch, match="another|trained on the base") as err:
        load_version_dir(engine, 1, tmp_path / "weights" / "v1")
    assert ours[:16] in str(err.value) and engine.version == 0
    assert all(torch.equal(p, base[k]) for k, p in engine.model.named_parameters())
    for version in (2, 3):
        load_version_dir(engine, version, tmp_path / "weights" / f"v{version}")
        params = dict(engine.model.named_parameters())
        assert engine.version == version and all(torch.equal(params[k], v) for k, v in merge(base, adapter, 2.0).items())
