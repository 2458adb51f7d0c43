"""Zero-infrastructure model of a simulated run: the same SimEngine and admission rule, on a virtual clock only.

What: `simulate(...)` plays a whole run as a discrete-event simulation in one process, with no sockets: the
controller's admission rule (passed in: workers/controller_admission.can_admit, the one definition), dispatch to the
engine with the most free slots (the job broker's rule), groups stored when complete, the sample store's
staleness filter (a group whose oldest token is older than v - η is dropped and stops counting), and a
trainer that takes `batch_groups` groups when it is idle, trains for the timing model's train_step_s and
publishes v+1 to every engine at once (the engines model the update pause).
Why: (1) the simulator's own correctness test — with zero infrastructure cost and a constant decode time its
sync and async throughput must match the closed form (tests/unit/sim/test_closed_form.py); (2) quick sweeps of
the generation:training split (benchmarks/speed/scale.py --balance), where running real processes for every split
would take hours. The real-process simulation (workers/swarm.py + real brokers) measures what this leaves out:
infrastructure cost.

    from areal_mq.sim.des import simulate
    simulate(admit=can_admit, n_workers=8, capacity=4, timing=..., lengths=..., batch_groups=8, group_size=4,
             eta=1, steps=10, train_devices=2)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from areal_mq.engines.base import EngineRequest
from areal_mq.sim.engine import SimEngine
from areal_mq.messages import SamplingSpec
from areal_mq.sim.timing import LengthModel, TimingModel


@dataclass
class _Run:
    now: float = 0.0
    version: int = 0
    counted: int = 0  # groups against the staleness bound (admitted - stale drops)
    next_group: int = 0
    open_groups: dict[int, list] = field(default_factory=dict)  # group -> finished outputs
    stored: list[tuple[int, int, int]] = field(default_factory=list)  # (group, oldest token version, tokens)
    queue: list[tuple[int, int]] = field(default_factory=list)  # (group, index) waiting for a free slot
    train_until: float | None = None
    training: list[tuple[int, int, int]] = field(default_factory=list)
    step_ends: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    train_busy_s: float = 0.0
    dropped: int = 0


def simulate(*, admit: Callable[..., bool], n_workers: int, capacity: int, timing: TimingModel, lengths: LengthModel,
             batch_groups: int, group_size: int, eta: int, steps: int, train_devices: int, prompt_len: int = 64,
             max_new_tokens: int | None = None, max_concurrent_groups: int | None = None, seed: int = 0) -> dict:
    """Play a run of `steps` training steps; returns its simulated duration, throughput and idle figures."""
    run = _Run()
    engines = [SimEngine(timing, lengths, capacity, clock=lambda: run.now, seed=seed * 7919 + i)
               for i in range(n_workers)]
    cap_groups = max_concurrent_groups or max(1, n_workers * capacity // group_size)
    spec = SamplingSpec(max_new_tokens=max_new_tokens or lengths.cap)
    while len(run.step_ends) < steps:
        _admit(run, admit, eta, batch_groups, cap_groups, group_size)
        _dispatch(run, engines, spec, prompt_len)
        _start_training(run, timing, batch_groups, eta, train_devices)
        nxt = [t for t in (e.next_due() for e in engines) if t is not None]
        if run.train_until is not None:
            nxt.append(run.train_until)
        if not nxt:
            raise RuntimeError("simulation stalled: nothing to generate and nothing to train (check the settings)")
        run.now = max(run.now, min(nxt))
        _collect(run, engines, group_size)
        _finish_training(run, engines)
    total_s = run.step_ends[-1]
    gen_busy = sum(e.busy_s for e in engines)
    devices = n_workers + train_devices
    return {"sim_s": total_s, "samples": steps * batch_groups * group_size,
            "samples_per_s": steps * batch_groups * group_size / total_s, "step_ends": run.step_ends,
            "gen_utilization": gen_busy / (n_workers * total_s), "train_utilization": run.train_busy_s / total_s,
            "idle_fraction": 1 - (gen_busy + run.train_busy_s * train_devices) / (devices * total_s),
            "staleness": run.staleness, "dropped_stale": run.dropped,
            "gen_tokens": sum(e.tokens for e in engines), "completed": sum(e.completed for e in engines)}


def _admit(run: _Run, admit: Callable[..., bool], eta: int, batch_groups: int, cap_groups: int, size: int) -> None:
    while admit(run.counted, run.version, eta, batch_groups, len(run.open_groups), cap_groups):
        g = run.next_group
        run.next_group += 1
        run.counted += 1
        run.open_groups[g] = []
        run.queue.extend((g, i) for i in range(size))


def _dispatch(run: _Run, engines: list[SimEngine], spec: SamplingSpec, prompt_len: int) -> None:
    while run.queue:
        best = max(engines, key=lambda e: e.max_concurrent - len(e.running) - len(e.waiting))
        if best.max_concurrent - len(best.running) - len(best.waiting) <= 0:
            return
        g, i = run.queue.pop(0)
        best.submit(EngineRequest(f"g{g}-{i}", [1] * prompt_len, spec))


def _collect(run: _Run, engines: list[SimEngine], size: int) -> None:
    for engine in engines:
        for out in engine.step():
            g = int(out.request_id[1:].split("-")[0])
            run.open_groups[g].append(out)
            if len(run.open_groups[g]) == size:
                outs = run.open_groups.pop(g)
                tokens = sum(len(o.prompt_ids) + len(o.output_ids) for o in outs)
                run.stored.append((g, min(int(o.versions.min()) for o in outs if len(o.versions)), tokens))


def _start_training(run: _Run, timing: TimingModel, batch_groups: int, eta: int, devices: int) -> None:
    if run.train_until is not None:
        return
    fresh = [s for s in run.stored if s[1] >= run.version - eta]
    run.dropped += len(run.stored) - len(fresh)
    run.counted -= len(run.stored) - len(fresh)
    run.stored = fresh
    if len(run.stored) < batch_groups:
        return
    run.training, run.stored = run.stored[:batch_groups], run.stored[batch_groups:]
    step_s = timing.train_step_s(sum(s[2] for s in run.training), devices)
    run.train_busy_s += step_s
    run.train_until = run.now + step_s
    run.staleness.extend(run.version - v for _, v, _ in run.training)


def _finish_training(run: _Run, engines: list[SimEngine]) -> None:
    if run.train_until is None or run.now < run.train_until:
        return
    run.train_until = None
    run.version += 1
    run.step_ends.append(run.now)
    for engine in engines:
        engine.update_weights(run.version)


def closed_form(*, gen_s: float, train_s: float, steps: int, eta: int) -> float:
    """Simulated seconds for `steps` steps when every batch takes gen_s to generate (all its sequences in
    parallel) and train_s to train, with zero infrastructure cost (derivation: tests/unit/sim/test_closed_form.py)."""
    if eta == 0:
        return steps * (gen_s + train_s)
    return gen_s + (steps - 1) * max(gen_s, train_s) + train_s


def plan(**kw: Any) -> dict:
    """simulate(**kw) without the per-sample lists (for reports)."""
    out = simulate(**kw)
    out.pop("step_ends")
    out.pop("staleness")
    return out
