"""`areal-mq reward serve --broker tcp://H:P`: every broker address follows from the one given (issue 13 item 8),
and the launcher keeps the four broker ports consecutive so that rule holds for a run it starts."""
from __future__ import annotations

import socket

import pytest

from areal_mq.config import load_config
from areal_mq.errors import ConfigError
from areal_mq.launch.ports import settle_ports
from areal_mq.workers.reward import build_config, describe_addresses


def test_the_bus_and_store_follow_the_job_broker_address():
    cfg = build_config(None, "tcp://10.0.0.2:7000")
    b = cfg.brokers
    assert (b.host, b.job_port, b.bus_in_port, b.bus_out_port, b.store_port) == ("10.0.0.2", 7000, 7001, 7002, 7003)
    assert describe_addresses(cfg) == ("job broker tcp://10.0.0.2:7000, signal bus tcp://10.0.0.2:7001 (in) / "
                                       "tcp://10.0.0.2:7002 (out)")


def test_a_port_the_user_names_is_kept():
    cfg = build_config(None, "tcp://10.0.0.2:7000", ["brokers.bus_in_port=9000", "brokers.bus_out_port=9001"])
    assert (cfg.brokers.bus_in_port, cfg.brokers.bus_out_port) == (9000, 9001)


def test_a_job_port_with_no_room_after_it_is_refused_clearly():
    with pytest.raises(ConfigError, match="job port \\+ 1..3"):
        build_config(None, "tcp://10.0.0.2:65534")


def test_settle_ports_moves_all_four_to_a_consecutive_block_when_one_is_taken():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        cfg = load_config(None, [f"brokers.bus_out_port={port}"])
        b = settle_ports(cfg).brokers
        assert [b.bus_in_port, b.bus_out_port, b.store_port] == [b.job_port + 1, b.job_port + 2, b.job_port + 3]
        assert port not in (b.job_port, b.bus_in_port, b.bus_out_port, b.store_port)
    finally:
        taken.close()
