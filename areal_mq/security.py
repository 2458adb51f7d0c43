"""Authentication and authorization: CURVE keys, the ZAP allow-list, and who may say what.

What (the ZeroMQ guide's Ironhouse pattern, on every socket, loopback included):
- `generate_keys(DIR)`: a key set — one ZeroMQ certificate pair per key name (`NAME.key` public,
  `NAME.key_secret` secret, the format czmq and pyzmq read). Names are `ROLE` or `ROLE-SUFFIX`
  (`rollout-host7`): the role is the part before the first '-'. The launcher makes one per run in
  `run_dir/keys/` (mode 0700); `areal-mq keys generate DIR` makes one for many hosts.
- `Keyring.from_config(cfg, role)`: the identity of one process. Its `client(sock)` makes a socket
  authenticate to the brokers (or to the trainer's weight server); `server(sock)` makes a bound socket
  demand CURVE. `security.insecure: true` turns every socket back to plaintext (debugging only; refused
  off loopback; every process warns at start).
- `ZapHandler(ctx, AllowList(DIR))`: the ZAP handler of a process that binds: a client whose public key
  is not a `*.key` file of the key directory is refused during the handshake, so it cannot send a single
  frame. An accepted client's messages carry its role as ZeroMQ's "User-Id" property (`peer_role`).
- `HandshakeWatch(sock, log)`: what the ZAP handler never sees. A plaintext client (mechanism mismatch) or
  one holding a wrong server key (its HELLO does not decrypt) fails before ZAP; ZeroMQ reports it only on
  the server socket's monitor. The watch logs both as `security.peer_refused`, rate-limited like ZAP's, and a
  peer that hangs up mid-greeting as `handshake_aborted` (what libzmq's plaintext client mostly looks like).
- `refusal(role, action)`: the permission table. A message a role does not own is answered with
  Error(code="forbidden") (or dropped, where there is nobody to answer) and logged, rate-limited.

Why here: one module owns keys and roles, beside the protocol; brokers and workers only ask
"who sent this?" and "may they?".
Run: `areal-mq keys generate /tmp/keys && ls -l /tmp/keys`.
"""
from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from areal_mq.errors import SecurityError

# Key names the launcher and `areal-mq keys generate` create. "broker" is the brokers' server key;
# the trainer's key doubles as the server key of its weight server.
ROLES = ("broker", "launcher", "controller", "trainer", "rollout", "reward", "agent", "echo", "observer")
ANY = frozenset(ROLES)
# Services owned by one role: only that role may serve them. Other service names may be served by any
# worker role (user services, the diagnostic echo worker).
OWNED_SERVICES = {"generate": "rollout", "reward": "reward", "agent": "agent"}
PERMISSIONS: dict[str, frozenset[str]] = {
    "submit": frozenset({"controller", "agent", "launcher"}),  # jobs to the job broker
    "submit:pinned": frozenset({"controller"}),  # a generate_request with pin_version: it holds the workers' updates
    "serve": frozenset({"rollout", "reward", "agent", "echo"}),  # READY for a service no role owns
    "stream": frozenset({"rollout"}),  # generate_partial: tokens of a streamed generate_request, while it decodes
    "publish:weights": frozenset({"trainer"}),
    "publish:control": frozenset({"launcher", "controller"}),
    "publish:events": ANY,
    "store:put": frozenset({"controller"}),
    "store:take": frozenset({"trainer"}),  # get_batch and batch_ack
    "weights:fetch": frozenset({"rollout", "trainer", "launcher", "agent"}),
    "stats": ANY,
}
LOOPBACK = re.compile(r"^(127\.\d+\.\d+\.\d+|localhost|::1|\[::1\])$")
_NAME = re.compile(r"^[a-z]+(-[A-Za-z0-9_.]{1,64})?$")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"areal-mq"


def role_of(key_name: str) -> str:
    return key_name.split("-", 1)[0]


def is_loopback(host: str) -> bool:
    return bool(LOOPBACK.match(host))


def refusal(role: str | None, action: str) -> str | None:
    """None when `role` may do `action`, else why not. role None = insecure mode: everything allowed.

    `action` is a key of PERMISSIONS, or "serve:SERVICE" for a worker's READY.
    """
    if role is None:
        return None
    if action.startswith("serve:"):
        service = action[6:]
        owner = OWNED_SERVICES.get(service)
        if owner is not None:
            return None if role == owner else f"only the {owner} role may serve {service!r}, not {role or 'an unknown key'}"
        action = "serve"
    allowed = PERMISSIONS.get(action, frozenset())
    if role in allowed:
        return None
    return f"role {role or '(none)'!r} may not {action}; allowed: {', '.join(sorted(allowed))}"


def peer_role(frame: Any, secure: bool) -> str | None:
    """The role the ZAP handler bound to the connection `frame` came from ("" when unknown)."""
    if not secure:
        return None
    try:
        return frame.get("User-Id") or ""
    except Exception:  # no ZAP metadata on this message: trust nothing
        return ""


# ---------------------------------------------------------------- key files
def generate_keys(key_dir: str | Path, names: Iterable[str] = ROLES, overwrite: bool = False) -> list[str]:
    """Create a certificate pair per name in `key_dir` (0700; secrets 0600). Returns the names created."""
    import zmq.auth

    d = Path(key_dir)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    made = []
    for name in names:
        if not _NAME.match(name) or role_of(name) not in ROLES:
            raise SecurityError(f"key name {name!r}: use ROLE or ROLE-SUFFIX with ROLE one of {', '.join(ROLES)}")
        if (d / f"{name}.key_secret").exists() and not overwrite:
            continue
        public, secret = zmq.auth.create_certificates(d, name)
        os.chmod(secret, 0o600)
        os.chmod(public, 0o644)
        made.append(name)
    return made


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    import zmq.auth

    if not path.is_file():
        raise SecurityError(f"missing key file {path}: create the run's keys with `areal-mq keys generate "
                            f"{path.parent}` (the launcher does this for `areal-mq run`), or copy this file "
                            "from the host that made them")
    if secret and path.stat().st_mode & 0o077:
        raise SecurityError(f"secret key {path} is readable by other users; chmod 600 it")
    try:
        public, sec = zmq.auth.load_certificate(path)
    except Exception as exc:
        raise SecurityError(f"key file {path} is not a ZeroMQ certificate: {exc}") from None
    if secret and not sec:
        raise SecurityError(f"{path} holds no secret key")
    return public, sec


@dataclass
class Keyring:
    """The CURVE identity of one process; `key_dir` None means insecure (plaintext) sockets."""

    key_dir: Path | None
    name: str = "observer"
    public: bytes = b""
    secret: bytes = b""
    _servers: dict = field(default_factory=dict)

    @classmethod
    def load(cls, key_dir: str | Path, name: str) -> "Keyring":
        d = Path(key_dir)
        public, secret = _load(d / f"{name}.key_secret", secret=True)
        return cls(d, name, public, secret)

    @classmethod
    def insecure(cls, name: str = "observer") -> "Keyring":
        return cls(None, name)

    @classmethod
    def from_config(cls, cfg: Any, role: str) -> "Keyring":
        sec = cfg.security
        if sec.insecure:
            return cls.insecure(role)
        return cls.load(key_dir(cfg), sec.key_name or role)

    @property
    def secure(self) -> bool:
        return self.key_dir is not None

    @property
    def role(self) -> str:
        return role_of(self.name)

    def server_key(self, server: str) -> bytes:
        if server not in self._servers:
            self._servers[server] = _load(self.key_dir / f"{server}.key", secret=False)[0]
        return self._servers[server]

    def client(self, sock: Any, server: str = "broker") -> Any:
        """Make `sock` (before connect) authenticate with our key to the holder of `server`'s key."""
        if self.secure:
            sock.curve_secretkey = self.secret
            sock.curve_publickey = self.public
            sock.curve_serverkey = self.server_key(server)
        return sock

    def server(self, sock: Any, name: str = "") -> Any:
        """Make `sock` (before bind) a CURVE server with our key; clients are checked by the ZAP handler.
        `name` (the address it binds) rides in the ZAP domain, so a refusal names the socket it came to."""
        if self.secure:
            sock.curve_server = True
            sock.curve_secretkey = self.secret
            sock.curve_publickey = self.public
            sock.zap_domain = zap_domain(name)
        return sock


def zap_domain(socket_name: str = "") -> bytes:
    """The ZAP domain of a server socket: `areal-mq` or `areal-mq:<its address>` (at most 254 bytes)."""
    return (ZAP_DOMAIN + b":" + socket_name.encode())[:254] if socket_name else ZAP_DOMAIN


def zap_socket(domain: bytes) -> str:
    """The socket name a ZAP request's domain carries (zap_domain's inverse); "" for a bare domain."""
    return domain[len(ZAP_DOMAIN) + 1:].decode(errors="replace") if domain.startswith(ZAP_DOMAIN + b":") else ""


def key_dir(cfg: Any) -> Path:
    return Path(cfg.security.keys_dir or Path(cfg.run.run_dir) / "keys")


class AllowList:
    """Public key (z85) -> role, read from the `*.key` files of a directory; reread when it changes,
    so a key added mid-run (a new rollout host) is accepted without restarting the brokers."""

    def __init__(self, key_dir: str | Path):
        self.dir = Path(key_dir)
        self._stamp: tuple = ()
        self._roles: dict[bytes, str] = {}

    def role(self, public_z85: bytes) -> str | None:
        self._refresh()
        return self._roles.get(public_z85)

    def _refresh(self) -> None:
        try:
            files = sorted(self.dir.glob("*.key"))
            stamp = tuple((f.name, f.stat().st_mtime_ns) for f in files)
        except OSError:
            files, stamp = [], ()
        if stamp == self._stamp:
            return
        roles = {}
        for f in files:
            name = f.name[:-4]
            if _NAME.match(name) and role_of(name) in ROLES:
                try:
                    roles[_load(f, secret=False)[0]] = role_of(name)
                except SecurityError:
                    continue
        self._roles, self._stamp = roles, stamp


class RateLimited:
    """At most one log line per key every `every_s` seconds; the count of suppressed ones rides along."""

    def __init__(self, log: Any, every_s: float = 10.0):
        self.log, self.every_s = log, every_s
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, event: str, key: str, **fields: Any) -> None:
        self.emit("warning", event, key, **fields)

    def info(self, event: str, key: str, **fields: Any) -> None:
        self.emit("info", event, key, **fields)

    def error(self, event: str, key: str, **fields: Any) -> None:
        self.emit("error", event, key, **fields)

    def emit(self, level: str, event: str, key: str, **fields: Any) -> None:
        now = time.monotonic()
        last, suppressed = self._last.get(key, (-1e18, 0))
        if now - last < self.every_s:
            self._last[key] = (last, suppressed + 1)
            return
        if len(self._last) > 10_000:  # bounded: a flood of distinct keys cannot grow memory
            self._last.clear()
        self._last[key] = (now, 0)
        if self.log is not None:
            getattr(self.log, level)(event, suppressed=suppressed, **fields)


class ZapHandler:
    """ZAP (RFC 27) handler thread for one zmq.Context: accepts CURVE clients on the allow-list.

    Start it before binding any CURVE server socket of that context (a socket that binds while no
    handler is present would accept any client that knows the server's public key).
    """

    def __init__(self, ctx: Any, allow: AllowList, log: Any = None):
        import zmq

        self.allow, self.log = allow, RateLimited(log)
        self.accepted = self.denied = 0
        self._stop = threading.Event()
        self._sock = ctx.socket(zmq.REP)
        self._sock.linger = 0
        self._sock.bind(ZAP_ENDPOINT)
        self._thread = threading.Thread(target=self._run, name="zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(100):
                    self._sock.send_multipart(self._answer(self._sock.recv_multipart()))
        finally:
            self._sock.close(0)

    def _answer(self, req: list[bytes]) -> list[bytes]:
        import zmq.utils.z85 as z85

        if len(req) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism = req[:6]
        role = None
        if mechanism == b"CURVE" and len(req) == 7 and len(req[6]) == 32:
            role = self.allow.role(z85.encode(req[6]))
        if role is None:
            self.denied += 1
            sock = zap_socket(domain)  # one line per socket and reason per 10 s (docs/security.md), as the watch's
            self.log.warning("security.peer_refused", key=f"{sock}:unknown_key", socket=sock,
                             address=address.decode(errors="replace"), mechanism=mechanism.decode(errors="replace"),
                             reason="unknown_key", hint="its public key is not in the run's key directory")
            return [version, request_id, b"400", b"unknown key", b"", b""]
        self.accepted += 1
        return [version, request_id, b"200", b"OK", role.encode(), b""]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)


class HandshakeWatch:
    """Logs `security.peer_refused` for CURVE handshakes a bound socket failed before ZAP was asked.

    ZeroMQ's socket monitor reports them as EVENT_HANDSHAKE_FAILED_PROTOCOL with the ZMTP error code, or as
    EVENT_HANDSHAKE_FAILED_NO_DETAIL when the peer hung up mid-greeting (`handshake_aborted`); it does not
    say who the peer was (the event names our own endpoint). Unknown client keys are ZAP's to log (their
    EVENT_HANDSHAKE_FAILED_AUTH is not watched, so nothing is logged twice). With `on_closed`, each closed
    connection's file descriptor is passed to it too (the job broker names the worker it was: a frame over
    the socket's ZMQ_MAXMSGSIZE closes the connection without any other sign). The owner polls `sock` and
    calls `handle()` when it is readable; `close()` before the watched socket closes.
    """

    def __init__(self, watched: Any, log: Any, name: str, on_closed: Any = None):
        import zmq

        self.name, self.log, self.refused = name, RateLimited(log), 0
        self._watched, self.on_closed = watched, on_closed
        events = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                  | (zmq.EVENT_DISCONNECTED if on_closed else 0))
        self.sock = watched.get_monitor_socket(events)
        self.sock.linger = 0
        self._why = {
            zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: (
                "plaintext", "the client speaks plaintext (NULL) to a CURVE server: set its CURVE keys "
                "(docs/protocol.md §1.1), or run every process with security.insecure"),
            zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: (
                "wrong_server_key", "the client's HELLO does not decrypt: its ZMQ_CURVE_SERVERKEY is not this "
                "server's public key (broker.key, or trainer.key for the weight server)"),
        }
        # libzmq's plaintext client checks the server's greeting as soon as it has it and hangs up, often
        # before its own mechanism is on the wire (then it retries once and gives up): the server sees a
        # greeting cut short, not a mismatch. Measured on loopback, most plaintext attempts end this way.
        self._aborted = (
            "handshake_aborted", "the peer hung up during the ZMTP greeting: most often a plaintext (NULL) "
            "client, which drops a CURVE server as soon as it reads its greeting (set its CURVE keys, "
            "docs/protocol.md §1.1); else a port probe or a client killed mid-connect")

    def handle(self) -> None:
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        while True:
            try:
                event = parse_monitor_message(self.sock.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.on_closed(event["value"])
                continue
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                reason, hint = self._aborted
            else:
                reason, hint = self._why.get(event["value"], ("handshake", "the ZMTP handshake failed "
                                                              f"(protocol error {event['value']:#x})"))
            self.refused += 1
            self.log.warning("security.peer_refused", key=f"{self.name}:{reason}", socket=self.name,
                             endpoint=event["endpoint"].decode(errors="replace"), mechanism="CURVE",
                             reason=reason, hint=hint)

    def close(self) -> None:
        try:
            self._watched.disable_monitor()
        except Exception:  # the watched socket is already closed
            pass
        self.sock.close(0)


def start_zap(ctx: Any, keys: Keyring, log: Any = None) -> ZapHandler | None:
    """The ZAP handler for a process whose `keys` are secure (None when insecure)."""
    return ZapHandler(ctx, AllowList(keys.key_dir), log) if keys.secure else None


def warn_if_insecure(keys: Keyring, log: Any) -> None:
    if not keys.secure and log is not None:
        log.warning("security.insecure", role=keys.role,
                    hint="sockets are unauthenticated and unencrypted (security.insecure / --insecure): "
                         "any peer that reaches a port can stop workers, publish weights and put samples")
