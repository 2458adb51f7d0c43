"""Random but realistic training batches for the trainer tests and the DDP integration test."""
from __future__ import annotations

import numpy as np

from areal_mq.messages import Sample, SeqSample


def make_samples(
    seed: int = 0,
    n_groups: int = 3,
    group_size: int = 4,
    prompt_len: tuple[int, int] = (3, 12),
    gen_len: tuple[int, int] = (1, 20),
    vocab: int = 49152,
    version: int = 0,
    staleness: int = 2,
    logp_noise: float = 0.5,
) -> list[Sample]:
    """Groups of sequences; behaviour logprobs are noise around -3 (the weights exp(p - b) then vary
    around 1 and sometimes exceed a cap); token versions lie in [version - staleness, version]."""
    rng = np.random.default_rng(seed)
    samples = []
    for g in range(n_groups):
        prompt = rng.integers(0, vocab, rng.integers(*prompt_len), dtype=np.int32)
        seqs = []
        for _ in range(group_size):
            n = int(rng.integers(*gen_len))
            seqs.append(SeqSample(
                prompt_ids=prompt,
                output_ids=rng.integers(0, vocab, n, dtype=np.int32),
                logprobs=(-3.0 + logp_noise * rng.standard_normal(n)).astype(np.float32),
                versions=rng.integers(max(0, version - staleness), version + 1, n, dtype=np.int32),
                reward=float(rng.integers(0, 2)),
            ))
        samples.append(Sample(sample_id=f"s{seed}-{g}", prompt_id=f"p{g}", seqs=seqs))
    return samples


def behaviour_near_model(samples: list[Sample], model_dir, temperature: float = 1.0, noise: float = 0.3,
                         seed: int = 0) -> list[Sample]:
    """Replace behaviour logprobs by the model's own logprobs plus noise, so exp(prox - behaviour)
    is spread around 1 as in real asynchronous training."""
    import torch

    from areal_mq.algorithms.packing import SeqData, build_microbatch
    from areal_mq.algorithms.trainer import token_logprobs
    from areal_mq.engines.models import load_causal_lm

    model = load_causal_lm(model_dir, "float32")
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for sample in samples:
            for seq in sample.seqs:
                tokens = np.concatenate([seq.prompt_ids, seq.output_ids]).astype(np.int64)
                data = SeqData(tokens, len(seq.prompt_ids), seq.logprobs, seq.versions, 0.0, sample.sample_id)
                mb = build_microbatch([data], [0], packed=True)
                logp, _ = token_logprobs(model, mb, temperature)
                seq.logprobs = (logp.numpy() + noise * rng.standard_normal(len(logp))).astype(np.float32)
    return samples
