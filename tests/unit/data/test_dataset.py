"""Dataset iteration: epochs, seeded shuffle, resumable position; building from DataConfig."""
from __future__ import annotations

import itertools
import json

import pytest
from pydantic import ValidationError

from areal_mq.data import DataConfig, DataFormatError, Dataset, Problem, build_dataset, load_eval_problems
from areal_mq.errors import ConfigError


def _problems(n: int) -> list[Problem]:
    return [Problem(id=f"p{i}", prompt=f"What is {i} + 1?", answer=str(i + 1)) for i in range(n)]


def _ids(ds, k):
    return [p.id for p in itertools.islice(ds, k)]


def test_every_epoch_is_a_permutation_with_its_own_seeded_order():
    ds = Dataset(_problems(10), seed=3)
    e0, e1 = _ids(ds, 10), _ids(ds, 10)
    assert sorted(e0) == sorted(e1) == sorted(p.id for p in _problems(10))
    assert e0 != e1 and ds.epoch == 1 and ds.consumed == 20
    assert _ids(Dataset(_problems(10), seed=3), 20) == e0 + e1  # deterministic
    assert _ids(Dataset(_problems(10), seed=4), 10) != e0


def test_no_shuffle_keeps_file_order():
    assert _ids(Dataset(_problems(4), shuffle=False), 6) == ["p0", "p1", "p2", "p3", "p0", "p1"]


def test_epoch_limit_stops():
    ds = Dataset(_problems(3), epochs=2)
    assert len(list(ds)) == 6
    with pytest.raises(StopIteration):
        next(ds)


@pytest.mark.parametrize("taken", [0, 1, 7, 10, 13])
def test_resume_continues_exactly(taken):
    ref = Dataset(_problems(10), seed=1)
    expected = _ids(ref, 30)
    ds = Dataset(_problems(10), seed=1)
    _ids(ds, taken)
    state = json.loads(json.dumps(ds.state_dict()))  # must survive a JSON checkpoint
    resumed = Dataset(_problems(10), seed=1)
    resumed.load_state_dict(state)
    assert _ids(resumed, 30 - taken) == expected[taken:]


def test_resume_refuses_other_data_or_order():
    ds = Dataset(_problems(10), seed=1)
    next(ds)
    state = ds.state_dict()
    with pytest.raises(ConfigError, match="different data or ordering"):
        Dataset(_problems(11), seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="different data or ordering"):
        Dataset(_problems(10), seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="bad dataset state"):
        Dataset(_problems(10), seed=1).load_state_dict({"epoch": 0})
    with pytest.raises(ConfigError, match="out of range"):
        Dataset(_problems(10), seed=1).load_state_dict({**state, "index": 11})


def test_empty_dataset_is_a_config_error():
    with pytest.raises(ConfigError, match="empty"):
        Dataset([])


def test_default_config_builds_arith_train_and_test():
    cfg = DataConfig()
    ds = build_dataset(cfg)
    held_out = load_eval_problems(cfg)
    assert len(ds) > 1000 and len(held_out) >= 200
    assert {p.id for p in ds.problems}.isdisjoint({p.id for p in held_out})
    assert all(p.prompt.endswith("\nEnd your answer with \\boxed{N}, where N is the number.") for p in held_out)
    assert {p.level for p in held_out} == {1, 2, 3}


def test_config_filters_and_limits():
    cfg = DataConfig(levels=[1], max_problems=50, eval_size=10, shuffle=False)
    ds = build_dataset(cfg)
    assert len(ds) == 50 and {p.level for p in ds.problems} == {1}
    assert len(load_eval_problems(cfg)) == 10
    with pytest.raises(ConfigError, match="empty"):
        build_dataset(DataConfig(levels=[9]))


def test_file_sources(tmp_path):
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n", encoding="utf-8")
    cfg = DataConfig(name=str(gsm))
    assert [p.answer for p in build_dataset(cfg).problems] == ["2"]
    assert load_eval_problems(cfg) == []  # a file source has no implicit held-out set
    assert load_eval_problems(cfg.model_copy(update={"eval_name": str(gsm)}))[0].answer == "2"

    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"text": "2*3?", "y": 6}) + "\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match="set data.prompt_template"):
        build_dataset(DataConfig(name=str(plain)))
    ds = build_dataset(DataConfig(name=str(plain), prompt_template="{text} Box it: \\boxed{}", answer_field="y"))
    assert ds.problems[0].prompt == "2*3? Box it: \\boxed{}" and ds.problems[0].answer == "6"


def test_config_validation():
    with pytest.raises(ValidationError, match="needs prompt_template"):
        DataConfig(format="jsonl")
    with pytest.raises(ValidationError, match="only for the built-in"):
        DataConfig(name="x.jsonl", format="arith")
    with pytest.raises(ValidationError):
        DataConfig(shuffle_seed=1)  # extra fields are rejected
    assert DataConfig(name="arith:test").resolved_eval_name() == "arith:test"
