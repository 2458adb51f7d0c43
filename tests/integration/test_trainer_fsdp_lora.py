"""LoRA under FSDP2 (trainer.lora with trainer.strategy: fsdp) on 2 CPU ranks over gloo matches LoRA under ddp in
one process, keeps its frozen base bf16 and bit-identical, and resumes from its adapter-only checkpoint.

One launch of THIS file under torch.distributed.run (2 ranks, CUDA hidden, one thread per rank) per family, tiny Llama
(tied: embeddings and head in the FSDP root) and tiny Qwen2 (untied: embeddings and norm + head FSDP units of their
own, algorithms/fsdp.py vocab_units, found in the PEFT model's base), with
a KL reference (kl_coef > 0: the reference is the base with the adapter off, in the same sharded model):
  fp32: 3 steps (a checkpoint after step 2, the published adapter after step 3), then a fresh 2-rank trainer
        resumed from that checkpoint runs step 3;
  fp32 with trainer.gradient_checkpointing: the same 3 steps, the same losses and adapter;
  bf16: 3 steps; the base's dtypes and shards before and after, the adapter's and AdamW's dtypes.
The test process runs the same steps with strategy ddp in one process. Targets: fp32 losses within 1e-4 relative, the
adapter within 1e-4 (1 % of one step at lr 1e-2: AdamW's normalised step magnifies the reduce-scatter's summation
order; measured 2.5e-5), the published names identical, the resumed step 3 the uninterrupted one's; bf16
(FSDP2's param_dtype bf16 against ddp's autocast: the same casts, other kernels' order) losses within 10 %; the
frozen base bf16 on every rank and bit-identical to ddp's before and after training, adapter and AdamW state fp32;
the checkpoint holds PEFT's adapter files, the base's identity and no base weights.
Run: pytest tests/integration/test_trainer_fsdp_lora.py   (about 55 s for both families on 2 shared cores, marked slow)
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CFG = dict(lr=1e-2, max_tokens_per_mb=64, seed=3, grad_clip=1.0, ppo_n_minibatches=2, checkpoint_every=0,
           kl_coef=0.1)
LORA = dict(rank=4, alpha=8.0)


def _batch(i: int):
    from tests.unit.algorithms.batches import make_samples

    return make_samples(30 + i, n_groups=3, group_size=3, version=i, staleness=1)


def _trainer(model_dir: Path, strategy: str, precision: str, **more):
    from areal_mq.algorithms.config import LoraConfig, TrainerConfig
    from areal_mq.algorithms.trainer import Trainer

    cfg = TrainerConfig(strategy=strategy, precision=precision, lora=LoraConfig(**LORA), **CFG, **more)
    return Trainer(cfg, model_dir, device="cpu")


def _base(trainer) -> dict:
    """The frozen base, whole (gathered under fsdp: every rank calls this), in its own dtype."""
    state = trainer.strategy.full_state_dict(trainer.unwrapped, None, keep=True)
    return {k: v for k, v in state.items() if "lora_" not in k}


def _local_base(trainer) -> dict:
    """This rank's own part of every frozen parameter, copied."""
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
            for n, p in trainer.unwrapped.named_parameters() if not p.requires_grad}


def run_rank(out: Path) -> None:
    import torch

    from areal_mq.algorithms.checkpoint import load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    model_dir = out / "model"
    trainer = _trainer(model_dir, "fsdp", "fp32")
    losses = []
    for i in range(3):
        losses.append(trainer.train_step(_batch(i))["loss"])
        if i == 1:
            save_checkpoint(trainer, out / "ckpt")
    result = {"fp32": losses, "world": trainer.world_size}
    adapter = trainer.publish_tensors("float32")  # collective: rank 0 keeps it
    resumed = _trainer(model_dir, "fsdp", "fp32")
    load_checkpoint(resumed, out / "ckpt" / f"step{2:08d}")
    result["resumed"] = resumed.train_step(_batch(2))["loss"]
    result["resumed_version"] = resumed.version
    resumed_adapter = resumed.publish_tensors("float32")
    del trainer, resumed

    recomputed = _trainer(model_dir, "fsdp", "fp32", gradient_checkpointing=True)  # activations recomputed
    result["checkpointed"] = [recomputed.train_step(_batch(i))["loss"] for i in range(3)]
    checkpointed_adapter = recomputed.publish_tensors("float32")
    del recomputed

    trainer = _trainer(model_dir, "fsdp", "bf16")
    before = _local_base(trainer)
    result["bf16"] = [trainer.train_step(_batch(i))["loss"] for i in range(3)]
    after = _local_base(trainer)
    params = dict(trainer.unwrapped.named_parameters())
    result["base_dtypes"] = sorted({str(params[n].dtype) for n in before})
    result["base_unchanged"] = all(torch.equal(before[n], after[n]) for n in before)
    result["adapter_dtypes"] = sorted({str(p.dtype) for p in params.values() if p.requires_grad})
    result["adam_dtypes"] = sorted({str(v.dtype) for st in trainer.optimizer.state.values() for k, v in st.items()
                                    if k != "step"})
    result["sharded"] = all(hasattr(p, "to_local") for p in params.values())
    base = _base(trainer)
    bf16_adapter = trainer.publish_tensors("float32")
    published = trainer.publish_tensors()  # in trainer.publish_dtype; a collective every rank joins
    result["published_dtype"] = sorted({str(t.dtype) for t in published.values()})
    result["published_off_rank0"] = len(published) if not trainer.is_main else 0
    rank = int(os.environ.get("RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if rank == 0:
        (out / "result-two.json").write_text(json.dumps(result))  # what the launcher reads back
        torch.save({"fp32": adapter, "resumed": resumed_adapter, "bf16": bf16_adapter, "base": base,
                    "checkpointed": checkpointed_adapter},
                   out / "tensors.pt")


@pytest.mark.slow
@pytest.mark.parametrize("family", ["tiny-llama", "tiny-qwen2"])  # tied: vocabulary in the root; untied: own units
def test_lora_under_fsdp_on_two_ranks_matches_ddp_and_resumes(tmp_path, family):
    import torch
    from accelerate.state import AcceleratorState

    from areal_mq.engines.shapes import build_random_model
    from tests.integration.procs import launch_ranks

    build_random_model(tmp_path / "model", family, seed=5)
    torch.set_num_threads(1)
    want = {}
    for precision in ("fp32", "bf16"):  # LoRA under ddp, one process
        trainer = _trainer(tmp_path / "model", "ddp", precision)
        base = _base(trainer)
        losses = [trainer.train_step(_batch(i))["loss"] for i in range(3)]
        want[precision] = (losses, trainer.publish_tensors("float32"), base)
        del trainer
        AcceleratorState._reset_state(reset_partial_state=True)  # a bf16 Accelerator would make the next fail

    launch_ranks(__file__, "two", 2, tmp_path)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    got = torch.load(tmp_path / "tensors.pt", map_location="cpu")
    losses, adapter, _ = want["fp32"]
    two = ranks[0]
    assert two["world"] == 2
    assert two["fp32"] == pytest.approx(losses, rel=1e-4, abs=1e-9)
    assert set(got["fp32"]) == set(adapter) and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in adapter)
    for name, tensor in adapter.items():
        torch.testing.assert_close(got["fp32"][name], tensor, rtol=1e-4, atol=1e-4, msg=name)  # measured 2.5e-5
    # resumed from the 2-rank checkpoint, step 3 continues with the same loss and adapter
    assert two["resumed_version"] == 3
    assert two["resumed"] == pytest.approx(losses[2], rel=1e-4, abs=1e-9)
    for name, tensor in adapter.items():
        torch.testing.assert_close(got["resumed"][name], tensor, rtol=1e-4, atol=1e-4, msg=f"resumed {name}")
    # gradient checkpointing (activations recomputed in backward) changes nothing: the adapter still gets its
    # gradients through the frozen, recomputed layers
    assert two["checkpointed"] == pytest.approx(two["fp32"], rel=1e-6, abs=1e-9)
    for name, tensor in got["fp32"].items():
        torch.testing.assert_close(got["checkpointed"][name], tensor, rtol=1e-5, atol=1e-6, msg=f"checkpointed {name}")
    assert any(got["checkpointed"][k].abs().max() > 0 for k in got["checkpointed"] if ".lora_B." in k)
    ckpt = {p.name for p in (tmp_path / "ckpt" / f"step{2:08d}").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "base_model.json", "sharded"} <= ckpt
    assert not any(f.startswith("model") and f.endswith(".safetensors") for f in ckpt)  # no copy of the base
    # bf16: the frozen base in bf16, never changed, the adapter and AdamW in fp32
    losses, _, base = want["bf16"]
    assert two["bf16"] == pytest.approx(losses, rel=0.1, abs=1e-6)  # measured: within 4.2 %
    for r in ranks:
        assert r["sharded"] and r["base_unchanged"], r
        assert r["base_dtypes"] == ["torch.bfloat16"] and r["adapter_dtypes"] == ["torch.float32"], r
        assert r["adam_dtypes"] == ["torch.float32"], r
    assert two["published_dtype"] == ["torch.bfloat16"]  # trainer.publish_dtype
    assert ranks[1]["published_off_rank0"] == 0  # rank 0 keeps the gathered adapter, the others nothing
    assert set(got["base"]) == set(base)
    for name, tensor in base.items():
        assert torch.equal(got["base"][name], tensor), name


if __name__ == "__main__":
    try:
        run_rank(Path(sys.argv[2]))
    finally:
        from tests.integration.procs import end_process_group

        end_process_group()
