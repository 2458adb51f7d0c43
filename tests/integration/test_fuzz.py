"""A short fuzz pass over every target, and the regression corpus replayed (issue 40, part 2).

The campaign driver is benchmarks/faults/fuzz.py (10^6-input runs, counts in benchmarks/RESULTS.md); this is its fast
pass: Hypothesis draws the same mutations (benchmarks/faults/fuzz_mutate.py) over the same targets
(benchmarks/faults/fuzz_targets.py, fuzz_files.py) for a few seconds each, so a failure shrinks to a minimal input.
Every input must end in a documented refusal or a correct answer, and the component must still serve a valid
request afterwards. tests/fuzz_corpus/ holds the inputs that once failed (with the fix that made them pass) and
a few of each outcome the campaigns saw; each is replayed and must still end the way it did.
Run: pytest tests/integration/test_fuzz.py
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "faults")]  # common.py; the fuzz modules

import fuzz  # noqa: E402
from fuzz_mutate import DataChooser  # noqa: E402

CORPUS = ROOT / "tests" / "fuzz_corpus"
EXAMPLES = {"job": 300, "bus": 300, "store": 300, "store-log": 120, "weights-delta": 150, "weights-full": 150,
            "weight-server": 300, "openai": 150, "reward-http": 150}
STATELESS = {"refused:bad_header", "refused:bad_version", "refused:bad_fields", "refused:bad_arrays", "refused:bad_frames",
             "refused:too_large", "refused:unknown_kind", "refused:corrupt", "refused:base", "refused:checksum",
             "replayed", "quarantined", "answered:v2", "forwarded", "refused", "refused:final", "refused:400",
             "http09"}  # decided by the input alone


@pytest.mark.parametrize("name", fuzz.TARGETS)
def test_a_short_fuzz_pass_ends_every_input_in_a_refusal_or_an_answer(name, tmp_path):
    target = fuzz.make_target(name, tmp_path)
    seen: dict[str, int] = {}
    counter = iter(range(10**9))
    try:
        @settings(max_examples=EXAMPLES[name], deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.data())
        def one(data):
            i = next(counter)
            inp = fuzz.draw_input(DataChooser(data), target)
            outcome = fuzz.run_one(target, inp, i, hang_s=10.0)
            seen[outcome] = seen.get(outcome, 0) + 1
            if i % 100 == 99:
                target.tick(i // 100 + 1)

        one()
        target.health()  # a valid request still succeeds (over real CURVE sockets for job, bus, store)
    finally:
        target.close()
    refusals = [o for o in seen if o.startswith("refused") or o in ("quarantined", "refused")]
    assert refusals, seen  # the pass reached the checks, not only the happy path


def _corpus() -> list[Path]:
    return sorted(CORPUS.glob("*.json"))


@pytest.mark.parametrize("path", _corpus(), ids=lambda p: p.stem)
def test_the_regression_corpus_replays_to_the_same_end(path, tmp_path):
    case = json.loads(path.read_text())
    target = fuzz.make_target(case["target"], tmp_path)
    try:
        inp = {"seed": case["seed"], "pristine": case["pristine"], "role": case["role"],
               "ident": bytes.fromhex(case["ident"]), "frames": [bytes.fromhex(f) for f in case["frames"]]}
        outcome = fuzz.run_one(target, inp, case.get("i", 1), hang_s=10.0)
    finally:
        target.close()
    want = case["outcome"]
    if want in STATELESS:  # others (answers, forbidden, no_service...) depend on what came before
        assert outcome == want, (case.get("why", ""), outcome)


def test_the_campaign_driver_runs(tmp_path):
    """benchmarks/faults/fuzz.py itself, briefly (the flags, the table, the JSON shape); no speed asserted."""
    import subprocess

    out = tmp_path / "fuzz.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "faults" / "fuzz.py"), "--target", "weights-full",
                           "--inputs", "200", "--seed", "3", "--json", str(out), "--corpus", str(tmp_path / "c")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert report["benchmark"] == "fuzz" and result["inputs"] == 200 and result["crashes"] == 0
    assert "weights-full" in proc.stdout and "command:" in proc.stdout


@pytest.mark.parametrize("name, seed", [("job", "stats_request"), ("store", "stats_request"),
                                        ("weight-server", "full-v2-0")])
def test_the_wire_path_reaches_the_curve_server(name, seed, tmp_path):
    """The campaign's 1-in-K real-socket inputs must reach the server: the weight server's wire path once used the
    broker's key, every CURVE handshake failed, and 10^6 inputs ran with no frame over the wire (a stuck DEALER
    was the only sign). A valid request over that path is answered."""
    target = fuzz.make_target(name, tmp_path)
    try:
        answers = []
        for _ in range(20):  # the first sends may go out before the CURVE handshake completes
            answers = target.wire(target.seeds[seed], "rollout", timeout_s=0.5)
            if answers:
                break
    finally:
        target.close()
    assert answers, f"no answer over the wire from the {name} server"
