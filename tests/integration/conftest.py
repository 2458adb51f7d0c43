"""Fixtures: a run config on free loopback ports, a process manager, and a running broker."""
from __future__ import annotations

import pytest

from areal_mq.client import JobClient
from areal_mq.config import load_config

from .procs import Procs, keys, wait_for, write_config


@pytest.fixture
def procs(tmp_path):
    manager = Procs(tmp_path)
    yield manager
    manager.stop_all()


@pytest.fixture
def config_path(tmp_path):
    return write_config(tmp_path)


@pytest.fixture
def cfg(config_path):
    return load_config(config_path)


def broker_up(cfg, timeout: float = 20.0) -> None:
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg), heartbeat_s=cfg.brokers.heartbeat_s)
    try:
        client.stats(timeout=timeout)
    finally:
        client.close()


@pytest.fixture
def broker(procs, config_path, cfg):
    proc = procs.start(["broker", "--config", str(config_path)], "broker")
    broker_up(cfg)
    return proc


def worker_count(cfg, service: str) -> int:
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg))
    try:
        return sum(1 for w in client.stats(5)["workers"].values() if w["service"] == service)
    finally:
        client.close()


__all__ = ["wait_for", "worker_count", "broker_up", "keys"]
