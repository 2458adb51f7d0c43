"""Users' own data as Parquet files and `datasets` directories: same mapping, same clear errors as JSONL."""
from __future__ import annotations

import json

import pytest

from areal_mq.data import DataConfig, DataFormatError, build_dataset, load_eval_problems
from areal_mq.data.sources import read_source

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

RECORDS = [{"id": f"p{i}", "q": f"What is {i} + 1?", "sol": i + 1, "level": 1 + i % 2} for i in range(6)]
GSM = [{"question": f"Sam has {i} apples and buys 2. How many now?", "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}
       for i in range(4)]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def config(name, **kw):
    return DataConfig(name=name, prompt_template="{q} Answer in \\boxed{{}}.", answer_field="sol", shuffle=False, **kw)


def test_parquet_records_map_like_jsonl(tmp_path):
    pq_path = write_parquet(tmp_path / "train.parquet", RECORDS)
    jl_path = tmp_path / "train.jsonl"
    jl_path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    from_pq, from_jl = build_dataset(config(str(pq_path))).problems, build_dataset(config(str(jl_path))).problems
    assert [(p.id, p.prompt, p.answer, p.level) for p in from_pq] == [(p.id, p.prompt, p.answer, p.level) for p in from_jl]
    assert from_pq[2].prompt == "What is 2 + 1? Answer in \\boxed{}." and from_pq[2].answer == "3"


def test_parquet_gsm8k_layout_is_sniffed(tmp_path):
    path = write_parquet(tmp_path / "gsm.parquet", GSM)
    problems = build_dataset(DataConfig(name=str(path), shuffle=False)).problems
    assert [p.answer for p in problems] == ["2", "3", "4", "5"]
    assert problems[0].id == "gsm-1"  # no id field: file stem and row


def test_saved_dataset_and_a_heldout_split_from_the_same_source(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS[:4]),
                               "test": datasets.Dataset.from_list(RECORDS[4:])})
    dd.save_to_disk(str(tmp_path / "saved"))
    cfg = config(f"{tmp_path}/saved:train", eval_name=f"{tmp_path}/saved:test")
    assert [p.id for p in build_dataset(cfg).problems] == ["p0", "p1", "p2", "p3"]
    assert [p.answer for p in load_eval_problems(cfg)] == ["5", "6"]


def test_single_saved_dataset(tmp_path):
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "one"))
    assert len(build_dataset(config(str(tmp_path / "one"))).problems) == 6


def test_bad_row_names_file_row_and_fix(tmp_path):
    rows = [dict(r) for r in RECORDS]
    del rows[2]["sol"]
    rows[2]["other"] = 1
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(DataFormatError, match=r"bad\.parquet row 3: missing field 'sol'.*answer field"):
        build_dataset(config(str(path)))


def test_bad_answer_type_in_dataset_row(tmp_path):
    rows = [dict(r) for r in RECORDS]
    rows[4]["sol"] = None  # null in a table = the field is missing in that row
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "d"))
    with pytest.raises(DataFormatError, match=r"d row 5: missing field 'sol'"):
        build_dataset(config(str(tmp_path / "d")))


@pytest.mark.parametrize("make, message", [
    (lambda d: (d / "x.parquet").write_text("not parquet"), r"x\.parquet: not a readable Parquet file"),
    (lambda d: (d / "plain").mkdir(), r"plain is a directory but not a `datasets` directory"),
])
def test_unreadable_sources(tmp_path, make, message):
    made = make(tmp_path)
    name = "x.parquet" if "parquet" in message else "plain"
    del made
    with pytest.raises(DataFormatError, match=message):
        list(read_source(tmp_path / name))


def test_split_errors(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(RECORDS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataFormatError, match=r"holds the splits \['train'\]; name one as .*dd:SPLIT"):
        list(read_source(tmp_path / "dd"))
    with pytest.raises(DataFormatError, match=r"has no split 'test'; it has \['train'\]"):
        list(read_source(f"{tmp_path}/dd:test"))
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(tmp_path / "single"))
    with pytest.raises(DataFormatError, match="single Dataset with no splits"):
        list(read_source(f"{tmp_path}/single:train"))


def test_missing_source_says_what_is_accepted(tmp_path):
    with pytest.raises(DataFormatError, match=r"does not exist; pass a \.jsonl file, a \.parquet file"):
        list(read_source(tmp_path / "nope.parquet"))
