"""Fuzz campaign: hostile inputs against every socket and file a peer or a crash can reach (issue 40, part 2).

What: for each target, `--inputs N` inputs, each a captured valid message (or file) mutated by 1-4 operations
(benchmarks/faults/fuzz_mutate.py: sizes, types, nesting, truncation, huge declared lengths, wrong kinds; and a role
drawn for its connection: wrong roles), fed to the real component (benchmarks/faults/fuzz_targets.py,
benchmarks/faults/fuzz_files.py); 1 in 50 goes unmutated and must get its documented answer. With `--wire-every K`
one input in K also goes over a real CURVE socket. Every input must end in a documented refusal or a correct
answer; a Python exception out of the handler is a crash, an answer outside the protocol is `unexpected`, an
input still running after `--hang-s` is a hang. RSS is sampled every 1,000 inputs; growth is measured from the
end of the first 10 % (warm-up) to the end. After the campaign a valid request must still succeed (`health`).

    python benchmarks/faults/fuzz.py --target all --inputs 20000 --seed 1
    python benchmarks/faults/fuzz.py --target job --inputs 1000000 --seed 7 --json benchmarks/results/fuzz-job.json
    flock /tmp/areal-heavy.lock python benchmarks/faults/fuzz.py --quick      # every target, 500 inputs each

Engines: `random` (default: a seeded random.Random draws every choice; reproducible from --seed, fast enough for
10^6-input campaigns) or `hypothesis` (Hypothesis draws the same choices through st.data(); what
tests/integration/test_fuzz.py runs, where a failure shrinks to a minimal input; in a long campaign Hypothesis
may stop when a replayed example meets a component whose state moved on, and the rest runs on `random`). A crash's
input is written under --corpus (default benchmarks/results/fuzz-crashes/) as JSON; copy it into
tests/fuzz_corpus/ with its fix, where tests/integration/test_fuzz.py replays it.
Targets: job, bus, store (each plaintext and CURVE), store-log, weights-delta, weights-full, weight-server
(plaintext and CURVE), openai (the HTTP endpoint, with and without an API key), reward-http (what a reward
server answers the HTTP bridge); benchmarks/faults/fuzz_servers.py has the last three.
"""
from __future__ import annotations

import hashlib
import json
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)

import common  # noqa: E402
from fuzz_mutate import DataChooser, RandomChooser, mutate  # noqa: E402

TARGETS = ("job", "bus", "store", "store-log", "weights-delta", "weights-full", "weight-server", "openai",
           "reward-http")
IDENTS = (b"peer-a", b"peer-b", b"\x00\x01", b"x" * 255)
ROOT = Path(__file__).resolve().parents[1]  # benchmarks/


class Hang(Exception):
    pass


def make_target(name: str, root: Path) -> Any:
    from fuzz_files import StoreLogTarget, WeightsTarget
    from fuzz_servers import OpenAITarget, RewardHttpTarget, WeightServerTarget
    from fuzz_targets import BusTarget, JobTarget, StoreTarget

    makers: dict[str, Callable[[], Any]] = {
        "job": lambda: JobTarget(root), "bus": lambda: BusTarget(root), "store": lambda: StoreTarget(root),
        "store-log": lambda: StoreLogTarget(root), "weights-delta": lambda: WeightsTarget(root, "delta"),
        "weights-full": lambda: WeightsTarget(root, "full"), "weight-server": lambda: WeightServerTarget(root),
        "openai": lambda: OpenAITarget(root), "reward-http": lambda: RewardHttpTarget(root)}
    return makers[name]()


def draw_input(c: Any, target: Any) -> dict:
    """One input: a seed, mutated (or, 1 in 50, not), a role for its connection and a peer identity."""
    from fuzz_targets import FUZZ_ROLES

    seed = c.choice(sorted(target.seeds))
    frames = target.seeds[seed]
    pristine = c.int(0, 49) == 0
    if not pristine:
        custom = getattr(target, "mutate", None)
        frames = custom(c, seed, frames) if custom else mutate(c, frames)
    return {"seed": seed, "pristine": pristine, "frames": frames, "role": c.choice(FUZZ_ROLES),
            "ident": c.choice(IDENTS)}


def under_alarm(call: Any, hang_s: float, what: str) -> Any:
    """`call()` under an alarm: Hang when it is still running after `hang_s`."""
    def alarm(*_: Any) -> None:
        raise Hang(f"{what} still running after {hang_s}s")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, hang_s)
    try:
        return call()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def run_one(target: Any, inp: dict, i: int, hang_s: float) -> str:
    """Feed one input under an alarm; returns its outcome. Raises what the target raised (or Hang)."""
    return under_alarm(lambda: target.feed(inp["frames"], inp["role"], inp["ident"],
                                           inp["seed"] if inp["pristine"] else None, i), hang_s, "input")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def reproducer(target: str, inp: dict, exc: BaseException | None) -> dict:
    rep = {"target": target, "i": inp.get("i", 1), "seed": inp["seed"], "pristine": inp["pristine"],
           "role": inp["role"],
           "ident": inp["ident"].hex(), "frames": [f.hex() for f in inp["frames"]]}
    if exc is not None:
        rep.update(error=f"{type(exc).__name__}: {str(exc)[:500]}",
                   where=traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:])
    return rep


class Campaign:
    """Counts for one target: inputs, outcomes, crashes, unexpected answers, hangs, RSS samples."""

    def __init__(self, name: str, target: Any, n: int, hang_s: float, wire_every: int, corpus: Path,
                 save: Path | None = None, deadline: float = float("inf")):
        from fuzz_targets import Unexpected

        self.name, self.target, self.n, self.hang_s, self.wire_every = name, target, n, hang_s, wire_every
        self.deadline = deadline  # time.monotonic() at which the campaign stops early (--minutes)
        self.corpus, self.unexpected_type, self.save, self.kept = corpus, Unexpected, save, {}
        self.counts = {"inputs": 0, "crashes": 0, "unexpected": 0, "hangs": 0, "wire": 0, "wire_answered": 0}
        self.outcomes: dict[str, int] = {}
        self.failures: dict[str, dict] = {}  # first input of each distinct failure (type + place)
        self.rss: list[float] = []
        self.hypothesis_stopped = ""
        self.sizes: list[dict] = []

    def step(self, c: Any, i: int) -> None:
        inp = {**draw_input(c, self.target), "i": i}
        try:
            outcome = run_one(self.target, inp, i, self.hang_s)
            if self.wire_every and i % self.wire_every == 0:  # a real socket: a stuck server is a hang, not a stall
                under_alarm(lambda: self._wire(inp), 2 * self.hang_s, "the same input over the wire")
        except Hang as exc:
            self._fail("hangs", inp, exc)
            outcome = "hang"
        except self.unexpected_type as exc:
            self._fail("unexpected", inp, exc)
            outcome = "unexpected"
        except Exception as exc:  # noqa: BLE001 - a crash: counted, its input kept
            self._fail("crashes", inp, exc)
            outcome = "crash"
        self.counts["inputs"] += 1
        self._keep(inp, outcome)
        key = outcome.split(":")[0] if outcome.startswith("answered") else outcome
        self.outcomes[key] = self.outcomes.get(key, 0) + 1
        if (i + 1) % 1000 == 0 or i + 1 == self.n:
            self.target.tick((i + 1) // 1000)
            self.rss.append(round(rss_mb(), 1))
            self.sizes.append(self.target.size())

    def _wire(self, inp: dict) -> None:
        from areal_mq import protocol
        from fuzz_targets import ERROR_CODES

        if not getattr(self.target, "wire_capable", False):
            return
        role = inp["role"] if inp["role"] in ("controller", "trainer", "rollout", "reward", "observer") else "observer"
        answers = self.target.wire(inp["frames"], role)
        for frames in answers:
            env = protocol.decode(frames, 1 << 30)
            if env.kind.value == "error" and env.msg.code not in ERROR_CODES:
                raise self.unexpected_type(f"over the wire: undocumented code {env.msg.code}")
        self.counts["wire"] += 1
        self.counts["wire_answered"] += bool(answers)  # a wire path nothing answers is a broken harness, not a pass

    def _keep(self, inp: dict, outcome: str) -> None:
        """With --save-corpus: the first 2 inputs of each outcome, as regression inputs for tests/fuzz_corpus."""
        if self.save is None or self.kept.get(outcome, 0) >= 2 or outcome in ("crash", "unexpected", "hang"):
            return
        self.kept[outcome] = self.kept.get(outcome, 0) + 1
        rep = {**reproducer(self.name, inp, None), "outcome": outcome}
        digest = hashlib.sha1("".join(rep["frames"]).encode()).hexdigest()[:12]
        self.save.mkdir(parents=True, exist_ok=True)
        (self.save / f"{self.name}-{outcome.replace(':', '-')}-{digest}.json").write_text(json.dumps(rep, indent=1))

    def _fail(self, kind: str, inp: dict, exc: BaseException) -> None:
        self.counts[kind] += 1
        where = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
        sig = f"{kind}:{type(exc).__name__}:{[(f.filename.rsplit('/', 1)[-1], f.lineno) for f in where]}"
        if sig not in self.failures and len(self.failures) < 50:
            rep = reproducer(self.name, inp, exc)
            self.failures[sig] = rep
            self.corpus.mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha1("".join(rep["frames"]).encode()).hexdigest()[:12]
            (self.corpus / f"{self.name}-{kind}-{digest}.json").write_text(json.dumps(rep, indent=1))

    def run(self, seed: int, engine: str) -> dict:
        t0 = time.monotonic()
        if engine == "random":
            c = RandomChooser(seed)
            for i in range(self.n):
                if i % 1000 == 0 and time.monotonic() > self.deadline:
                    break  # --minutes spent: the count says how far it got
                self.step(c, i)
        else:
            self._run_hypothesis(seed)
        wall = time.monotonic() - t0
        try:
            self.target.health()
            health = "ok"
        except Exception as exc:  # noqa: BLE001 - reported, not raised: the other targets still run
            health = f"FAILED: {type(exc).__name__}: {str(exc)[:300]}"
        warm = self.rss[max(0, len(self.rss) // 10 - 1)] if self.rss else 0.0
        end = self.rss[-1] if self.rss else 0.0
        return {"target": self.name, **self.counts, "outcomes": dict(sorted(self.outcomes.items())),
                "health": health, "rss_warm_mb": warm, "rss_end_mb": end,
                "rss_growth_pct": round(100 * (end - warm) / warm, 1) if warm else 0.0,
                "rss_mb_series": self.rss[::max(1, len(self.rss) // 50)] + self.rss[-1:],  # a plateau or a slope
                "inputs_per_s": round(self.counts["inputs"] / max(wall, 1e-9), 1), "wall_s": round(wall, 1),
                "state_end": self.sizes[-1] if self.sizes else {}, "hypothesis_stopped": self.hypothesis_stopped,
                "failures": list(self.failures.values())[:10]}

    def _run_hypothesis(self, seed: int) -> None:
        from hypothesis import HealthCheck, given, settings, strategies as st
        from hypothesis import seed as hseed

        counter = iter(range(self.n))

        @hseed(seed)
        @settings(max_examples=self.n, deadline=None, database=None, derandomize=False, phases=["generate"],
                  suppress_health_check=list(HealthCheck))
        @given(st.data())
        def one(data: Any) -> None:
            i = next(counter, None)
            if i is not None:
                self.step(DataChooser(data), i)

        try:
            one()
        except Exception as exc:  # noqa: BLE001 - Hypothesis replays an example and finds the component changed
            self.hypothesis_stopped = f"{type(exc).__name__}"  # (state carries over): go on with its seed
        for i in counter:  # Hypothesis stopped early (out of distinct inputs, or above): finish with its seed
            self.step(RandomChooser(seed * 1_000_003 + i), i)


def table(report: dict) -> str:
    rows = [("target", "inputs", "wire (answered)", "crashes", "unexpected", "hangs", "health", "RSS MB warm->end", "growth",
             "inputs/s")]
    for r in report["results"]:
        rows.append((r["target"], r["inputs"], f"{r['wire']} ({r.get('wire_answered', '-')})", r["crashes"], r["unexpected"], r["hangs"],
                     r["health"][:20], f"{r['rss_warm_mb']:.0f}->{r['rss_end_mb']:.0f}", f"{r['rss_growth_pct']}%",
                     r["inputs_per_s"]))
    lines = common.align(rows)
    for r in report["results"]:
        lines.append(f"{r['target']} outcomes: " + ", ".join(f"{k} {v}" for k, v in r["outcomes"].items()))
        for f in r["failures"][:3]:
            lines.append(f"  {r['target']} FAILURE {f['error'][:160]} at {f['where'][-1].strip()[:160]}")
    lines.append(f"command: {common.command('fuzz.py')}")
    return "\n".join(lines)


def main() -> int:
    parser = common.arg_parser(__doc__, "every target, 500 inputs each (under a minute on 2 cores)")
    parser.add_argument("--target", default="all", choices=("all", *TARGETS))
    parser.add_argument("--inputs", type=int, default=20_000, help="Inputs per target.")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--engine", default="random", choices=("random", "hypothesis"))
    parser.add_argument("--wire-every", type=int, default=100, help="Send 1 input in K over a real CURVE socket too.")
    parser.add_argument("--hang-s", type=float, default=5.0)
    parser.add_argument("--minutes", type=float, help="Stop each target's campaign after this long (the inputs "
                        "done are reported): keeps a run within a shared machine's turn.")
    parser.add_argument("--corpus", type=Path, default=ROOT / "results" / "fuzz-crashes",
                        help="Where a crash's, hang's or unexpected answer's input is written.")
    parser.add_argument("--save-corpus", type=Path, help="Also keep 2 inputs of each outcome here (regression).")
    args = parser.parse_args()
    n = 500 if args.quick else args.inputs
    names = TARGETS if args.target == "all" else (args.target,)
    report: dict = {"benchmark": "fuzz", "quick": bool(args.quick), "machine": common.machine(),
                    "seed": args.seed, "engine": args.engine, "results": [], "ratios": {},
                    "targets": {"crashes": 0, "unexpected": 0, "hangs": 0, "rss_growth_pct_below": 10.0}}
    t0 = time.monotonic()
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"fuzz-{name}-") as tmp:
            target = make_target(name, Path(tmp))
            try:
                deadline = time.monotonic() + 60 * args.minutes if args.minutes else float("inf")
                result = Campaign(name, target, n, args.hang_s, args.wire_every, args.corpus,
                                  args.save_corpus, deadline).run(args.seed, args.engine)
            finally:
                target.close()
        report["results"].append(result)
        print(f"{name}: {result['inputs']} inputs, {result['crashes']} crashes, {result['unexpected']} unexpected, "
              f"{result['hangs']} hangs, health {result['health']}", flush=True)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    out = args.json or ROOT / "results" / f"fuzz-{args.target}-seed{args.seed}-n{n}.json"
    common.finish(report, out, table(report))
    bad = sum(r["crashes"] + r["unexpected"] + r["hangs"] for r in report["results"])
    return 1 if bad or any(r["health"] != "ok" for r in report["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
