"""`areal-mq checkpoint export` of a 2-rank fsdp checkpoint: every tensor is assembled from both ranks' chunks of the
torch.distributed.checkpoint directory, in one process without a process group, into bf16 shards that
transformers loads with the trainer's weights (cast to bf16) and their greedy tokens.

One launch of THIS file under torch.distributed.run (2 ranks, CUDA hidden, one thread each): per family (tiny Llama
with tied embeddings, tiny Qwen2 with q/k/v biases), one fsdp training step, a sharded checkpoint, and the whole
model gathered to rank 0 for the comparison.
Run: pytest tests/integration/test_export_fsdp.py   (about 30 s on 2 cores, marked slow)
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAMILIES = ("tiny-llama", "tiny-qwen2")


def run_rank(out: Path) -> None:
    import torch

    from areal_mq.algorithms.checkpoint import save_checkpoint
    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.trainer import Trainer
    from tests.unit.algorithms.batches import make_samples

    torch.set_num_threads(1)
    for fam in FAMILIES:
        trainer = Trainer(TrainerConfig(strategy="fsdp", lr=1e-2, max_tokens_per_mb=64, seed=3),
                          out / "models" / fam, device="cpu")
        trainer.train_step(make_samples(4, version=0, staleness=0))
        save_checkpoint(trainer, out / "ckpt" / fam)
        params = trainer.strategy.full_state_dict(trainer.unwrapped, "float32", keep=trainer.is_main)
        if trainer.is_main:
            torch.save(params, out / f"params-{fam}.pt")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_two_rank_fsdp_checkpoint_exports_bf16_shards_with_the_trainers_greedy_tokens(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from areal_mq.algorithms.export import export_model
    from areal_mq.engines.shapes import build_random_model

    for fam in FAMILIES:
        build_random_model(tmp_path / "models" / fam, fam, seed=5)
    from tests.integration.procs import run_ranks

    run_ranks(__file__, str(tmp_path), nproc=2)

    prompt = torch.tensor([[1, 306, 4658, 278, 6593, 310, 2834, 338]])
    for fam in FAMILIES:
        ckpt = tmp_path / "ckpt" / fam / f"step{1:08d}"
        assert (ckpt / "sharded" / ".metadata").is_file() and not list(ckpt.glob("*.safetensors"))
        done = export_model(ckpt, tmp_path / "export" / fam, dtype="bfloat16", max_shard_size="1MB")
        assert done.source == "dcp" and len(done.files) >= 2
        trained = torch.load(tmp_path / f"params-{fam}.pt", map_location="cpu")
        exported = AutoModelForCausalLM.from_pretrained(str(done.out), local_files_only=True).eval()
        assert exported.dtype == torch.bfloat16
        got = exported.state_dict()
        for name, tensor in trained.items():
            assert torch.equal(got[name], tensor.to(torch.bfloat16)), (fam, name)
        reference = AutoModelForCausalLM.from_pretrained(str(tmp_path / "models" / fam), dtype=torch.bfloat16,
                                                         local_files_only=True).eval()
        reference.load_state_dict({k: v.to(torch.bfloat16) for k, v in trained.items()}, strict=False)
        with torch.no_grad():
            tokens = [m.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, min_new_tokens=12,
                                 do_sample=False)[0, prompt.shape[1]:].tolist() for m in (exported, reference)]
        assert tokens[0] == tokens[1], fam


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    try:
        run_rank(Path(sys.argv[1]))
    finally:
        from tests.integration.procs import end_process_group

        end_process_group()
