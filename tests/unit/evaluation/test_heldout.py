"""Held-out evaluation runs through the engine with more problems than slots (queueing, KV growth and
slot compaction) and grades every problem, strict and lenient."""
from areal_mq.config import load_config
from areal_mq.evaluation import heldout
from areal_mq.evaluation.heldout import evaluate


def test_evaluate_more_problems_than_slots(monkeypatch):
    monkeypatch.setattr(heldout, "EVAL_BATCH", 3)  # 3 slots for 10 problems (the default decodes 128 at once)
    cfg = load_config(None, ["model.name=tiny-random-llama", "rollout.engine.max_concurrent=3",
                             "controller.max_new_tokens=40"])
    result = evaluate(cfg, n=10, progress=False)
    assert result["n"] == 10 and sum(v["n"] for v in result["by_level"].values()) == 10
    assert result["truncated"] == 1.0  # a random model never stops by itself within 40 tokens


def test_the_evaluation_engine_runs_on_the_rollout_device(monkeypatch):
    """rollout.device (set for a GPU that generates beside a trainer on another) decides where the held-out
    engine runs; without it model.device does."""
    seen = []
    monkeypatch.setattr("areal_mq.engines.build_engine", lambda *a, **kw: seen.append(kw["device"]))
    base = ["model.name=tiny-random-llama", "model.device=cpu"]
    heldout.eval_setup(load_config(None, base), n=2)
    heldout.eval_setup(load_config(None, [*base, "rollout.device=meta"]), n=2)
    assert seen == ["cpu", "meta"]


def test_an_evaluation_leaves_no_engine_behind(monkeypatch):
    """The launcher evaluates in its own process: once evaluate returns, its engine (model weights, KV pool) is
    garbage and the device's cached memory was handed back (issue 39: evaluations release device memory)."""
    import weakref

    from areal_mq.engines import build_engine

    refs, released = [], []

    def tracked(*a, **kw):
        engine = build_engine(*a, **kw)
        refs.append(weakref.ref(engine.model))
        return engine

    monkeypatch.setattr("areal_mq.engines.build_engine", tracked)
    monkeypatch.setattr("areal_mq.devices.release_device_memory", lambda: released.append(1))
    cfg = load_config(None, ["model.name=tiny-random-llama", "controller.max_new_tokens=4"])
    evaluate(cfg, n=2, progress=False)
    import gc

    gc.collect()
    assert refs and refs[0]() is None, "the evaluation's model is still referenced"
    assert released == [1]
