"""A run trains on a user's Parquet file and evaluates on a split of a `datasets` directory (slow: run in CI)."""
from __future__ import annotations

import json

import pytest

from .test_e2e import _events, _run

pytestmark = pytest.mark.slow
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")


def test_run_trains_on_parquet_and_evaluates_on_a_saved_split(tmp_path):
    rows = [{"uid": f"u{i}", "text": f"What is {i} plus {i + 1}?", "result": 2 * i + 1} for i in range(40)]
    pq.write_table(pa.Table.from_pylist(rows[:32]), tmp_path / "train.parquet")
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows[32:])}).save_to_disk(str(tmp_path / "held"))
    run_dir = tmp_path / "run"
    done = _run(run_dir, "controller.total_steps=2", "controller.max_new_tokens=12", "eval.size=4",
                f"data.name={tmp_path / 'train.parquet'}", f"data.eval_name={tmp_path / 'held'}:test",
                "data.prompt_template='{text} Answer as \\boxed{{N}}.'", "data.answer_field=result", "data.id_field=uid",
                evaluate=True)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == [1, 2]
    trained = {e["group"].split("-", 1)[1] for e in _events(run_dir, "controller.group_stored")}  # g0000001-<id>
    assert trained and trained <= {r["uid"] for r in rows[:32]}
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert evals and evals[-1]["n"] == 4
