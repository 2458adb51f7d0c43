"""The Trainer on the real tiny Llama: learning direction, metrics, checkpoints and exact resume."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from areal_mq.algorithms.checkpoint import load_checkpoint, save_checkpoint
from areal_mq.algorithms.config import TrainerConfig
from areal_mq.algorithms.trainer import Trainer
from areal_mq.messages import Sample, SeqSample
from tests.unit.algorithms.batches import behaviour_near_model, make_samples

RESUME_CFG = dict(lr=1e-3, warmup_steps=2, lr_schedule="cosine", decay_steps=10, ppo_n_minibatches=2,
                  max_tokens_per_mb=64, seed=7, weight_decay=0.01)


# Two paths are compared on the device the test runs on (auto: CUDA with bf16 autocast on a GPU machine).
# fp32 on the CPU: a resume is bit-exact and the proximal shortcut agrees to rtol 1e-4. bf16: every matmul
# rounds to 8 mantissa bits (relative step 2^-8 = 3.9e-3) and CUDA kernels need not be bitwise deterministic,
# so both comparisons use rtol 2e-2, atol 1e-3 there.
TOL = {"fp32": dict(rtol=1e-4, atol=1e-6), "bf16": dict(rtol=2e-2, atol=1e-3)}


def _assert_same_params(trainer: Trainer, got: dict, expected: dict, what: str) -> None:
    exact = trainer.precision == "fp32" and trainer.device.type == "cpu"
    for name, value in expected.items():
        if exact:
            assert torch.equal(got[name], value), f"{name} differs {what}"
        else:
            torch.testing.assert_close(got[name], value, **TOL[trainer.precision], msg=f"{name} differs {what}")


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters()}


def test_rewarded_sequence_becomes_more_likely(tiny_model_dir):
    good = SeqSample(prompt_ids=[5, 6, 7], output_ids=[100, 200, 300], logprobs=[0, 0, 0], versions=[0] * 3,
                     reward=1.0)
    bad = SeqSample(prompt_ids=[5, 6, 7], output_ids=[400, 500, 600], logprobs=[0, 0, 0], versions=[0] * 3,
                    reward=0.0)
    batch = behaviour_near_model([Sample(sample_id="g", seqs=[good, bad])], tiny_model_dir, noise=0.0)
    trainer = Trainer(TrainerConfig(lr=3e-3, grad_clip=None), tiny_model_dir)
    before = [s.logprobs.sum() for s in batch[0].seqs]
    metrics = [trainer.train_step(batch) for _ in range(3)]
    from areal_mq.algorithms.packing import build_microbatch, samples_to_seqs
    from areal_mq.algorithms.trainer import token_logprobs

    seqs = samples_to_seqs(batch, trainer.cfg)
    with torch.no_grad():
        trained = [token_logprobs(trainer.model, build_microbatch(seqs, [i], True, device=trainer.device), 1.0)[0].sum().item()
                   for i in range(2)]
    assert trained[0] > before[0] + 0.01 and trained[1] < before[1] - 0.01
    assert trainer.version == 3 and [m["version"] for m in metrics] == [1, 2, 3]
    # on-policy first step: proximal == behaviour == current, so the ratio and weight are exactly 1
    # (behaviour from an fp32 CPU model: under bf16 the weights are 1 only to bf16's precision)
    assert metrics[0]["behav_weight_mean"] == pytest.approx(1.0, abs=1e-5 if trainer.precision == "fp32" else 5e-2)
    assert metrics[0]["clip_frac"] == 0.0 or trainer.precision == "bf16"


def test_metrics_report_staleness_weights_and_throughput(tiny_model_dir):
    trainer = Trainer(TrainerConfig(max_tokens_per_mb=64), tiny_model_dir)
    trainer.version = 5
    batch = make_samples(4, version=5, staleness=3)
    for seq in batch[0].seqs:  # behaviour far less likely than the model: weights e^(p - b) blow past the cap
        seq.logprobs = seq.logprobs - 40.0
    m = trainer.train_step(batch)
    for key in ("loss", "clip_frac", "entropy", "behav_weight_mean", "behav_weight_max", "behav_capped_frac",
                "grad_norm", "staleness_mean", "staleness_max", "tokens_per_s", "prox_recompute_s", "lr"):
        assert np.isfinite(m[key]), key
    assert 0 < m["staleness_mean"] <= 3 and m["staleness_max"] <= 3
    hist = m["staleness_hist"]  # per generated token: how many versions behind the trained policy
    assert len(hist) == m["staleness_max"] + 1 and sum(hist) == m["n_gen_tokens"]
    assert sum(k * c for k, c in enumerate(hist)) / sum(hist) == pytest.approx(m["staleness_mean"])
    assert 0 < m["behav_capped_frac"] < 1 and m["behav_weight_max"] > trainer.cfg.behav_weight_cap
    assert m["n_microbatches"] > 1 and m["version"] == 6
    assert m["masked_frac"] == 0.0  # truncate mode: nothing masked


def test_masked_frac_reports_the_tokens_icepop_masked(tiny_model_dir):
    """offpolicy_mask_k: the tokens of the group whose behaviour is far off (w >> k) are masked, the rest
    (behaviour = noise around -3, so some weights also leave [1/k, k]) in part; the fraction is per token."""
    trainer = Trainer(TrainerConfig(max_tokens_per_mb=64, offpolicy_mask_k=2.0), tiny_model_dir)
    batch = make_samples(4, version=0, staleness=0)
    for seq in batch[0].seqs:
        seq.logprobs = seq.logprobs - 40.0
    m = trainer.train_step(batch)
    far = sum(len(s.output_ids) for s in batch[0].seqs) / m["n_gen_tokens"]
    assert far <= m["masked_frac"] <= 1.0 and np.isfinite(m["loss"])


def test_empty_batch_is_refused(tiny_model_dir):
    trainer = Trainer(TrainerConfig(), tiny_model_dir)
    empty = SeqSample(prompt_ids=[1], output_ids=[], logprobs=[], versions=[], reward=1.0)
    with pytest.raises(ValueError, match="no generated tokens"):
        trainer.train_step([Sample(sample_id="e", seqs=[empty])])
    assert trainer.version == 0


def test_resume_reaches_the_same_parameters_as_an_uninterrupted_run(tiny_model_dir, tmp_path):
    cfg = TrainerConfig(**RESUME_CFG)
    batches = [make_samples(10 + i, version=i, staleness=1) for i in range(4)]

    straight = Trainer(cfg, tiny_model_dir)
    for b in batches:
        straight.train_step(b)
    expected = _params(straight)
    del straight

    first = Trainer(cfg, tiny_model_dir)
    for b in batches[:2]:
        first.train_step(b)
    at_two = _params(first)
    ckpt = save_checkpoint(first, tmp_path / "ckpt", {"dataset_pos": 17})
    del first
    torch.manual_seed(999)  # disturb the RNG: resume must restore it

    resumed = Trainer(cfg, tiny_model_dir)
    assert load_checkpoint(resumed, ckpt) == {"dataset_pos": 17}
    assert resumed.version == 2 and resumed.optimizer_steps == 4
    assert resumed.resumed_ids == [s.sample_id for b in batches[:2] for s in b]  # the interval it closed
    assert resumed.consumed_ids == [] and resumed.checkpoint_base == 2
    assert resumed.consumed_total == sum(len(b) for b in batches[:2])
    for b in batches[2:]:
        resumed.train_step(b)
    _assert_same_params(resumed, _params(resumed), expected, "after resume")
    # the checkpoint is a plain Hugging Face model holding the step-2 weights
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(ckpt), local_files_only=True)
    for name, p in plain.named_parameters():
        assert torch.equal(p, at_two[name].cpu()), name
    assert (ckpt / "tokenizer.json").is_file()
    rng = torch.load(ckpt / "rng_rank0.pt", map_location="cpu", weights_only=True)
    assert ("cuda" in rng) == (resumed.device.type == "cuda")  # the device's RNG too when it has one


def test_checkpoints_are_pruned_and_latest_found(tiny_model_dir, tmp_path):
    from areal_mq.algorithms.checkpoint import latest_checkpoint, list_checkpoints

    trainer = Trainer(TrainerConfig(keep_checkpoints=2), tiny_model_dir)
    batch = make_samples(5, n_groups=1)
    for _ in range(3):
        trainer.train_step(batch)
        save_checkpoint(trainer, tmp_path)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step00000002", "step00000003"]
    assert latest_checkpoint(tmp_path).name == "step00000003"
    assert not list(tmp_path.glob(".*tmp"))
    with pytest.raises(TypeError):
        save_checkpoint(trainer, tmp_path, {"bad": object()})


@pytest.mark.parametrize("mode", ["disk", "zmq"])
def test_published_weights_load_into_a_fresh_model(tiny_model_dir, tmp_path, mode):
    from areal_mq.engines.models import load_causal_lm
    from areal_mq.weights import WeightPublisher, load_published

    cfg = TrainerConfig(lr=1e-3, publish_mode=mode, publish_dtype="float32")
    trainer = Trainer(cfg, tiny_model_dir)
    trainer.train_step(make_samples(6, n_groups=1))
    tensors = trainer.publish_tensors()
    assert "lm_head.weight" not in tensors  # tied to the embedding: sent once
    publisher = WeightPublisher(cfg, tmp_path)
    try:
        ready = publisher.publish(trainer.version, tensors, trainer.unwrapped.config.to_json_string())
        fresh = load_causal_lm(tiny_model_dir, "float32")
        missing, unexpected = fresh.load_state_dict(load_published(ready, timeout_s=30), strict=False)
    finally:
        publisher.close()
    assert missing == ["lm_head.weight"] and unexpected == []
    trained = dict(trainer.unwrapped.named_parameters())
    for name, p in fresh.named_parameters():
        assert torch.equal(p, trained[name].detach().cpu()), name
    if mode == "disk":
        from transformers import AutoModelForCausalLM

        assert AutoModelForCausalLM.from_pretrained(ready.path, local_files_only=True) is not None


@pytest.mark.parametrize("options", [
    {"precision": "bf16"}, {"kl_coef": 0.1, "kl_estimator": "k3"}, {"gradient_checkpointing": True},
    {"packing": "padded", "padded_mb_size": 3}, {"behav_cap_mode": "mask", "ppo_n_minibatches": 3},
    {"behav_correction": False, "temperature": 0.7},
], ids=lambda o: ",".join(o))
def test_options_train_on_policy_without_clipping(tiny_model_dir, options):
    """First step on on-policy data: behaviour == proximal == current (same forward), so nothing is
    clipped or capped and the KL to the (identical) reference is zero, whatever the option."""
    cfg = TrainerConfig(lr=1e-3, max_tokens_per_mb=64, **options)
    batch = behaviour_near_model(make_samples(8, n_groups=2), tiny_model_dir, cfg.temperature, noise=0.0)
    trainer = Trainer(cfg, tiny_model_dir)
    before = _params(trainer)
    m = trainer.train_step(batch)
    assert np.isfinite(m["loss"]) and m["grad_norm"] > 0
    if trainer.precision == "fp32" and cfg.ppo_n_minibatches == 1:
        assert m["clip_frac"] == 0.0 and m["behav_capped_frac"] == 0.0
        assert m["behav_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    if cfg.kl_coef:
        assert m["kl"] == pytest.approx(0.0, abs=1e-6)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.unwrapped.named_parameters())


def test_prox_from_the_training_forward_equals_a_separate_recompute(tiny_model_dir):
    """With one mini-batch the proximal logprobs are taken from the training forward (detached) instead of a
    separate no-grad pass: off-policy data (stale versions, behaviour far from the model, weights capped)
    must give the same loss, weights and parameters either way, over several steps."""
    batch = make_samples(8, n_groups=2, version=3, staleness=2)
    for k, seq in enumerate(batch[0].seqs):  # off-policy: behaviour weights far from 1, some past the cap
        seq.logprobs = seq.logprobs - (40.0 if k == 0 else 0.5)
    runs, precision = {}, "fp32"
    for always in (False, True):
        trainer = Trainer(TrainerConfig(lr=1e-3, max_tokens_per_mb=64, seed=3, always_recompute_prox=always),
                          tiny_model_dir)
        trainer.version = 3
        runs[always] = ([trainer.train_step(batch) for _ in range(3)], _params(trainer))
        precision = trainer.precision
    (fast, fast_params), (slow, slow_params) = runs[False], runs[True]
    assert [m["prox_from_forward"] for m in fast] == [1, 1, 1] and [m["prox_from_forward"] for m in slow] == [0] * 3
    for a, b in zip(fast, slow):
        for key in ("loss", "behav_weight_mean", "behav_capped_frac", "clip_frac", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=TOL[precision]["rtol"], abs=TOL[precision]["atol"]), key
    assert fast[0]["behav_capped_frac"] > 0  # the comparison covered capped weights
    for name, p in fast_params.items():
        torch.testing.assert_close(p, slow_params[name], **TOL[precision])


def test_several_minibatches_still_recompute_the_proximal_policy(tiny_model_dir):
    trainer = Trainer(TrainerConfig(lr=1e-3, max_tokens_per_mb=64, ppo_n_minibatches=2), tiny_model_dir)
    m = trainer.train_step(make_samples(8, n_groups=2))
    assert m["prox_from_forward"] == 0 and m["prox_recompute_s"] > 0


def test_the_trained_ids_live_apart_from_the_checkpoints_and_a_resume_supersedes_the_rolled_back_ones(tmp_path):
    """Issue 52 item 6: a checkpoint's JSON holds one interval's ids; the run's whole history is the chain of
    checkpoints/trained_ids.jsonl lines, where a trainer resumed from an older checkpoint replaces what it redid."""
    import json

    from areal_mq.algorithms.checkpoint import trained_ids

    lines = [{"version": 2, "base": 0, "ids": ["a", "b"]}, {"version": 4, "base": 2, "ids": ["c", "d"]},
             {"version": 6, "base": 4, "ids": ["e"]},
             {"version": 6, "base": 4, "ids": ["e2"]},  # resumed from v4 (v6's checkpoint lost): redone
             {"version": 8, "base": 6, "ids": ["f"]}]
    (tmp_path / "trained_ids.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"version": 9, "ba')
    assert trained_ids(tmp_path, 8) == ["a", "b", "c", "d", "e2", "f"]
    assert trained_ids(tmp_path, 4) == ["a", "b", "c", "d"]
    assert trained_ids(tmp_path / "absent", 4) == []
