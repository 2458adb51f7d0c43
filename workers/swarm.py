"""`areal-mq worker swarm`: one process hosting N SIMULATED rollout workers (issue 17, scale by simulation).

What: N RolloutWorkers — the real role code of workers/rollout.py — each on its own simulated engine
(areal_mq/sim/engine.py, `rollout.engine.kind: sim`) and its own DEALER identity with READY and
heartbeats (areal_mq/actor/link.py's WorkerLink, the one the worker runtime drives too; built in
workers/swarm_links.py), so the real job broker sees N workers. One SUB socket on the signal bus
feeds WeightsReady / Control to all of them. Optionally the process also serves the `reward` service with a
simulated instant reward (`rollout.engine.sim.reward_capacity`) and a `probe` service that records dispatch
latency (client -> broker -> worker; the probes come from benchmarks/speed/scale.py).

    areal-mq worker swarm --config CFG --set rollout.engine.kind=sim --set rollout.engine.sim.workers=64

How one thread runs N workers: the engines' virtual clock is real time / time_scale; each engine says when its
next sequence finishes (`next_due`), a heap orders the workers by it, and the loop polls every socket until
the earliest one is due, then ticks only the workers that are due (or got a job or a signal). `lag` — how late
a due tick ran in real time — shows when this process, not the simulated GPUs, is the limit.
On exit (SIGTERM, Control shutdown) each worker says DISCONNECT (the broker requeues what it held) and a
summary JSON is written to run_dir/swarm-<worker_id>.json (busy time, tokens, lag, probe latencies).
"""
from __future__ import annotations

import functools
import heapq
import json
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from areal_mq import protocol
from areal_mq.errors import ProtocolError
from areal_mq.messages import Control
from areal_mq.workers.rollout import RolloutWorker
from areal_mq.workers.swarm_links import Responder, probe_answer, sim_reward, swarm_link

POLL_MAX_S = 0.05  # the loop wakes at least this often (heartbeats, stop requests)


class Swarm:
    def __init__(self, cfg: Any, log: Any, swarm_id: str, keys: Any, reward_keys: Any = None):
        from areal_mq.engines import build_engine

        sim, eng = cfg.rollout.engine.sim, cfg.rollout.engine
        self.cfg, self.log, self.swarm_id, self.scale = cfg, log, swarm_id, sim.time_scale
        self.ctx = zmq.Context()
        # libzmq allows 1,023 sockets per context by default; a closed socket's slot is freed later (by the reaper),
        # so a burst of reconnects needs room for the old and the new socket of every link
        raise_socket_limits(self.ctx, 2 * (sim.workers + 8))
        self.t0 = time.monotonic()
        self.links, self.workers = [], []
        for i in range(sim.workers):
            link = swarm_link(self.ctx, cfg, keys, log, f"{swarm_id}-w{i:04d}", "generate", eng.max_concurrent)
            engine = build_engine(eng, cfg.model, seed=cfg.run.seed * 100_003 + i, clock=self.sim_now)
            link.on_rejoin = functools.partial(self._forget_jobs, i)
            self.links.append(link)
            self.workers.append(RolloutWorker(cfg, engine, link))
        self.probe_latencies: list[tuple[float, float]] = []
        self.responders = [Responder(swarm_link(self.ctx, cfg, keys, log, f"{swarm_id}-probe", "probe", 64),
                                     probe_answer(self.probe_latencies))]
        if sim.reward_capacity:
            link = swarm_link(self.ctx, cfg, reward_keys or keys, log, f"{swarm_id}-reward", "reward",
                              sim.reward_capacity, role="reward")
            self.responders.append(Responder(link, sim_reward(cfg.run.seed, link.worker_id)))
        self.sub = self._subscribe(keys)
        self.due: list[tuple[float, int]] = []
        self.scheduled: dict[int, float] = {}
        self.lags: list[float] = []
        self.stopping = False
        self.ticks = self.loops = 0
        self.timeline: list[tuple[float, float]] = []  # (wall time, busy device-seconds so far): windows of a run

    def sim_now(self) -> float:
        return (time.monotonic() - self.t0) / self.scale

    def _subscribe(self, keys: Any) -> zmq.Socket:
        sub = keys.client(self.ctx.socket(zmq.SUB))
        sub.setsockopt(zmq.LINGER, 0)
        for topic in (b"weights", b"control"):
            sub.setsockopt(zmq.SUBSCRIBE, topic)
        sub.connect(self.cfg.brokers.bus_out_addr)
        return sub

    # ------------------------------------------------------------ the loop
    def run(self) -> None:
        for link in self.links + [r.link for r in self.responders]:
            link.ready()
        self.log.info("swarm.started", workers=len(self.workers), time_scale=self.scale,
                      timing=self.cfg.rollout.engine.sim.timing, lengths=self.cfg.rollout.engine.sim.lengths)
        next_beats = 0.0
        while not self.stopping:
            self.loops += 1
            poller = self._poller()
            wait = POLL_MAX_S if not self.due else min(POLL_MAX_S, max(0.0, self.due[0][0] - time.monotonic()))
            ready = dict(poller.poll(int(wait * 1000)))
            if self.sub in ready:
                self._signals()
            for sock in ready:
                if (i := self.index.get(sock)) is not None:
                    self._jobs(i)
            for r in self.responders:
                if r.link.sock in ready:
                    r.serve()
            self._tick_due(time.monotonic())
            if time.monotonic() >= next_beats:
                next_beats = time.monotonic() + self.links[0].heartbeat_s / 10
                self._heartbeats(time.monotonic())
                self._record()

    def _record(self) -> None:
        now = self.sim_now()
        self.timeline.append((round(time.time(), 3), round(sum(w.engine.busy_at(now) for w in self.workers), 3)))

    def _poller(self) -> zmq.Poller:
        if getattr(self, "_poll", None) is None:  # rebuilt only when a link replaced its socket
            self.index = {link.sock: i for i, link in enumerate(self.links)}
            self._poll = zmq.Poller()
            for s in [self.sub] + [l.sock for l in self.links] + [r.link.sock for r in self.responders]:
                self._poll.register(s, zmq.POLLIN)
        return self._poll

    def _jobs(self, i: int) -> None:
        for job in self.links[i].receive():
            self.workers[i].on_job(job)
        self._tick(i)

    def _signals(self) -> None:
        max_frame = int(self.cfg.brokers.max_frame_mb * (1 << 20))
        while True:
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                _, env = protocol.decode_topic(frames, max_frame)
            except ProtocolError as exc:
                self.log.warning("swarm.bad_signal", code=exc.code, error=str(exc))
                continue
            msg = env.msg
            if isinstance(msg, Control) and msg.action == "shutdown" and msg.target_role in ("", "rollout"):
                self.stopping = True
            for worker in self.workers:
                worker.on_signal(msg)
        for i in range(len(self.workers)):  # a new version is loaded at the next tick of every worker
            self._tick(i)

    def _tick(self, i: int) -> None:
        self.ticks += 1
        self.workers[i].on_tick()
        due = self.workers[i].engine.next_due()
        if due is None:
            self.scheduled.pop(i, None)
            return
        at = self.t0 + due * self.scale
        if self.scheduled.get(i) != at:
            self.scheduled[i] = at
            heapq.heappush(self.due, (at, i))

    def _tick_due(self, now: float) -> None:
        while self.due and self.due[0][0] <= now:
            at, i = heapq.heappop(self.due)
            if self.scheduled.get(i) != at:
                continue  # superseded by a later schedule
            del self.scheduled[i]
            self.lags.append(now - at)
            self._tick(i)

    def _heartbeats(self, now: float) -> None:
        replaced = False
        for link in self.links + [r.link for r in self.responders]:
            replaced = link.beat(now) or replaced
        if replaced:
            self._poll = None

    def _forget_jobs(self, i: int) -> None:
        """Worker i's link rejoined a broker (a reconnect, or a restarted broker): the broker requeued what it
        held (or, restarted, never knew it; its clients resubmit), so its engine stops generating for it."""
        worker = self.workers[i]
        for rid in list(worker.jobs):
            worker.engine.abort(rid)
        worker.jobs.clear()

    # ------------------------------------------------------------ the end
    def summary(self) -> dict:
        stats = [w.engine.stats() for w in self.workers]
        lags = np.array(self.lags or [0.0])
        probes = np.array([lat for _, lat in self.probe_latencies] or [np.nan])
        return {"swarm": self.swarm_id, "workers": len(self.workers), "time_scale": self.scale,
                "sim_s": round(self.sim_now(), 3), "busy_s": round(sum(s["busy_s"] for s in stats), 3),
                "pause_s": round(sum(s["pause_s"] for s in stats), 3), "tokens": sum(s["tokens"] for s in stats),
                "completed": sum(s["completed"] for s in stats), "ticks": self.ticks, "loops": self.loops,
                "lag_p50_ms": round(float(np.percentile(lags, 50)) * 1e3, 3),
                "lag_p99_ms": round(float(np.percentile(lags, 99)) * 1e3, 3),
                "probes": len(self.probe_latencies), "timeline": self.timeline, "probe_log": self.probe_latencies,
                "dispatch_p50_ms": round(float(np.nanpercentile(probes, 50)) * 1e3, 3) if self.probe_latencies else None,
                "dispatch_p99_ms": round(float(np.nanpercentile(probes, 99)) * 1e3, 3) if self.probe_latencies else None}

    def close(self) -> None:
        for link in self.links + [r.link for r in self.responders]:
            link.disconnect("swarm stopping")
            link.close()
        self.sub.close(0)
        self.ctx.term()


def raise_socket_limits(ctx: zmq.Context, sockets: int) -> None:
    """Room for `sockets` sockets: the context's cap and the process's open-file limit (each TCP socket is a file)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * sockets + 256  # a connected DEALER holds a few descriptors (socket, mailbox, connection)
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
    ctx.set(zmq.MAX_SOCKETS, max(ctx.get(zmq.MAX_SOCKETS), sockets))


def main(cfg: Any, worker_id: str | None = None) -> int:
    from areal_mq.errors import ConfigError
    from areal_mq.telemetry.log import make_logger
    from areal_mq.actor.runtime import default_worker_id
    from areal_mq.security import Keyring, warn_if_insecure

    if cfg.rollout.engine.kind != "sim":
        raise ConfigError(f"a swarm hosts simulated rollout workers only; rollout.engine.kind is "
                          f"{cfg.rollout.engine.kind!r}: add --set rollout.engine.kind=sim (or run `worker rollout`)")
    swarm_id = worker_id or default_worker_id("swarm")
    keys = Keyring.from_config(cfg, "rollout")
    reward_keys = Keyring.from_config(cfg, "reward") if cfg.rollout.engine.sim.reward_capacity else None
    log, sink = make_logger(cfg, "rollout", swarm_id, keys=keys)
    warn_if_insecure(keys, log)
    swarm = Swarm(cfg, log, swarm_id, keys, reward_keys)
    signal.signal(signal.SIGTERM, lambda *_: setattr(swarm, "stopping", True))
    try:
        swarm.run()
        return 0
    finally:
        summary = swarm.summary()
        swarm.close()
        log.info("swarm.stopped", **{k: v for k, v in summary.items()
                                     if v is not None and k not in ("timeline", "probe_log")})
        Path(cfg.run.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.run.run_dir) / f"swarm-{swarm_id}.json").write_text(json.dumps(summary))
        sink.close()
