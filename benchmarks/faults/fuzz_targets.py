"""Fuzz targets for the sockets a peer can reach: the job broker, the signal bus and the sample store (issue 40).

Each target builds the real component (brokers/job_broker.py, signal_bus.py, sample_store.py) in this process,
bound on loopback, twice: plaintext and with CURVE (its own key directory, a ZAP handler, `broker` keys). An
input is a list of frames (a mutated valid message) plus the role ZAP would have bound to its connection
(including none and unknown ones: the "wrong roles" mutation); `feed` hands it to the component's own message
handler with that role (`PeerFrame`, what pyzmq's frame answers to `get("User-Id")`), so a million inputs take
minutes rather than hours of socket round trips; `wire` sends it over a real (CURVE) DEALER/PUB socket instead,
for a share of the inputs. What the component sends back is captured and judged:

- the input must end in a documented refusal or a correct answer: every message sent to the peer decodes, an
  `error` carries a code of docs/protocol.md §9, and a pristine seed gets its kind's answer (stats, heartbeat,
  ack, batch); the bus forwards or refuses each publication, exactly one of the two;
- no exception may escape the handler (a crash: in the real process it would end the poll loop);
- `health()` afterwards: a valid request over a real socket (CURVE where the component has keys) still works.

Run: through benchmarks/faults/fuzz.py (`--target job|bus|store`) and tests/integration/test_fuzz.py.
"""
from __future__ import annotations

import collections
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from areal_mq import protocol
from areal_mq.brokers.dispatch import Leases
from areal_mq.brokers.job_broker import JobBroker
from areal_mq.brokers.sample_store import SampleStore
from areal_mq.brokers.signal_bus import SignalBus
from areal_mq.messages import (BatchAck, Control, Disconnect, Error, Event, GenerateRequest, GenerateResult, GetBatch,
                               Heartbeat, Kind, Ready, RewardJob, RewardResult, Sample, SamplingSpec, SeqSample,
                               StatsRequest, WeightsLink, WeightsReady)
from areal_mq.security import Keyring, ROLES, generate_keys, refusal, start_zap

ERROR_CODES = {"bad_frames", "bad_header", "bad_version", "unknown_kind", "bad_fields", "bad_arrays", "too_large",
               "queue_full", "store_full", "no_service", "job_failed", "bad_request", "bad_reply", "forbidden",
               "weights_unavailable", "internal"}  # docs/protocol.md §9
FUZZ_ROLES = (*ROLES, "", "intruder")
MAX_FRAME = 1 << 16  # the components' brokers.max_frame_mb for the campaign (64 KiB: oversized inputs are cheap)


class PeerFrame(bytes):
    """The first frame of a message as a component receives it: its bytes (a ROUTER's peer identity, a bus
    topic) and the role the ZAP handler bound to its connection (pyzmq: `frame.get("User-Id")`)."""

    role: str | None

    def __new__(cls, data: bytes, role: str | None) -> "PeerFrame":
        obj = super().__new__(cls, data)
        obj.role = role
        return obj

    @property
    def bytes(self) -> bytes:
        return bytes(self)

    def get(self, prop: Any) -> Any:
        if prop == "User-Id" and self.role is not None:
            return self.role
        raise zmq.ZMQError(zmq.EINVAL)  # as pyzmq: no such property on this message


class CountingLog:
    """A logger that counts events by name and keeps the last few (bounded: a campaign logs millions)."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.last: collections.deque = collections.deque(maxlen=20)

    def _add(self, level: str, event: str, **fields: Any) -> None:
        self.counts[event] += 1
        self.last.append((level, event))

    def debug(self, event: str, **f: Any) -> None:
        self._add("debug", event, **f)

    def info(self, event: str, **f: Any) -> None:
        self._add("info", event, **f)

    def warning(self, event: str, **f: Any) -> None:
        self._add("warning", event, **f)

    def error(self, event: str, **f: Any) -> None:
        self._add("error", event, **f)

    exception = critical = error

    def bind(self, **_: Any) -> "CountingLog":
        return self


class Unexpected(AssertionError):
    """An input that ended in neither a documented refusal nor a correct answer."""


def free_port() -> int:
    """Below the ephemeral range (launch/ports.py quiet_ports): a bind(0) port can be taken by any process's
    outgoing connection before the target binds it (a corpus replay failed so in CI: 'Address already in use')."""
    from areal_mq.launch.ports import quiet_ports

    return quiet_ports("127.0.0.1", 1)[0]


def _seq(n: int = 3) -> SeqSample:
    return SeqSample(prompt_ids=np.arange(4, dtype=np.int32), output_ids=np.arange(n, dtype=np.int32),
                     logprobs=np.full(n, -0.5, np.float32), versions=np.zeros(n, np.int32), reward=1.0)


def router_seeds() -> dict[str, list[bytes]]:
    """Valid messages as the peers encode them: each kind's documented example, through protocol.encode."""
    msgs = {
        "ready": (Ready(service="reward", capacity=4, worker_id="reward-0", role="reward", tasks=["math"]), {}),
        "heartbeat": (Heartbeat(peer_id="rollout-0"), {}),
        "disconnect": (Disconnect(reason="sigterm"), {}),
        "stats_request": (StatsRequest(), {}),
        "reward_job": (RewardJob(task="math", prompt_id="p17", prompt="2+3?", completions=["\\boxed{5}"],
                                 reference="5"), {"service": "reward"}),
        "generate_request": (GenerateRequest(prompt_ids=np.array([1, 2, 3], np.int32), group_id="p17-e0",
                                             sampling=SamplingSpec(max_new_tokens=64), session="p17-e0-s3"), {}),
        "generate_result": (GenerateResult(output_ids=np.array([5, 6], np.int32), logprobs=np.array([-.1, -2.], np.float32),
                                           versions=np.array([3, 4], np.int32), finish_reason="stop", text="42",
                                           worker_id="rollout-0"), {"reply_to": "job-1"}),
        "reward_result": (RewardResult(rewards=[1.0], worker_id="reward-0"), {"reply_to": "job-1"}),
        "sample": (Sample(sample_id="p17-e0", prompt_id="p17", seqs=[_seq(), _seq(2)]), {}),
        "get_batch": (GetBatch(n_samples=1, version=3, max_staleness=2, timeout_ms=0), {}),
        "batch_ack": (BatchAck(batch_id="b3", sample_ids=["p17-e0"]), {}),
        "error": (Error(code="job_failed", message="no", ref_id="job-1"), {"reply_to": "job-1"}),
    }
    return {name: [bytes(memoryview(f)) for f in protocol.encode(m, **kw)] for name, (m, kw) in msgs.items()}


def bus_seeds(run_dir: Path) -> dict[str, list[bytes]]:
    ready = WeightsReady(version=4, mode="disk", path=str(run_dir / "weights" / "v4"), base=3,
                         links=[WeightsLink(version=3), WeightsLink(version=4, base=3, bytes=812)])
    msgs = {"weights": ("weights", ready), "control": ("control", Control(action="pause")),
            "events": ("events", Event(record={"event": "rollout.started", "role": "rollout", "tokens": 87}))}
    return {name: [bytes(memoryview(f)) for f in protocol.topic_frames(topic, m)] for name, (topic, m) in msgs.items()}


class Keys:
    """A throwaway key directory (every role) and the brokers' keyring over it."""

    def __init__(self, root: Path):
        self.dir = root / "keys"
        generate_keys(self.dir)
        self.broker = Keyring.load(self.dir, "broker")

    def client(self, role: str) -> Keyring:
        return Keyring.load(self.dir, role)


class RouterTarget:
    """Shared by the job broker and the sample store: two instances (plaintext, CURVE), captured sends."""

    name = "router"
    wire_capable = True  # wire(): the same input over a real CURVE socket
    seeds: dict[str, list[bytes]]
    answers = {"stats_request": Kind.STATS, "heartbeat": Kind.HEARTBEAT}

    def __init__(self, root: Path):
        self.root, self.ctx = root, zmq.Context()
        self.keys = Keys(root)
        self.zap = start_zap(self.ctx, self.keys.broker, None)
        self.log = CountingLog()
        self.sent: list[tuple[bytes, list]] = []
        self.addrs = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
        self.plain = self._make(self.addrs[0], None)
        self.secure = self._make(self.addrs[1], self.keys.broker)
        for comp in (self.plain, self.secure):
            comp._send = self._capture  # what it answers is judged, not sent (feed); wire() restores it
        self.seeds = router_seeds()
        self._wire: dict[str, zmq.Socket] = {}

    def _make(self, addr: str, keys: Keyring | None) -> Any:
        raise NotImplementedError

    def _capture(self, ident: bytes, frames: list) -> None:
        self.sent.append((ident, [bytes(memoryview(f)) for f in frames]))

    def components(self) -> tuple:
        return (self.plain, self.secure)

    def feed(self, frames: list[bytes], role: str | None, ident: bytes, seed: str | None, i: int) -> str:
        """Hand one input to the plaintext (even i) or CURVE (odd i) instance; returns its outcome."""
        comp = self.secure if i % 2 else self.plain
        self.sent.clear()
        role = role if i % 2 else None  # None: plaintext, every role may say everything
        comp._on_message([PeerFrame(ident, role), *frames])
        return self.judge(ident, seed, role)

    def allowed(self, seed: str, role: str | None) -> bool:
        """May `role` get the documented answer to the valid `seed` (docs/protocol.md §1.1)?"""
        return True  # the job broker answers stats and heartbeats from anyone

    def judge(self, ident: bytes, seed: str | None, role: str | None) -> str:
        outcome = "silent"
        for to, frames in self.sent:
            env = protocol.decode(frames, 1 << 30)  # whatever a component sends must decode (raises otherwise)
            if to != ident:
                continue  # a job forwarded to a worker: the client's frames, decoded by the broker first
            if env.kind == Kind.ERROR:
                if env.msg.code not in ERROR_CODES:
                    raise Unexpected(f"undocumented error code {env.msg.code!r}: {env.msg.message[:200]}")
                outcome = f"refused:{env.msg.code}"
            else:
                outcome = f"answered:{env.kind.value}"
        want = self.answers.get(seed or "")
        if want is not None and outcome != f"answered:{want.value}" and self.allowed(seed, role):
            raise Unexpected(f"the valid {seed} got {outcome}, not {want.value}")
        return outcome

    def tick(self, k: int) -> None:
        """Time passes (an hour per call): leases end, silent workers are dropped, waiters answered."""
        for comp in self.components():
            comp.tick(time.monotonic() + 3600.0 * k)

    def size(self) -> dict:
        return {}

    def wire(self, frames: list[bytes], role: str, timeout_s: float = 0.02) -> list[list[bytes]]:
        """Send one input over a real CURVE socket as `role` (the secure instance); its answers."""
        sock = self._wire.get(role)
        if sock is None:
            sock = self._wire[role] = self.keys.client(role).client(self.ctx.socket(zmq.DEALER))
            sock.linger = 0
            sock.connect(self.addrs[1])
        if not frames:
            return []  # ZeroMQ sends no message of zero frames
        comp = self.secure
        del comp._send  # the real _send again (an instance attribute shadowed it)
        try:
            sock.send_multipart(frames)
            return self._pump(comp, sock, timeout_s)
        finally:
            comp._send = self._capture

    def _pump(self, comp: Any, sock: zmq.Socket, timeout_s: float) -> list[list[bytes]]:
        got, deadline = [], time.monotonic() + timeout_s
        while True:  # at least once, even with no time to wait
            if comp.sock.poll(5):
                comp.handle()
            while sock.poll(0):
                got.append(sock.recv_multipart())
            if time.monotonic() >= deadline:
                return got

    def roundtrip(self, role: str, msg: Any, want: Kind, timeout_s: float = 10.0, **kw: Any) -> Any:
        """A valid request over a real CURVE socket: its first non-heartbeat answer must be `want`."""
        deadline = time.monotonic() + timeout_s
        comp = self.secure
        del comp._send
        try:
            sock = self.keys.client(role).client(self.ctx.socket(zmq.DEALER))
            sock.linger = 0
            sock.connect(self.addrs[1])
            sock.send_multipart(protocol.encode(msg, **kw))
            while time.monotonic() < deadline:
                for frames in self._pump(comp, sock, 0.05):
                    env = protocol.decode(frames)
                    if env.kind != Kind.HEARTBEAT or want == Kind.HEARTBEAT:
                        sock.close(0)
                        if env.kind != want:
                            raise Unexpected(f"health: {msg.kind.value} answered {env.kind.value}: {env.msg}")
                        return env
            sock.close(0)
            raise Unexpected(f"health: no answer to {msg.kind.value} in {timeout_s}s")
        finally:
            comp._send = self._capture

    def close(self) -> None:
        for s in self._wire.values():
            s.close(0)
        for comp in self.components():
            comp.close()
        if self.zap is not None:
            self.zap.close()
        self.ctx.term()


class JobTarget(RouterTarget):
    name = "job"

    def _make(self, addr: str, keys: Keyring | None) -> JobBroker:
        return JobBroker(self.ctx, addr, heartbeat_s=1.0, liveness=5, max_queue=16, max_frame_bytes=MAX_FRAME,
                         log=self.log, keys=keys, max_services=64, max_sessions=1000, leases=Leases(30.0))

    def size(self) -> dict:
        return {"jobs": sum(len(b.jobs) for b in self.components()),
                "workers": sum(len(b.workers) for b in self.components())}

    def health(self) -> None:
        """A reward worker registers over CURVE, takes every queued job (failing the fuzz ones) and answers a
        fresh job from a controller with the right result."""
        b = self.secure
        self.tick(10_000)  # every fuzz worker is long silent: dropped, their jobs requeued
        del b._send
        ctx = self.ctx
        worker = self.keys.client("reward").client(ctx.socket(zmq.DEALER))
        client = self.keys.client("controller").client(ctx.socket(zmq.DEALER))
        try:
            for s in (worker, client):
                s.linger = 0
                s.connect(self.addrs[1])
            worker.send_multipart(protocol.encode(Ready(service="reward", capacity=64, worker_id="health")))
            job_id, sent_at = protocol.new_id(), time.monotonic() + 0.3  # after the READY: the queue drains first
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                if sent_at and time.monotonic() > sent_at:
                    client.send_multipart(protocol.encode(RewardJob(task="t", completions=["abc"]), service="reward",
                                                          id=job_id))
                    sent_at = 0.0
                for frames in self._pump(b, worker, 0.05):
                    env = protocol.decode(frames, 1 << 30)
                    if env.kind == Kind.HEARTBEAT:
                        continue
                    if env.id == job_id:
                        reply = RewardResult(rewards=[3.0], worker_id="health")
                    else:
                        reply = Error(code="job_failed", message="fuzz job", ref_id=env.id)
                    worker.send_multipart(protocol.encode(reply, reply_to=env.id))
                for frames in self._pump(b, client, 0.0):
                    env = protocol.decode(frames)
                    if env.kind == Kind.HEARTBEAT:
                        continue
                    if env.kind == Kind.ERROR and env.msg.code == "queue_full":  # fuzz jobs still ahead: again
                        sent_at = time.monotonic() + 0.2
                        continue
                    if env.reply_to != job_id or env.kind != Kind.REWARD_RESULT or env.msg.rewards != [3.0]:
                        raise Unexpected(f"health: the job got {env.kind.value} {env.msg}")
                    return
            raise Unexpected("health: the job broker did not answer a valid job in 20 s")
        finally:
            worker.close(0)
            client.close(0)
            b._send = self._capture


class StoreTarget(RouterTarget):
    name = "store"
    answers = {"stats_request": Kind.STATS, "heartbeat": Kind.HEARTBEAT, "batch_ack": Kind.ACK,
               "get_batch": Kind.SAMPLE_BATCH}

    def _make(self, addr: str, keys: Keyring | None) -> SampleStore:
        d = Path(tempfile.mkdtemp(dir=self.root, prefix="store-"))
        return SampleStore(self.ctx, addr, d, lease_s=60.0, max_frame_bytes=MAX_FRAME, log=self.log, keys=keys,
                           max_samples=256, max_waiters=16, max_wait_ms=50, max_done_ids=10_000,
                           compact_bytes=1 << 20)

    def allowed(self, seed: str, role: str | None) -> bool:
        action = {"stats_request": "stats", "get_batch": "store:take", "batch_ack": "store:take"}.get(seed)
        return action is None or refusal(role, action) is None

    def tick(self, k: int) -> None:
        """Time passes, then the trainer takes and acks everything held (so puts keep reaching the log)."""
        super().tick(k)
        for i, comp in enumerate(self.components()):
            ident, role = b"fuzz-trainer", ("trainer" if i else None)
            n = max(1, len(comp.pending))
            self.sent.clear()
            comp._on_message([PeerFrame(ident, role), *protocol.encode(GetBatch(n_samples=n, version=0,
                                                                                release_leases=True))])
            batches = [protocol.decode(f, 1 << 30).msg for to, f in self.sent if to == ident]
            ids = [s.sample_id for b in batches if b.kind == Kind.SAMPLE_BATCH for s in b.samples]
            comp._on_message([PeerFrame(ident, role), *protocol.encode(BatchAck(sample_ids=ids))])
            self.sent.clear()

    def size(self) -> dict:
        return {"samples": sum(len(s.samples) for s in self.components()),
                "waiters": sum(len(s.waiters) for s in self.components()),
                "log_bytes": sum(s.log_file.size for s in self.components())}

    def health(self) -> None:
        """Over CURVE: the trainer takes and acks everything held; a controller's new sample is acked, then
        served to the trainer intact and acked."""
        self.tick(10_000)
        sample = Sample(sample_id=f"health-{protocol.new_id()}", prompt_id="p", seqs=[_seq(5)])
        while True:
            got = self.roundtrip("trainer", GetBatch(n_samples=1, version=0, release_leases=True), Kind.SAMPLE_BATCH)
            if not got.msg.samples:
                break
            self.roundtrip("trainer", BatchAck(batch_id=got.msg.batch_id,
                                               sample_ids=[s.sample_id for s in got.msg.samples]), Kind.ACK)
        self.roundtrip("controller", sample, Kind.ACK)
        got = self.roundtrip("trainer", GetBatch(n_samples=1, version=0), Kind.SAMPLE_BATCH)
        (back,) = got.msg.samples
        if back.sample_id != sample.sample_id or not np.array_equal(back.seqs[0].output_ids, sample.seqs[0].output_ids):
            raise Unexpected(f"health: the store served {back.sample_id}, not the sample just put")
        self.roundtrip("trainer", BatchAck(batch_id=got.msg.batch_id, sample_ids=[back.sample_id]), Kind.ACK)


class BusTarget:
    """The signal bus: publications (topic + message) as any role; subscriptions of any bytes."""

    name = "bus"

    def __init__(self, root: Path):
        from areal_mq.config import load_config
        from areal_mq.weights import check_ready

        self.root, self.ctx = root, zmq.Context()
        self.keys = Keys(root)
        self.zap = start_zap(self.ctx, self.keys.broker, None)
        self.log = CountingLog()
        trainer = load_config().trainer
        run_dir = root / "run"
        self.addrs = [f"tcp://127.0.0.1:{free_port()}" for _ in range(4)]
        self.buses = [SignalBus(self.ctx, self.addrs[2 * i], self.addrs[2 * i + 1], max_frame_bytes=MAX_FRAME,
                                log=self.log, keys=k, check_weights=lambda r: check_ready(r, run_dir, trainer),
                                retain_path=root / f"retained-{i}.msgpack")
                      for i, k in enumerate((None, self.keys.broker))]
        self.seeds = bus_seeds(run_dir)
        self.run_dir = run_dir

    def components(self) -> list:
        return self.buses

    def feed(self, frames: list[bytes], role: str | None, ident: bytes, seed: str | None, i: int) -> str:
        bus = self.buses[i % 2]
        if i % 11 == 10:  # a subscription frame of any bytes (forwarded upstream; "weights" replays)
            bus._from_subscriber([PeerFrame(frames[0] if frames else b"", None)])
            return "subscribed"
        before = (bus.forwarded, bus.refused)
        if not frames:
            frames = [b""]
        role = role if i % 2 else None  # frames as pyzmq receives them (copy=False): .bytes, and the role
        bus._from_publisher([PeerFrame(f, role) for f in frames])
        forwarded, refused = bus.forwarded - before[0], bus.refused - before[1]
        if forwarded + refused != 1:
            raise Unexpected(f"a publication was forwarded {forwarded} and refused {refused} times")
        if forwarded and bus.retained is not None:
            _, env = protocol.decode_topic(bus.retained, MAX_FRAME)  # what late joiners get must decode
            if not isinstance(env.msg, WeightsReady):
                raise Unexpected(f"the bus retained a {env.msg.kind.value}")
        if seed is not None and not forwarded and (not i % 2 or refusal(role, f"publish:{seed}") is None):
            raise Unexpected(f"the valid {seed} publication ({role if i % 2 else 'plaintext'}) was refused")
        return "forwarded" if forwarded else "refused"

    def tick(self, k: int) -> None:
        for bus in self.buses:  # the retained file is another parser: read back what was written, any bytes
            bus.retained = bus._load_retained()

    def size(self) -> dict:
        return {"retained_bytes": sum(len(b"".join(b.retained or [])) for b in self.buses)}

    def health(self) -> None:
        """Over CURVE: a subscriber gets the retained weights on subscribing, then a trainer's new WeightsReady."""
        bus = self.buses[1]
        sub = self.keys.client("rollout").client(self.ctx.socket(zmq.SUB))
        pub = self.keys.client("trainer").client(self.ctx.socket(zmq.PUB))
        try:
            for s, addr in ((sub, self.addrs[3]), (pub, self.addrs[2])):
                s.linger = 0
                s.connect(addr)
            sub.setsockopt(zmq.SUBSCRIBE, b"weights")
            ready = WeightsReady(version=99, mode="disk", path=str(self.run_dir / "weights" / "v99"))
            seen: list[int] = []
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and 99 not in seen:
                for s in bus.sockets:
                    if s.poll(5):
                        bus.handle(s)
                if seen:
                    pub.send_multipart(protocol.topic_frames("weights", ready))
                while sub.poll(0):
                    _, env = protocol.decode_topic(sub.recv_multipart())
                    seen.append(env.msg.version)
            if 99 not in seen:
                raise Unexpected(f"health: the bus did not relay a trainer's WeightsReady (saw versions {seen})")
        finally:
            sub.close(0)
            pub.close(0)

    def wire(self, frames: list[bytes], role: str, timeout_s: float = 0.0) -> list:
        return []

    def close(self) -> None:
        for bus in self.buses:
            bus.close()
        if self.zap is not None:
            self.zap.close()
        self.ctx.term()
