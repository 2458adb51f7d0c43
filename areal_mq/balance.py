"""How to split devices between generation and training, from live figures (issue 17 item 4).

What: `recommend_split(...)` (pure) turns what a running system shows — generated tokens/s, trained samples/s,
how busy the generation slots and the trainer are, the sample store's depth and the staleness of trained data —
into a recommended number of generation devices. `SplitAdvisor` keeps the running figures for the controller,
which logs its recommendation with its periodic stats (`controller.split_recommendation`).
Why: the AReaL paper names its fixed generation:training split as a limitation; the right split depends on the
length distribution and the model, and the system can measure it.
How: each phase's capacity per device is its measured rate divided by the devices it kept busy:
    gen capacity   c_g = (gen_tokens_per_s / tokens_per_sample) / (gen_devices * gen_busy)     samples/s/device
    train capacity c_t = trained_samples_per_s / (train_devices * train_busy)                 samples/s/device
The split that makes both pipelines equally fast, f * D * c_g = (1 - f) * D * c_t, is f = c_t / (c_g + c_t) —
equivalently, devices in proportion to the device-seconds each phase actually used. The store depth and the
staleness explain the direction in the reason (a deep store: training is behind; staleness near η with idle
generation slots: generation waits on the bound). Checked by tests/unit/sim/test_balance.py and, against a
sweep of splits for three length distributions, by `python benchmarks/speed/scale.py --balance`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

MIN_BUSY = 0.02  # busy shares below this say nothing about capacity (an idle phase): keep the split


@dataclass(frozen=True)
class Split:
    gen_devices: int
    train_devices: int
    gen_fraction: float  # unrounded recommendation
    reason: str

    def as_fields(self) -> dict[str, Any]:
        return {"gen_devices": self.gen_devices, "train_devices": self.train_devices,
                "gen_fraction": round(self.gen_fraction, 3), "reason": self.reason}


def recommend_split(*, gen_devices: int, train_devices: int, gen_tokens_per_s: float, tokens_per_sample: float,
                    trained_samples_per_s: float, gen_busy: float, train_busy: float, store_depth: float = 0.0,
                    batch_samples: int = 1, staleness_mean: float = 0.0, eta: int = 1) -> Split:
    """The generation:training split that balances the two phases (see the module docstring)."""
    if gen_devices < 1 or train_devices < 1:
        raise ValueError(f"need at least one device per phase, got {gen_devices} generation / {train_devices} training")
    total = gen_devices + train_devices
    if min(gen_busy, train_busy) < MIN_BUSY or gen_tokens_per_s <= 0 or trained_samples_per_s <= 0 \
            or tokens_per_sample <= 0:
        return Split(gen_devices, train_devices, gen_devices / total, "not enough activity yet to measure both phases")
    c_gen = gen_tokens_per_s / tokens_per_sample / (gen_devices * min(1.0, gen_busy))
    c_train = trained_samples_per_s / (train_devices * min(1.0, train_busy))
    fraction = c_train / (c_gen + c_train)
    gen = min(total - 1, max(1, round(fraction * total)))
    if gen > gen_devices:
        why = "training has spare capacity" + (" (store empty, trainer waits)" if store_depth < batch_samples else "")
    elif gen < gen_devices:
        why = "generation has spare capacity" + (
            f" (store holds {store_depth:.0f} samples, {store_depth / max(1, batch_samples):.1f} batches)"
            if store_depth >= batch_samples else "")
        if eta and staleness_mean >= eta - 0.5:
            why += f"; staleness {staleness_mean:.2f} near η={eta}: generation waits on the bound"
    else:
        why = "balanced"
    return Split(gen, total - gen, fraction, f"{why}; capacity per device: generation {c_gen:.4g}, "
                                             f"training {c_train:.4g} samples/s")


class SplitAdvisor:
    """The controller's running figures for recommend_split, measured between two stats reports.

    gen_busy is the occupancy of the generation slots (sequences in flight / slots), train_busy the trainer's
    busy share when its WeightsReady carries it (meta "train_busy": the simulated trainer does), else 1 while
    the store holds a batch or more (the trainer is never waiting) — without either nothing is recommended."""

    def __init__(self, gen_devices: int, train_devices: int, slots: int, batch_samples: int, eta: int,
                 window_s: float = 10.0):
        self.gen_devices, self.train_devices, self.slots = gen_devices, train_devices, slots
        self.batch_samples, self.eta, self.window_s = batch_samples, eta, window_s
        self.last: tuple[float, int, int, int] | None = None  # (time, gen tokens, completed seqs, version)
        self.train_busy: float | None = None
        self.occupancy: list[float] = []

    def weights(self, meta: dict) -> None:
        if isinstance(meta.get("train_busy"), (int, float)):
            self.train_busy = float(meta["train_busy"])

    def observe(self, in_flight_seqs: int) -> None:
        self.occupancy.append(min(1.0, in_flight_seqs / max(1, self.slots)))

    def report(self, now: float, gen_tokens: int, completed: int, version: int, store_depth: int,
               staleness_mean: float) -> Split | None:
        last = self.last
        if last is not None and now - last[0] < self.window_s:
            return None  # measure over at least window_s
        self.last = (now, gen_tokens, completed, version)
        busy = sum(self.occupancy) / len(self.occupancy) if self.occupancy else 0.0
        self.occupancy = []
        if last is None or completed <= last[2]:
            return None
        dt = now - last[0]
        train_busy = self.train_busy if self.train_busy is not None else (1.0 if store_depth >= self.batch_samples
                                                                           else None)
        if train_busy is None:
            return None
        return recommend_split(
            gen_devices=self.gen_devices, train_devices=self.train_devices,
            gen_tokens_per_s=(gen_tokens - last[1]) / dt, tokens_per_sample=(gen_tokens - last[1]) / (completed - last[2]),
            trained_samples_per_s=(version - last[3]) * self.batch_samples / dt, gen_busy=busy, train_busy=train_busy,
            store_depth=store_depth, batch_samples=self.batch_samples, staleness_mean=staleness_mean, eta=self.eta)

    @classmethod
    def from_config(cls, cfg: Any) -> "SplitAdvisor":
        """Devices as the config describes them: simulated (rollout.engine.sim.workers, trainer.sim.devices) or
        launcher.rollout_workers rollout workers and one trainer."""
        sim = cfg.rollout.engine.kind == "sim"
        gen = cfg.rollout.engine.sim.workers if sim else cfg.launcher.rollout_workers
        train = cfg.trainer.sim.devices if cfg.trainer.sim.enabled else 1
        ctl = cfg.controller
        return cls(gen, train, gen * cfg.rollout.engine.max_concurrent, ctl.batch_groups * ctl.group_size,
                   cfg.staleness_bound)

    def tick(self, log: Any, *, in_flight_seqs: int, gen_tokens: int, completed: int, version: int,
             store_depth: int) -> None:
        """The controller's periodic stats: sample occupancy; once per window log the recommendation."""
        self.observe(in_flight_seqs)
        split = self.report(time.monotonic(), gen_tokens, completed, version, store_depth, 0.0)
        if split is not None:
            log.info("controller.split_recommendation", current_gen=self.gen_devices,
                     current_train=self.train_devices, **split.as_fields())
