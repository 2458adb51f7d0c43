"""Keeps benchmarks/speed/weights.py from rotting: its --quick mode (tiny random Llama, 3 steps at each lr, the same code
path: quickstart rollouts, the real Trainer, zmq and disk fleets of 1 and 4 catch-ups, the engine's pause) runs and
writes the documented JSON shape and a plot. No speed or size is asserted (benchmarks/RESULTS.md has the figures).

Run: pytest tests/integration/test_weights_benchmark.py -q -m slow   (~30 s)
"""
import pytest

from .bench_smoke import run_quick


@pytest.mark.slow
def test_weights_benchmark_quick_mode(tmp_path):
    plot = tmp_path / "bytes.png"
    report, stdout = run_quick("speed/weights.py", tmp_path, "--plot", str(plot), timeout=300)
    assert set(report["ratios"]) >= {"full_vs_delta_bytes_bf16", "full_vs_delta_bytes_bf16_lr1e-5",
                                     "full_vs_delta_bytes_fp32", "full_vs_delta_pause_zmq"}
    assert set(report["targets"]) == {"full_vs_delta_bytes_bf16", "full_vs_delta_pause_zmq"}
    setup, summary, *updates = report["results"]
    assert setup["name"] == "setup" and summary["name"] == "summary"
    assert [(u["lr"], u["version"]) for u in updates] == [(lr, v) for lr in (1e-6, 1e-5) for v in (1, 2, 3)]
    first = updates[0]
    for mode in ("zmq", "disk"):  # every route measured at lr 1e-6: deltas each update, full on the first
        assert {f"delta_w{w}" for w in (1, 4)} | {f"full_w{w}" for w in (1, 4)} <= set(first[mode])
        assert first[mode]["delta_w1"]["route"] == "delta" and first[mode]["delta_w1"]["engine_pause_s"] > 0
    assert first["zmq"]["full_w1"]["route"] == "full" and first["disk"]["full_w1"]["route"] == "path"
    assert first["float32"]["full_bytes"] == 2 * first["bfloat16"]["full_bytes"]
    assert all(0 <= u[d]["delta_bytes"] < u[d]["full_bytes"] for u in updates for d in ("bfloat16", "float32"))
    assert len(report["machine"]["loadavg_at_start"]) == len(report["machine"]["loadavg_at_end"]) == 3
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert "full_vs_delta_pause_zmq" in stdout and "command: python benchmarks/speed/weights.py --quick" in stdout


@pytest.mark.slow
def test_weights_lora_benchmark_quick_mode(tmp_path):
    """--lora: an adapter version against a full one on the tiny model; both ratios and per-round pauses reported;
    the engine's merged decode against the unmerged one, with each one's bf16 rounding."""
    report, stdout = run_quick("speed/weights.py", tmp_path, "--lora", timeout=300)
    assert report["mode"] == "lora" and set(report["ratios"]) == {*report["targets"], "unmerged_vs_merged_decode"}
    (row,) = report["models"]
    assert row["model"] == "tiny-random-llama" and 0 < row["lora_bytes"] < row["full_bytes"]
    assert len(row["pause_s"]["full"]) == len(row["pause_s"]["lora"]) == 2
    decode = row["decode"]
    assert len(decode["step_s"]["merged"]) == len(decode["step_s"]["unmerged"]) == 2 * decode["steps_per_round"]
    # merged once in fp32 then cast rounds no worse than a bf16 base plus a bf16 low-rank product, and neither is 0
    errors = decode["bf16_logprob_error"]
    assert 0 < errors["merged"]["mean"] <= errors["unmerged"]["mean"] * 1.5, errors
    assert "command: python benchmarks/speed/weights.py --lora --quick" in stdout
