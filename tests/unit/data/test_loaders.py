"""GSM8K and generic JSONL loaders, placeholder templates, and the clear errors on bad files."""
from __future__ import annotations

import json

import pytest

from areal_mq.data.loaders import (
    DEFAULT_MATH_TEMPLATE,
    DataFormatError,
    fill_template,
    load_gsm8k,
    load_records,
    sniff_format,
    template_fields,
)
from areal_mq.errors import ConfigError


def _write(path, lines):
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines), encoding="utf-8")
    return path


GSM = [
    {"question": "Nat has 3 cats and buys 2. How many?", "answer": "3 + 2 = <<3+2=5>>5\n#### 5"},
    {"question": "A farm sells 1,200 eggs a day. Eggs in 2 days?", "answer": "1,200 * 2 = 2,400\n#### 2,400"},
    {"question": "Debt?", "answer": "She owes money.\n####  -7 "},
]


def test_gsm8k_parses_final_answer_and_keeps_solution(tmp_path):
    problems = load_gsm8k(_write(tmp_path / "gsm.jsonl", GSM))
    assert [p.answer for p in problems] == ["5", "2400", "-7"]
    assert [p.id for p in problems] == ["gsm-1", "gsm-2", "gsm-3"]  # file stem + line when there is no id
    assert problems[0].prompt == (
        "Nat has 3 cats and buys 2. How many?\nEnd your answer with \\boxed{N}, where N is the number."
    )
    assert problems[0].meta["solution"] == "3 + 2 = <<3+2=5>>5"
    assert problems[0].level is None


@pytest.mark.parametrize(
    "bad_line,match",
    [
        ({"answer": "#### 5"}, r"gsm\.jsonl:2: missing field 'question'"),
        ({"question": "q"}, r"gsm\.jsonl:2: missing field 'answer'"),
        ({"question": "q", "answer": "5"}, r"gsm\.jsonl:2: answer has no final '#### N' line"),
        ('{"question": "q", "answer": ', r"gsm\.jsonl:2: invalid JSON"),
        ("[1, 2]", r"gsm\.jsonl:2: expected a JSON object, got list"),
    ],
)
def test_gsm8k_bad_lines_name_file_line_and_problem(tmp_path, bad_line, match):
    path = _write(tmp_path / "gsm.jsonl", [GSM[0], bad_line])
    with pytest.raises(DataFormatError, match=match):
        load_gsm8k(path)


def test_generic_jsonl_with_template(tmp_path):
    path = _write(tmp_path / "data.jsonl", [
        {"id": "a", "q": "2+2", "unit": "apples", "gold": 4, "level": 1},
        {"id": "b", "q": "1/4", "unit": "pies", "gold": "0.25"},
        {"id": "c", "q": "name?", "unit": "-", "gold": "Ada"},
    ])
    problems = load_records(path, "Compute {q} ({unit}). Answer in \\boxed{}, e.g. {{x}}.", answer_field="gold")
    assert [p.id for p in problems] == ["a", "b", "c"]
    assert problems[0].prompt == "Compute 2+2 (apples). Answer in \\boxed{}, e.g. {x}."
    assert [p.answer for p in problems] == ["4", "0.25", "Ada"]  # numbers canonical, other strings kept
    assert [p.level for p in problems] == [1, None, None]
    assert problems[0].meta == {"q": "2+2", "unit": "apples", "level": 1}


@pytest.mark.parametrize(
    "record,match",
    [
        ({"id": "x", "gold": 1}, r"data\.jsonl:2: missing field 'q'.*template uses \['q'\].*answer field is 'gold'"),
        ({"id": "x", "q": "1"}, r"data\.jsonl:2: missing field 'gold'"),
        ({"id": "x", "q": "1", "gold": None}, r"data\.jsonl:2: answer must be a number or a string"),
        ({"id": "x", "q": "1", "gold": "  "}, r"data\.jsonl:2: answer is empty"),
        ({"id": "x", "q": "1", "gold": 1, "level": "hard"}, r"data\.jsonl:2: 'level' must be an integer"),
        ({"id": "a", "q": "1", "gold": 1}, r"duplicate id 'a' \(records 1 and 2\)"),
    ],
)
def test_generic_jsonl_errors(tmp_path, record, match):
    path = _write(tmp_path / "data.jsonl", [{"id": "a", "q": "ok", "gold": 1}, record])
    with pytest.raises(DataFormatError, match=match):
        load_records(path, "{q}", answer_field="gold")


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataFormatError, match="does not exist"):
        load_records(tmp_path / "nope.jsonl", "{q}")
    empty = _write(tmp_path / "empty.jsonl", ["", "   "])
    with pytest.raises(DataFormatError, match="has no records"):
        load_gsm8k(empty)
    with pytest.raises(DataFormatError, match="has no records"):
        sniff_format(empty)


def test_data_errors_are_config_errors():
    assert issubclass(DataFormatError, ConfigError)  # the CLI reports them as bad configuration


def test_blank_lines_are_skipped_but_line_numbers_stay_true(tmp_path):
    path = _write(tmp_path / "gsm.jsonl", [GSM[0], "", {"question": "q"}])
    with pytest.raises(DataFormatError, match=r"gsm\.jsonl:3:"):
        load_gsm8k(path)


def test_sniff_format(tmp_path):
    assert sniff_format(_write(tmp_path / "g.jsonl", GSM)) == "gsm8k"
    assert sniff_format(_write(tmp_path / "r.jsonl", [{"question": "q", "answer": 3}])) == "jsonl"


def test_template_helpers():
    assert template_fields("{a} and {b}, {a} again, \\boxed{} {{lit}} {0}") == ["a", "b"]
    assert template_fields(DEFAULT_MATH_TEMPLATE) == ["question"]
    # Substituted values are not re-parsed as templates.
    assert fill_template("Q: {question}", {"question": "What is {x}?"}) == "Q: What is {x}?"
    with pytest.raises(KeyError):
        fill_template("{missing}", {})
