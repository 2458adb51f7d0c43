"""What a trainer publishes, chosen once: the trainer worker's one seam to the weights room.

What: `make_publisher(cfg, trainer, bus=, keys=, log=, exchange=)` reads the layout from TrainerConfig (here and
nowhere else) and returns this rank's `TrainerPublisher`. The trainer worker calls `publish_version()` after each
step, `keep_for_eval(publication, weights_dir)` at the versions it evaluates, `drain()` and `close()` at the end,
and never asks which layout it has. A `Publication` is what a rank took from the trainer for one version:

    layout   chosen when                          a rank takes, on the step's thread         published by
    gather   ddp; fsdp with publish_layout        full (Trainer.publish_tensors: a copy;     rank 0's WeightPublisher
             gather; tp > 1; LoRA; the simulated  under fsdp a collective every rank joins)  (disk | zmq)
             trainer                              or adapter (trainer.lora: the adapter)
    sharded  fsdp over zmq (publish_layout auto   shard (Trainer.publish_slices: its own     every serving rank's
             or sharded), trainer.parallel.tp 1   slices, no collective)                     ShardPublisher (sharded.py)
    live     publish_mode cuda_ipc                live (rank 0's live parameters)            rank 0's WeightPublisher
                                                                                             (ipc.py buffers)

Publishing runs beside the next step (trainer.publish_async, background.py) except `live`, which copies the live
parameters in the step. Who serves and who joins a gather is the trainer's ParallelDims' answer
(areal_mq/algorithms/parallel.py `publish_group`, `gathers_collectively`): under HSDP (trainer.parallel.dp_replicate
> 1) a rank outside the serving replica group joins the endpoint exchange once, here, and serves nothing.
Collective order (fsdp gather): every rank calls publish_tensors
once per version in publish_version, and again in keep_for_eval only where no full copy was taken (sharded), so
every rank takes the same branch. `WeightPublisher(cfg, run_dir, keys)` is the full-state transport: disk version
directories under run_dir/weights (disk.py) or a WeightServer (server.py), with deltas when `deltas_on(cfg)`, or the
cuda_ipc buffers. A LoRA version carries `adapter_form(cfg, base_checksum)`: the base's sha256 lets a rollout
worker refuse an adapter trained on another base (catchup.py). Tests: tests/unit/test_weights_publishing.py,
tests/unit/test_weights.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping

from areal_mq.messages import WeightsAdapter, WeightsReady
from areal_mq.security import Keyring
from areal_mq.weights.codec import same_layout, unique_tensors
from areal_mq.weights.delta import checksum, encode_version
from areal_mq.weights.disk import DiskDelta, publish_disk
from areal_mq.weights.ipc import IpcPublisher
from areal_mq.weights.server import WeightServer

if TYPE_CHECKING:
    import torch

    from areal_mq.algorithms.config import TrainerConfig


def adapter_form(cfg: "TrainerConfig", base_checksum: str = "") -> WeightsAdapter | None:
    """What a LoRA trainer's versions announce (trainer.lora): the tensors are then the adapter only; `base_checksum`
    (lora.base_identity's sha256, "" when unknown: not checked) names the base it was trained on."""
    if cfg.lora is None:
        return None
    return WeightsAdapter(rank=cfg.lora.rank, alpha=cfg.lora.alpha, target_modules=cfg.lora.target_modules,
                          base_checksum=base_checksum)


def deltas_on(cfg: "TrainerConfig") -> bool:
    """Whether versions also travel as deltas (trainer.weight_deltas; auto: zmq yes, disk no)."""
    return cfg.weight_deltas == "on" or (cfg.weight_deltas == "auto" and cfg.publish_mode == "zmq")


def layout(cfg: "TrainerConfig") -> Literal["gather", "sharded", "live"]:
    """The one place the publishing layout is read from the config (the table in the module docstring)."""
    if cfg.publish_mode == "cuda_ipc":
        return "live"
    return "sharded" if cfg.sharded_publish and not cfg.sim.enabled else "gather"


class WeightPublisher:
    """The full-state transport of rank 0 (gather and live layouts): disk dirs under run_dir/weights, a
    WeightServer, or the cuda_ipc buffers, with deltas when `deltas_on(cfg)`."""

    def __init__(self, cfg: "TrainerConfig", run_dir: str | Path, keys: Keyring | None = None, log: Any = None,
                 base_checksum: str = ""):
        self.cfg = cfg
        self.weights_dir = Path(run_dir) / "weights"
        self.deltas = deltas_on(cfg)
        self.server = None
        self.ipc = IpcPublisher(run_dir, cfg.publish_dtype) if cfg.publish_mode == "cuda_ipc" else None
        self._last: tuple[int, Mapping[str, Any]] | None = None  # disk: the previous version, the delta's base
        self.adapter = adapter_form(cfg, base_checksum)  # a LoRA trainer publishes its adapter (WeightsReady.adapter)
        if cfg.publish_mode == "zmq":
            self.server = WeightServer(cfg.weight_server_host, cfg.weight_server_port, cfg.keep_weight_versions,
                                       int(cfg.weight_chunk_mb * (1 << 20)), keys=keys, log=log,
                                       deltas=self.deltas, chain=cfg.full_every)

    def publish(self, version: int, tensors: Mapping[str, "torch.Tensor"], hf_config_json: str | None = None,
                snapshot: bool = False) -> WeightsReady:
        """Publish `tensors` as `version`. They are copied first (unique_tensors in cfg.publish_dtype) unless
        `snapshot` says they already are such a copy (Trainer.publish_tensors). cuda_ipc takes the live parameters
        and copies them on their device into the shared buffers (weights/ipc.py)."""
        if self.ipc is not None:
            return self.ipc.publish(version, tensors)
        if not snapshot:
            tensors = unique_tensors(tensors, self.cfg.publish_dtype)
        if self.server is not None:
            ready = self.server.publish(version, tensors)
            return ready if self.adapter is None else ready.model_copy(update={"adapter": self.adapter})
        delta, digests, full = None, None, True
        if self.deltas:  # disk: the delta from the previous version, a full snapshot every full_every
            digests = {k: checksum(t) for k, t in tensors.items()}
            if self._last is not None and self._last[0] == version - 1 and same_layout(self._last[1], tensors):
                encoded = encode_version(self._last[1], tensors, digests)
                delta = DiskDelta(version - 1, encoded)
            full = delta is None or version % self.cfg.full_every == 0
            self._last = (version, tensors)
        return publish_disk(self.weights_dir, version, tensors, self.cfg.keep_weight_versions, hf_config_json,
                            delta=delta, full=full, digests=digests, adapter=self.adapter)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.ipc is not None:
            self.ipc.close()


@dataclass(frozen=True)
class Publication:
    """One version as a trainer rank took it (see the module docstring's table). `tensors`: full, the whole state in
    publish_dtype (rank 0's copy; {} on the other ranks of a gathering fsdp trainer); adapter, the LoRA adapter's
    tensors; shard, this rank's own slices on their device, `where` name -> (start, rows, whole shape); live, the
    live parameters (not a copy)."""

    version: int
    form: Literal["full", "adapter", "shard", "live"]
    tensors: Mapping[str, Any]
    hf_config_json: str | None = None
    where: Mapping[str, tuple] | None = None

    @property
    def whole(self) -> Mapping[str, Any] | None:
        """The whole state (or adapter) as a copy nobody changes, reusable as the evaluation copy; else None."""
        return self.tensors if self.form in ("full", "adapter") else None


class TrainerPublisher:
    """One trainer rank's publisher, the gather layout (the others below change what a rank takes and how it is
    announced). `transport`: the WeightPublisher (rank 0), ShardPublisher (a serving rank) or None (nothing to
    serve from this rank); `bus`: where rank 0 announces WeightsReady."""

    def __init__(self, cfg: "TrainerConfig", trainer: Any, transport: Any, bus: Any = None, log: Any = None,
                 background: bool = False, base_checksum: str = ""):
        self.cfg, self.trainer, self.transport, self.bus, self.log = cfg, trainer, transport, bus, log
        self.adapter = adapter_form(cfg, base_checksum)
        self.keeps = cfg.publish_mode != "disk" and not cfg.sim.enabled  # disk versions are on disk already
        self.background = None
        if background and transport is not None:
            from areal_mq.weights.background import BackgroundPublisher

            self.background = BackgroundPublisher(self._send, log=log)

    def publish_version(self) -> Publication | None:
        """Take the trainer's current version (on this thread: under fsdp a collective where the layout has one) and
        publish it, beside the next step when there is a background thread. Returns what was taken (None: nothing)."""
        publication = self.take()
        if publication is not None and self.transport is not None:
            if self.background is not None:
                self.background.submit(publication.version, publication, publication.hf_config_json)
            else:
                self._send(publication.version, publication, publication.hf_config_json)
        return publication

    def take(self) -> Publication | None:
        t = self.trainer
        if not t.is_main and not t.parallel.gathers_collectively:
            return None
        return Publication(t.version, "full" if self.adapter is None else "adapter", t.publish_tensors(),
                           t.hf_config_json)

    def _send(self, version: int, publication: Publication, hf_config_json: str | None) -> None:
        """Publish a snapshot and say so on the bus (in the background thread when there is one)."""
        self.bus.publish("weights", self.transport.publish(version, publication.tensors, hf_config_json, snapshot=True))

    def keep_for_eval(self, publication: Publication | None, weights_dir: Path) -> Path | None:
        """Write the current version in full under `weights_dir` (the held-out evaluation reads vN there) where
        versions do not reach the disk anyway (zmq, cuda_ipc), not announced. Reuses `publication`'s whole copy, else
        takes one (under fsdp a gather every rank joins, in the same order: every rank took the same form). Returns
        the version's directory on rank 0, None where nothing was written; a full disk raises OSError."""
        t = self.trainer
        if not self.keeps or (not t.is_main and not t.parallel.gathers_collectively):
            return None
        whole = publication.whole if publication is not None else None
        tensors = whole if whole is not None else t.publish_tensors()
        if not t.is_main:
            return None
        publish_disk(weights_dir, t.version, tensors, keep=self.cfg.keep_weight_versions,
                     hf_config_json=t.hf_config_json, digests={k: checksum(x) for k, x in tensors.items()},
                     adapter=self.adapter)
        return Path(weights_dir) / f"v{t.version}"

    def drain(self, timeout: float = 120.0) -> None:
        """Every submitted version published (the last one reaches the workers before the trainer says finished)."""
        if self.background is not None:
            self.background.close(timeout=timeout)

    def close(self, timeout: float = 30.0) -> None:
        self.drain(timeout)
        if self.transport is not None:
            self.transport.close()


class ShardedPublisher(TrainerPublisher):
    """Every serving rank takes its own slices; rank 0 announces the manifest once every rank serves them."""

    def take(self) -> Publication | None:
        if self.transport is None:  # HSDP: a rank outside the serving replica group serves nothing
            return None
        slices, where = self.trainer.publish_slices()
        return Publication(self.trainer.version, "shard", slices, self.trainer.hf_config_json, where)

    def _send(self, version: int, publication: Publication, hf_config_json: str | None) -> None:
        ready = self.transport.publish(version, (publication.tensors, publication.where), hf_config_json)
        if ready is not None and self.trainer.is_main:
            self.bus.publish("weights", ready)
            if self.log is not None:
                self.log.info("trainer.published_sharded", version=version, ranks=len(ready.shards),
                              bytes=int(ready.meta.get("bytes", 0)))


class LivePublisher(TrainerPublisher):
    """cuda_ipc: rank 0's live parameters, copied on their device into the shared buffers, in the step."""

    def take(self) -> Publication | None:
        t = self.trainer
        return Publication(t.version, "live", t.unwrapped.state_dict(), t.hf_config_json) if t.is_main else None

    def _send(self, version: int, publication: Publication, hf_config_json: str | None) -> None:
        self.bus.publish("weights", self.transport.publish(version, publication.tensors, hf_config_json))


BUILD: Any = object()  # make_publisher's default transport: build the one this rank's layout needs


def make_publisher(cfg: Any, trainer: Any, bus: Any = None, keys: Keyring | None = None, log: Any = None,
                   exchange: Any = None, transport: Any = BUILD) -> TrainerPublisher:
    """This rank's publisher for the layout `cfg.trainer` chooses (`cfg`: the RunConfig). `exchange(mine) -> rank 0's`
    (a collective, sharded layout only); `transport`: a ready one instead (tests, the simulated trainer)."""
    tcfg, kind = cfg.trainer, layout(cfg.trainer)
    base = base_checksum_of(trainer) if tcfg.lora is not None else ""
    if kind == "sharded":
        if transport is BUILD:
            transport = _shard_transport(cfg, trainer, keys, log, exchange)
        return ShardedPublisher(tcfg, trainer, transport, bus, log, background=tcfg.publish_async)
    if transport is BUILD:
        transport = WeightPublisher(tcfg, cfg.run.run_dir, keys=keys, log=log, base_checksum=base) \
            if trainer.is_main else None
        if trainer.is_main and trainer.world_size > 1 and log is not None:  # say once why, and what would avoid it
            log.info("trainer.publish_layout", layout=kind, world=trainer.world_size, publish_mode=tcfg.publish_mode,
                     hint="every version is gathered to rank 0 and published from there; with publish_mode zmq every "
                          "rank serves its own shard instead (publish_layout auto or sharded; not under "
                          "trainer.parallel.tp > 1, whose shards are column blocks: docs/bigger-models.md)")
    if kind == "live":
        return LivePublisher(tcfg, trainer, transport, bus, log)
    return TrainerPublisher(tcfg, trainer, transport, bus, log, background=tcfg.publish_async and trainer.is_main,
                            base_checksum=base)


def _shard_transport(cfg: Any, trainer: Any, keys: Keyring | None, log: Any, exchange: Any) -> Any:
    """The serving rank's ShardPublisher (its constructor is a collective), or None under HSDP for a rank of another
    replica group, which joins the endpoint exchange and serves nothing."""
    group = trainer.parallel.publish_group(trainer.rank)  # ParallelDims: who serves which slices
    if group is None:
        if exchange is not None:
            exchange("")
        return None
    from areal_mq.weights.sharded import ShardPublisher

    return ShardPublisher(cfg.trainer, keys or Keyring.from_config(cfg, "trainer"), log, group[0], group[1],
                          exchange=exchange, host_rank=trainer.rank)


def base_checksum_of(trainer: Any) -> str:
    """The sha256 a LoRA trainer computed of its base (lora.base_identity, kept by its strategy), or ""."""
    identity = getattr(trainer, "lora_identity", None) or getattr(getattr(trainer, "strategy", None),
                                                                   "lora_identity", None) or {}
    return str(identity.get("sha256", ""))
