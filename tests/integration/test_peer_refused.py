"""What a broker logs when a peer fails the CURVE handshake (issue 28 item 5a; docs/protocol.md §1.1).

Three ways in, all refused before a frame is read, each logged by the broker as `security.peer_refused`:
a plaintext client (mechanism mismatch, seen by the socket monitor), a client holding a wrong server key
(its HELLO does not decrypt, seen by the socket monitor) and a client whose own key is not in the key
directory (seen by the ZAP handler). The client itself only sees silence. Real broker process on loopback.
Run: pytest tests/integration/test_peer_refused.py
"""
from __future__ import annotations

import json
from pathlib import Path

import zmq

from areal_mq import protocol
from areal_mq.messages import StatsRequest
from areal_mq.security import generate_keys

from .conftest import wait_for
from .procs import keys


def _refusals(cfg) -> list[dict]:
    out = []
    for path in Path(cfg.run.run_dir, "events").glob("broker-*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("event") == "security.peer_refused":
                out.append(rec)
    return out


def _knock(cfg, setup, reason: str) -> None:
    """A DEALER set up by `setup` asks the job broker for stats and stays connected until the broker has
    logged its refusal for `reason`; no answer may come meanwhile. It used to close after a fixed second, and
    under a loaded full suite the broker once logged nothing for it within 20 s; connected, the client keeps
    retrying the handshake until the refusal is seen, and a failure lists what the broker did log."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    setup(sock)
    sock.connect(cfg.brokers.job_addr)
    try:
        try:
            sock.send_multipart(protocol.encode(StatsRequest()), zmq.NOBLOCK)
        except zmq.Again:
            pass  # no connection came up: nothing can be sent

        def logged() -> bool:
            assert not sock.poll(0), f"a refused peer ({reason}) got an answer"
            return any(r.get("reason") == reason for r in _refusals(cfg))

        try:
            wait_for(logged, 30, interval=0.1, what=f"security.peer_refused for {reason}")
        except AssertionError as exc:  # say what the broker did log, so a failure can be told apart
            seen = [(r.get("reason"), r.get("endpoint")) for r in _refusals(cfg)]
            raise AssertionError(f"{exc}; refusals logged so far: {seen}") from None
        assert not sock.poll(500), f"a refused peer ({reason}) got an answer"
    finally:
        sock.close(0)


def test_plaintext_wrong_server_key_and_unknown_key_are_each_logged_as_peer_refused(cfg, broker, tmp_path):
    mine = keys(cfg, "controller")
    other = tmp_path / "other_keys"
    generate_keys(other, ["broker", "controller"])
    stranger = keys(cfg, "controller").load(other, "controller")

    def wrong_server(sock):
        mine.client(sock)
        sock.curve_serverkey = stranger.server_key("broker")  # another run's broker key

    def unknown_client(sock):
        stranger.client(sock)
        sock.curve_serverkey = mine.server_key("broker")  # the right server, but a key it does not list

    cases = {"plaintext": lambda sock: None, "wrong_server_key": wrong_server, "unknown_key": unknown_client}
    for reason, setup in cases.items():
        _knock(cfg, setup, reason)
    by_reason = {r["reason"]: r for r in _refusals(cfg)}
    assert set(by_reason) == set(cases)  # the ZAP handler is not asked for the first two: no double lines
    assert "plaintext" in by_reason["plaintext"]["hint"] and by_reason["plaintext"]["level"] == "warning"
    assert "ZMQ_CURVE_SERVERKEY" in by_reason["wrong_server_key"]["hint"]
    assert "not in the run's key directory" in by_reason["unknown_key"]["hint"]
    # a client with the right keys is still served
    client_sock = zmq.Context.instance().socket(zmq.DEALER)
    client_sock.linger = 0
    mine.client(client_sock)
    client_sock.connect(cfg.brokers.job_addr)
    try:
        client_sock.send_multipart(protocol.encode(StatsRequest()))
        assert client_sock.poll(10_000), "the keyed client got no stats"
    finally:
        client_sock.close(0)
