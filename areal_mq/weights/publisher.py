"""The trainer-side publisher: one version at a time, in the mode TrainerConfig chooses.

What: `WeightPublisher(cfg, run_dir, keys)` publishes to disk version directories under run_dir/weights (disk.py), to
a WeightServer (server.py), or to shared device buffers (cuda_ipc, ipc.py), with deltas when `deltas_on(cfg)`.
Call `publish` on the main rank only (sharded publishing from every rank is sharded.py). Tests in
tests/unit/test_weights.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

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


def adapter_form(cfg: "TrainerConfig") -> WeightsAdapter | None:
    """What a LoRA trainer's versions announce (trainer.lora): the tensors are then the adapter only."""
    if cfg.lora is None:
        return None
    return WeightsAdapter(rank=cfg.lora.rank, alpha=cfg.lora.alpha, target_modules=cfg.lora.target_modules)


def deltas_on(cfg: "TrainerConfig") -> bool:
    """Whether versions also travel as deltas (trainer.weight_deltas; auto: zmq yes, disk no)."""
    return cfg.weight_deltas == "on" or (cfg.weight_deltas == "auto" and cfg.publish_mode == "zmq")


class WeightPublisher:
    """Trainer-side publishing in the mode TrainerConfig chooses (disk dirs under run_dir/weights or
    a WeightServer), with deltas when `deltas_on(cfg)`. Call `publish` on the main rank only."""

    def __init__(self, cfg: "TrainerConfig", run_dir: str | Path, keys: Keyring | None = None, log: Any = None):
        self.cfg = cfg
        self.weights_dir = Path(run_dir) / "weights"
        self.deltas = deltas_on(cfg)
        self.server = None
        self.ipc = IpcPublisher(run_dir, cfg.publish_dtype) if cfg.publish_mode == "cuda_ipc" else None
        self._last: tuple[int, Mapping[str, Any]] | None = None  # disk: the previous version, the delta's base
        self.adapter = adapter_form(cfg)  # a LoRA trainer publishes its adapter (WeightsReady.adapter)
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
        if not self.deltas:
            return publish_disk(self.weights_dir, version, tensors, self.cfg.keep_weight_versions, hf_config_json,
                                adapter=self.adapter)
        delta = None
        digests = {k: checksum(t) for k, t in tensors.items()}
        if self._last is not None and self._last[0] == version - 1 and same_layout(self._last[1], tensors):
            delta = DiskDelta(version - 1, encode_version(self._last[1], tensors, digests))
        full = delta is None or version % self.cfg.full_every == 0
        self._last = (version, tensors)
        return publish_disk(self.weights_dir, version, tensors, self.cfg.keep_weight_versions, hf_config_json,
                            delta=delta, full=full, digests=digests, adapter=self.adapter)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.ipc is not None:
            self.ipc.close()
