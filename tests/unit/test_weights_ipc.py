"""Colocated weight updates (areal_mq/weights/ipc.py) on the CPU's shared memory: the protocol, its versions and
every refusal, with a small engine whose update_weights is the torch engine's in-place loader.
The same protocol across processes with the real torch engine: tests/integration/test_weights_ipc.py."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from areal_mq.config import load_config
from areal_mq.engines.torch.weights import load_weights_in_place
from areal_mq.errors import ConfigError, WeightsFetchError, WeightsRefused
from areal_mq.messages import WeightsReady
from areal_mq.weights.ipc import (ALIGN, SEQ, IpcPublisher, IpcReceiver, check_config, check_ready_ipc, layout,
                                  set_paths)


class Net(torch.nn.Module):
    def __init__(self, vocab: int = 40, dim: int = 8, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, dtype=dtype)
        self.proj = torch.nn.Linear(dim, dim, dtype=dtype)
        self.head = torch.nn.Linear(dim, vocab, bias=False, dtype=dtype)
        self.head.weight = self.embed.weight  # tied, as lm_head and embed_tokens


class Engine:
    """What IpcReceiver needs of an engine: model, device, version and update_weights (the torch engine's loader)."""

    def __init__(self, model: torch.nn.Module, device: str = "cpu", on_copy=None):
        self.model, self.device, self.version, self.on_copy = model, torch.device(device), 0, on_copy

    def update_weights(self, version, tensors=None, path=None):
        if self.on_copy is not None:
            self.on_copy()
        n = load_weights_in_place(self.model, tensors=tensors, path=path)
        self.version = version
        return {"load_s": 0.0, "pause_s": 0.0, "tensors": float(n)}


def _trained(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return Net().state_dict()


def _params(engine: Engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def _equal_bf16(engine: Engine, tensors: dict[str, torch.Tensor]) -> None:
    got = engine.model.state_dict()
    for k, t in tensors.items():
        assert torch.equal(got[k], t.to(torch.bfloat16).to(got[k].dtype)), k


def test_publish_then_update_copies_in_place_and_stamps_the_version(tmp_path):
    pub = IpcPublisher(tmp_path, "bfloat16")
    engine = Engine(Net())
    ptrs = {k: p.data_ptr() for k, p in engine.model.named_parameters()}
    rx = IpcReceiver(tmp_path)
    for version in (1, 2, 3):
        weights = _trained(version)
        ready = pub.publish(version, weights)
        assert ready.mode == "cuda_ipc" and ready.version == version and ready.ipc_set == pub.set.set_id
        ready = WeightsReady.model_validate(ready.model_dump(mode="json"))  # as it travels on the bus
        timings = rx.update(engine, ready)
        assert engine.version == version and timings["loaded_version"] == version and timings["torn_retries"] == 0
        _equal_bf16(engine, weights)
    assert {k: p.data_ptr() for k, p in engine.model.named_parameters()} == ptrs  # storages kept
    assert [t.name for t in pub.set.tensors] == ["embed.weight", "proj.weight", "proj.bias"]  # tied: once
    paths = set_paths(tmp_path, pub.set.set_id)
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in paths.values())
    assert (tmp_path / "ipc").stat().st_mode & 0o777 == 0o700
    pub.close()
    assert not any(p.exists() for p in paths.values())


def test_layout_aligns_every_tensor():
    specs, nbytes = layout({"a": torch.zeros(3), "b": torch.zeros(2, 5, dtype=torch.float64)}, None)
    assert [s.offset for s in specs] == [0, ALIGN] and nbytes == 2 * ALIGN and specs[1].dtype == "float64"


def test_an_overwritten_version_loads_the_newest_whole_one(tmp_path):
    pub, engine = IpcPublisher(tmp_path), Engine(Net())
    first = pub.publish(1, _trained(1))
    pub.publish(2, _trained(2))
    newest = _trained(3)
    pub.publish(3, newest)  # v1's slot now holds v3
    timings = IpcReceiver(tmp_path).update(engine, first)
    assert engine.version == 3 and timings["loaded_version"] == 3
    _equal_bf16(engine, newest)


def test_a_torn_copy_is_detected_and_the_newest_version_copied_again(tmp_path):
    pub = IpcPublisher(tmp_path)
    ready = pub.publish(1, _trained(1))
    newest = _trained(3)
    writes = iter([lambda: (pub.publish(2, _trained(2)), pub.publish(3, newest))])  # reuses v1's slot mid-copy

    def trainer_publishes_during_the_first_copy():
        step = next(writes, None)
        if step is not None:
            step()
    engine = Engine(Net(), on_copy=trainer_publishes_during_the_first_copy)
    timings = IpcReceiver(tmp_path).update(engine, ready)
    assert timings["torn_retries"] == 1 and timings["loaded_version"] == 3 and engine.version == 3
    _equal_bf16(engine, newest)


def test_copies_torn_until_the_deadline_stop_the_worker_instead_of_decoding_on_them(tmp_path):
    from areal_mq.errors import ArealError
    from areal_mq.weights.ipc import TornWeights

    pub = IpcPublisher(tmp_path)
    ready = pub.publish(1, _trained(1))
    versions = iter(range(2, 10_000))

    def trainer_always_publishes_twice_during_a_copy():
        v = next(versions)
        pub.publish(v, _trained(v % 5))
        pub.publish(next(versions), _trained(v % 7))
    engine = Engine(Net(), on_copy=trainer_always_publishes_twice_during_a_copy)
    with pytest.raises(TornWeights, match="mixed weights") as info:
        IpcReceiver(tmp_path, timeout_s=0.2).update(engine, ready)
    assert not isinstance(info.value, ArealError)  # the rollout worker must not treat it as a retryable fetch error


def test_a_slot_being_written_is_never_read(tmp_path):
    pub, engine = IpcPublisher(tmp_path), Engine(Net())
    ready = pub.publish(1, _trained(1))
    pub.header[0, SEQ] += 1  # the trainer is writing that slot (odd seq), the other holds nothing yet
    before = _params(engine)
    with pytest.raises(WeightsFetchError, match="hold versions"):
        IpcReceiver(tmp_path, timeout_s=1).update(engine, ready)
    assert engine.version == 0 and all(torch.equal(before[k], v) for k, v in _params(engine).items())


def test_a_version_going_back_within_a_set_is_refused(tmp_path):
    pub, engine, rx = IpcPublisher(tmp_path), Engine(Net()), IpcReceiver(tmp_path)
    old = pub.publish(1, _trained(1))
    rx.update(engine, pub.publish(2, _trained(2)))
    with pytest.raises(WeightsRefused, match="never go back"):
        rx.update(engine, old)
    assert engine.version == 2
    again = IpcPublisher(tmp_path)  # a resumed trainer: a new set may start lower
    rx.update(engine, again.publish(1, _trained(1)))
    assert engine.version == 1


def test_the_publisher_refuses_a_version_going_back_or_a_changed_model(tmp_path):
    pub = IpcPublisher(tmp_path)
    pub.publish(2, _trained(2))
    with pytest.raises(ConfigError, match="only go up"):
        pub.publish(2, _trained(2))
    with pytest.raises(ConfigError, match="changed names or shapes"):
        pub.publish(3, Net(vocab=41).state_dict())


def test_an_unknown_set_and_a_set_of_another_run_are_refused(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    pub = IpcPublisher(other)
    ready = pub.publish(1, _trained(1))
    engine = Engine(Net())
    with pytest.raises(WeightsRefused, match="unknown handle set"):
        IpcReceiver(run).update(engine, ready)
    (run / "ipc").mkdir(parents=True)
    for path in set_paths(other, ready.ipc_set).values():  # the other run's files copied into this run
        copy = run / "ipc" / path.name
        copy.write_bytes(path.read_bytes())
        copy.chmod(0o600)
    with pytest.raises(WeightsRefused, match="belongs to the run at"):
        IpcReceiver(run).update(engine, ready)
    assert engine.version == 0


def _edit_set(tmp_path: Path, set_id: str, **changes) -> None:
    path = set_paths(tmp_path, set_id)["json"]
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


def test_a_worker_on_another_host_or_device_is_refused(tmp_path):
    pub = IpcPublisher(tmp_path)
    ready = pub.publish(1, _trained(1))
    with pytest.raises(WeightsRefused, match="works only colocated.*engine on meta"):
        IpcReceiver(tmp_path).update(Engine(Net(), device="meta"), ready)
    _edit_set(tmp_path, ready.ipc_set, host="elsewhere:0")
    with pytest.raises(WeightsRefused, match="colocated: the trainer shares its buffers on host elsewhere"):
        IpcReceiver(tmp_path).update(Engine(Net()), ready)


def test_a_set_that_does_not_fit_the_engine_is_refused_before_any_copy(tmp_path):
    pub = IpcPublisher(tmp_path)
    ready = pub.publish(1, _trained(1))
    engine = Engine(Net(vocab=41))
    before = _params(engine)
    with pytest.raises(WeightsRefused, match=r"does not fit.*embed.weight: shared \[40, 8\], engine \[41, 8\]"):
        IpcReceiver(tmp_path).update(engine, ready)
    assert engine.version == 0 and all(torch.equal(before[k], v) for k, v in _params(engine).items())

    class Extra(Net):
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(WeightsRefused, match="gate: not shared"):
        IpcReceiver(tmp_path).update(Engine(Extra()), ready)
    ints = IpcPublisher(tmp_path, dtype=None)
    w = _trained(1)
    w["proj.bias"] = torch.arange(8, dtype=torch.int32)
    with pytest.raises(WeightsRefused, match="proj.bias: shared int32, engine float32"):
        IpcReceiver(tmp_path).update(Engine(Net()), ints.publish(1, w))


def test_files_that_are_not_ours_alone_or_malformed_are_refused(tmp_path):
    pub = IpcPublisher(tmp_path)
    ready = pub.publish(1, _trained(1))
    paths = set_paths(tmp_path, ready.ipc_set)
    paths["slots"].chmod(0o644)
    with pytest.raises(WeightsRefused, match="mode 0600"):
        IpcReceiver(tmp_path).update(Engine(Net()), ready)
    paths["slots"].chmod(0o600)
    os.replace(paths["json"], tmp_path / "elsewhere.json")
    os.symlink(tmp_path / "elsewhere.json", paths["json"])
    with pytest.raises(WeightsRefused, match="regular file"):
        IpcReceiver(tmp_path).update(Engine(Net()), ready)
    paths["json"].unlink()
    os.replace(tmp_path / "elsewhere.json", paths["json"])
    _edit_set(tmp_path, ready.ipc_set, tensors=[{"name": "embed.weight", "dtype": "bfloat16", "shape": [40, 8],
                                                 "offset": 10 ** 9}])
    with pytest.raises(WeightsRefused, match="malformed.*does not fit"):
        IpcReceiver(tmp_path).update(Engine(Net()), ready)
    _edit_set(tmp_path, ready.ipc_set, tensors=[], pickle="cos\nsystem\n")
    with pytest.raises(WeightsRefused, match="malformed"):
        IpcReceiver(tmp_path).update(Engine(Net()), ready)
    paths["json"].write_text("{not json")
    with pytest.raises(WeightsRefused, match="malformed"):
        IpcReceiver(tmp_path).update(Engine(Net()), ready)


def test_announcements_are_checked(tmp_path):
    with pytest.raises(ValueError):
        WeightsReady(version=1, mode="cuda_ipc", ipc_set="../../etc/passwd")
    good = WeightsReady(version=1, mode="cuda_ipc", ipc_set="ab" * 16)
    assert check_ready_ipc(good, "cuda_ipc") is None
    assert "publish_mode cuda_ipc" in check_ready_ipc(good, "zmq")
    assert "names a handle set" in check_ready_ipc(WeightsReady(version=1, mode="cuda_ipc"), "cuda_ipc")
    assert "no path" in check_ready_ipc(good.model_copy(update={"path": "/tmp/x"}), "cuda_ipc")
    with pytest.raises(WeightsRefused, match="needs a cuda_ipc WeightsReady"):
        IpcReceiver(tmp_path).update(Engine(Net()), WeightsReady(version=1, mode="zmq", endpoint="tcp://x:1"))


@pytest.mark.parametrize("trainer,rollout,ok", [("cpu", "cpu", True), ("cuda", "cuda:0", True), (None, None, True),
                                                ("cuda:0", "cuda:1", False), ("cpu", "cuda", False),
                                                ("meta", "meta", False)])
def test_config_needs_one_device_for_trainer_and_rollout(trainer, rollout, ok):
    over = ["trainer.publish_mode=cuda_ipc"] + [f"{role}.device={d}" for role, d in
                                                (("trainer", trainer), ("rollout", rollout)) if d]
    if ok:
        check_config(load_config(None, over))  # auto and auto: both resolve alike on one host
    else:
        with pytest.raises(ConfigError, match="on one device"):
            load_config(None, over)
    load_config(None, ["trainer.publish_mode=zmq", "trainer.device=cpu", "rollout.device=cuda"])  # only cuda_ipc


def test_config_refuses_deltas_with_cuda_ipc():
    with pytest.raises(ConfigError, match="weight_deltas"):
        load_config(None, ["trainer.publish_mode=cuda_ipc", "model.device=cpu", "trainer.weight_deltas=on"])


def test_the_bus_rule_and_the_trainer_worker_publish_live_parameters(tmp_path):
    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.weights import WeightPublisher, check_ready, resolve
    from areal_mq.workers.trainer import TrainerWorker

    cfg = load_config(None, [f"run.run_dir={tmp_path}", "trainer.publish_mode=cuda_ipc", "model.device=cpu"])
    sent = []

    class Trainer:
        is_main, version, hf_config_json, unwrapped = True, 1, "{}", Net()

        def publish_tensors(self):
            raise AssertionError("cuda_ipc publishes the live parameters, not a CPU snapshot")

    class Bus:
        def publish(self, topic, msg):
            sent.append((topic, msg))

    publisher = WeightPublisher(cfg.trainer, tmp_path)
    worker = TrainerWorker(cfg, Trainer(), None, Bus(), publisher, rt=None)
    worker.publish()
    (topic, ready), = sent
    assert topic == "weights" and ready.mode == "cuda_ipc" and ready.version == 1
    assert check_ready(ready, tmp_path, cfg.trainer) is None and resolve(ready, tmp_path, cfg.trainer) == {}
    assert "publish_mode cuda_ipc" in check_ready(ready, tmp_path, TrainerConfig(publish_mode="zmq"))
    engine = Engine(Net())
    IpcReceiver(tmp_path).update(engine, ready)
    _equal_bf16(engine, Trainer.unwrapped.state_dict())
    worker.sinks.close()
    publisher.close()
    assert not list((tmp_path / "ipc").iterdir())
