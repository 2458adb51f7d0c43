"""`areal-mq worker trainer`: sample batches in, decoupled-PPO steps, new policy versions out.

A Role on the shared loop (areal_mq/actor/roles.py); each tick:
       store.get_batch(batch_groups, version, η) ──► Trainer.train_step ──► publisher.publish_version()
       (v+1, in the layout areal_mq/weights/publisher.py chose once at start; WeightsReady(v+1) on the signal bus)
       ──► metrics sinks (metrics.jsonl line; TensorBoard / W&B when `metrics:` asks, telemetry/metrics.py)
Invariants:
- the version starts at 0 (or the checkpoint's) and increases by exactly 1 per finished step;
- a batch is acknowledged to the store only once a checkpoint containing its effect is written (or at
  once when checkpoints are off), so a crash replays exactly the batches trained after the last checkpoint:
  none is lost and none is trained twice into the resumed parameters. The checkpoint names the batches whose
  acks follow it (`store_unacked`); a resumed trainer acks those (a crash may have come between save and
  ack), then asks with `release_leases` so the batches trained after the checkpoint come back. The whole
  history is never sent: it outgrew the 4 MiB header past ~155k samples;
- the store re-serves a batch whose lease expires, so the worker checkpoints (and acks) early when its
  oldest un-acked batch reaches half of `brokers.lease_s`; a re-served sample that this policy already
  trained on is skipped anyway (logged as trainer.duplicates_skipped);
- Control(pause) stops taking batches until Control(resume); Control(checkpoint) checkpoints now;
  Control(shutdown) / SIGTERM finish the current step, checkpoint, and exit;
- a sample with a non-finite reward or behaviour logprob is never trained: it is dropped and named
  (trainer.nonfinite_dropped) instead of turning the loss into NaN;
- η is a checked, exported invariant: every step's metrics (metrics.jsonl and every sink) carry
  `staleness_max` (the oldest generated token it trained on, in versions behind the trained policy),
  `staleness_violations` (tokens older than v - η: must stay 0, logged as trainer.staleness_violation) and
  `dropped_stale` / `dropped_stale_total` (samples the store dropped as too stale since the last step / since
  this process started; the store reports each drop once, in the next batch it serves);
- samples of a batch are trained in sample_id order, so the same samples give the same step whatever order
  they reached the store in (this is what makes η = 0 reproduce sync mode exactly).
Under `accelerate launch`, rank 0 talks to the store and the bus; the batch is broadcast to every rank.

    areal-mq worker trainer --config configs/quickstart.yaml
"""
from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from areal_mq.messages import Control
from areal_mq.actor.roles import Role, RoleLoop

STORE_UNACKED = "store_unacked"  # checkpoint extra: ids trained into it whose ack follows the save
ACK_CHUNK = 10_000  # ids per BatchAck when a resumed trainer acks them (far below the 4 MiB header limit)
# a checkpoint write cut by a full disk is tried again in place after 1, 2, 4 ... (at most 30) s, as the publisher
# does, instead of ending the trainer (the fault soak's finding; issue 52 item 6)
CHECKPOINT_RETRY_BASE_S = 1.0
CHECKPOINT_RETRY_MAX_S = 30.0


def staleness_violations(staleness_hist: list[int], max_staleness: int) -> int:
    """Generated tokens trained more than η versions behind the policy (`staleness_hist[k]`: tokens k behind)."""
    return int(sum(staleness_hist[max_staleness + 1:]))


def nonfinite_part(sample: Any) -> str | None:
    """What in `sample` is NaN or inf (None when nothing is)."""
    for i, seq in enumerate(sample.seqs):
        if not np.isfinite(seq.reward):
            return f"seq {i}: reward {seq.reward}"
        bad = np.flatnonzero(~np.isfinite(seq.logprobs))
        if bad.size:
            return f"seq {i}: logprobs at positions {bad[:5].tolist()}"
    return None


def _exchange_collector(mine: str) -> str:
    """Rank 0's shard collector endpoint, on every rank (one all_gather at start, never during a publish)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return str(everyone[0])


class TrainerWorker(Role):
    name = "trainer"
    stats_every_s = 0.0  # it reports every step (trainer.step event, metrics sinks)

    def __init__(self, cfg: Any, trainer: Any, store: Any, bus: Any, publisher: Any, rt: Any, sinks: Any = None):
        """`publisher`: this rank's TrainerPublisher (weights/publisher.py make_publisher), or a bare transport (a
        WeightPublisher, the simulated trainer's, a test's stand-in) put behind the same seam here (it announces on
        `bus`)."""
        from areal_mq.telemetry.metrics import JsonlSink, MetricsSinks, jsonl_path
        from areal_mq.weights.publisher import TrainerPublisher, make_publisher

        super().__init__(rt)
        self.cfg, self.trainer, self.store = cfg, trainer, store
        self.publisher = publisher if isinstance(publisher, TrainerPublisher) else \
            make_publisher(cfg, trainer, bus=bus, log=self.log, transport=publisher)
        self.run_dir = Path(cfg.run.run_dir)
        # the JSONL file alone where main() passes no sinks (ranks > 0, which never write, and tests)
        self.sinks = sinks or MetricsSinks([JsonlSink(jsonl_path(self.run_dir, "trainer"))], "trainer", self.log)
        self.unacked: list[Any] = []
        self.unacked_since: float | None = None  # monotonic time the oldest un-acked batch was served
        self.consumed: set[str] = set()
        self.first_get = True
        self.ckpt_root = self.run_dir / "checkpoints"
        self.ckpt_requested = False
        self.waited_since = time.perf_counter()
        self.stale_unreported = 0  # stale drops the store reported that no step's metrics carried yet
        self.stale_total = 0

    @property
    def is_main(self) -> bool:
        return self.trainer.is_main

    def resume(self) -> None:
        from areal_mq.algorithms.checkpoint import latest_checkpoint, load_checkpoint

        path = latest_checkpoint(self.ckpt_root)
        if path is not None:
            extra = load_checkpoint(self.trainer, path)
            # the acks of the batches inside this checkpoint may not have reached the store (a crash right
            # after saving): send them now. Older checkpoints do not name them: ack every consumed id.
            unacked = extra.get(STORE_UNACKED, self.trainer.resumed_ids)
            self.log_info("trainer.resumed", checkpoint=str(path), version=self.trainer.version,
                          consumed=self.trainer.consumed_total, acking=len(unacked))
            if self.is_main:
                for i in range(0, len(unacked), ACK_CHUNK):  # bounded requests, whatever the history
                    self.store.ack("", list(unacked[i:i + ACK_CHUNK]))
        self.consumed = set(self.trainer.resumed_ids)  # acked at that checkpoint: older ids are never served again
        if self.trainer.version > 0:
            self.publish()  # rollout workers must move to the resumed policy

    def log_info(self, event: str, **kw: Any) -> None:
        if self.is_main and self.log:
            self.log.info(event, **kw)

    def next_batch(self) -> Any:
        """Rank 0 asks the store; every rank receives the same batch (or None)."""
        batch = None
        if self.is_main:
            got = self.store.get_batch(self.cfg.controller.batch_groups, self.trainer.version,
                                       self.cfg.staleness_bound, wait_s=1.0,
                                       release_leases=self.first_get)  # resume() acked what we trained
            self.first_get = False
            self.stale_unreported += got.dropped_stale
            if got.dropped_stale:
                self.log_info("trainer.stale_dropped", count=got.dropped_stale, version=self.trainer.version)
            batch = self._fresh(got) if got.samples else None
        return self._broadcast(batch)

    def _fresh(self, got: Any) -> Any:
        """The batch without samples this policy already trained on (None if nothing is left)."""
        fresh = [s for s in got.samples if s.sample_id not in self.consumed]
        if len(fresh) < len(got.samples):
            self.log_info("trainer.duplicates_skipped", batch=got.batch_id, count=len(got.samples) - len(fresh),
                          hint="a lease expired before its checkpoint; raise brokers.lease_s or lower "
                               "trainer.checkpoint_every")
        return got.model_copy(update={"samples": fresh}) if fresh else None

    def _broadcast(self, obj: Any) -> Any:
        if self.trainer.world_size == 1:
            return obj
        from accelerate.utils import broadcast_object_list

        box = [obj]
        broadcast_object_list(box, from_process=0)
        return box[0]

    def _finite(self, samples: list[Any]) -> list[Any]:
        """The samples without non-finite rewards or behaviour logprobs (they would make the loss NaN); the
        controller never stores such a sample, but a store may still hold one (older log, another writer)."""
        keep, bad = [], {}
        for sample in samples:
            why = nonfinite_part(sample)
            if why is None:
                keep.append(sample)
            else:
                bad[sample.sample_id] = why
        if bad:
            self.log_info("trainer.nonfinite_dropped", samples=bad, count=len(bad), version=self.trainer.version)
        return keep

    def step(self, batch: Any, waited_s: float) -> dict:
        from areal_mq.algorithms.packing import trains_anything

        samples = self._finite(sorted(batch.samples, key=lambda s: s.sample_id))
        if samples and not trains_anything(samples):  # e.g. every answer truncated under controller.overlong_filter
            self.log_info("trainer.step_skipped", batch=batch.batch_id, samples=len(samples),
                          version=self.trainer.version, reason="no sequence has a token to train on (empty or loss_excluded): no loss, no update")
            samples = []
        if not samples:  # nothing trainable: acked at once (no parameter depends on it), no new version
            if self.is_main:
                self.store.ack(batch)
            return {}
        metrics = self.trainer.train_step(samples)
        self.consumed.update(s.sample_id for s in samples)
        if not self.unacked:
            self.unacked_since = time.monotonic()
        self.unacked.append(batch)
        t0 = time.perf_counter()
        self.keep_for_eval(self.publish())
        metrics.update(publish_s=time.perf_counter() - t0, wait_s=waited_s, time=time.time(), **self._bound(metrics))
        if self.is_main:
            self.sinks.write(self.trainer.version, metrics)
        self.log_info("trainer.step", sample_ids=[s.sample_id for s in samples],  # what the chaos audit reads
                      **{k: round(v, 5) if isinstance(v, float) else v for k, v in metrics.items()})
        every = self.cfg.trainer.checkpoint_every
        if every == 0:
            self.ack_all()
        elif self.trainer.version % every == 0 or self._checkpoint_due():
            self.checkpoint()
        return metrics

    def _bound(self, metrics: dict) -> dict:
        """The staleness invariant of this step (see the module docstring)."""
        eta = self.cfg.staleness_bound
        violations = staleness_violations(metrics.get("staleness_hist", []), eta)
        if violations and self.is_main and self.log:
            self.log.warning("trainer.staleness_violation", tokens=violations, max_staleness=eta,
                          staleness_max=metrics.get("staleness_max"), version=self.trainer.version)
        dropped, self.stale_unreported = self.stale_unreported, 0
        self.stale_total += dropped
        return {"staleness_bound": eta, "staleness_violations": violations, "dropped_stale": dropped,
                "dropped_stale_total": self.stale_total}

    def publish(self) -> Any:
        """Publish the trainer's current version through this rank's publisher; returns what it took (the snapshot
        keep_for_eval reuses; None when this rank took nothing)."""
        return self.publisher.publish_version()

    def keep_for_eval(self, publication: Any = None) -> None:
        """The held-out evaluation (`areal-mq run`'s final one, eval.every's periodic ones, `areal-mq eval`) reads
        run_dir/weights/vN: those versions (every eval.every-th and the last, controller.total_steps) are written
        there in full, not announced, where publishing leaves none on disk (publisher.keep_for_eval; under fsdp a
        gather every rank joins, at those versions only). Costs a full write of publish_dtype bytes per such version
        (the last trainer.keep_weight_versions of them kept). `publication`: what publish() just took, reused."""
        cfg, version = self.cfg, self.trainer.version
        if version < cfg.controller.total_steps and not (cfg.eval.every and version % cfg.eval.every == 0):
            return
        t0 = time.perf_counter()
        try:
            path = self.publisher.keep_for_eval(publication, self.run_dir / "weights")
        except OSError as exc:  # a full disk costs this version's evaluation, not the training run
            if self.log:
                self.log.error("trainer.kept_for_eval_failed", version=version, error=str(exc)[:300],
                               hint="this version is not on disk, so it is not evaluated; training goes on")
            return
        if path is not None:
            self.log_info("trainer.kept_for_eval", version=version, path=str(path),
                          seconds=round(time.perf_counter() - t0, 2))

    def checkpoint(self) -> None:
        from areal_mq.algorithms.checkpoint import save_checkpoint

        self.ckpt_requested = False
        extra = {STORE_UNACKED: [s.sample_id for batch in self.unacked for s in batch.samples]}  # see resume()
        path = self._retry_full_disk(lambda: save_checkpoint(self.trainer, self.ckpt_root, extra))
        self.ack_all()
        self.log_info("trainer.checkpoint", path=str(path), version=self.trainer.version)

    def _retry_full_disk(self, save: Any) -> Any:
        """`save()`, tried again in place while it meets a full disk (a single process: under several ranks the
        save is collective and one rank cannot retry alone, so the error ends the unit and the launcher restarts
        it from the last checkpoint, as before). The batches trained since stay unacked meanwhile: nothing is lost."""
        from areal_mq.errors import full_disk_errno

        pause = CHECKPOINT_RETRY_BASE_S
        while True:
            try:
                return save()
            except Exception as exc:  # noqa: BLE001 - only a full disk is retried; anything else is raised
                if full_disk_errno(exc) is None or self.trainer.world_size > 1:
                    raise
                if self.log:
                    self.log.warning("trainer.checkpoint_disk_full", version=self.trainer.version,
                                     error=str(exc)[:200], retry_in_s=pause,
                                     hint="free space on the run directory's disk; the trainer waits and retries")
                time.sleep(pause)
                pause = min(2 * pause, CHECKPOINT_RETRY_MAX_S)

    def ack_all(self) -> None:
        if self.is_main:
            for batch in self.unacked:
                self.store.ack(batch)
        self.unacked = []
        self.unacked_since = None

    def _checkpoint_due(self) -> bool:
        """Rank 0's decision, on every rank (checkpoints are collective): a Control(checkpoint) arrived,
        or the oldest un-acked batch is half-way to its lease expiry."""
        lease_due = self.unacked_since is not None and \
            time.monotonic() - self.unacked_since > 0.5 * self.cfg.brokers.lease_s
        return bool(self._broadcast(bool(self.is_main and (self.ckpt_requested or lease_due))))

    # ------------------------------------------------------------ loop hooks (rank 0 alone gets signals)
    def on_signal(self, msg: Any) -> None:
        if isinstance(msg, Control) and msg.action == "checkpoint" and msg.target_role in ("", "trainer"):
            self.ckpt_requested = True

    def should_stop(self, stopping: bool) -> bool:
        """Rank 0's stop decision on every rank (a collective), or the last step is done."""
        return self.trainer.version >= self.cfg.controller.total_steps or bool(self._broadcast(stopping))

    def on_tick(self) -> bool:
        if self._checkpoint_due() and self.unacked:
            self.checkpoint()
        if self._broadcast(self.paused):
            time.sleep(0.1)
            return True
        batch = self.next_batch()  # waits up to 1 s in the store
        if batch is not None:
            self.step(batch, time.perf_counter() - self.waited_since)
            self.waited_since = time.perf_counter()
        return True

    def on_stop(self) -> None:
        self.publisher.drain()  # the last version reaches the workers before the trainer says finished
        if self.unacked or self._broadcast(self.ckpt_requested) or \
                self.trainer.version >= self.cfg.controller.total_steps:
            self.checkpoint()
        self.log_info("trainer.finished", version=self.trainer.version)
        self.sinks.close()

    def run(self) -> None:
        self.waited_since = time.perf_counter()
        RoleLoop(self.rt, self).run()


def main(cfg: Any, worker_id: str | None = None) -> int:
    if cfg.trainer.sim.enabled:  # a simulated training step (issue 17): workers/sim_trainer.py
        from areal_mq.workers.sim_trainer import main as sim_main

        return sim_main(cfg, worker_id)
    from areal_mq.algorithms.trainer import Trainer, rollout_dtype
    from areal_mq.client import SignalPublisher, StoreClient
    from areal_mq.devices import role_device
    from areal_mq.engines.models import resolve_model
    from areal_mq.telemetry.metrics import MetricsSinks
    from areal_mq.actor.runtime import WorkerRuntime
    from areal_mq.actor.threads import apply_thread_budget
    from areal_mq.weights.publisher import make_publisher

    apply_thread_budget(cfg, "trainer")
    trainer = Trainer(cfg.trainer, resolve_model(cfg.model.name, cfg.model.cache_dir),
                      device=role_device(cfg, "trainer"), engine_dtype=rollout_dtype(cfg))
    rt = store = bus = sinks = None
    if not trainer.is_main:  # torchrun forwards SIGTERM to every rank: only rank 0 decides when to stop
        signal.signal(signal.SIGTERM, lambda *_: None)
    if trainer.is_main:
        rt = WorkerRuntime(cfg, role="trainer", service=None, capacity=0, worker_id=worker_id, topics=("control",))
        sinks = MetricsSinks.from_config(cfg, "trainer", rt.log)  # a missing sink package stops us here
        rt.start()
        store = StoreClient(cfg.brokers.store_addr, keys=rt.keys, heartbeat_s=cfg.brokers.heartbeat_s)
        bus = SignalPublisher(cfg.brokers.bus_in_addr, keys=rt.keys)
        time.sleep(0.3)  # let the PUB socket connect before the first WeightsReady
    # every rank, at the same point: the layout may exchange endpoints (a collective)
    publisher = make_publisher(cfg, trainer, bus=bus, keys=rt.keys if rt is not None else None,
                               log=rt.log if rt is not None else None, exchange=_exchange_collector)
    worker = TrainerWorker(cfg, trainer, store, bus, publisher, rt, sinks)
    try:
        worker.resume()
        worker.log_info("trainer.started", version=trainer.version, world_size=trainer.world_size,
                        total_steps=cfg.controller.total_steps, device=str(trainer.device),
                        precision=trainer.precision, engine_dtype=rollout_dtype(cfg))
        worker.run()
        return 0
    finally:
        for thing in (publisher, store, bus):
            if thing is not None:
                thing.close()
        if rt is not None:
            rt.close(drain_timeout=0)
        trainer.close()  # the process group last: the publisher's exchange may still have used it
