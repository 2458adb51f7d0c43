"""The shipped arith splits: deterministic, disjoint by problem and by (operands, operator), well formed."""
from __future__ import annotations

import json

import pytest

from areal_mq.data import arith_problems as arith


def _read(split: str) -> list[dict]:
    return [json.loads(line) for line in arith.shipped_path(split).read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def shipped():
    return _read("train"), _read("test")


def test_shipped_files_equal_the_generator_output(shipped):
    train, test = arith.generate_splits()
    assert (train, test) == shipped, "shipped files are stale: run python -m areal_mq.data.arith_problems"


def test_generation_is_deterministic_and_seed_dependent():
    assert arith.generate_splits(7) == arith.generate_splits(7)
    assert arith.generate_splits(7)[1] != arith.generate_splits(8)[1]


def test_splits_are_disjoint_by_key_and_text(shipped):
    train, test = shipped
    assert not {arith.key_of(r) for r in train} & {arith.key_of(r) for r in test}
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    # Commutative problems share a key whatever the operand order ("3 + 4" vs "4 + 3").
    assert arith.key_of({"op": "+", "operands": [4, 3]}) == arith.key_of({"op": "+", "operands": [3, 4]})


def test_test_split_has_enough_problems_of_every_level(shipped):
    _, test = shipped
    assert len(test) >= 200
    assert len({arith.key_of(r) for r in test}) == len(test)  # one problem per held-out key
    levels = dict(arith.iter_levels(test))
    assert set(levels) == {1, 2, 3} and min(levels.values()) >= 30


def test_records_are_well_formed_and_answers_right(shipped):
    for split in shipped:
        ids = [r["id"] for r in split]
        assert len(set(ids)) == len(ids)
        for r in split:
            assert set(r) == {"id", "question", "answer", "level", "op", "operands"}
            assert r["answer"] == arith.answer_of((r["op"], *r["operands"]))
            assert isinstance(r["answer"], int) and r["answer"] >= 0
            # Every operand appears in the wording, so the problem is solvable from the text.
            for x in r["operands"]:
                assert str(x) in r["question"]
            assert len(r["question"]) < 160  # short prompts: decode time on CPU


def test_level_definitions():
    assert arith.answer_of(("+", 3, 4)) == 7
    assert arith.answer_of(("-", 9, 5)) == 4
    assert arith.answer_of(("*", 7, 8)) == 56
    assert arith.answer_of(("+-", 6, 5, 3)) == 8
    with pytest.raises(ValueError, match="unknown arith op"):
        arith.answer_of(("/", 1, 2))
    for pool in arith.POOLS:
        for key in pool.keys():
            assert key[0] == pool.op
            if pool.level == 1:
                assert all(1 <= x <= 9 for x in key[1:])
            if pool.level == 2:
                assert all(10 <= x <= 99 for x in key[1:])


def test_singular_for_one():
    import random

    assert arith.render(("-", 1, 1), random.Random(0), "{a} apples, {b} cards") == "1 apple, 1 card"
    assert arith.render(("-", 11, 1), random.Random(0), "{a} apples") == "11 apples"


def test_write_splits_and_cli(tmp_path, capsys):
    arith.main(["--out", str(tmp_path), "--seed", "3"])
    assert "test:" in capsys.readouterr().out
    train, test = arith.generate_splits(3)
    assert (tmp_path / arith.TEST_FILE).read_text(encoding="utf-8") == arith.to_jsonl(test)
    assert (tmp_path / arith.TRAIN_FILE).read_text(encoding="utf-8") == arith.to_jsonl(train)


def test_pool_cannot_hold_out_all_keys():
    pool = arith.KeyPool(1, "+", lambda: arith._add_keys(1, 2), n_test=3, n_train=1)
    with pytest.raises(ValueError, match="cannot hold out"):
        arith.generate_splits(0, (pool,))


def test_shipped_path_rejects_unknown_split():
    with pytest.raises(ValueError, match="one of \\['test', 'test_large', 'train'\\]"):
        arith.shipped_path("dev")


def test_large_heldout_set(shipped):
    """>= 1,000 held-out problems: the shipped 220 first and unchanged, levels in the same proportions, no
    arithmetic (key) shared with training, no question twice; the shipped file equals the generator output."""
    train, test = shipped
    large = _read("test_large")
    assert large == arith.generate_large_test(), "shipped large set is stale: run python -m areal_mq.data.arith_problems"
    assert len(large) >= 1000 and large[: len(test)] == test
    assert {k: v * arith.LARGE_FACTOR for k, v in arith.iter_levels(test)} == dict(arith.iter_levels(large))
    assert not {arith.key_of(r) for r in large} & {arith.key_of(r) for r in train}
    assert len({r["question"] for r in large}) == len(large) and len({r["id"] for r in large}) == len(large)
    assert all(r["answer"] == arith.answer_of(arith.key_of(r)) for r in large)
    fresh = {arith.key_of(r) for r in large} - {arith.key_of(r) for r in test}
    assert len(fresh) >= 300, "the large set should bring new arithmetic where the key space allows"


def test_large_set_is_an_eval_source():
    from areal_mq.data import DataConfig, load_eval_problems

    problems = load_eval_problems(DataConfig(eval_name="arith:test-large"))
    assert len(problems) == 1100 and problems[0].id == "arith-test-00000"
