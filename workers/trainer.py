"""`areal-mq worker trainer`: sample batches in, decoupled-PPO steps, new policy versions out.

Loop:  store.get_batch(batch_groups, version, η) ──► Trainer.train_step ──► publish weights v+1
       (disk dir or zmq server) ──► WeightsReady(v+1) on the signal bus ──► metrics.jsonl line
Invariants:
- the version starts at 0 (or the checkpoint's) and increases by exactly 1 per finished step;
- a batch is acknowledged to the store only once a checkpoint containing its effect is written (or at
  once when checkpoints are off), so a crash replays exactly the batches trained after the last checkpoint:
  none is lost and none is trained twice into the resumed parameters;
- samples of a batch are trained in sample_id order, so the same samples give the same step whatever order
  they reached the store in (this is what makes η = 0 reproduce sync mode exactly).
Under `accelerate launch`, rank 0 talks to the store and the bus; the batch is broadcast to every rank.

    areal-mq worker trainer --config configs/quickstart.yaml
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class TrainerWorker:
    def __init__(self, cfg: Any, trainer: Any, store: Any, bus: Any, publisher: Any, rt: Any):
        self.cfg, self.trainer, self.store, self.bus, self.publisher, self.rt = cfg, trainer, store, bus, publisher, rt
        self.log = rt.log if rt else None
        self.run_dir = Path(cfg.run.run_dir)
        self.unacked: list[Any] = []
        self.first_get = True
        self.ckpt_root = self.run_dir / "checkpoints"
        self.ckpt_requested = False

    @property
    def main(self) -> bool:
        return self.trainer.is_main

    def resume(self) -> None:
        from areal_mq.algorithms.checkpoint import latest_checkpoint, load_checkpoint

        path = latest_checkpoint(self.ckpt_root)
        if path is not None:
            load_checkpoint(self.trainer, path)
            self.log_info("trainer.resumed", checkpoint=str(path), version=self.trainer.version,
                          consumed=len(self.trainer.consumed_ids))
        if self.trainer.version > 0:
            self.publish()  # rollout workers must move to the resumed policy

    def log_info(self, event: str, **kw: Any) -> None:
        if self.main and self.log:
            self.log.info(event, **kw)

    def next_batch(self) -> Any:
        """Rank 0 asks the store; every rank receives the same batch (or None)."""
        batch = None
        if self.main:
            c = self.cfg.controller
            eta = 0 if self.cfg.run.mode == "sync" else c.max_staleness
            got = self.store.get_batch(c.batch_groups, self.trainer.version, eta, wait_s=1.0,
                                       release_leases=self.first_get,
                                       skip_ids=self.trainer.consumed_ids if self.first_get else None)
            self.first_get = False
            if got.dropped_stale:
                self.log_info("trainer.stale_dropped", count=got.dropped_stale, version=self.trainer.version)
            batch = got if got.samples else None
        return self._broadcast(batch)

    def _broadcast(self, obj: Any) -> Any:
        if self.trainer.world_size == 1:
            return obj
        from accelerate.utils import broadcast_object_list

        box = [obj]
        broadcast_object_list(box, from_process=0)
        return box[0]

    def step(self, batch: Any, waited_s: float) -> dict:
        samples = sorted(batch.samples, key=lambda s: s.sample_id)
        metrics = self.trainer.train_step(samples)
        self.unacked.append(batch)
        t0 = time.perf_counter()
        self.publish()
        metrics.update(publish_s=time.perf_counter() - t0, wait_s=waited_s, time=time.time(),
                       dropped_stale=batch.dropped_stale)
        if self.main:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(metrics) + "\n")
        self.log_info("trainer.step", **{k: round(v, 5) if isinstance(v, float) else v for k, v in metrics.items()})
        every = self.cfg.trainer.checkpoint_every
        if every == 0:
            self.ack_all()
        elif self.trainer.version % every == 0 or self.ckpt_requested:
            self.checkpoint()
        return metrics

    def publish(self) -> None:
        if not self.main:
            return
        model = self.trainer.unwrapped
        ready = self.publisher.publish(self.trainer.version, model.state_dict(), model.config.to_json_string())
        self.bus.publish("weights", ready)

    def checkpoint(self) -> None:
        from areal_mq.algorithms.checkpoint import save_checkpoint

        self.ckpt_requested = False
        state_file = self.run_dir / "controller_state.json"
        extra = {"controller": json.loads(state_file.read_text())} if state_file.exists() else {}
        path = save_checkpoint(self.trainer, self.ckpt_root, extra)
        self.ack_all()
        self.log_info("trainer.checkpoint", path=str(path), version=self.trainer.version)

    def ack_all(self) -> None:
        if self.main:
            for batch in self.unacked:
                self.store.ack(batch)
        self.unacked = []

    def handle_signals(self) -> None:
        from areal_mq.messages import Control

        if not (self.main and self.rt):
            return
        while (env := self.rt.next_signal()) is not None:
            if isinstance(env.msg, Control) and env.msg.action == "checkpoint":
                self.ckpt_requested = True

    def run(self) -> None:
        total = self.cfg.controller.total_steps
        waited = time.perf_counter()
        while self.trainer.version < total and not self._stopping():
            self.handle_signals()
            if self.ckpt_requested and self.unacked:
                self.checkpoint()
            batch = self.next_batch()
            if batch is None:
                continue
            self.step(batch, time.perf_counter() - waited)
            waited = time.perf_counter()
        if self.unacked or self.ckpt_requested or self.trainer.version >= total:
            self.checkpoint()
        self.log_info("trainer.finished", version=self.trainer.version)

    def _stopping(self) -> bool:
        stop = bool(self.rt and self.rt.stopping)
        return bool(self._broadcast(stop))


def main(cfg: Any, worker_id: str | None = None) -> int:
    from areal_mq.algorithms.trainer import Trainer
    from areal_mq.client import SignalPublisher, StoreClient
    from areal_mq.engines.models import resolve_model
    from areal_mq.threads import apply_thread_budget
    from areal_mq.weights import WeightPublisher
    from areal_mq.workers.runtime import WorkerRuntime

    apply_thread_budget(cfg, "trainer")
    trainer = Trainer(cfg.trainer, resolve_model(cfg.model.name, cfg.model.cache_dir))
    rt = store = bus = publisher = None
    if trainer.is_main:
        rt = WorkerRuntime(cfg, role="trainer", service=None, capacity=0, worker_id=worker_id, topics=("control",))
        rt.start()
        store = StoreClient(cfg.brokers.store_addr, heartbeat_s=cfg.brokers.heartbeat_s)
        bus = SignalPublisher(cfg.brokers.bus_in_addr)
        publisher = WeightPublisher(cfg.trainer, cfg.run.run_dir)
        time.sleep(0.3)  # let the PUB socket connect before the first WeightsReady
    worker = TrainerWorker(cfg, trainer, store, bus, publisher, rt)
    try:
        worker.resume()
        worker.log_info("trainer.started", version=trainer.version, world_size=trainer.world_size,
                        total_steps=cfg.controller.total_steps)
        worker.run()
        return 0
    finally:
        for thing in (publisher, store, bus):
            if thing is not None:
                thing.close()
        if rt is not None:
            rt.close(drain_timeout=0)
