"""Ulysses context parallelism (areal_mq/algorithms/ulysses.py) at cp 2 equals one process.

The test starts THIS file as 2 ranks (gloo on the CPU, a FileStore in tmp_path for the rendezvous, gloo on the
loopback interface); each builds the same tiny Qwen2 (4 heads, 2 KV heads, hidden 64, 2 layers, seeded random
weights, no download), switches it to the Ulysses attention, shards three packed micro-batches over the cp group
and computes their token logprobs and the trainer's PPO loss (token-mean over all the rows' trained tokens), runs
backward and sums the gradients over the group. The micro-batches: a dynamic row of 3 sequences and 25 tokens
(odd: one pad column; a sequence crosses the slice boundary and the token scored by rank 0's last column has
its target on rank 1), one sequence of 13 tokens (plain causal, padded; rank 0 scores none of its tokens), and a
shared row (one prompt, two completions, trainer.attention varlen's blocks) of 16 tokens.
The test process computes the same with one unsplit process and transformers' sdpa attention (its block-diagonal
mask from the position ids, its L x L shared mask) and compares per-token logprobs, the loss and every parameter's
gradient to 1e-5.
Run: pytest tests/integration/test_ulysses.py   (18-35 s on 2 busy cores, most of it the 3 processes' imports;
marked slow)
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CP = 2
VOCAB = 128


def tiny_qwen2():
    """The seeded tiny Qwen2 both sides build (untied head: the embeddings and the head get separate gradients)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).float()


def microbatches(varlen: bool):
    """The three packed rows of the module docstring, built by packing.py on the CPU; the shared row with its
    blocks (`varlen`, what the ranks need) or with its L x L mask (the sdpa reference)."""
    import numpy as np

    from areal_mq.algorithms.packing import SeqData, build_microbatch

    rng = np.random.default_rng(7)

    def seq(prompt_len, n_gen, sample="s", prompt=None):
        tokens = rng.integers(0, VOCAB, prompt_len + n_gen).astype(np.int64)
        if prompt is not None:
            tokens[:prompt_len] = prompt
        return SeqData(tokens, prompt_len, (-4.8 + 0.3 * rng.standard_normal(n_gen)).astype(np.float32),
                       np.zeros(n_gen, np.int64), float(rng.choice([-1.0, 1.0])), sample)

    dynamic = [seq(4, 3, "a"), seq(5, 8, "b"), seq(3, 2, "c")]  # 7 + 13 + 5 = 25 columns
    single = [seq(9, 4)]  # 13 columns, scored by columns 8..11: all on rank 1 of 14 / 2
    prompt = rng.integers(0, VOCAB, 6)
    shared = [seq(6, 4, "p", prompt), seq(6, 6, "p", prompt)]  # [prompt 6, 4, 6] = 16 columns
    return [build_microbatch(dynamic, [0, 1, 2], packed=True),
            build_microbatch(single, [0], packed=True),
            build_microbatch(shared, [0, 1], packed=True, share_prompts=True, varlen=varlen)]


def loss_of(model, mbs, total_tokens):
    """(logprobs of each micro-batch, the summed PPO loss) of the (sharded or whole) micro-batches."""
    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.ppo import ppo_loss
    from areal_mq.algorithms.trainer import token_logprobs

    cfg = TrainerConfig(device="cpu", precision="fp32")
    logps, loss = [], 0.0
    for mb in mbs:
        logp, _ = token_logprobs(model, mb, 1.0)
        part, _ = ppo_loss(logp, logp.detach(), mb.behav_logp, mb.advantages, total_tokens, cfg, None, mb.seq_index)
        logps.append(logp)
        loss = loss + part
    return logps, loss


def run_rank(rank: int, store: str, out: Path) -> None:
    """Body of each launched rank."""
    import torch
    import torch.distributed as dist

    from areal_mq.algorithms.ulysses import ATTN, reduce_cp_grads, shard_microbatch, use_ulysses

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, CP), rank=rank, world_size=CP,
                            timeout=timedelta(seconds=60))  # a rank left alone fails instead of waiting 30 min
    group = dist.new_group(list(range(CP)))  # the cp group (here the whole world)
    model = use_ulysses(tiny_qwen2(), group)
    assert model.config._attn_implementation == ATTN
    mbs = microbatches(varlen=True)
    local = [shard_microbatch(mb, group) for mb in mbs]
    logps, loss = loss_of(model, local, sum(mb.targets.numel() for mb in mbs))
    loss.backward()
    reduce_cp_grads(model, group)
    torch.save({"logp": [lp.detach() for lp in logps], "index": [mb.segments.token_index for mb in local],
                "width": [mb.input_ids.shape[1] for mb in local], "loss": loss.detach(),
                "grads": {n: p.grad for n, p in model.named_parameters()}}, out / f"rank{rank}.pt")


@pytest.fixture
def ranks(tmp_path):
    """The 2 ranks, started on the CPU; stopped by PID at the end whatever happened."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="",
               GLOO_SOCKET_IFNAME="lo")
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(store), str(tmp_path)], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(CP)]
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()


@pytest.mark.slow  # two rank processes, each importing torch and transformers
def test_cp2_equals_one_process(ranks, tmp_path):
    import torch

    torch.set_num_threads(1)
    model = tiny_qwen2()  # the reference, computed while the ranks run
    mbs = microbatches(varlen=False)
    logps, loss = loss_of(model, mbs, sum(mb.targets.numel() for mb in mbs))
    loss.backward()
    for proc in ranks:
        output, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, output[-3000:]
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(CP)]

    assert [g["width"] for g in got] == [[13, 7, 8]] * CP  # 25 -> 26, 13 -> 14, 16 columns: halves
    assert got[0]["index"][1].numel() == 0  # rank 0 scores nothing of the single sequence, and still joins backward
    for k, want in enumerate(logps):  # every trained token scored once, on the rank of its scoring column
        index = torch.cat([g["index"][k] for g in got])
        assert torch.equal(index.sort().values, torch.arange(want.numel()))
        cp_logp = torch.cat([g["logp"][k] for g in got])
        torch.testing.assert_close(cp_logp, want.detach()[index], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[0]["loss"] + got[1]["loss"], loss.detach(), rtol=0, atol=1e-5)
    for name, p in model.named_parameters():
        assert torch.equal(got[0]["grads"][name], got[1]["grads"][name]), name  # summed over the group
        torch.testing.assert_close(got[0]["grads"][name], p.grad, rtol=1e-5, atol=1e-5, msg=name)
    boundary = mbs[0].keep_cols[mbs[0].logit_index] == 12  # rank 0's last column scores a token on rank 1
    assert boundary.any() and bool(torch.isin(boundary.nonzero().flatten(), got[0]["index"][0]).all())


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    import torch.distributed as dist

    try:
        run_rank(int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
