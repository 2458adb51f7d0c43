"""The SIMULATED trainer (`trainer.sim.enabled: true`): the real trainer role's store and bus traffic, no model.

What: the same TrainerWorker loop as workers/trainer.py (GetBatch from the real sample store with the
staleness bound, BatchAck, one WeightsReady per step on the real signal bus), with the training step replaced
by a sleep of the named timing model's train_step_s(tokens of the batch, trainer.sim.devices) on the virtual
clock (trainer.sim.time_scale real seconds per simulated second). Versions are published as
WeightsReady(mode="sim"): there are no weights; simulated engines model the load pause, real engines refuse it.
Each step's metrics line (run_dir/metrics.jsonl) carries the simulated step time, the batch's tokens and the
staleness of every trained sequence (version at training minus the oldest version among its tokens) as
`stale_K` counts, which benchmarks/speed/scale.py reads, and per generated token as the real trainer reports it
(`staleness_hist`, `staleness_max`), so the worker's staleness invariant (`staleness_violations`,
`dropped_stale`) is checked and exported the same way.
Why: issue 17 (scale by simulation) — only the GPUs are simulated; store, bus and protocol are real.

    areal-mq worker trainer --config CFG --set trainer.sim.enabled=true   (workers/trainer.py hands over here)
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable

import numpy as np

from areal_mq.messages import WeightsReady
from areal_mq.sim.timing import timing_model
from areal_mq.workers.trainer import TrainerWorker


class SimTrainer:
    """Stands where algorithms.trainer.Trainer stands, for TrainerWorker: train_step, version, publish_tensors."""

    is_main = True
    world_size = 1
    hf_config_json = ""

    def __init__(self, sim_cfg: Any, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic):
        self.timing, self.devices, self.scale = timing_model(sim_cfg.timing), sim_cfg.devices, sim_cfg.time_scale
        self.sleep, self.clock = sleep, clock
        self.version = 0
        self.consumed_ids: list[str] = []
        self.resumed_ids: list[str] = []  # no checkpoints: a resume has nothing to ack again
        self.busy_s = 0.0
        self.started = clock()

    def train_step(self, samples: list[Any]) -> dict:
        seqs = [seq for s in samples for seq in s.seqs]
        tokens = sum(len(q.prompt_ids) + len(q.output_ids) for q in seqs)
        step_s = self.timing.train_step_s(tokens, self.devices)
        self.sleep(step_s * self.scale)
        self.busy_s += step_s
        # generated tokens only: an episode's environment tokens carry version -1 and are never trained
        gen = [np.asarray(q.versions, dtype=np.int64)[np.asarray(q.versions) >= 0] for q in seqs]
        stale = Counter(self.version - int(v.min()) if len(v) else 0 for v in gen)
        # per generated token, as the real trainer reports it: TrainerWorker checks the bound against this
        behind = np.concatenate([self.version - v for v in gen] or [np.zeros(0, dtype=np.int64)])
        self.version += 1
        self.consumed_ids.extend(s.sample_id for s in samples)
        metrics = {"version": self.version, "sim_step_s": round(step_s, 4), "sim_busy_s": round(self.busy_s, 4),
                   "sim_t": round((self.clock() - self.started) / self.scale, 4), "tokens": tokens,
                   "gen_tokens": sum(len(q.output_ids) for q in seqs), "seqs": len(seqs)}
        metrics.update({f"stale_{k}": v for k, v in sorted(stale.items())})
        metrics.update(staleness_max=int(behind.max()) if behind.size else 0,
                       staleness_hist=np.bincount(np.clip(behind, 0, None).astype(np.int64)).tolist())
        return metrics

    def publish_tensors(self) -> dict:
        return {}

    def busy_share(self) -> float:
        """Busy share of the simulated trainer since the previous call (the controller's split advisor reads it)."""
        now, busy = (self.clock() - self.started) / self.scale, self.busy_s
        last_t, last_busy = getattr(self, "_last_share", (0.0, 0.0))
        self._last_share = (now, busy)
        return round(min(1.0, (busy - last_busy) / max(1e-9, now - last_t)), 4)


class SimPublisher:
    """WeightPublisher's place: announces a version (with the trainer's busy share), publishes nothing."""

    def __init__(self, trainer: SimTrainer | None = None):
        self.trainer = trainer

    def publish(self, version: int, tensors: Any = None, config_json: str = "", snapshot: bool = True) -> WeightsReady:
        meta: dict[str, Any] = {"simulated": True}
        if self.trainer is not None:
            meta["train_busy"] = self.trainer.busy_share()
        return WeightsReady(version=version, mode="sim", meta=meta)

    def close(self) -> None:
        pass


class SimTrainerWorker(TrainerWorker):
    """TrainerWorker without checkpoints (a simulated trainer has no parameters): batches are acked when the
    real worker would checkpoint them, so the store's lease and ack traffic stays the same."""

    def resume(self) -> None:
        self.consumed = set()

    def checkpoint(self) -> None:
        self.ckpt_requested = False
        self.ack_all()


def main(cfg: Any, worker_id: str | None = None) -> int:
    from areal_mq.client import SignalPublisher, StoreClient
    from areal_mq.actor.runtime import WorkerRuntime

    rt = WorkerRuntime(cfg, role="trainer", service=None, capacity=0, worker_id=worker_id, topics=("control",))
    store = bus = None
    try:
        rt.start()
        store = StoreClient(cfg.brokers.store_addr, keys=rt.keys, heartbeat_s=cfg.brokers.heartbeat_s)
        bus = SignalPublisher(cfg.brokers.bus_in_addr, keys=rt.keys)
        time.sleep(0.3)  # let the PUB socket connect before the first WeightsReady
        trainer = SimTrainer(cfg.trainer.sim)
        worker = SimTrainerWorker(cfg, trainer, store, bus, SimPublisher(trainer), rt)
        worker.log_info("trainer.started", version=0, simulated=True, timing=cfg.trainer.sim.timing,
                        devices=cfg.trainer.sim.devices, total_steps=cfg.controller.total_steps)
        worker.run()
        return 0
    finally:
        for thing in (store, bus):
            if thing is not None:
                thing.close()
        rt.close(drain_timeout=0)
