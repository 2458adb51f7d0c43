"""The trainer puts every tensor it makes on its device, checked on a CPU-only machine.

The H100 run failed 14 trainer tests with "index is on cpu, different from other tensors on cuda:0": the
micro-batches were built on the CPU and fed to a model on the GPU. Here the model and every parameter sit on
`meta` and a real step (tiny Llama: packing, forward, loss, backward, clipping, AdamW, the metric sums) runs
under DeviceGuard, which fails on any op mixing devices (a plain meta run would not: meta absorbs a CPU index).
The step's one read-back to the host (`Trainer._reduce`'s `.cpu()`) and anything that needs values are left
out: meta tensors hold none. The `gpu` tests run the same on CUDA (skipped without it, tests/conftest.py).
Run: pytest tests/unit/algorithms/test_trainer_device.py -q
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from areal_mq.algorithms.config import TrainerConfig
from areal_mq.algorithms.packing import build_microbatch, samples_to_seqs
from areal_mq.algorithms.trainer import (DeviceSpan, Trainer, apply_tf32_policy, compute_precision, rollout_dtype,
                                         token_logprobs)
from areal_mq.config import load_config
from areal_mq.errors import ConfigError
from areal_mq.testing.device_guard import DeviceGuard, DeviceMismatch
from tests.unit.algorithms.batches import behaviour_near_model, make_samples

CONFIGS = Path(__file__).resolve().parents[3] / "configs"

MB_TENSORS = ("input_ids", "position_ids", "attention_mask", "keep_cols", "logit_index", "targets", "behav_logp",
              "advantages", "versions", "prox_logp", "ref_logp")


def _devices_of(minis) -> set[str]:
    return {str(getattr(mb, f).device) for mini in minis for mb in mini for f in MB_TENSORS
            if getattr(mb, f) is not None}


# The full step runs with "shared" packing (the default), whose explicit 4D mask leaves transformers nothing
# to read. With "dynamic" and "padded" transformers reads VALUES to build its mask (the packed-sequence
# starts from position_ids, `.all()` of a padding mask): meta cannot answer those, so for them the test
# below checks what the trainer builds, under the guard, and stops before the forward.
@pytest.mark.parametrize("options", [
    {"packing": "shared"},
    {"packing": "shared", "ppo_n_minibatches": 2, "kl_coef": 0.1},  # separate recompute + reference model
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_a_trainer_step_with_the_model_on_meta_mixes_no_devices(tiny_model_dir, options):
    trainer = Trainer(TrainerConfig(max_tokens_per_mb=64, **options), tiny_model_dir, device="meta")
    assert trainer.device == torch.device("meta")
    assert {p.device.type for p in trainer.model.parameters()} == {"meta"}
    with DeviceGuard() as guard:
        _, minis, gen_tokens, _ = trainer.prepare(make_samples(3, n_groups=2))
        trainer.recompute(minis)
        sums, counts, weight_max, norms = trainer.run_minibatches(minis, gen_tokens)
        reduced = trainer._all_reduce(sums, counts, weight_max, norms)
    assert guard.ops > 1000 and "meta" in guard.seen_devices
    assert _devices_of(minis) == {"meta"}
    if options["packing"] == "shared":
        assert all(mb.attention_mask is not None for mini in minis for mb in mini)  # the tree mask, on meta
    assert counts[0] > 0  # host counts: generated tokens trained
    assert {t.device.type for t in (sums, weight_max, reduced, *norms)} == {"meta"}
    assert trainer.optimizer_steps == len(minis)
    states = [v for st in trainer.optimizer.state.values() for k, v in st.items() if k != "step"]
    assert states and {t.device.type for t in states} == {"meta"}  # AdamW moments beside their parameters


@pytest.mark.parametrize("packing", ["dynamic", "padded"])
def test_every_packing_builds_its_micro_batches_on_the_device(tiny_model_dir, packing):
    trainer = Trainer(TrainerConfig(max_tokens_per_mb=64, packing=packing), tiny_model_dir, device="meta")
    with DeviceGuard() as guard:
        _, minis, _, _ = trainer.prepare(make_samples(3, n_groups=2))
    assert guard.ops > 0 and _devices_of(minis) == {"meta"}
    assert (minis[0][0].attention_mask is None) == (packing == "dynamic")


def test_an_idle_rank_joins_with_a_dummy_input_on_the_device(tiny_model_dir):
    """A data-parallel rank with no sequence still runs a forward/backward on a dummy token (DDP's all-reduce
    needs it): the dummy must sit where the embedding does."""
    trainer = Trainer(TrainerConfig(), tiny_model_dir, device="meta")
    embed = trainer.unwrapped.get_input_embeddings()
    with DeviceGuard():
        out = embed(trainer._dummy_ids())
    assert out.device.type == "meta"


def test_the_guard_catches_a_batch_built_on_the_cpu_for_a_model_elsewhere(tiny_model_dir):
    """What the trainer did before it had a device (the H100 failure), caught on the CPU."""
    trainer = Trainer(TrainerConfig(), tiny_model_dir, device="meta")
    seqs = samples_to_seqs(make_samples(3, n_groups=1), trainer.cfg)
    cpu_batch = build_microbatch(seqs, [0, 1], packed=True, share_prompts=True)  # no device: the CPU
    weight = trainer.unwrapped.get_input_embeddings().weight
    assert torch.nn.functional.embedding(cpu_batch.input_ids, weight).device.type == "meta"  # meta absorbs it
    with DeviceGuard(), pytest.raises(DeviceMismatch, match="cpu.*meta|meta.*cpu"):
        token_logprobs(trainer.model, cpu_batch, 1.0)


def test_precision_auto_follows_the_engines_dtype_on_every_device():
    # the behaviour weights divide the trainer's probabilities by the engine's: auto computes as the engine does
    # (a bf16 trainer against an fp32 engine drove the weight at staleness 0 to ~100 on an H200, RESULTS.md)
    assert compute_precision(TrainerConfig(), "float32") == "fp32"
    assert compute_precision(TrainerConfig(), "bfloat16") == "bf16"
    assert compute_precision(TrainerConfig(precision="fp32"), "bfloat16") == "fp32"  # explicit wins
    assert compute_precision(TrainerConfig(precision="bf16"), "float32") == "bf16"
    cfg = load_config(CONFIGS / "quickstart.yaml", [])
    assert rollout_dtype(cfg) == "float32"  # model.dtype, rollout.engine.dtype auto
    assert rollout_dtype(load_config(CONFIGS / "quickstart.yaml", ["rollout.engine.dtype=bfloat16"])) == "bfloat16"
    assert rollout_dtype(load_config(CONFIGS / "quickstart-gpu.yaml", [])) == "bfloat16"


def test_tf32_policy_is_set_explicitly_on_cuda_only():
    flags = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        for allow in (True, False):
            apply_tf32_policy(torch.device("cuda", 0), allow)  # sets flags; needs no GPU
            assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (allow, allow)
        apply_tf32_policy(torch.device("cpu"), True)
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = flags


def test_trainer_device_setting_is_validated_and_overrides_the_model_device():
    from pydantic import ValidationError

    from areal_mq.config import RunConfig
    from areal_mq.devices import role_device

    with pytest.raises(ValidationError, match="pattern"):
        TrainerConfig(device="gpu")
    cfg = RunConfig.model_validate({"model": {"device": "cpu"}, "trainer": {"device": "cuda:1"}})
    assert role_device(cfg, "trainer") == "cuda:1" and role_device(cfg, "rollout") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_asking_for_cuda_without_one_is_a_config_error(tiny_model_dir):
    with pytest.raises(ConfigError, match="no CUDA device"):
        Trainer(TrainerConfig(device="cuda"), tiny_model_dir)


def test_a_cpu_trainer_runs_on_the_cpu_in_fp32(tiny_model_dir):
    trainer = Trainer(TrainerConfig(device="cpu"), tiny_model_dir)
    assert trainer.device == torch.device("cpu") == trainer.accelerator.device and trainer.precision == "fp32"
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}


def test_a_device_span_on_the_cpu_is_the_host_clock():
    import time

    with DeviceSpan("cpu") as span:
        time.sleep(0.02)
    assert 0.02 <= span.seconds() < 5


# ------------------------------------------------------------------ on a GPU (skipped without CUDA)
@pytest.mark.gpu
def test_a_device_span_on_cuda_times_the_kernels_not_their_launch():
    """prox_recompute_s is a DeviceSpan: a kernel that spins on the GPU takes far longer there than its launch."""
    import time

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with DeviceSpan("cuda") as span:
        torch.cuda._sleep(200_000_000)  # ~0.1 s of spinning at ~2 GHz
    launched = time.perf_counter() - t0
    device_s = span.seconds()
    assert device_s > 0.02 and device_s > 5 * launched, (device_s, launched)


@pytest.mark.gpu
def test_a_train_step_on_cuda_keeps_fp32_master_weights_under_bf16_autocast(tiny_model_dir):
    cfg = TrainerConfig(lr=1e-3, max_tokens_per_mb=64, device="cuda")
    batch = behaviour_near_model(make_samples(8, n_groups=2), tiny_model_dir, noise=0.0)
    assert Trainer(cfg, tiny_model_dir).precision == "fp32"  # auto follows the engine's dtype, not the device
    trainer = Trainer(cfg, tiny_model_dir, engine_dtype="bfloat16")
    assert trainer.device.type == "cuda" and trainer.precision == "bf16"
    assert not torch.backends.cuda.matmul.allow_tf32  # the stated policy: off unless trainer.tf32
    before = {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters()}
    with DeviceGuard():
        m = trainer.train_step(batch)
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0
    # bf16 tolerance: on-policy, proximal == current up to the bf16 forward, so weights stay near 1
    assert m["behav_weight_mean"] == pytest.approx(1.0, abs=5e-2)
    params = dict(trainer.unwrapped.named_parameters())
    assert {p.device.type for p in params.values()} == {"cuda"} and {p.dtype for p in params.values()} == {
        torch.float32}
    assert any(not torch.equal(p, before[n]) for n, p in params.items())


@pytest.mark.gpu
def test_a_cuda_checkpoint_restores_the_cuda_rng_and_loads_without_a_map(tiny_model_dir, tmp_path):
    from areal_mq.algorithms.checkpoint import load_checkpoint, save_checkpoint

    trainer = Trainer(TrainerConfig(lr=1e-3, max_tokens_per_mb=64, device="cuda"), tiny_model_dir)
    trainer.train_step(make_samples(4, n_groups=1))
    ckpt = save_checkpoint(trainer, tmp_path)
    expected = torch.rand(4, device=trainer.device)  # what the next draw is after the checkpoint
    torch.rand(100, device=trainer.device)
    load_checkpoint(trainer, ckpt)
    assert torch.equal(torch.rand(4, device=trainer.device), expected)
    steps = [st["step"] for st in trainer.optimizer.state.values()]
    assert steps and all(s.device.type == "cpu" for s in steps)  # AdamW's step stays on the host
