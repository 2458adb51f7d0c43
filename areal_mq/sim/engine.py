"""`rollout.engine.kind: sim` — a SIMULATED inference engine: no model, no GPU, a named timing model.

What: the Engine contract (base.py) with the GPU replaced by arithmetic. Requests are accepted and validated
like any engine's; each draws its completion length from a named long-tailed distribution (capped by
max_new_tokens); "decoding" advances a virtual clock by the timing model's step time, a function of the
running batch size and the mean context length, plus prefill time per prompt token when a request is admitted.
Finished sequences carry real arrays of the right shapes: output_ids [T] int32 (random ids below vocab_size),
logprobs [T] float32 (finite, negative), versions [T] int32 (the policy version at each token's step, so a
weight update in the middle of a sequence shows in its versions). update_weights models the pause
(update_pause_s, plus recomputing the in-flight KV as prefill under kv_on_update=recompute); it loads nothing.
Why: to run hundreds of rollout workers against the real brokers, controller and store on a CPU machine
(issue 17). Timing models and lengths live in areal_mq/sim/timing.py with their sources.
How it stays cheap: time advances in jumps from one event (a sequence finishing) to the next, not token by
token; `next_due()` tells a host (workers/swarm.py) when the next sequence will finish, so it can sleep.

The clock is injected: by default real time / time_scale (simulated seconds); the zero-infrastructure model
(areal_mq/sim/des.py) passes a purely virtual one.
"""
from __future__ import annotations

import collections
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from areal_mq.engines.base import Engine, EngineOutput, EngineRequest
from areal_mq.errors import EngineRequestError
from areal_mq.sim.timing import LengthModel, TimingModel, length_model, timing_model


@dataclass
class _Seq:
    req: EngineRequest
    target: int  # tokens this sequence will generate
    finish_reason: str
    rng: np.random.Generator
    done: int = 0
    segments: list[tuple[int, int]] = field(default_factory=list)  # (first token index, policy version)

    @property
    def context(self) -> int:
        return len(self.req.prompt_ids) + self.done


def scaled_clock(time_scale: float) -> Callable[[], float]:
    """Simulated seconds since now: real monotonic seconds / time_scale."""
    start = time.monotonic()
    return lambda: (time.monotonic() - start) / time_scale


class SimEngine(Engine):
    """Simulated engine; see the module docstring. All times are simulated seconds."""

    def __init__(self, timing: TimingModel, lengths: LengthModel, max_concurrent: int, *,
                 clock: Callable[[], float], vocab_size: int = 151_936, kv_on_update: str = "recompute",
                 seed: int | None = None):
        self.timing, self.lengths, self.max_concurrent = timing, lengths, max_concurrent
        self.clock, self.vocab_size, self.kv_on_update, self.seed = clock, vocab_size, kv_on_update, seed
        self.version = 0
        self.t = self.started = clock()  # the device has done its work up to simulated time self.t
        self.busy_s = self.pause_s = 0.0
        self.running: list[_Seq] = []
        self.waiting: collections.deque[_Seq] = collections.deque()
        self.finished: list[EngineOutput] = []
        self.paused = False
        self.tokens = self.completed = 0

    # ------------------------------------------------------------ contract
    def submit(self, request: EngineRequest) -> None:
        request.sampling.check()
        if not request.prompt_ids:
            raise EngineRequestError("prompt_ids is empty; a request needs at least one prompt token")
        rng = np.random.default_rng(self._seed_of(request))
        drawn = int(self.lengths.sample(rng, 1)[0])
        target = min(drawn, request.sampling.max_new_tokens)
        reason = "length" if target == request.sampling.max_new_tokens else "stop"
        self._advance(self.clock())
        self.waiting.append(_Seq(request, target, reason, rng))

    def step(self) -> list[EngineOutput]:
        self._advance(self.clock())
        out, self.finished = self.finished, []
        return out

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.finished)

    def update_weights(self, version: int, tensors: Mapping[str, Any] | None = None,
                       path: str | None = None) -> dict[str, float]:
        """Model a weight load: the device stops for update_pause_s, then (kv_on_update=recompute) prefills the
        in-flight contexts again. Tokens decoded after it carry `version`. Loads nothing (there are no weights)."""
        self._advance(self.clock())
        self.t = max(self.t, self.clock())
        pause = self.timing.update_pause_s
        recompute = self.timing.prefill_s(sum(s.context for s in self.running)) \
            if self.kv_on_update == "recompute" else 0.0
        self.t += pause + recompute
        self.pause_s += pause
        self.busy_s += recompute
        self.version = int(version)
        for seq in self.running:
            seq.segments.append((seq.done, self.version))
        return {"load_s": 0.0, "pause_s": pause, "recompute_s": recompute, "in_flight": float(len(self.running))}

    def abort(self, request_id: str) -> EngineOutput | None:
        for pool in (self.running, self.waiting):
            for seq in pool:
                if seq.req.request_id == request_id:
                    pool.remove(seq)
                    return self._output(seq, "abort")
        return None

    def pause(self) -> None:
        self._advance(self.clock())
        self.paused = True

    def resume(self) -> None:
        self.t = max(self.t, self.clock())
        self.paused = False

    def stats(self) -> dict[str, Any]:
        elapsed = max(1e-9, max(self.t, self.clock()) - self.started)
        return {"engine": "sim", "running": len(self.running), "waiting": len(self.waiting), "version": self.version,
                "tokens": self.tokens, "completed": self.completed, "busy_s": round(self.busy_s, 4),
                "pause_s": round(self.pause_s, 4), "sim_s": round(elapsed, 4),
                "utilization": round(self.busy_s / elapsed, 4)}

    # ------------------------------------------------------------ simulation
    def busy_at(self, now: float) -> float:
        """Busy simulated seconds up to `now`, counting the decoding in progress since the last event."""
        running = self.running and not self.paused
        return self.busy_s + (max(0.0, now - self.t) if running else 0.0)

    def next_due(self) -> float | None:
        """Simulated time at which step() will next return something (None: nothing will happen by itself)."""
        if self.paused or not (self.running or self.waiting):
            return None
        if self.finished or (self.waiting and len(self.running) < self.max_concurrent) or not self.running:
            return self.t
        k, dt = self._next_jump()
        return self.t + k * dt

    def _next_jump(self) -> tuple[int, float]:
        """Decode steps until the next sequence finishes, and the step time over them."""
        k = min(s.target - s.done for s in self.running)
        ctx = sum(s.context for s in self.running) / len(self.running) + k / 2
        return k, self.timing.decode_step_s(len(self.running), ctx)

    def _advance(self, now: float) -> None:
        """Do the device's work up to simulated time `now`, event by event (admission, a sequence finishing)."""
        if self.paused:
            return
        while True:
            self._admit()
            if not self.running:
                self.t = max(self.t, now)
                return
            if self.t >= now:
                return
            k, dt = self._next_jump()
            steps = k if self.t + k * dt <= now + 1e-9 else int((now - self.t) / dt + 1e-9)  # 1e-9: float steps
            if steps <= 0:
                return
            self._decode(steps, dt)
            if steps < k:
                return

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_concurrent:
            seq = self.waiting.popleft()
            seq.segments.append((0, self.version))
            cost = self.timing.prefill_s(len(seq.req.prompt_ids))
            self.t += cost
            self.busy_s += cost
            self.running.append(seq)

    def _decode(self, steps: int, dt: float) -> None:
        self.t += steps * dt
        self.busy_s += steps * dt
        self.tokens += steps * len(self.running)
        still = []
        for seq in self.running:
            seq.done += steps
            if seq.done >= seq.target:
                self.finished.append(self._output(seq, seq.finish_reason))
                self.completed += 1
            else:
                still.append(seq)
        self.running = still

    def _output(self, seq: _Seq, reason: str) -> EngineOutput:
        n = seq.done
        versions = np.empty(n, np.int32)
        bounds = [start for start, _ in seq.segments[1:]] + [n]
        for (start, version), end in zip(seq.segments, bounds):
            versions[start:end] = version
        if not seq.segments:
            versions[:] = self.version
        ids = seq.rng.integers(0, self.vocab_size, n, dtype=np.int32)
        logprobs = -seq.rng.exponential(0.5, n).astype(np.float32)
        return EngineOutput(seq.req.request_id, list(seq.req.prompt_ids), ids, logprobs, versions, reason,
                            stats={"sim_finished_at_s": round(self.t, 4)})

    def _seed_of(self, request: EngineRequest) -> int:
        seed = request.sampling.seed if request.sampling.seed is not None else self.seed
        text = f"{seed}/{request.request_id}" if request.sampling.seed is None else str(seed)
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def build(engine_cfg: Any, model_cfg: Any = None, *, seed: int | None = None, clock: Callable[[], float] | None = None,
          **_: Any) -> SimEngine:
    """The simulated engine of `rollout.engine` (its `sim` section names the timing model and lengths)."""
    sim = engine_cfg.sim
    return SimEngine(timing_model(sim.timing), length_model(sim.lengths), engine_cfg.max_concurrent,
                     clock=clock or scaled_clock(sim.time_scale), vocab_size=sim.vocab_size,
                     kv_on_update=engine_cfg.kv_on_update, seed=seed)
