"""eval.via: a bad value is a clear error; with via rollout the plan counts no evaluation engine (it says where the
evaluation runs instead) and a Ray layout with GPUs is accepted, while via process keeps today's refusals.
Run: pytest tests/unit/evaluation/test_via_rollout_config.py -q
"""
from __future__ import annotations

import pytest

from areal_mq.config import config_from_dict, load_config
from areal_mq.errors import ConfigError
from areal_mq.launch.plan import GIB, make_plan


def test_a_bad_eval_via_names_the_field_and_the_choices():
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["eval.via=engine"])
    assert "eval.via" in str(exc.value) and "'process' or 'rollout'" in str(exc.value)


def test_under_ray_with_gpus_only_the_evaluation_process_is_refused():
    ray = {"launcher": {"backend": "ray"}, "placement": {"rollout": {"gpus_per_process": 1}}}
    with pytest.raises(ConfigError) as exc:
        config_from_dict({**ray, "eval": {"every": 5}})
    assert "eval.via: rollout" in str(exc.value)
    assert config_from_dict({**ray, "eval": {"every": 5, "via": "rollout"}}).eval.via == "rollout"


def test_via_rollout_the_plan_counts_no_evaluation_engine_and_says_where_it_runs(tmp_path):
    from areal_mq.engines.shapes import hf_config

    model = tmp_path / "qwen2.5-7b"
    hf_config("qwen2.5-7b").save_pretrained(str(model))
    base = {"model": {"name": str(model), "dtype": "bfloat16", "device": "cuda"}, "eval": {"every": 10},
            "trainer": {"strategy": "fsdp"}, "launcher": {"trainer_ranks": 2, "rollout_workers": 1},
            "placement": {"trainer": {"gpus": [0, 1]}, "rollout": {"gpus": [2]}},
            "rollout": {"engine": {"kv_cache_bytes": 48 * GIB, "max_concurrent": 128}}}
    beside = make_plan(config_from_dict(base), device_gib=80)  # the second engine does not fit beside engine 0
    assert any("periodic evaluation" in r for r in beside.refusals), beside.table()
    via = make_plan(config_from_dict({**base, "eval": {"every": 10, "via": "rollout"}}), device_gib=80)
    assert not via.refusals, via.table()
    assert not [p for p in via.processes if p.role.startswith("evaluation")]
    assert any("through the rollout engines, no engine of its own" in n for n in via.notes), via.notes


def test_the_launcher_says_each_evaluation_through_the_rollout_engines_once(tmp_path):
    import json

    from areal_mq.evaluation.periodic import RolloutEvalNotes

    (tmp_path / "events").mkdir()
    records = [{"event": "controller.stats"},
               {"event": "controller.eval_done", "version": 2, "strict": 0.25, "lenient": 0.5, "n": 8, "seconds": 1.5},
               {"event": "controller.eval_skipped", "version": 4, "reason": "p1: [version_passed] the worker holds 5"}]
    (tmp_path / "events" / "controller.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    notes = RolloutEvalNotes(tmp_path)
    lines = notes.poll().splitlines()
    assert "v2 strict 25.0% lenient 50.0% (n=8" in lines[0]
    assert lines[1] == "periodic eval of v4 skipped: p1: (version_passed) the worker holds 5"  # no rich markup
    assert notes.poll() is None
