"""The simulator's own correctness: with zero infrastructure cost and a constant decode time, the
zero-infrastructure model (areal_mq/sim/des.py, which drives the real SimEngine and the controller's can_admit)
reproduces the closed-form sync and async throughput within 5 %.

Closed form. N workers with c slots each, a batch of B = N * c sequences (batch_groups * group_size), every
sequence exactly L tokens, every decode step d seconds whatever the batch (timing model `constant`), no prefill
and no weight-load pause, so one batch takes G = L * d to generate (all its sequences in parallel) and
T = train_step_s(tokens of the batch) to train. Over K training steps:

- sync (η = 0): a batch is admitted only after the previous one trained: each step costs G + T, so
      time_sync = K * (G + T),           throughput_sync = K * B / (K * (G + T)) = B / (G + T).
- async (η >= 1): batch k+1 is generated while batch k trains. The first batch costs G before any training;
  then each step costs max(G, T) (the slower of the two pipelines: when T <= G the trainer waits for the next
  batch, when T > G generation waits on the staleness bound), and the last batch's training T ends the run:
      time_async = G + (K - 1) * max(G, T) + T,     throughput_async = K * B / time_async.
  η = 1 suffices: batch k (k >= 1) needs submitted < (η + v + 1) * B, i.e. v >= k - 1 trained versions, and
  version k - 1 is out by G + (k - 1) * max(G, T) at the latest, when batch k's slots free up.
So as K grows the async/sync ratio tends to (G + T) / max(G, T): 2 when G = T.

Run: pytest tests/unit/sim/test_closed_form.py -q
"""
from __future__ import annotations

import dataclasses

import pytest

from areal_mq.sim.des import closed_form, simulate
from areal_mq.sim.timing import length_model, timing_model
from areal_mq.workers.controller_admission import can_admit

N, CAPACITY, GROUP, STEPS, PROMPT = 4, 4, 4, 8, 1


def run(eta: int, train_devices: int) -> tuple[float, float]:
    # 1 ms of training per token: T = 16 s / devices against G = 10 s
    tm, lm = dataclasses.replace(timing_model("constant"), train_s_per_token=1e-3), length_model("constant-1k")
    batch_groups = N * CAPACITY // GROUP
    out = simulate(admit=can_admit, n_workers=N, capacity=CAPACITY, timing=tm, lengths=lm, batch_groups=batch_groups,
                   group_size=GROUP, eta=eta, steps=STEPS, train_devices=train_devices, prompt_len=PROMPT)
    gen_s = lm.median * tm.decode_step_s(CAPACITY, 0)
    train_s = tm.train_step_s(batch_groups * GROUP * (PROMPT + int(lm.median)), train_devices)
    expected = STEPS * batch_groups * GROUP / closed_form(gen_s=gen_s, train_s=train_s, steps=STEPS, eta=eta)
    return out["samples_per_s"], expected


@pytest.mark.parametrize("train_devices", [1, 2, 4])  # T > G, T ~ G, T < G (G = 10 s; T = 16 s / devices)
@pytest.mark.parametrize("eta", [0, 1, 2, 4])
def test_throughput_matches_the_closed_form(eta, train_devices):
    got, expected = run(eta, train_devices)
    assert got == pytest.approx(expected, rel=0.05)


def test_async_beats_sync_by_the_closed_form_ratio_when_balanced():
    sync, _ = run(0, 2)
    async_, _ = run(2, 2)
    gen_s, train_s = 10.0, 16 * 1001 * 1e-3 / 2
    k = STEPS
    assert async_ / sync == pytest.approx(k * (gen_s + train_s) / (gen_s + (k - 1) * max(gen_s, train_s) + train_s),
                                          rel=0.05)
