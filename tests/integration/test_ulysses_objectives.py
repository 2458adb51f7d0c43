"""The sequence-level objectives under Ulysses context parallelism (cp 2) equal one process (issue 61: GSPO and the
per-sequence aggregations at 32k-token answers, where a sequence is cut between the cp ranks).

One launch of THIS file under torch.distributed.run, 2 ranks (gloo on the CPU, one thread per rank), fp32:
  1. the real Trainer at trainer.parallel cp 2 (varlen, shared packing, 2 mini-batches a step, a KL reference) with
     policy_loss gspo, loss_agg seq-mean-token-mean, behav_weight_level geometric and REINFORCE++'s kl_in
     reward_normalized (advantages.normalize_returns: suffix sums across the ranks, mean/std over both): 2 steps, then
     its weights gathered. Answers of 8-29 tokens: every packed row cuts a sequence between the ranks (checked);
  2. ppo_loss itself on test_ulysses.py's three packed rows (3 sequences in a dynamic row, one cut by the split; one
     sequence that rank 0 holds none of; a shared prompt with two completions), the tiny Qwen2 switched to Ulysses,
     for each objective in CASES: the loss summed over the rows, backward, the gradients summed over the group. The
     proximal (and reference) logprobs are the current ones moved by fixed per-token offsets (carried through the
     split as the micro-batch's prox_logp / ref_logp), so gspo's s_i and the sequence weights are not 1 and some
     sequences clip. Plus GRAD: a sequence-mean whose gradient flows through CpSequenceSums.totals (the autograd
     all-reduce) - no objective needs that today, this checks that one would stay right.
The test process computes the same in one process (world 1, LOCAL sums, sdpa attention on the unsplit rows).
Targets: the Trainer's per-step loss, clip fraction, grad norm and KL within 1e-5 and every parameter within 1e-5
after 2 steps; each case's loss (the two ranks' sum) and every parameter's gradient within 1e-5.
Run: pytest tests/integration/test_ulysses_objectives.py   (marked slow; ~40 s on 2 cores)
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAMILY = "tiny-qwen2"
# adam_eps 1e-6: see test_trainer_tp_cp.py (last-bit differences of a rarely seen embedding row's gradient).
# grad_clip 1.0 with behaviour logprobs near the model's: the gradient norm is ~2.7, so the clip acts on both sides
# (this test found fsdp.clip_grad_norm clipping nothing: it handed gradients to clip_grads_with_norm_, which takes
# parameters; the parameters then parted from world 1's by up to 2e-4 after one step).
TRAINER = dict(lr=1e-3, max_tokens_per_mb=64, seed=3, grad_clip=1.0, ppo_n_minibatches=2, checkpoint_every=0,
               attention="varlen", adam_eps=1e-6, policy_loss="gspo", loss_agg="seq-mean-token-mean",
               behav_weight_level="geometric", kl_coef=0.05, kl_in="reward_normalized", adv_estimator="reinforce_pp")
CLOSE = ("loss", "clip_frac", "grad_norm", "kl", "behav_weight_mean")
CASES = {
    "gspo-seqmean": dict(policy_loss="gspo", loss_agg="seq-mean-token-mean"),
    "ppo-seqsum": dict(loss_agg="seq-mean-token-sum"),
    "ppo-seqmean": dict(loss_agg="seq-mean-token-mean"),
    "behav-sequence": dict(behav_weight_level="sequence", behav_weight_cap=3.0),
    "behav-geometric": dict(behav_weight_level="geometric", policy_loss="gspo", loss_agg="seq-mean-token-sum",
                            behav_weight_cap=2.0, behav_cap_mode="mask"),
    "kl-reward": dict(kl_coef=0.1, kl_in="reward"),  # token-mean: the suffix sums alone
}


def _batches(model_dir: Path) -> list:
    """Two steps' batches: answers of 8-29 tokens (shared packing cuts one or two of each row between the ranks),
    behaviour logprobs the model's own plus noise (weights spread around 1, as in asynchronous training)."""
    from tests.unit.algorithms.batches import behaviour_near_model, make_samples

    return [behaviour_near_model(make_samples(30 + i, n_groups=3, group_size=3, gen_len=(8, 30), version=i,
                                              staleness=1), model_dir, seed=i) for i in range(2)]


def _trainer(model_dir: Path, cp: int):
    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.trainer import Trainer

    layout = {"parallel": {"dp_shard": 1, "cp": 2}} if cp > 1 else {}
    return Trainer(TrainerConfig(**TRAINER, **layout), model_dir, device="cpu")


def _rows(varlen: bool):
    """test_ulysses.py's three packed rows (the shared one with its blocks for the ranks, its L x L mask for the sdpa
    reference), each with fixed per-token offsets of the proximal and reference logprobs in prox_logp / ref_logp
    (sliced with the row), and (trained tokens, sequences) of the whole rows."""
    import torch

    from tests.integration.test_ulysses import microbatches

    g = torch.Generator().manual_seed(11)
    mbs = microbatches(varlen)
    for mb in mbs:
        shift = 0.4 * torch.randn(len(mb.seq_ids), generator=g)[mb.seq_index]  # sequence-wide: some sequences clip
        mb.prox_logp = shift + 0.2 * torch.randn(mb.targets.numel(), generator=g)
        mb.ref_logp = 0.3 * torch.randn(mb.targets.numel(), generator=g)
    return mbs, (sum(mb.targets.numel() for mb in mbs), sum(len(mb.seq_ids) for mb in mbs))


def _case(model, mbs, counts: tuple[int, int], name: str, sums_of) -> float:
    """Case `name` on the (sharded or whole) rows `mbs`: the loss, its gradient left in `model` (before any cp sum)."""
    import torch

    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.ppo import ppo_loss
    from areal_mq.algorithms.trainer import token_logprobs

    model.zero_grad(set_to_none=True)
    total_tokens, total_seqs = counts
    loss = 0.0
    for mb in mbs:
        logp, _ = token_logprobs(model, mb, 1.0)
        prox, ref = logp.detach() + mb.prox_logp, logp.detach() + mb.ref_logp
        sums = sums_of(mb)
        if name == "GRAD":  # sum_t exp(mean over t's sequence of (θ - p)) x A_t: the gradient crosses the ranks
            mean = sums.totals(logp - prox, mb.seq_index) / sums.totals(torch.ones_like(logp), mb.seq_index)
            part = (torch.exp(mean)[mb.seq_index] * mb.advantages).sum() / total_tokens
        else:
            cfg = TrainerConfig(device="cpu", precision="fp32", **CASES[name])
            part, _ = ppo_loss(logp, prox, mb.behav_logp, mb.advantages, total_tokens, cfg, ref, mb.seq_index,
                               total_seqs, sums=sums)
        part.backward()
        loss += float(part.detach())
    return loss


def run_rank(out: Path) -> None:
    """The Trainer at cp 2, then every loss case, on this launch's 2 ranks (one cp group: the whole world)."""
    import torch
    import torch.distributed as dist

    from areal_mq.algorithms.ulysses import ContextParallel, reduce_cp_grads, use_ulysses
    from tests.integration.test_ulysses import tiny_qwen2

    torch.set_num_threads(1)
    trainer = _trainer(out / "models" / FAMILY, 2)
    assert trainer.world_size == 2 and trainer.context.group is not None
    batches = torch.load(out / "batches.pt", weights_only=False)
    steps = [{k: m[k] for k in CLOSE} for m in map(trainer.train_step, batches)]
    params = trainer.publish_tensors("float32")  # gathered (a collective)

    context = ContextParallel(trainer.context.group)
    model = use_ulysses(tiny_qwen2(), context.group)
    mbs, counts = _rows(varlen=True)
    local = [context.shard(mb) for mb in mbs]
    cases = {}
    for name in (*CASES, "GRAD"):
        loss = _case(model, local, counts, name, context.sequence_sums)
        reduce_cp_grads(model, context.group)
        cases[name] = {"loss": loss, "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    torch.save({"steps": steps, "cases": cases, "params": params}, out / f"rank{trainer.rank}.pt")
    dist.barrier()


@pytest.mark.slow
def test_sequence_level_objectives_at_cp2_match_one_process(tmp_path):
    import torch

    from areal_mq.algorithms.objective import LOCAL
    from areal_mq.algorithms.ulysses import slice_microbatch
    from areal_mq.engines.shapes import build_random_model
    from tests.integration.procs import run_ranks
    from tests.integration.test_ulysses import tiny_qwen2

    torch.set_num_threads(1)
    build_random_model(tmp_path / "models" / FAMILY, FAMILY, seed=5)
    batches = _batches(tmp_path / "models" / FAMILY)
    torch.save(batches, tmp_path / "batches.pt")
    single = _trainer(tmp_path / "models" / FAMILY, 1)  # the plain single-process trainer (world 1)
    for batch in batches:  # every packed row cuts a sequence between the 2 cp ranks (tokens on both)
        for mini in single.prepare(batch)[1]:
            for mb in mini:
                halves = [set(slice_microbatch(mb, r, 2).seq_index.tolist()) for r in range(2)]
                assert halves[0] & halves[1], mb.seq_ids
    want_steps = [{k: m[k] for k in CLOSE} for m in map(single.train_step, batches)]
    final = {n: p.detach().clone() for n, p in single.unwrapped.state_dict().items()}
    model, (mbs, counts) = tiny_qwen2(), _rows(varlen=False)
    want = {}
    for name in (*CASES, "GRAD"):
        loss = _case(model, mbs, counts, name, lambda mb: LOCAL)
        want[name] = loss, {n: p.grad.clone() for n, p in model.named_parameters()}

    run_ranks(__file__, "objectives", str(tmp_path), nproc=2)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    for i, (a, b) in enumerate(zip(got[0]["steps"], want_steps)):
        for k in CLOSE:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-5), (f"trainer step {i + 1}", k, a, b)
    for name, tensor in got[0]["params"].items():
        torch.testing.assert_close(tensor, final[name], rtol=1e-5, atol=1e-5, msg=f"trainer {name}")
    for name, (loss, grads) in want.items():
        cp_loss = got[0]["cases"][name]["loss"] + got[1]["cases"][name]["loss"]
        assert cp_loss == pytest.approx(loss, rel=1e-5, abs=1e-6), name
        for pname, grad in grads.items():
            assert torch.equal(got[0]["cases"][name]["grads"][pname], got[1]["cases"][name]["grads"][pname])
            torch.testing.assert_close(got[0]["cases"][name]["grads"][pname], grad, rtol=1e-5, atol=1e-5,
                                       msg=f"{name} {pname}")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    try:
        run_rank(Path(sys.argv[2]))
    finally:
        from tests.integration.procs import end_process_group

        end_process_group()
