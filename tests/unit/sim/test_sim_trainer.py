"""The simulated trainer reports staleness like the real one, so the worker's staleness invariant holds for it.
Run: pytest tests/unit/sim/test_sim_trainer.py
"""
from __future__ import annotations

import numpy as np

from areal_mq.messages import Sample, SeqSample
from areal_mq.sim.config import SimTrainerConfig
from areal_mq.workers.sim_trainer import SimTrainer
from areal_mq.workers.trainer import staleness_violations


def _seq(versions: list[int], mask: list[int] | None = None) -> SeqSample:
    n = len(versions)
    return SeqSample(prompt_ids=np.arange(3, dtype=np.int32), output_ids=np.arange(n, dtype=np.int32),
                     logprobs=np.zeros(n, dtype=np.float32), versions=np.asarray(versions, dtype=np.int32),
                     reward=1.0, loss_mask=None if mask is None else np.asarray(mask, dtype=np.uint8))


def _trainer(version: int) -> SimTrainer:
    t = SimTrainer(SimTrainerConfig(time_scale=0.001), sleep=lambda s: None)
    t.version = version
    return t


def test_the_histogram_counts_generated_tokens_by_versions_behind():
    # trained at version 5: tokens from 5, 4, 4 and 3; an episode whose environment tokens (version -1) are
    # not generated and must not count as 6 versions old
    samples = [Sample(sample_id="a", seqs=[_seq([5, 4, 4]), _seq([3, -1, 4], mask=[1, 0, 1])])]
    m = _trainer(5).train_step(samples)
    assert m["staleness_hist"] == [1, 3, 1] and m["staleness_max"] == 2
    assert m["stale_1"] == 1 and m["stale_2"] == 1 and "stale_6" not in m
    assert staleness_violations(m["staleness_hist"], 1) == 1 and staleness_violations(m["staleness_hist"], 2) == 0


def test_a_batch_with_nothing_generated_reports_zero():
    m = _trainer(0).train_step([Sample(sample_id="a", seqs=[_seq([])])])
    assert m["staleness_hist"] == [] and m["staleness_max"] == 0
