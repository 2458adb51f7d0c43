"""DAPO's overlong filtering (arXiv 2503.14476, §3.4: truncated samples masked out of the loss), controller to
trainer: the controller marks a truncated answer loss_excluded (controller.overlong_filter), packing leaves its
tokens out of the loss and its counts while its reward still counts in the group's advantages, and a step where
every sequence is excluded is acked without an update instead of dividing by zero tokens."""
from __future__ import annotations

import numpy as np
import pytest

from areal_mq.algorithms.config import TrainerConfig
from areal_mq.algorithms.packing import plan_step, samples_to_seqs, trains_anything
from areal_mq.messages import Sample, SampleBatch, SeqSample
from tests.unit.algorithms.batches import make_samples
from tests.unit.rewards.test_shaping import _controller, _round


def _seq(n: int, reward: float, excluded: bool = False) -> SeqSample:
    return SeqSample(prompt_ids=np.array([1, 2], np.int32), output_ids=np.full(n, 7, np.int32),
                     logprobs=np.full(n, -1.0, np.float32), versions=np.zeros(n, np.int32), reward=reward,
                     finish_reason="length" if excluded else "stop", loss_excluded=excluded)


@pytest.mark.parametrize("on", [True, False])
def test_the_controller_marks_truncated_answers_only_when_asked(tmp_path, on):
    ctl, jobs, store, _ = _controller(tmp_path, f"controller.overlong_filter={str(on).lower()}")
    _round(ctl, jobs, [3, 8], [1.0, 0.0], [{"correct": True}, {"correct": False}])  # 8 = the cap: "length"
    (sample,) = store.samples
    assert {len(s.output_ids): s.loss_excluded for s in sample.seqs} == {3: False, 8: on}


def test_an_excluded_sequence_is_not_trained_but_counts_in_its_group_baseline_by_hand():
    """Group rewards (1, 0, 0) with the truncated third excluded: GRPO's mean 1/3 and std sqrt(2)/3 still take
    all three, so the two trained sequences get (1 - 1/3) / (sqrt(2)/3) = sqrt(2) and -1/sqrt(2); the step counts
    their 3 + 4 tokens and 2 sequences, not the excluded one's 5."""
    sample = Sample(sample_id="g", seqs=[_seq(3, 1.0), _seq(4, 0.0), _seq(5, 0.0, excluded=True)])
    cfg = TrainerConfig(adv_eps=1e-12, loss_agg="seq-mean-token-mean")
    seqs = samples_to_seqs([sample], cfg)
    assert [s.n_gen for s in seqs] == [3, 4]
    assert [s.advantage for s in seqs] == pytest.approx([np.sqrt(2), -1 / np.sqrt(2)])
    plan = plan_step(seqs, cfg)
    assert plan.gen_tokens == [7] and plan.n_seqs == [2]
    assert trains_anything([sample])
    assert not trains_anything([Sample(sample_id="h", seqs=[_seq(5, 0.0, True), _seq(2, 1.0, True)])])


def test_a_step_of_only_excluded_sequences_is_acked_and_logged_without_an_update(tmp_path, tiny_model_dir):
    from tests.unit.algorithms.test_trainer_nonfinite import _worker

    worker, log = _worker(tmp_path, tiny_model_dir)
    samples = make_samples(4, n_groups=2, group_size=2)
    for sample in samples:
        for seq in sample.seqs:
            seq.loss_excluded = True
    assert worker.step(SampleBatch(batch_id="b1", samples=samples), 0.0) == {}
    assert worker.trainer.version == 0 and worker.store.acked == ["b1"]
    (skipped,) = [kw for e, kw in log.events if e == "trainer.step_skipped"]
    assert skipped["samples"] == 2 and "loss_excluded" in skipped["reason"]
    samples[0].seqs[0].loss_excluded = False  # one trained sequence is enough for a step
    metrics = worker.step(SampleBatch(batch_id="b2", samples=samples), 0.0)
    assert worker.trainer.version == 1 and metrics["loss_excluded_seqs"] == 3 and metrics["n_seqs"] == 1
