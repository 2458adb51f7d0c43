"""A taken broker port at `areal-mq run` (issue 28 item 6): stop at once naming the port, its holder and the --set
that moves it, or (brokers.auto_ports, or ports left at their defaults) move the brokers and say where. Ports are
held by real listening sockets on 127.0.0.1.

Run: pytest tests/unit/launch/test_ports.py -q
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from areal_mq.config import BrokerConfig, load_config
from areal_mq.errors import ConfigError
from areal_mq.launch.launcher import assign_metrics_ports
from areal_mq.launch.ports import free_port_block
from areal_mq.launch.ports import PORT_NAMES, PortInUse, auto_wanted, claim_broker_ports, port_holder, port_taken

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def held():
    """A port of 127.0.0.1 held by a listening socket of this process (closed with linger 0 afterwards)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()


def named_ports(taken: int, *extra: str) -> list[str]:
    """--set overrides naming four broker ports (non-default), the bus out port being `taken`."""
    base = free_port_block("127.0.0.1", 3)
    ports = {"job_port": base, "bus_in_port": base + 1, "bus_out_port": taken, "store_port": base + 2}
    return [f"brokers.{name}={port}" for name, port in ports.items()] + list(extra)


def test_a_taken_port_the_user_named_stops_the_run_with_the_port_holder_and_the_fix(held):
    cfg = load_config(None, named_ports(held))
    before = [getattr(cfg.brokers, name) for name in PORT_NAMES]
    with pytest.raises(PortInUse) as err:
        claim_broker_ports(cfg)
    text = str(err.value)
    assert f"brokers.bus_out_port {held}" in text and "127.0.0.1" in text
    assert f"held by pid {os.getpid()}:" in text  # this test's process holds it
    assert "--set brokers.job_port=" in text and "--set brokers.store_port=" in text
    assert "--set brokers.auto_ports=true" in text
    assert isinstance(err.value, ConfigError)
    assert [getattr(cfg.brokers, name) for name in PORT_NAMES] == before  # nothing moved behind the user's back
    # the --set it suggests works: those ports are free
    moves = [part.rstrip(",;") for part in text.split() if part.startswith("brokers.") and "=" in part
             and "auto" not in part]
    assert len(moves) == 4 and claim_broker_ports(load_config(None, moves)) is None


def test_auto_ports_moves_all_four_to_a_free_consecutive_block_and_says_where(held):
    cfg = load_config(None, named_ports(held, "brokers.auto_ports=true", "run.run_dir=/tmp/r1"))
    note = claim_broker_ports(cfg)
    b = cfg.brokers
    assert [b.bus_in_port, b.bus_out_port, b.store_port] == [b.job_port + 1, b.job_port + 2, b.job_port + 3]
    assert held not in (b.job_port, b.bus_in_port, b.bus_out_port, b.store_port)
    assert not any(port_taken("127.0.0.1", getattr(b, name)) for name in PORT_NAMES)
    assert f"brokers.bus_out_port {held}" in note and f"job {b.job_port}" in note
    assert "--config /tmp/r1/config.yaml" in note


def test_free_ports_are_kept_silently():
    cfg = load_config(None, named_ports(free_port_block("127.0.0.1", 1)))
    before = cfg.brokers.model_dump()
    assert claim_broker_ports(cfg) is None and cfg.brokers.model_dump() == before


def test_unset_auto_ports_moves_only_ports_left_at_their_defaults():
    assert auto_wanted(BrokerConfig())  # 5555-5558: a second quickstart on this host just moves
    assert not auto_wanted(BrokerConfig(job_port=7000))  # a port somebody named is never moved
    assert auto_wanted(BrokerConfig(job_port=7000, auto_ports=True))
    assert not auto_wanted(BrokerConfig(auto_ports=False))


def test_port_holder_names_the_listening_process(held):
    assert port_holder(held).startswith(f"pid {os.getpid()}: ")
    assert port_taken("127.0.0.1", held)
    free = free_port_block("127.0.0.1", 1)
    assert port_holder(free) is None and not port_taken("127.0.0.1", free)


def test_a_taken_prometheus_port_names_its_holder(held):
    cfg = load_config(None, ["metrics.prometheus=true", f"metrics.prometheus_port={held}"])
    # the block is 2 ports: the one held here, and its neighbour, which another process may hold right now
    with pytest.raises(ConfigError, match=rf"{held}(, \d+)? on 127.0.0.1 are in use \(held by pid {os.getpid()}:.*"
                                          r"--set metrics.prometheus_port=N"):
        assign_metrics_ports(cfg, ["broker", "reward-0"])


def test_areal_mq_run_exits_2_before_starting_anything(held, tmp_path):
    run_dir, config = tmp_path / "run", tmp_path / "run.yaml"
    config.write_text("controller: {total_steps: 1}\n")
    args = [a for o in named_ports(held, f"run.run_dir={run_dir}") for a in ("--set", o)]
    done = subprocess.run([sys.executable, "-m", "areal_mq.cli", "run", str(config), *args, "--skip-eval", "--quiet"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"brokers.bus_out_port {held}" in done.stderr and "--set brokers.auto_ports=true" in done.stderr
    assert not run_dir.exists()  # no key, no config, no log: nothing started


def test_two_xdist_workers_draw_from_disjoint_slices_below_the_ephemeral_range(monkeypatch):
    """Every quiet port a test, or a run, benchmark or fuzz target it starts, picks comes from its xdist worker's own
    slice (the variables are inherited by child processes), so two workers never race for one port."""
    from areal_mq.launch.ports import LOW_PORT, ephemeral_range, quiet_ports, quiet_span

    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert quiet_span() == (LOW_PORT, ephemeral_range()[0])
    spans = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
        spans.append(quiet_span())
        lo, hi = spans[-1]
        assert all(lo <= p < hi for p in quiet_ports("127.0.0.1", 5))
    assert spans[0][1] <= spans[1][0] and spans[1][1] <= ephemeral_range()[0]
