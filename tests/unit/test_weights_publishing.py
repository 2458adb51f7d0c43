"""What a trainer publishes, chosen once (areal_mq/weights/publisher.py make_publisher): each layout from the config,
what each rank takes and sends (the fsdp gather's collective order included), the evaluation copy, a LoRA version
naming its base, and a rollout worker's catch-up refusing an adapter trained on another base.

Stand-ins for the trainer (counting its publish calls), the transport and the bus; real disk publishing.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from areal_mq.config import load_config
from areal_mq.errors import WeightsLoadError
from areal_mq.messages import WeightsAdapter
from areal_mq.security import Keyring
from areal_mq.weights.catchup import WeightCatchup
from areal_mq.weights.disk import publish_disk, read_adapter
from areal_mq.weights.publisher import (LivePublisher, ShardedPublisher, TrainerPublisher, WeightPublisher, layout,
                                        make_publisher)

REPO = Path(__file__).resolve().parents[2]
SHA = "ab" * 32


class Strategy:
    """The trainer's strategy (a LoRA base's identity) and ParallelDims (who gathers, who serves) in one stand-in."""

    def __init__(self, gathers: bool = False, group=(0, 1), lora_identity=None):
        self.gathers_collectively, self.group = gathers, group
        self.lora_identity = lora_identity or {}

    def publish_group(self, rank):
        return self.group


class Trainer:
    """Counts the calls a layout makes (publish_tensors is a collective under fsdp)."""

    def __init__(self, rank: int = 0, world: int = 1, strategy: Strategy | None = None):
        self.rank, self.world_size, self.is_main = rank, world, rank == 0
        self.strategy = self.parallel = strategy or Strategy()
        self.version, self.hf_config_json = 3, "{}"
        self.calls: list[str] = []
        self.unwrapped = torch.nn.Linear(2, 2)

    def publish_tensors(self):
        self.calls.append("publish_tensors")
        return {"w": torch.ones(2, 2)} if self.is_main else {}

    def publish_slices(self):
        self.calls.append("publish_slices")
        return {"w": torch.ones(1, 2)}, {"w": (self.rank, 1, (2, 2))}


class Transport:
    def __init__(self):
        self.sent, self.closed = [], False

    def publish(self, version, tensors, hf_config_json=None, **kw):
        self.sent.append((version, tensors))
        return f"ready-v{version}"

    def close(self):
        self.closed = True


class Bus:
    def __init__(self):
        self.sent = []

    def publish(self, topic, msg):
        self.sent.append((topic, msg))


def _cfg(tmp_path, *over):
    return load_config(None, [f"run.run_dir={tmp_path}", "trainer.publish_async=false", *over])


@pytest.mark.parametrize("over, want, kind", [
    ((), TrainerPublisher, "gather"),
    (("trainer.publish_mode=zmq",), TrainerPublisher, "gather"),
    (("trainer.strategy=fsdp", "trainer.publish_mode=zmq", "trainer.publish_layout=gather"), TrainerPublisher,
     "gather"),
    (("trainer.strategy=fsdp", "trainer.publish_mode=zmq"), ShardedPublisher, "sharded"),
    (("trainer.strategy=fsdp", "trainer.publish_mode=zmq", "trainer.lora.rank=2"), TrainerPublisher, "gather"),
    (("trainer.strategy=fsdp", "trainer.publish_mode=zmq", "trainer.sim.enabled=true"), TrainerPublisher, "gather"),
    (("trainer.publish_mode=cuda_ipc", "model.device=cpu"), LivePublisher, "live"),
])
def test_each_layout_is_chosen_from_the_config(tmp_path, over, want, kind):
    cfg = _cfg(tmp_path, *over)
    assert layout(cfg.trainer) == kind
    publisher = make_publisher(cfg, Trainer(), bus=Bus(), keys=Keyring.insecure("trainer"), exchange=lambda s: s)
    try:
        assert type(publisher) is want
        assert publisher.transport is not None  # rank 0 always serves
    finally:
        publisher.close()


def test_the_trainer_worker_has_no_layout_branch():
    text = (REPO / "workers/trainer.py").read_text()
    hits = re.findall(r"publish_mode|sharded_publish|publish_layout|cuda_ipc|ShardPublisher|WeightPublisher\(|"
                      r"BackgroundPublisher|publish_slices|publish_tensors", text)
    assert not hits, f"workers/trainer.py knows publishing layouts (move it into weights/publisher.py): {hits}"


def test_gather_every_fsdp_rank_joins_the_snapshot_once_and_only_rank0_sends(tmp_path):
    cfg = _cfg(tmp_path, "trainer.publish_mode=zmq")
    for rank, gathers, want_calls in ((0, True, ["publish_tensors"]), (1, True, ["publish_tensors"]), (1, False, [])):
        trainer, transport, bus = Trainer(rank, 2, Strategy(gathers)), Transport(), Bus()
        publisher = make_publisher(cfg, trainer, bus=bus, transport=transport if rank == 0 else None)
        publication = publisher.publish_version()
        assert trainer.calls == want_calls, (rank, gathers)
        assert (publication is None) == (not want_calls)
        # the evaluation copy reuses the snapshot: no second collective on any rank
        written = publisher.keep_for_eval(publication, tmp_path / f"w{rank}{gathers}")
        assert trainer.calls == want_calls
        assert (written is not None) == (rank == 0)
        assert bus.sent == ([("weights", "ready-v3")] if rank == 0 else [])


def test_sharded_every_rank_sends_its_slices_and_the_evaluation_copy_is_gathered(tmp_path):
    cfg = _cfg(tmp_path, "trainer.strategy=fsdp", "trainer.publish_mode=zmq")
    for rank in (0, 1):
        trainer, transport, bus = Trainer(rank, 2, Strategy(gathers=True)), Transport(), Bus()
        publisher = make_publisher(cfg, trainer, bus=bus, transport=transport)
        publication = publisher.publish_version()
        assert publication.form == "shard" and trainer.calls == ["publish_slices"]
        (version, (slices, where)), = transport.sent
        assert version == 3 and where == {"w": (rank, 1, (2, 2))}
        assert bus.sent == ([("weights", "ready-v3")] if rank == 0 else [])
        publisher.keep_for_eval(publication, tmp_path / f"w{rank}")  # a gather every rank joins
        assert trainer.calls == ["publish_slices", "publish_tensors"]


def test_an_hsdp_replica_outside_the_serving_group_joins_the_exchange_and_serves_nothing(tmp_path):
    cfg = _cfg(tmp_path, "trainer.strategy=fsdp", "trainer.publish_mode=zmq")
    exchanged = []
    trainer = Trainer(2, 4, Strategy(gathers=True, group=None))
    publisher = make_publisher(cfg, trainer, exchange=exchanged.append)
    assert exchanged == [""] and publisher.transport is None
    assert publisher.publish_version() is None and trainer.calls == []
    publisher.keep_for_eval(None, tmp_path / "w")
    assert trainer.calls == ["publish_tensors"]  # it still joins the evaluation copy's gather
    publisher.close()


def test_a_lora_version_names_its_base_on_the_wire_and_on_disk(tmp_path):
    cfg = _cfg(tmp_path, "trainer.lora.rank=2", "trainer.lora.target_modules=[q_proj]")
    trainer, bus = Trainer(strategy=Strategy(lora_identity={"path": "/m", "sha256": SHA})), Bus()
    publisher = make_publisher(cfg, trainer, bus=bus)
    try:
        assert isinstance(publisher.transport, WeightPublisher)
        assert publisher.publish_version().form == "adapter"
        (_, ready), = bus.sent
        assert ready.adapter.base_checksum == SHA and read_adapter(ready.path).base_checksum == SHA
    finally:
        publisher.close()


def test_the_catchup_refuses_an_adapter_of_another_base_before_fetching(tmp_path):
    computed = []

    def ours():
        computed.append(1)
        return SHA

    catchup = WeightCatchup(tmp_path, load_config(None, []).trainer, base_checksum=ours)
    adapter = {"m.lora_A.weight": torch.zeros(2, 3), "m.lora_B.weight": torch.zeros(3, 2)}
    ready = publish_disk(tmp_path / "weights", 1, adapter)
    plain = catchup.prepare(ready.model_copy(update={"adapter": WeightsAdapter(rank=2, alpha=4.0)}))
    assert computed == [] and set(plain.kwargs["tensors"]) == set(adapter)  # empty: not checked, nothing computed
    same = catchup.prepare(ready.model_copy(update={"adapter": WeightsAdapter(rank=2, alpha=4.0, base_checksum=SHA)}))
    assert same.adapter.base_checksum == SHA
    other = ready.model_copy(update={"adapter": WeightsAdapter(rank=2, alpha=4.0, base_checksum="cd" * 32)})
    with pytest.raises(WeightsLoadError, match="trained on the base with sha256 cdcdcd"):
        catchup.prepare(other)
    assert computed == [1]  # once per worker start
