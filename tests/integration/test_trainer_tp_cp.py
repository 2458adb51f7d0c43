"""The real Trainer under trainer.parallel tp 2 and cp 2 (2 CPU ranks over gloo) equals the single-process trainer,
and its checkpoints resume across layouts (issue 61 items 3 and 4).

One launch of THIS file under torch.distributed.run, 2 ranks (CUDA hidden, one thread per rank), tiny Qwen2 (4
heads, 2 KV heads: tp 2 and cp 2 both divide them; untied head), trainer.attention varlen, a KL reference model
(kl_coef > 0: the reference is parallelized and switched to Ulysses too), 2 mini-batches a step:
  1. tp 2 (algorithms/tensor_parallel.py inside FsdpStrategy.build): 3 steps, a checkpoint after step 2, the
     weights gathered by Trainer.publish_tensors (the gathered publishing path) after step 3;
  2. dp_shard 2 (plain FSDP2): a fresh trainer resumes the tp-2 checkpoint: its gathered weights are step 2's, its
     step 3 the uninterrupted step 3;
  3. cp 2 (algorithms/ulysses.py: every packed row split over both ranks): 3 steps, a checkpoint after step 2, the
     weights after step 3;
  4. tp 2 again: a fresh trainer resumes the cp-2 checkpoint and runs step 3.
The test process runs the plain single-process trainer (world 1, no sharding, no process group) on the same batches.
Targets: per-step loss and the metrics that count tokens (n_gen_tokens, fwd_tokens: each token once, whatever tp
and cp) equal world 1; loss, entropy, clip fraction and grad norm within 1e-5, parameters within 1e-5 after 3 steps;
the resumed step 3 equal to the uninterrupted one, across tp 2 -> dp 2 and cp 2 -> tp 2.
Run: pytest tests/integration/test_trainer_tp_cp.py   (marked slow; 30-45 s on 2 cores, two minutes when others load them)
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAMILY = "tiny-qwen2"
# adam_eps 1e-6, not 1e-8: AdamW moves an element by lr * g / (|g| + eps), so an element whose gradient is ~1e-9
# (a rarely seen vocabulary row of the embeddings or the head) turns the last-bit rounding of a differently ordered
# sum (tp's all-reduced partial sums, cp's two halves of a row) into a move of ~lr / 10: with eps 1e-8 a few dozen
# of the 3.1 M embedding / head elements landed up to 9e-5 from world 1, every other parameter within 4e-6. eps 1e-6
# bounds that amplification under the tolerance while the updates (~lr a step) stay far above it
# (tests/integration/test_tensor_parallel.py found the same).
CFG = dict(lr=1e-3, max_tokens_per_mb=64, seed=3, grad_clip=1.0, ppo_n_minibatches=2, checkpoint_every=0,
           attention="varlen", kl_coef=0.05, adam_eps=1e-6)
CLOSE = ("loss", "entropy", "clip_frac", "grad_norm", "kl")  # within 1e-5 of world 1
# summed over ranks, each token counted once whatever tp and cp (fwd_tokens also depends on how dp splits the batch:
# shared packing computes a prompt once per rank that holds its group)
EXACT = ("n_gen_tokens", "fwd_tokens")
LAYOUTS = {"tp2": {"dp_shard": 1, "tp": 2}, "dp2": {"dp_shard": 2}, "cp2": {"dp_shard": 1, "cp": 2}}


def _batch(i: int):
    from tests.unit.algorithms.batches import make_samples

    return make_samples(30 + i, n_groups=3, group_size=3, version=i, staleness=1)


def _trainer(model_dir: Path, layout: str | None):
    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.trainer import Trainer

    cfg = TrainerConfig(**CFG) if layout is None else TrainerConfig(parallel=LAYOUTS[layout], **CFG)
    return Trainer(cfg, model_dir, device="cpu")


def _metrics(m: dict) -> dict:
    return {k: m[k] for k in (*CLOSE, *EXACT)}


def run_rank(out: Path) -> None:
    """Both layouts and both resumes, one after the other, on this launch's 2 ranks."""
    import torch

    from areal_mq.algorithms.checkpoint import load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    model_dir, result = out / "models" / FAMILY, {}
    for layout, resume_at in (("tp2", "dp2"), ("cp2", "tp2")):
        trainer = _trainer(model_dir, layout)
        assert trainer.world_size == 2 and trainer.strategy.name == "fsdp"
        q = trainer.unwrapped.model.layers[0].self_attn.q_proj.weight  # tp: a 2-D DTensor on (dp_shard, tp)
        assert q.device_mesh.mesh_dim_names == (("dp_shard", "tp") if layout == "tp2" else ("dp_shard",)), q
        want_attn = "areal_ulysses" if layout == "cp2" else "areal_varlen"
        assert trainer.unwrapped.config._attn_implementation == want_attn  # cp: Ulysses around varlen
        steps = []
        for i in range(3):
            steps.append(_metrics(trainer.train_step(_batch(i))))
            if i == 1:
                save_checkpoint(trainer, out / f"ckpt-{layout}")
        params = trainer.publish_tensors("float32")  # gathered over every dim (a collective)
        resumed = _trainer(model_dir, resume_at)
        load_checkpoint(resumed, out / f"ckpt-{layout}" / f"step{2:08d}")
        at2 = resumed.publish_tensors("float32")
        entry = {"steps": steps, "resumed_version": resumed.version,
                 "resumed_step3": _metrics(resumed.train_step(_batch(2))),
                 "saved": json.loads((out / f"ckpt-{layout}" / f"step{2:08d}" / "trainer_state.json").read_text())[
                     "parallel"]}
        if trainer.is_main:
            torch.save(params, out / f"params-{layout}.pt")
            torch.save(at2, out / f"at2-{layout}-in-{resume_at}.pt")
        result[layout] = entry
        del trainer, resumed
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "result-tpcp.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_trainer_at_tp2_and_cp2_matches_one_process_and_resumes_across_layouts(tmp_path):
    import torch

    from areal_mq.engines.shapes import build_random_model
    from tests.integration.procs import launch_ranks

    build_random_model(tmp_path / "models" / FAMILY, FAMILY, seed=5)
    torch.set_num_threads(1)
    single = _trainer(tmp_path / "models" / FAMILY, None)  # the plain single-process trainer (ddp, world 1)
    assert single.world_size == 1 and single.strategy.name == "ddp"
    want, at2 = [], None
    for i in range(3):
        want.append(_metrics(single.train_step(_batch(i))))
        if i == 1:
            at2 = {n: p.detach().clone() for n, p in single.unwrapped.state_dict().items()}
    final = {n: p.detach().clone() for n, p in single.unwrapped.state_dict().items()}

    got = launch_ranks(__file__, "tpcp", 2, tmp_path)

    def same(a: dict, b: dict, what: str, exact: tuple = EXACT) -> None:
        for k in exact:
            assert a[k] == b[k], (what, k, a, b)
        for k in CLOSE:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-5), (what, k, a, b)

    for layout, resume_at in (("tp2", "dp2"), ("cp2", "tp2")):
        entry = got[layout]
        assert entry["saved"] == {"dp_replicate": 1, **{d: 1 for d in ("dp_shard", "cp", "tp")}, **LAYOUTS[layout]}
        for i, (a, b) in enumerate(zip(entry["steps"], want)):
            same(a, b, f"{layout} step {i + 1}")
        params = torch.load(tmp_path / f"params-{layout}.pt", map_location="cpu")
        assert params.keys() <= final.keys() and "lm_head.weight" in params
        for name, tensor in params.items():
            torch.testing.assert_close(tensor, final[name], rtol=1e-5, atol=1e-5, msg=f"{layout} {name}")
        # its checkpoint, resumed at another layout: step 2's weights, then the uninterrupted step 3
        resumed = torch.load(tmp_path / f"at2-{layout}-in-{resume_at}.pt", map_location="cpu")
        for name, tensor in resumed.items():
            torch.testing.assert_close(tensor, at2[name], rtol=1e-5, atol=1e-5, msg=f"{layout} -> {resume_at} {name}")
        assert entry["resumed_version"] == 2
        same(entry["resumed_step3"], want[2], f"{layout} -> {resume_at} step 3", EXACT[:1 + (resume_at != "dp2")])


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    try:
        run_rank(Path(sys.argv[2]))
    finally:
        from tests.integration.procs import end_process_group

        end_process_group()
