"""`areal-mq broker`: runs the job broker, signal bus and sample store in one poll loop.

Each component can also run alone (`--only job|bus|store`), e.g. the sample store on the trainer's host.
All bind to `brokers.host` (127.0.0.1 by default) and demand CURVE: the brokers' key is `broker` in the
key directory, and only clients whose public key is there get in (security.ZapHandler, started before
any socket binds). SIGTERM/SIGINT stop the loop cleanly; the sample store's log makes a restart lose nothing.

    areal-mq broker --config configs/quickstart.yaml [--only store] [--set brokers.job_port=6000]
"""
from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import zmq

from areal_mq.errors import ConfigError, SecurityError
from areal_mq.telemetry.log import make_logger
from areal_mq.security import HandshakeWatch, Keyring, start_zap, warn_if_insecure


class BrokerHost:
    """Polls the sockets of the components it hosts and gives each its `tick` every loop."""

    def __init__(self, cfg: Any, only: set[str] | None = None, log: Any = None, keys: Keyring | None = None):
        from areal_mq.brokers.dispatch import Leases
        from areal_mq.brokers.job_broker import JobBroker
        from areal_mq.brokers.sample_store import SampleStore
        from areal_mq.brokers.signal_bus import SignalBus
        from areal_mq.weights import check_ready

        b = cfg.brokers
        only = only or {"job", "bus", "store"}
        keys = keys or Keyring.from_config(cfg, "broker")
        self.ctx = zmq.Context()
        self.zap = start_zap(self.ctx, keys, log)
        max_frame = int(b.max_frame_mb * 1024 * 1024)
        self.log = log
        self.components: list = []
        self.poller = zmq.Poller()
        self._owner: dict = {}
        if "bus" in only:
            self.bus = SignalBus(self.ctx, b.bus_in_addr, b.bus_out_addr, max_frame_bytes=max_frame, log=log,
                                 keys=keys, check_weights=lambda r: check_ready(r, cfg.run.run_dir, cfg.trainer),
                                 retain_path=Path(cfg.run.run_dir) / "bus" / "retained_weights.msgpack")
            self._add(self.bus, self.bus.sockets, lambda s: self.bus.handle(s))
        if "job" in only:
            self.job = JobBroker(self.ctx, b.job_addr, heartbeat_s=b.heartbeat_s, liveness=b.liveness,
                                 max_queue=b.max_queue, max_frame_bytes=max_frame, log=log, keys=keys,
                                 max_capacity=b.max_worker_capacity, max_services=b.max_services,
                                 max_sessions=b.max_sessions, sticky_wait_s=b.sticky_wait_s,
                                 leases=Leases(b.job_deadline_s, cfg.job_leases(), b.job_max_attempts))
            self._add(self.job, [self.job.sock], lambda s: self.job.handle())
        if "store" in only:
            self.store = SampleStore.from_config(self.ctx, b, Path(cfg.run.run_dir) / "store", log=log, keys=keys)
            self._add(self.store, [self.store.sock], lambda s: self.store.handle())
        # plaintext clients and wrong server keys fail before ZAP: only the sockets' monitors see them
        job_sock = self.job.sock if "job" in only else None
        self.watches = [HandshakeWatch(s, log, s.getsockopt_string(zmq.LAST_ENDPOINT),
                                       self.job.connection_closed if s is job_sock else None)
                        for s in list(self._owner) if keys.secure or s is job_sock]
        for w in self.watches:
            self.poller.register(w.sock, zmq.POLLIN)
            self._owner[w.sock] = lambda s, w=w: w.handle()
            if w.on_closed is not None:  # a READY first handles the closes that wait behind it (job_broker)
                self.job.poll_closed = w.handle
        from areal_mq.telemetry.prometheus import broker_metrics  # None unless metrics.prometheus

        self.metrics = broker_metrics(cfg, "-".join(sorted(only)), getattr(self, "job", None),
                                      getattr(self, "bus", None), getattr(self, "store", None), log)
        if self.metrics is not None and "job" in only:
            self.job.metrics = self.metrics  # the dispatch latency and job time histograms
        self._stop = False

    def _add(self, component: Any, sockets: list, handler: Any) -> None:
        self.components.append(component)
        for s in sockets:
            self.poller.register(s, zmq.POLLIN)
            self._owner[s] = handler

    def run(self, tick_s: float = 0.05) -> None:
        while not self._stop:
            for sock, _ in self.poller.poll(int(tick_s * 1000)):
                self._owner[sock](sock)
            now = time.monotonic()
            for c in self.components:
                tick = getattr(c, "tick", None)
                if tick:
                    tick(now)
            if self.metrics is not None:
                self.metrics.tick(now)  # snapshots the components' stats at most once a second

    def stop(self, *_: Any) -> None:
        self._stop = True

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.exporter.close()
        for w in self.watches:
            w.close()
        for c in self.components:
            c.close()
        if self.zap is not None:
            self.zap.close()
        self.ctx.term()


def main(cfg: Any, only: set[str] | None = None) -> int:
    try:
        keys = Keyring.from_config(cfg, "broker")
    except SecurityError as exc:
        print(f"error: {exc}", flush=True)
        return 2
    log, sink = make_logger(cfg, "broker", "-".join(sorted(only)) if only else "all", keys=keys)
    warn_if_insecure(keys, log)
    host = None
    try:
        host = BrokerHost(cfg, only, log, keys)
        signal.signal(signal.SIGTERM, host.stop)
        signal.signal(signal.SIGINT, host.stop)
        b = cfg.brokers
        log.info("broker.started", job=b.job_addr, bus_in=b.bus_in_addr, bus_out=b.bus_out_addr,
                 store=b.store_addr, components=sorted(only or {"job", "bus", "store"}))
        host.run()
        log.info("broker.stopped")
        return 0
    except ConfigError as exc:  # metrics.prometheus: the package missing or the port taken
        log.error("broker.config_error", error=str(exc))
        print(f"error: {exc}", flush=True)
        return 2
    except zmq.ZMQError as exc:
        log.error("broker.bind_failed", error=str(exc), hint="is another broker using these ports? "
                  "change brokers.*_port with --set")
        return 2
    finally:
        if host is not None:
            host.close()
        sink.close()
