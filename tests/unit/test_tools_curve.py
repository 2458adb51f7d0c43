"""benchmarks/quality/tools_curve.py (the tool task's training curve from agent events): windows, the order, cut lines,
the refusals. Run: pytest tests/unit/test_tools_curve.py -q   (< 2 s)"""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "quality"))
import tools_curve  # noqa: E402


def write_events(run_dir: Path, eps: list[dict]) -> None:
    (run_dir / "events").mkdir(parents=True)
    lines = [json.dumps({"event": "agent.episode_done", **e}) for e in eps]
    lines.insert(1, json.dumps({"event": "agent.started", "ts": 0.5}))  # other events are not episodes
    (run_dir / "events" / "agent-agent-0.jsonl").write_text("\n".join(lines) + '\n{"event": "agent.epis')  # cut line


def test_windows_count_each_outcome_in_the_order_episodes_ended(tmp_path, capsys):
    eps = [dict(ts=3.0, correct_at=1, tool_calls=1, tool_repairs=1, tool_errors=0, exact_turns=2, chat_calls=2),
           dict(ts=1.0, correct_at=0, tool_calls=0, tool_repairs=0, tool_errors=1, exact_turns=1, chat_calls=1),
           dict(ts=2.0, correct_at=2, tool_calls=2, tool_repairs=0, tool_errors=0, exact_turns=2, chat_calls=3)]
    write_events(tmp_path, eps)
    assert [e["ts"] for e in tools_curve.episodes(tmp_path)] == [1.0, 2.0, 3.0]
    out = tmp_path / "curve.json"
    assert tools_curve.main([str(tmp_path), "--window", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["episodes"] for r in rows] == [2, 3] and [r["n"] for r in rows] == [2, 1]
    first = rows[0]  # ts 1.0 and 2.0
    assert (first["correct"], first["called"], first["bare"], first["malformed"], first["exact"]) == (0.5, 0.5, 0, 0.5, 0.5)
    assert rows[1]["correct"] == rows[1]["bare"] == rows[1]["exact"] == 1.0
    assert "episodes" in capsys.readouterr().out


def test_refuses_what_is_not_a_run_and_a_bad_window(tmp_path):
    with pytest.raises(SystemExit):
        tools_curve.main([str(tmp_path)])
    write_events(tmp_path, [])
    with pytest.raises(SystemExit):
        tools_curve.main([str(tmp_path), "--window", "0"])
    assert tools_curve.windows([], 10) == []


def test_tools_report_arms_seeds_curves_and_refusals(tmp_path, capsys):
    """benchmarks/quality/tools_report.py: the last line of each episodes.py --out file counts, arms keep the order
    they were named in, means per arm; a curve per run; bad specs and non-results are refused with the reason."""
    import tools_report

    def result(name: str, acc: float, tool_frac: float, lines: int = 1) -> str:
        path = tmp_path / name
        recs = [{"n": 100, "acc_first": 0.0, "tool_frac": 0.0}] * (lines - 1)
        recs.append({"n": 100, "acc_first": acc, "tool_frac": tool_frac, "workflow_args": {"agent": "m:f"}})
        path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
        return str(path)

    run = tmp_path / "run"
    write_events(run, [dict(ts=float(i), correct_at=int(i >= 2), tool_calls=1, exact_turns=1, chat_calls=1)
                       for i in range(4)])
    (run / "events" / "trainer-trainer.jsonl").write_text("\n".join(json.dumps(e) for e in (
        {"event": "trainer.published", "ts": 1.5, "version": 1}, {"event": "trainer.step", "ts": 2.0, "version": 9},
        {"event": "trainer.published", "ts": 3.0, "version": 2})) + "\n")
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = [f"tool:0={result('a', 0.97, 1.0)}", f"no-tool:0={result('b', 0.18, 0.0)}",
            f"tool:1={result('c', 0.91, 1.0, lines=3)}", "--curve", f"tool s0={run}", "--window", "2",
            "--json", str(out), "--plot", str(png)]
    assert tools_report.main(argv) == 0
    rep = json.loads(out.read_text())
    assert list(rep["arms"]) == ["tool", "no-tool"]
    assert rep["arms"]["tool"]["acc"] == [97.0, 91.0] and rep["arms"]["tool"]["mean"] == 94.0
    assert rep["arms"]["tool"]["seeds"] == ["0", "1"] and rep["arms"]["no-tool"]["mean"] == 18.0
    assert [r["correct"] for r in rep["curves"]["tool s0"]] == [0.0, 1.0]
    assert [r["version"] for r in rep["curves"]["tool s0"]] == [0, 2]  # the newest published at a window's end
    assert png.stat().st_size > 0 and "no-tool" in capsys.readouterr().out
    for bad in (["tool0=" + result("d", 0.5, 0.0)], ["tool:0"], [f"tool:0={tmp_path / 'missing'}"],
                [f"tool:0={result('e', 0.5, 0.0)}", "--curve", f"x={tmp_path}"]):
        with pytest.raises(SystemExit):
            tools_report.main(bad)
    (tmp_path / "f").write_text('{"accuracy": 1}\n')
    with pytest.raises(SystemExit):
        tools_report.main([f"tool:0={tmp_path / 'f'}"])
