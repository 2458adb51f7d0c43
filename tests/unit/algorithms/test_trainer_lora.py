"""The Trainer under trainer.lora on the real tiny Llama: only the adapter trains, the base stays as loaded, the
reference is the base, a version publishes the adapter, a checkpoint holds the adapter only and resumes exactly."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from areal_mq.algorithms.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from areal_mq.algorithms.config import LoraConfig, TrainerConfig  # noqa: E402
from areal_mq.algorithms.trainer import Trainer  # noqa: E402
from areal_mq.errors import ConfigError  # noqa: E402
from areal_mq.weights.adapter import merge  # noqa: E402
from tests.unit.algorithms.batches import make_samples  # noqa: E402

CFG = dict(lr=1e-2, ppo_n_minibatches=2, max_tokens_per_mb=64, seed=7, grad_clip=None,
           lora=LoraConfig(rank=4, alpha=8.0))


def _base(trainer):
    return {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters() if not p.requires_grad}


def test_only_the_adapter_trains_and_a_version_publishes_it(tiny_model_dir):
    trainer = Trainer(TrainerConfig(**CFG), tiny_model_dir)
    base = _base(trainer)
    trainable = [p for p in trainer.unwrapped.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    assert sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"]) == sum(
        p.numel() for p in trainable)  # AdamW holds the adapter only
    before = trainer.publish_tensors("float32")
    for i in range(2):
        trainer.train_step(make_samples(i, version=i, staleness=0))
    after = trainer.publish_tensors("float32")
    assert set(after) == set(before) and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in after)
    assert any(not torch.equal(after[k], before[k]) for k in after)
    assert all(torch.equal(v, base[k]) for k, v in _base(trainer).items())  # the base never moved
    assert trainer.publish_tensors()[next(iter(after))].dtype == torch.bfloat16  # trainer.publish_dtype


def test_the_reference_is_the_base_and_the_policy_is_the_merged_model(tiny_model_dir):
    from areal_mq.algorithms.packing import build_microbatch, samples_to_seqs
    from areal_mq.algorithms.trainer import token_logprobs
    from areal_mq.engines.models import load_causal_lm

    trainer = Trainer(TrainerConfig(**CFG, kl_coef=0.1), tiny_model_dir)
    assert trainer.ref_model is trainer.model  # no second model
    for i in range(2):
        trainer.train_step(make_samples(i, version=i, staleness=0))
    batch = make_samples(9, n_groups=1, group_size=2)
    seqs = samples_to_seqs(batch, trainer.cfg)
    mb = build_microbatch(seqs, [0, 1], True, device=trainer.device)
    plain = load_causal_lm(tiny_model_dir).eval()
    merged = load_causal_lm(tiny_model_dir).eval()
    state = merged.state_dict()
    merged.load_state_dict({**state, **merge(state, trainer.publish_tensors("float32"), 8.0 / 4)})
    with torch.no_grad():
        with trainer._reference():
            ref = token_logprobs(trainer.model, mb, 1.0)[0]
        policy = token_logprobs(trainer.model, mb, 1.0)[0]
        want_ref = token_logprobs(plain, mb, 1.0)[0]
        want_policy = token_logprobs(merged, mb, 1.0)[0]
    torch.testing.assert_close(ref, want_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(policy, want_policy, rtol=0, atol=1e-4)
    assert (policy - ref).abs().max() > 1e-3


def test_a_lora_checkpoint_holds_the_adapter_only_and_resumes_exactly(tiny_model_dir, tmp_path):
    cfg = TrainerConfig(**CFG)
    batches = [make_samples(20 + i, version=i, staleness=0) for i in range(3)]
    straight = Trainer(cfg, tiny_model_dir)
    for b in batches:
        straight.train_step(b)
    want = straight.publish_tensors("float32")
    del straight

    first = Trainer(cfg, tiny_model_dir)
    for b in batches[:2]:
        first.train_step(b)
    ckpt = save_checkpoint(first, tmp_path / "ckpt")
    del first
    files = {p.name for p in ckpt.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "base_model.json"} <= files
    assert not any(f.startswith("model") and f.endswith(".safetensors") for f in files)  # no copy of the base
    resumed = Trainer(cfg, tiny_model_dir)
    load_checkpoint(resumed, ckpt)
    resumed.train_step(batches[2])
    got = resumed.publish_tensors("float32")
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_a_full_checkpoint_does_not_resume_a_lora_run(tiny_model_dir, tmp_path):
    full = Trainer(TrainerConfig(seed=7), tiny_model_dir)
    ckpt = save_checkpoint(full, tmp_path / "ckpt")
    del full
    with pytest.raises(ConfigError, match="no LoRA adapter"):
        load_checkpoint(Trainer(TrainerConfig(**CFG), tiny_model_dir), ckpt)


def test_lora_config_refusals():
    with pytest.raises(ValueError, match="cuda_ipc"):
        TrainerConfig(lora=LoraConfig(), publish_mode="cuda_ipc")
    with pytest.raises(ValueError, match="publish_layout auto or gather"):  # an adapter is rank 0's to publish
        TrainerConfig(lora=LoraConfig(), strategy="fsdp", publish_mode="zmq", publish_layout="sharded")
    fsdp = TrainerConfig(lora=LoraConfig(), strategy="fsdp", publish_mode="zmq")  # tests/integration/..._fsdp_lora.py
    assert fsdp.lora is not None and not fsdp.sharded_publish
    with pytest.raises(ValueError, match="module names"):
        TrainerConfig(lora={"target_modules": ["q_proj", "os.system"]})


def test_a_bf16_lora_trainer_reads_the_base_in_bf16_never_in_fp32(tiny_model_dir, monkeypatch):
    """The frozen base is read in its own dtype (no fp32 copy of the whole model, not even at load: that peak is
    twice the base's bytes on the trainer's device), equal to the fp32 read cast down, the rotary buffers fp32."""
    from areal_mq.engines import models

    read, real = [], models.load_causal_lm

    def spy(path, dtype="float32", device="cpu"):
        read.append(dtype)
        return real(path, dtype, device)

    monkeypatch.setattr(models, "load_causal_lm", spy)
    trainer = Trainer(TrainerConfig(**CFG, precision="bf16"), tiny_model_dir)
    assert read == ["bfloat16"]
    base = {n.replace("base_model.model.", "").replace(".base_layer", ""): p
            for n, p in trainer.unwrapped.named_parameters() if not p.requires_grad}
    assert base and all(p.dtype == torch.bfloat16 for p in base.values())
    fp32 = real(tiny_model_dir, "float32")
    want = dict(fp32.named_parameters())
    assert all(torch.equal(p, want[n].to(torch.bfloat16)) for n, p in base.items())
    buffers = dict(trainer.unwrapped.named_buffers())
    assert buffers and all(b.dtype == torch.float32 for n, b in buffers.items() if "inv_freq" in n)
    assert all(torch.equal(b, dict(fp32.named_buffers())[n.replace("base_model.model.", "")])
               for n, b in buffers.items() if "inv_freq" in n)
