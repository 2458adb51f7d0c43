"""Keys, the permission table, WeightsReady checks and the weight server's CURVE, without a broker.

Run: pytest tests/unit/test_security.py -q
"""
from __future__ import annotations

import os
import stat

import pytest
import zmq

from areal_mq.algorithms.config import TrainerConfig
from areal_mq.config import config_from_dict
from areal_mq.errors import ConfigError, SecurityError, WeightsFetchError
from areal_mq.messages import WeightsReady
from areal_mq.security import (AllowList, Keyring, RateLimited, ZapHandler, generate_keys, is_loopback, refusal)
from areal_mq.testing import RecordingLog
from areal_mq.weights import WeightServer, check_ready, fetch_weights


def test_generated_keys_are_private_and_loadable(tmp_path):
    d = tmp_path / "keys"
    made = generate_keys(d)
    assert "broker" in made and "trainer" in made
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE((d / "rollout.key_secret").stat().st_mode) == 0o600
    assert generate_keys(d) == []  # existing keys are kept (a resumed run keeps its identity)
    ring = Keyring.load(d, "rollout")
    assert ring.secure and ring.role == "rollout" and len(ring.secret) == 40
    assert generate_keys(d, ["rollout-host7"]) == ["rollout-host7"]
    assert Keyring.load(d, "rollout-host7").role == "rollout"


def test_key_problems_say_what_to_do(tmp_path):
    with pytest.raises(SecurityError, match="areal-mq keys generate"):
        Keyring.load(tmp_path / "nowhere", "rollout")
    generate_keys(tmp_path, ["rollout"])
    os.chmod(tmp_path / "rollout.key_secret", 0o644)
    with pytest.raises(SecurityError, match="chmod 600"):
        Keyring.load(tmp_path, "rollout")
    with pytest.raises(SecurityError, match="ROLE-SUFFIX"):
        generate_keys(tmp_path, ["../evil"])
    with pytest.raises(SecurityError, match="ROLE-SUFFIX"):
        generate_keys(tmp_path, ["root"])


@pytest.mark.parametrize("role,action,ok", [
    ("trainer", "publish:weights", True), ("rollout", "publish:weights", False), ("", "publish:weights", False),
    ("launcher", "publish:control", True), ("controller", "publish:control", True),
    ("reward", "publish:control", False), ("rollout", "publish:events", True),
    ("controller", "store:put", True), ("trainer", "store:put", False),
    ("trainer", "store:take", True), ("controller", "store:take", False),
    ("controller", "submit", True), ("rollout", "submit", False), ("observer", "stats", True),
    ("controller", "submit:pinned", True), ("agent", "submit:pinned", False), ("launcher", "submit:pinned", False),
    ("rollout", "serve:generate", True), ("reward", "serve:generate", False), ("reward", "serve:reward", True),
    ("echo", "serve:echo", True), ("echo", "serve:reward", False), ("observer", "serve:echo", False),
    ("rollout", "weights:fetch", True), ("reward", "weights:fetch", False),
    ("rollout", "stream", True), ("agent", "stream", False), ("controller", "stream", False),  # generate_partial
    ("reward", "stream", False),
    (None, "publish:weights", True),  # insecure mode: no roles, everything allowed
])
def test_permission_table(role, action, ok):
    why = refusal(role, action)
    assert (why is None) == ok, why
    if not ok:
        assert why  # says who may


def test_insecure_off_loopback_is_refused():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
    config_from_dict({"security": {"insecure": True}})
    with pytest.raises(ConfigError, match="keys generate"):
        config_from_dict({"security": {"insecure": True}, "brokers": {"host": "0.0.0.0"}})
    with pytest.raises(ConfigError, match="weight_server_host"):
        config_from_dict({"security": {"insecure": True}, "trainer": {"weight_server_host": "10.0.0.2"}})
    config_from_dict({"brokers": {"host": "0.0.0.0"}})  # with keys (the default) any interface is fine


def test_check_ready_accepts_only_this_runs_weights(tmp_path):
    cfg = TrainerConfig(weight_server_host="127.0.0.1", weight_server_port=0)
    ok_dir = str((tmp_path / "weights" / "v3").resolve())
    assert check_ready(WeightsReady(version=3, path=ok_dir), tmp_path, cfg) is None
    assert check_ready(WeightsReady(version=0, mode="base"), tmp_path, cfg) is None
    assert check_ready(WeightsReady(version=3, mode="zmq", endpoint="tcp://127.0.0.1:5000"), tmp_path, cfg) is None
    for bad in (WeightsReady(version=3, path="/etc"), WeightsReady(version=3, path=""),
                WeightsReady(version=3, path=str(tmp_path / "weights" / "v3" / ".." / ".." / "x")),
                WeightsReady(version=3, path=str(tmp_path / "weights" / "v3" / "model.safetensors")),
                WeightsReady(version=3, path=str(tmp_path / "weights" / "notes")),
                WeightsReady(version=3, mode="zmq", endpoint="tcp://10.0.0.9:5000"),
                WeightsReady(version=3, mode="zmq", endpoint="ipc:///tmp/x"),
                WeightsReady(version=0, mode="base", path="/etc")):
        assert check_ready(bad, tmp_path, cfg), bad
    fixed = TrainerConfig(weight_server_port=7000)
    assert check_ready(WeightsReady(version=3, mode="zmq", endpoint="tcp://127.0.0.1:7001"), tmp_path, fixed)


def test_allow_list_rereads_the_directory(tmp_path):
    import zmq.auth

    generate_keys(tmp_path, ["rollout"])
    allow = AllowList(tmp_path)
    rollout_pub = Keyring.load(tmp_path, "rollout").public
    assert allow.role(rollout_pub) == "rollout"
    generate_keys(tmp_path, ["reward-late"])  # a host added mid-run
    assert allow.role(zmq.auth.load_certificate(tmp_path / "reward-late.key")[0]) == "reward"
    assert allow.role(b"x" * 40) is None


def test_rate_limited_log_counts_what_it_suppressed():
    log = RecordingLog()
    limited = RateLimited(log, every_s=60)
    for _ in range(50):
        limited.warning("x.refused", key="a")
    limited.warning("x.refused", key="b")
    lines = log.at("warning")
    assert len(lines) == 2 and lines[0][1]["suppressed"] == 0


@pytest.fixture
def run_keys(tmp_path):
    generate_keys(tmp_path / "keys")
    return tmp_path / "keys"


def test_weight_server_serves_only_known_keys_of_allowed_roles(run_keys, tmp_path):
    torch = pytest.importorskip("torch")
    server = WeightServer(keys=Keyring.load(run_keys, "trainer"))
    try:
        ready = server.publish(1, {"w": torch.arange(6, dtype=torch.float32)})
        got = fetch_weights(ready, timeout_s=10, keys=Keyring.load(run_keys, "rollout"))
        assert got["w"].tolist() == list(range(6))
        with pytest.raises(WeightsFetchError, match="forbidden"):
            fetch_weights(ready, timeout_s=10, keys=Keyring.load(run_keys, "reward"))
        other = tmp_path / "other"
        generate_keys(other, ["rollout"])
        stranger = Keyring.load(other, "rollout")
        stranger.key_dir = run_keys  # knows the trainer's public key, but its own key is unknown
        for ident in (stranger, None):  # None: plaintext
            with pytest.raises(WeightsFetchError, match="did not deliver"):
                fetch_weights(ready, timeout_s=1.5, keys=ident)
    finally:
        server.close()


def test_fetch_from_an_impostor_server_fails(run_keys, tmp_path):
    """An endpoint that is not the trainer's key cannot complete the handshake: nothing is loaded."""
    torch = pytest.importorskip("torch")
    impostor_dir = tmp_path / "impostor"
    generate_keys(impostor_dir, ["trainer"])
    server = WeightServer(keys=Keyring.load(impostor_dir, "trainer"))
    try:
        ready = server.publish(1, {"w": torch.zeros(3)})
        with pytest.raises(WeightsFetchError, match="did not deliver"):
            fetch_weights(ready, timeout_s=1.5, keys=Keyring.load(run_keys, "rollout"))
    finally:
        server.close()


def test_zap_handler_answers_malformed_requests():
    ctx = zmq.Context()
    try:
        zap = ZapHandler(ctx, AllowList("/nonexistent"))
        assert zap._answer([b"1.0"])[2] == b"500"
        assert zap._answer([b"1.0", b"1", b"d", b"a", b"", b"NULL"])[2] == b"400"
        assert zap._answer([b"1.0", b"1", b"d", b"a", b"", b"CURVE", b"\x00" * 32])[2] == b"400"
        zap.close()
    finally:
        ctx.term()


def test_insecure_keyring_leaves_sockets_plain():
    ctx = zmq.Context()
    try:
        sock = Keyring.insecure().client(ctx.socket(zmq.DEALER))
        assert sock.mechanism == zmq.NULL
        sock.close(0)
    finally:
        ctx.term()
