"""The HTTP reward bridge's deadline covers the whole exchange: DNS, connect, headers and body.

An outside audit held a `timeout_s=2` call for 9 s with a server that trickled header lines; DNS had no
timeout at all. Each case here is a real socket server on 127.0.0.1 (or an injected slow resolver).
Run: pytest tests/unit/rewards/test_http_deadline.py -q   (~10 s)
"""
from __future__ import annotations

import socket
import threading
import time

import pytest

from areal_mq.messages import RewardJob
from areal_mq.rewards.config import HttpBridgeConfig
from areal_mq.rewards.http_bridge import HttpRewardBridge, HttpRewardError

TIMEOUT = 1.0
SLACK = 1.5  # generous for a loaded 2-core machine; the old code took 9 s on the header trickle


def _trickler(send_head: bool):
    """A server that accepts, then sends one header line (or one body byte) every 0.3 s, forever."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    stop = threading.Event()

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            threading.Thread(target=feed, args=(conn,), daemon=True).start()

    def feed(conn):
        try:
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            if send_head:
                conn.sendall(b"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{")
            for i in range(200):
                if stop.is_set():
                    break
                conn.sendall(b" " if send_head else f"X-Trickle-{i}: 1\r\n".encode())
                time.sleep(0.3)
        except OSError:
            pass
        finally:
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return srv, stop


@pytest.mark.parametrize("what,send_head", [("header lines", False), ("body bytes", True)])
def test_a_trickling_server_is_cut_at_the_deadline(what, send_head):
    srv, stop = _trickler(send_head)
    try:
        bridge = HttpRewardBridge(HttpBridgeConfig(url=f"http://127.0.0.1:{srv.getsockname()[1]}/r",
                                                   timeout_s=TIMEOUT, retries=0))
        t0 = time.monotonic()
        with pytest.raises(HttpRewardError, match="no complete response within"):
            bridge.score("j1", RewardJob(task="t", completions=["a"]))
        took = time.monotonic() - t0
        assert took < TIMEOUT + SLACK, f"trickled {what} held the call {took:.1f}s"
    finally:
        stop.set()
        srv.close()


def test_slow_name_resolution_is_cut_at_the_deadline():
    def slow_resolver(*args, **kwargs):
        time.sleep(30)
        raise socket.gaierror("never")

    bridge = HttpRewardBridge(HttpBridgeConfig(url="http://reward.invalid:8000/r", timeout_s=TIMEOUT, retries=0),
                              resolve=slow_resolver)
    t0 = time.monotonic()
    with pytest.raises(HttpRewardError, match="no complete response within"):
        bridge.score("j1", RewardJob(task="t", completions=["a"]))
    assert time.monotonic() - t0 < TIMEOUT + SLACK


def test_unresolvable_name_is_a_clear_error():
    def fails(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    bridge = HttpRewardBridge(HttpBridgeConfig(url="http://reward.invalid:8000/r", timeout_s=TIMEOUT, retries=0),
                              resolve=fails)
    with pytest.raises(HttpRewardError, match="cannot resolve 'reward.invalid'"):
        bridge.score("j1", RewardJob(task="t", completions=["a"]))
