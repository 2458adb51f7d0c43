"""Keeps benchmarks/speed/sticky.py from rotting: its --quick mode (real broker, two real rollout workers, the tiny
model) runs and writes the documented JSON shape. No speed is asserted; that the sticky mode reused KV at all
is a correctness check (the turns carried sessions and the engine kept their KV), not a speed.

Run: pytest tests/integration/test_sticky_benchmark.py -q -m slow   (~25 s)
"""
import pytest

from .bench_smoke import run_quick


@pytest.mark.slow
def test_sticky_benchmark_quick_mode(tmp_path):
    report, stdout = run_quick("speed/sticky.py", tmp_path)
    assert set(report["ratios"]) == set(report["targets"]) == {"plain_vs_sticky_episode_latency"}
    sticky, plain = report["results"]
    assert (sticky["mode"], plain["mode"]) == ("sticky", "plain")
    assert sticky["episodes"] == plain["episodes"] == report["settings"]["episodes"]
    assert sticky["prompt_tokens_per_episode"] == plain["prompt_tokens_per_episode"]  # the same turns
    assert sticky["prefill_saved_per_episode"] > 0 and plain["prefill_saved_per_episode"] == 0
    assert sticky["broker"]["sticky_hits"] > 0 and plain["broker"]["sticky_hits"] == 0
    assert "prefill tokens saved per episode" in stdout and "command: python benchmarks/speed/sticky.py --quick" in stdout
