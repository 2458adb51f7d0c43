"""Sharded publishing: every FSDP rank serves its own slices of the policy; no rank gathers the model.

What (trainer.publish_layout sharded, the default of an fsdp trainer publishing over zmq):

    every rank, in the step   the trainer's strategy hands it its slices (Trainer.publish_slices: a host copy of
                              its own dim-0 rows of each tensor, staged from the device through pinned buckets,
                              weights/staging.py, and where they sit; the only part on the step's critical path:
                              no collective, no device copy)
    every rank, beside it     ShardPublisher.publish (BackgroundPublisher thread): blake2b of each slice, a delta
                              against its previous slice (weights/delta.py), chunks handed to the rank's own
                              WeightServer (port weight_server_port + rank, or any free port)
    ranks > 0                 send their WeightsShard (endpoint, chunk counts, links, slices, checksums) to rank 0
                              over an authenticated PUSH socket
    rank 0                    waits for every rank's WeightsShard of that version (shard_publish_timeout_s), then
                              announces one WeightsReady(shards=[...]) on the bus: the manifest
    rollout workers           fetch from every rank at once and assemble (areal_mq/weights/catchup.py)

Why: a gather of the full model to rank 0 every step costs the whole model's bytes through one rank, one host copy
and one server, and interleaved gathers are the field's most reported silent hang. Here each rank moves 1/world
of the bytes, and the collectives of the training step never meet a publish: the only cross-rank traffic of a
publish is the small WeightsShard on zmq, off the training process group.
The layout is the strategy's (areal_mq/algorithms/fsdp.py local_slices: FSDP2's dim-0 sharding, torch.chunk's rule
`chunk_rows`; a tensor FSDP did not shard is served whole by rank 0; tied tensors once, under their first name);
this module only receives slices and where they sit, it never looks inside a trainer. Which ranks serve is the
trainer's ParallelDims' `publish_group` (areal_mq/algorithms/parallel.py): under HSDP (trainer.parallel.dp_replicate
> 1) the ranks of replica group 0 serve (rank = shard index, world = ranks per group), the other groups serve nothing
and never wait on a publish.
Failure: a rank that does not serve a version in time is named (trainer.shard_missing, error) and the version is not
announced: workers stay on the version they hold and move on with the next announcement; training goes on.
Memory per rank, all of it host memory: the staged copy of its shard (model bytes / world in publish_dtype, at
most 2 alive, as BackgroundPublisher bounds them) plus what its server keeps (trainer.keep_weight_versions full
shards and trainer.full_every deltas, the previous version as the next delta's base). The device holds one cast
piece of at most staging.PUBLISH_BUCKET_BYTES while the snapshot is taken. (Before staging the snapshot was a device
copy, 2 alive, and the server kept a third as the delta's base, computed on the GPU: 3 shards of device memory,
5.7 GB a rank for 7B on 8 ranks in bf16. A snapshot handed in on a device is still accepted and diffed there.)
"""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Mapping

from areal_mq.errors import ProtocolError, WeightsFetchError
from areal_mq.messages import WeightsReady, WeightsShard
from areal_mq.security import Keyring, peer_role, refusal, start_zap

if TYPE_CHECKING:
    import torch

SHARD_FRAME_BYTES = 64 << 20  # a WeightsShard of 65,536 slices is ~6 MB; nothing bigger comes from a rank
SHARD_WAIT_FACTOR = 4.0  # rank 0 waits for the others this many times its own publish time, on top of the timeout


def chunk_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """(start, count) of dim-0 rows `rank` holds under FSDP2's even split (torch.chunk's rule)."""
    per = -(-rows // world) if rows else 0
    start = min(rank * per, rows)
    return start, max(0, min(rows, start + per) - start)


def shard_port(cfg: Any, rank: int) -> int:
    if not cfg.weight_server_port:
        return 0
    port = cfg.weight_server_port + rank
    if port > 65535:
        raise WeightsFetchError(f"trainer.weight_server_port {cfg.weight_server_port} + rank {rank} is past 65535")
    return port


class ShardPublisher:
    """One per serving trainer rank (every rank constructs it at the same time, or joins `exchange` alone: the
    constructor exchanges endpoints with a collective on the caller's thread). `rank`/`world`: its index among the
    serving ranks and their number (the trainer's ParallelDims says: Trainer.parallel.publish_group); `host_rank`: the
    trainer rank it is, whose entry of trainer.weight_server_hosts and port offset it takes (default `rank`). `publish(version, slices_and_layout, hf_config_json)` runs in the rank's
    BackgroundPublisher thread; on rank 0 it returns the WeightsReady to announce, or None when a rank did not serve
    the version in time; on other ranks None."""

    def __init__(self, cfg: Any, keys: Keyring | None = None, log: Any = None,
                 rank: int = 0, world: int = 1, exchange: Any = None, host_rank: int | None = None):
        import zmq

        from areal_mq.weights.server import WeightServer, rank_host

        self.cfg, self.rank, self.world, self.log = cfg, rank, world, log
        self.keys = keys or Keyring.insecure("trainer")
        if cfg.weight_server_hosts and len(cfg.weight_server_hosts) < world:
            raise WeightsFetchError(f"trainer.weight_server_hosts lists {len(cfg.weight_server_hosts)} hosts for a "
                                    f"trainer of {world} ranks: one per rank")
        at = rank if host_rank is None else host_rank  # the trainer rank whose host and port this server takes
        host = rank_host(cfg, at)
        try:
            self.server = WeightServer(host, shard_port(cfg, at), cfg.keep_weight_versions,
                                       int(cfg.weight_chunk_mb * (1 << 20)), keys=self.keys, log=log, deltas=True,
                                       chain=cfg.full_every)
        except WeightsFetchError as exc:
            where = ("trainer.weight_server_hosts[%d]" % at) if cfg.weight_server_hosts else \
                "trainer.weight_server_host (every rank binds it when weight_server_hosts is empty)"
            raise WeightsFetchError(f"trainer rank {at}: {exc}. Its weight server binds {where}, which must be an "
                                    "address of the host this rank runs on; for a trainer spanning hosts list one per "
                                    "rank in trainer.weight_server_hosts, or set trainer.publish_layout: gather") from exc
        self.refused = 0
        self._ctx = zmq.Context()
        self._zap = None
        self._pull = None
        collector = ""
        if rank == 0 and world > 1:
            self._zap = start_zap(self._ctx, self.keys, log)
            self._pull = self.keys.server(self._ctx.socket(zmq.PULL), "shard_collector")
            self._pull.linger = 0
            self._pull.maxmsgsize = SHARD_FRAME_BYTES
            port = self._pull.bind_to_random_port(f"tcp://{cfg.weight_server_host}")
            collector = f"tcp://{cfg.weight_server_host}:{port}"
        # every rank learns rank 0's collector (one collective, here, on the constructing thread: never in a publish)
        self.collector = exchange(collector) if exchange is not None else collector
        self._push = None
        if rank > 0:
            self._push = self.keys.client(self._ctx.socket(zmq.PUSH), "trainer")
            self._push.linger = 2000
            self._push.sndhwm = 16
            self._push.connect(self.collector)
        self._pending: dict[int, dict[int, WeightsShard]] = {}  # rank 0: version -> rank -> shard
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    def publish(self, version: int, snapshot: tuple[Mapping[str, "torch.Tensor"], Mapping[str, tuple]],
                hf_config_json: str | None = None) -> WeightsReady | None:
        from areal_mq.protocol import encode
        from areal_mq.weights.delta import checksum

        started = time.monotonic()
        slices, where = snapshot
        host = {k: (v if v.device.type == "cpu" else v.to("cpu")) for k, v in slices.items()}
        digests = {k: checksum(t) for k, t in host.items()}
        on_device = any(v.device.type != "cpu" for v in slices.values())
        ready = self.server.publish(version, host, digests=digests, diff=slices if on_device else None)
        names = list(host)
        mine = WeightsShard(
            rank=self.rank, endpoint=self.server.endpoint, num_chunks=ready.num_chunks, base=ready.base,
            delta_chunks=ready.delta_chunks, bytes=int(ready.meta.get("bytes", 0)), links=ready.links, names=names,
            starts=[where[k][0] for k in names], rows=[where[k][1] for k in names],
            shapes=[list(where[k][2]) for k in names], checksums=[digests[k] for k in names])
        if self.rank > 0:
            assert self._push is not None
            self._push.send_multipart(encode(WeightsReady(version=version, mode="zmq", endpoint=mine.endpoint,
                                                          shards=[mine])))
            return None
        shards = self._collect(version, mine, time.monotonic() - started)
        if shards is None:
            return None
        return WeightsReady(version=version, mode="zmq", endpoint=self.server.endpoint,
                            num_chunks=sum(s.num_chunks for s in shards), shards=shards,
                            meta={"bytes": sum(s.bytes for s in shards), "world": self.world})

    def _collect(self, version: int, mine: WeightsShard, own_s: float = 0.0) -> list[WeightsShard] | None:
        """Rank 0: every rank's WeightsShard of `version` (None, logged, when one is missing at the deadline). The
        wait scales with the bytes: shard_publish_timeout_s plus SHARD_WAIT_FACTOR times what rank 0's own publish
        of its (equal-sized) shard took, so a 70B shard is not cut off at the fixed part a small model needs."""
        got = self._pending.pop(version, {})
        got[0] = mine
        for v in [v for v in self._pending if v < version]:
            del self._pending[v]  # a version that was never complete: nobody will announce it
        wait_s = self.cfg.shard_publish_timeout_s + SHARD_WAIT_FACTOR * own_s
        deadline = time.monotonic() + wait_s
        while len(got) < self.world:
            left = deadline - time.monotonic()
            if left <= 0 or self._pull is None:
                missing = sorted(set(range(self.world)) - set(got))
                if self.log is not None:
                    self.log.error("trainer.shard_missing", version=version, missing_ranks=missing,
                                   waited_s=round(wait_s, 1), rank0_publish_s=round(own_s, 2),
                                   hint="those ranks did not serve this version in time (dead, stuck or slow); it "
                                        "is not announced, rollout workers keep their weights until the next one")
                return None
            if not self._pull.poll(int(min(left, 0.5) * 1000) + 1):
                continue
            shard, shard_version = self._receive()
            if shard is None:
                continue
            if shard_version == version:
                got[shard.rank] = shard
            elif shard_version > version:
                self._pending.setdefault(shard_version, {})[shard.rank] = shard
        return [got[r] for r in range(self.world)]

    def _receive(self) -> tuple[WeightsShard | None, int]:
        """One WeightsShard from a rank; anything else is refused (logged) and dropped."""
        import zmq

        from areal_mq.protocol import decode

        frames = self._pull.recv_multipart(copy=False, flags=zmq.NOBLOCK)  # type: ignore[union-attr]
        why = refusal(peer_role(frames[0], self.keys.secure), "publish:weights")
        msg = None
        if not why:
            try:
                msg = decode(frames, SHARD_FRAME_BYTES).msg
            except ProtocolError as exc:
                why = f"undecodable: {exc}"
        if not why and (not isinstance(msg, WeightsReady) or len(msg.shards) != 1
                        or not 0 < msg.shards[0].rank < self.world):
            why = f"expected one WeightsShard of a rank in 1..{self.world - 1}"
        if why:
            self.refused += 1
            if self.log is not None:
                self.log.warning("trainer.shard_refused", reason=why)
            return None, -1
        assert isinstance(msg, WeightsReady)
        return msg.shards[0], msg.version

    def close(self) -> None:
        self.server.close()
        for sock in (self._pull, self._push):
            if sock is not None:
                sock.close(0)
        if self._zap is not None:
            self._zap.close()
        self._ctx.term()


def check_manifest(ready: WeightsReady) -> dict[str, tuple[list[int], list[tuple[int, int, int]]]]:
    """name -> (whole shape, [(shard index, start, rows)] in row order) for a sharded WeightsReady, after checking that
    every tensor's slices agree on its shape and tile its dimension 0 exactly. Raises WeightsFetchError."""
    layout: dict[str, tuple[list[int], list[tuple[int, int, int]]]] = {}
    for i, shard in enumerate(ready.shards):
        for name, start, rows, shape in zip(shard.names, shard.starts, shard.rows, shard.shapes):
            whole, parts = layout.setdefault(name, (list(shape), []))
            if whole != list(shape):
                raise WeightsFetchError(f"manifest of v{ready.version}: {name} is {whole} on one rank and {shape} "
                                        f"on rank {shard.rank}")
            parts.append((i, start, rows))
    for name, (whole, parts) in layout.items():
        parts.sort(key=lambda p: p[1])
        at = 0
        for _, start, rows in parts:
            if start != at:
                raise WeightsFetchError(f"manifest of v{ready.version}: the slices of {name} leave a gap or overlap "
                                        f"at row {at} (next slice starts at {start})")
            at += rows
        if at != (whole[0] if whole else 0) or (not whole and len(parts) != 1):
            raise WeightsFetchError(f"manifest of v{ready.version}: the slices of {name} cover {at} rows of {whole}")
    return layout


def shard_ready(ready: WeightsReady, shard: WeightsShard) -> WeightsReady:
    """One shard as an unsharded announcement of its own slices (what WeightCatchup's plans work on)."""
    return WeightsReady(version=ready.version, mode="zmq", endpoint=shard.endpoint, num_chunks=shard.num_chunks,
                        base=shard.base, delta_chunks=shard.delta_chunks, links=shard.links,
                        meta={"bytes": shard.bytes})


def slice_held(held: Mapping[str, "torch.Tensor"] | None, shard: WeightsShard) -> dict[str, "torch.Tensor"] | None:
    """The rows of the weights a worker holds that `shard` serves (views), or None when they do not fit."""
    if held is None:
        return None
    out = {}
    for name, start, rows, shape in zip(shard.names, shard.starts, shard.rows, shard.shapes):
        t = held.get(name)
        if t is None or list(t.shape) != list(shape):
            return None
        out[name] = t[start:start + rows] if shape else t
    return out


def check_slices(shard: WeightsShard, got: Mapping[str, "torch.Tensor"]) -> None:
    """Every slice `shard` lists is in `got` and matches the manifest's checksum (DeltaError naming the rank). Called
    on each shard's own fetch thread: blake2b releases the GIL, so the shards are checked side by side."""
    from areal_mq.weights.delta import DeltaError, checksum

    for name, digest in zip(shard.names, shard.checksums):
        t = got.get(name)
        if t is None:
            raise DeltaError("missing", f"trainer rank {shard.rank} ({shard.endpoint}) sent no {name}")
        if checksum(t) != digest:
            raise DeltaError("checksum", f"trainer rank {shard.rank} ({shard.endpoint}): {name} does not match "
                                         "the manifest's checksum")


def assemble(ready: WeightsReady, layout: Mapping[str, tuple[list[int], list[tuple[int, int, int]]]],
             parts: list[Mapping[str, "torch.Tensor"]], checked: bool = False) -> dict[str, "torch.Tensor"]:
    """The whole tensors from every shard's slices (in the manifest's tensor order), each slice checked against the
    manifest's checksum first unless `checked` says check_slices did (DeltaError("checksum") names the rank)."""
    import torch

    from areal_mq.weights.delta import DeltaError

    if not checked:
        for shard, got in zip(ready.shards, parts):
            check_slices(shard, got)
    out: dict[str, Any] = {}
    for name, (whole, slices) in layout.items():
        pieces = [parts[i][name] for i, _, _ in slices]
        if not whole:
            out[name] = pieces[0].clone()
            continue
        for (i, _, rows), piece in zip(slices, pieces):
            if list(piece.shape) != [rows, *whole[1:]]:
                raise DeltaError("corrupt", f"trainer rank {ready.shards[i].rank} sent {name} as "
                                            f"{list(piece.shape)}, the manifest says {[rows, *whole[1:]]}")
        out[name] = torch.cat(pieces, 0) if len(pieces) > 1 else pieces[0].clone()
    return out
