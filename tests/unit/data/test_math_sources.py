"""MATH / MATH-500 layouts, per-format prompts, level parsing, and several sources mixed by weight."""
from __future__ import annotations

import collections
import itertools
import json
import shutil

import pytest
from pydantic import ValidationError

from areal_mq.data import (
    SAMPLES,
    DataConfig,
    DataFormatError,
    MixedDataset,
    build_dataset,
    load_eval_problems,
    sample_path,
)
from areal_mq.data.loaders import DEFAULT_TEMPLATES, load_math, math_solution_answer, parse_level, sniff_format
from areal_mq.errors import ConfigError

MATH = [
    {"problem": "What is $\\frac{1}{4} + \\frac{1}{4}$?", "level": "Level 2", "type": "Prealgebra",
     "solution": "First $\\boxed{2/8}$ hmm; reduced, $\\boxed{\\frac{1}{2}}$."},
    {"problem": "Compute $\\sin 60^\\circ$.", "level": "Level 5", "type": "Precalculus",
     "solution": "It is $\\boxed{\\frac{\\sqrt{3}}{2}}$."},
    {"problem": "What is $2+2$?", "level": "Level ?", "type": "Algebra", "solution": "$\\fbox{4}$"},
]
MATH500 = [{"problem": "Solve $x+1=3$.", "solution": "So $x=\\boxed{2}$.", "answer": "2", "subject": "Algebra",
            "level": 1, "unique_id": "test/algebra/1.json"},
           {"problem": "Half of one?", "solution": "It is $\\boxed{0.5}$.", "answer": "\\frac{1}{2}",
            "subject": "Prealgebra", "level": 3, "unique_id": "test/prealgebra/7.json"}]


def _write(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _ids(ds, k):
    return [p.id for p in itertools.islice(ds, k)]


# ---------------------------------------------------------------- MATH layouts
@pytest.mark.parametrize("solution, answer", [
    ("so $x = \\boxed{\\frac{\\sqrt{3}}{2}}$.", "\\frac{\\sqrt{3}}{2}"),      # nested braces
    ("first \\boxed{1}, then \\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),             # the LAST box
    ("the answer is $\\fbox{7}$", "7"),
    ("hence $\\boxed 5$.", "5"),                                             # a few MATH solutions box without braces
])
def test_math_answer_is_the_last_box_braces_matched(solution, answer):
    assert math_solution_answer(solution, "f:1") == answer


@pytest.mark.parametrize("solution, match", [
    ("no box here, the answer is 5", r"f:1: the solution has no \\boxed\{\.\.\.\} answer"),
    ("\\boxed{\\frac{1}{2}", r"f:1: the solution has a \\boxed\{ whose braces never close"),
])
def test_math_solution_without_a_box_is_a_clear_error(solution, match):
    with pytest.raises(DataFormatError, match=match):
        math_solution_answer(solution, "f:1")


@pytest.mark.parametrize("value, level", [("Level 5", 5), ("level 1", 1), (" 3 ", 3), (4, 4), (2.0, 2),
                                          ("Level ?", None), ("?", None), (None, None)])
def test_levels(value, level):
    assert parse_level(value, "f:1") == level


@pytest.mark.parametrize("value", ["hard", "Level five", True, [1]])
def test_unknown_level_names_the_record_and_the_fix(value):
    with pytest.raises(DataFormatError, match=r"f:1: 'level' must be an integer or 'Level N', got .*level_field"):
        parse_level(value, "f:1")


def test_hendrycks_math_records(tmp_path):
    problems = load_math(_write(tmp_path / "math.jsonl", MATH))
    assert [p.answer for p in problems] == ["\\frac{1}{2}", "\\frac{\\sqrt{3}}{2}", "4"]
    assert [p.level for p in problems] == [2, 5, None]
    assert [p.id for p in problems] == ["math-1", "math-2", "math-3"]
    assert problems[1].meta == {"subject": "Precalculus", "solution": MATH[1]["solution"]}
    assert problems[0].prompt == MATH[0]["problem"] + "\nPut your final answer within \\boxed{}."


def test_math500_records_use_answer_and_unique_id(tmp_path):
    problems = load_math(_write(tmp_path / "test.jsonl", MATH500))
    assert [p.id for p in problems] == ["test/algebra/1.json", "test/prealgebra/7.json"]
    assert [p.answer for p in problems] == ["2", "\\frac{1}{2}"]  # the answer field, not the solution's box
    assert [(p.level, p.meta["subject"]) for p in problems] == [(1, "Algebra"), (3, "Prealgebra")]


def test_math_errors_through_the_config(tmp_path):
    path = _write(tmp_path / "m.jsonl", [MATH[0], {**MATH[1], "solution": "It is sqrt(3)/2."}])
    with pytest.raises(DataFormatError, match=r"m\.jsonl:2: the solution has no \\boxed"):
        build_dataset(DataConfig(name=path))
    path = _write(tmp_path / "h.jsonl", [MATH[0], {**MATH[1], "level": "hard"}])
    with pytest.raises(DataFormatError, match=r"h\.jsonl:2: 'level' must be an integer or 'Level N', got 'hard'"):
        build_dataset(DataConfig(name=path))
    assert len(build_dataset(DataConfig(name=path, level_field=None)).problems) == 2  # null: ignore levels


def test_sniff_and_default_template_per_format(tmp_path):
    math_path = _write(tmp_path / "math.jsonl", MATH)
    gsm_path = _write(tmp_path / "gsm.jsonl", [{"question": "1+1?", "answer": "1+1=2\n#### 2"}])
    assert sniff_format(math_path) == "math" and sniff_format(gsm_path) == "gsm8k"
    math_prompt = build_dataset(DataConfig(name=math_path)).problems[0].prompt
    gsm_prompt = build_dataset(DataConfig(name=gsm_path)).problems[0].prompt
    assert math_prompt.endswith("Put your final answer within \\boxed{}.") and "where N" not in math_prompt
    assert gsm_prompt == "1+1?\nEnd your answer with \\boxed{N}, where N is the number."
    assert DEFAULT_TEMPLATES["arith"] == DEFAULT_TEMPLATES["gsm8k"] and "jsonl" not in DEFAULT_TEMPLATES
    own = build_dataset(DataConfig(name=math_path, prompt_template="Q: {problem}", shuffle=False))
    assert own.problems[0].prompt == "Q: " + MATH[0]["problem"]


def test_generic_jsonl_level_field(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"q": "a", "gold": 1, "difficulty": "Level 4"}, {"q": "b", "gold": 2}])
    cfg = DataConfig(name=path, format="jsonl", prompt_template="{q}", answer_field="gold", level_field="difficulty",
                     shuffle=False)
    assert [p.level for p in build_dataset(cfg).problems] == [4, None]
    assert [p.id for p in build_dataset(cfg.model_copy(update={"levels": [4]})).problems] == ["d-1"]


# ---------------------------------------------------------------- storage: the MATH sample three ways
def test_math_sample_as_parquet_jsonl_and_saved_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    pq = pytest.importorskip("pyarrow.parquet")
    train, _ = SAMPLES["math"]
    rows = pq.read_table(train).to_pylist()
    jsonl = _write(tmp_path / "train.jsonl", rows)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved"))
    read = [build_dataset(DataConfig(name=name, shuffle=False)).problems
            for name in (train, jsonl, f"{tmp_path}/saved:train")]
    fields = [[(p.prompt, p.answer, p.level, p.meta["subject"]) for p in problems] for problems in read]
    assert fields[0] == fields[1] == fields[2] and len(fields[0]) == 24
    assert any(answer.startswith("\\frac") for _, answer, _, _ in fields[0])
    assert None in {level for _, _, level, _ in fields[0]}  # a "Level ?" record


def test_shipped_samples_load_in_their_layouts():
    for layout, (train, test) in SAMPLES.items():
        fmt = "gsm8k" if layout == "gsm8k" else "math"
        assert sniff_format(train) == sniff_format(test) == fmt
        held_out = load_eval_problems(DataConfig(name=train, eval_name=test))
        assert len(held_out) == 8 and len(build_dataset(DataConfig(name=train))) == 24
    assert sample_path("math500_sample/test.jsonl") == SAMPLES["math500"][1]
    with pytest.raises(ConfigError, match="no sample file 'nope.jsonl'; the shipped samples are"):
        sample_path("nope.jsonl")


def test_samples_are_what_make_samples_writes(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    from areal_mq.data.samples import HERE
    from areal_mq.data.samples.make_samples import write_all

    write_all(tmp_path)
    for rel in ("gsm8k_sample/train.jsonl", "gsm8k_sample/test.jsonl", "math500_sample/test.jsonl"):
        assert (tmp_path / rel).read_text() == (HERE / rel).read_text(), rel
    for rel in ("math_sample/train.parquet", "math_sample/test.parquet"):
        assert pq.read_table(tmp_path / rel).to_pylist() == pq.read_table(HERE / rel).to_pylist(), rel


# ---------------------------------------------------------------- several sources
def _mix(tmp_path, weights=(3.0, 1.0), seed=0, **kw):
    a = _write(tmp_path / "a" / "train.jsonl", [{"question": f"A{i}?", "answer": f"#### {i}"} for i in range(20)])
    b = _write(tmp_path / "b" / "train.jsonl", [{"question": f"B{i}?", "answer": f"#### {i}"} for i in range(5)])
    return DataConfig(sources=[{"name": a, "weight": weights[0]}, {"name": b, "weight": weights[1]}], seed=seed, **kw)


@pytest.mark.parametrize("weights", [(3.0, 1.0), (1.0, 1.0), (1.0, 4.0)])
def test_draws_follow_the_weights_whatever_the_sizes(tmp_path, weights):
    ds = build_dataset(_mix(tmp_path, weights))
    assert isinstance(ds, MixedDataset) and len(ds) == 25
    counts = collections.Counter(p.meta["source"] for p in itertools.islice(ds, 10_000))
    assert counts["a/train"] / 10_000 == pytest.approx(weights[0] / sum(weights), abs=0.02)
    assert ds.epoch == 399 and ds.consumed == 10_000  # an epoch is len(ds) draws


def test_each_source_cycles_through_its_own_shuffles(tmp_path):
    ds = build_dataset(_mix(tmp_path, (1.0, 1.0)))
    b_ids = [p.id for p in itertools.islice(ds, 200) if p.meta["source"] == "b/train"]
    for k in range(0, len(b_ids) - 5, 5):  # every 5 draws of source b are one of its epochs: a permutation
        assert sorted(b_ids[k:k + 5]) == sorted(f"b/train/train-{i}" for i in range(1, 6))


def test_mix_is_deterministic_per_seed(tmp_path):
    first = _ids(build_dataset(_mix(tmp_path)), 100)
    assert _ids(build_dataset(_mix(tmp_path)), 100) == first
    assert _ids(build_dataset(_mix(tmp_path, seed=1)), 100) != first


@pytest.mark.parametrize("taken", [0, 1, 24, 25, 26, 77])
def test_mix_resume_continues_exactly(tmp_path, taken):
    expected = _ids(build_dataset(_mix(tmp_path)), 120)
    ds = build_dataset(_mix(tmp_path))
    _ids(ds, taken)
    state = json.loads(json.dumps(ds.state_dict()))  # a JSON checkpoint
    resumed = build_dataset(_mix(tmp_path))
    resumed.load_state_dict(state)
    assert _ids(resumed, 120 - taken) == expected[taken:]


def test_mix_resume_refuses_other_weights_or_sources(tmp_path):
    ds = build_dataset(_mix(tmp_path))
    next(ds)
    state = ds.state_dict()
    with pytest.raises(ConfigError, match="different data or ordering"):
        build_dataset(_mix(tmp_path, (2.0, 1.0))).load_state_dict(state)
    with pytest.raises(ConfigError, match="'sources' must list 2 source positions"):
        build_dataset(_mix(tmp_path)).load_state_dict({**state, "sources": []})


def test_epoch_limit_of_a_mix(tmp_path):
    assert len(list(build_dataset(_mix(tmp_path, epochs=2)))) == 50


def test_ids_stay_unique_across_sources_with_the_same_ids(tmp_path):
    one = _write(tmp_path / "x" / "math" / "train.jsonl", MATH)
    shutil.copytree(tmp_path / "x", tmp_path / "y")
    cfg = DataConfig(sources=[{"name": one}, {"name": str(tmp_path / "y" / "math" / "train.jsonl")}])
    ids = [p.id for p in build_dataset(cfg).problems]
    assert len(set(ids)) == 6 and ids[0] == "x/math/train/train-1" and ids[3] == "y/math/train/train-1"


def test_one_source_is_a_plain_dataset(tmp_path):
    path = _write(tmp_path / "math.jsonl", MATH)
    via_sources = build_dataset(DataConfig(sources=[{"name": path}], name="ignored.jsonl"))
    assert [p.id for p in via_sources.problems] == ["math-1", "math-2", "math-3"]
    assert _ids(via_sources, 6) == _ids(build_dataset(DataConfig(name=path)), 6)


def test_eval_is_the_interleaved_union_of_the_sources_splits(tmp_path):
    m = _write(tmp_path / "math" / "train.jsonl", MATH)
    m500 = _write(tmp_path / "math500" / "test.jsonl", MATH500)
    g = _write(tmp_path / "gsm8k" / "train.jsonl", [{"question": "1+1?", "answer": "#### 2"}])
    g_test = _write(tmp_path / "gsm8k" / "test.jsonl", [{"question": f"{i}+1?", "answer": f"#### {i + 1}"}
                                                        for i in range(3)])
    cfg = DataConfig(sources=[{"name": m, "eval_name": m500, "weight": 2}, {"name": g, "eval_name": g_test}])
    held_out = load_eval_problems(cfg)
    # labelled like the training source (math/train.jsonl, gsm8k/train.jsonl: the stems alone would clash)
    assert [p.id for p in held_out] == ["math/train/test/algebra/1.json", "gsm8k/train/test-1",
                                        "math/train/test/prealgebra/7.json", "gsm8k/train/test-2", "gsm8k/train/test-3"]
    assert [p.meta["source"] for p in held_out[:2]] == ["math/train", "gsm8k/train"]
    assert [p.id for p in load_eval_problems(cfg.model_copy(update={"eval_size": 1}))] == [
        "math/train/test/algebra/1.json", "gsm8k/train/test-1"]  # eval_size caps each set
    # a top-level eval_name is one more held-out set, read with the top-level mapping
    other = _write(tmp_path / "extra" / "test.jsonl", MATH)
    extra = load_eval_problems(cfg.model_copy(update={"eval_name": other}))
    assert len(extra) == 8 and {p.meta["source"] for p in extra} == {"math/train", "gsm8k/train", "test"}
    same = load_eval_problems(cfg.model_copy(update={"eval_name": m}))  # the training file of a source as well
    assert len({p.id for p in same}) == 8 and "math/train-eval" in {p.meta["source"] for p in same}
    assert load_eval_problems(DataConfig(sources=[{"name": m}])) == []  # no eval_name anywhere: no eval set
    assert cfg.has_eval_set() and not DataConfig(sources=[{"name": m}]).has_eval_set()


def test_a_source_falls_back_to_the_top_level_mapping(tmp_path):
    a = _write(tmp_path / "a.jsonl", [{"q": "x", "gold": 1, "lv": "Level 2"}])
    b = _write(tmp_path / "b.jsonl", [{"text": "y", "sol": "\\frac{1}{3}"}])
    cfg = DataConfig(format="jsonl", prompt_template="{q}", answer_field="gold", level_field="lv", sources=[
        {"name": a}, {"name": b, "prompt_template": "{text}!", "answer_field": "sol"}])
    problems = sorted(build_dataset(cfg).problems, key=lambda p: p.id)
    assert [(p.id, p.prompt, p.answer, p.level) for p in problems] == [
        ("a/a-1", "x", "1", 2), ("b/b-1", "y!", "\\frac{1}{3}", None)]


def test_sources_validation(tmp_path):
    with pytest.raises(ValidationError, match="data.sources is empty"):
        DataConfig(sources=[])
    with pytest.raises(ValidationError, match="lists \\['a.jsonl'\\] more than once"):
        DataConfig(sources=[{"name": "a.jsonl"}, {"name": "a.jsonl", "weight": 2}])
    with pytest.raises(ValidationError, match=r"data.sources\[1\] \(b.jsonl\): format 'jsonl' needs prompt_template"):
        DataConfig(sources=[{"name": "a.jsonl"}, {"name": "b.jsonl", "format": "jsonl"}])
    with pytest.raises(ValidationError, match="greater than 0"):
        DataConfig(sources=[{"name": "a.jsonl", "weight": 0}])
    with pytest.raises(ConfigError, match="training source .* is empty after filtering by levels"):
        build_dataset(_mix(tmp_path, levels=[1]))  # GSM8K has no levels
