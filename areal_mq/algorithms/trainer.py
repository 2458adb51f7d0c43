"""The decoupled-PPO trainer on Hugging Face Accelerate.

What: `Trainer(cfg, model_path).train_step(samples)` runs one training step on a batch of rewarded
groups and returns its metrics; `version` counts finished steps (0 = the initial model).
One step:

    samples -> sequences + GRPO advantages -> plan (mini-batches / ranks / packed micro-batches)
            -> proximal logprobs recomputed with the current weights (no grad)  [behav_correction]
               (skipped with one mini-batch: the weights do not change before the only backward, so the
               proximal logprobs ARE that forward's logprobs, taken detached — same loss, one forward less)
            -> for each mini-batch: forward/backward every micro-batch (gradients accumulate;
               DDP syncs only on the last, FSDP2 reduce-scatters each into the sharded gradients and every
               rank runs the busiest rank's micro-batch count), clip, AdamW step, LR schedule step
            -> version += 1

With trainer.kl_in reward the reference logprobs of the recompute pass become a per-token reward inside the loss
(ppo.py `kl_in_reward`: each token's advantage minus kl_coef x the k1 KL summed from it to the sequence's end), so
the advantages computed at packing time never wait for the reference model.
Every rank receives the SAME full sample list and computes the same plan; it trains only its share (of
`parallel.dp` shares: ParallelDims.dp_rank).
The loss of every micro-batch is normalised by the generated-token count of the whole mini-batch
over all ranks and multiplied by the data-parallel world `parallel.dp` (DDP and FSDP2 average gradients over it),
so a step's gradient is the token mean over the batch whatever the number of ranks or micro-batches.
Logprobs follow areal_mq/engines/base.py: log_softmax(logits / temperature)[token].

Device: one device per rank, `self.device` == `accelerator.device` (trainer.device, else model.device;
auto = cuda when available, areal_mq/devices.py). The model, every micro-batch tensor (built there by
packing.py), the dummy input of an idle rank and the metric sums all-reduced by NCCL live on it. The master
weights and AdamW state are fp32 whatever `model.dtype` says; bf16 is autocast (trainer.precision, auto = bf16
when the rollout engine computes in bf16, fp32 when it computes in fp32, on any device: the behaviour weights
compare the trainer's logprobs with the engine's) and the TF32 policy is set explicitly (trainer.tf32). A step keeps its
statistics on the device and reads them back ONCE (`_reduce`): no host sync per micro-batch.

Parallelism (trainer.parallel, areal_mq/algorithms/parallel.py): `self.parallel` (ParallelDims) owns the mesh and
says which rank does what: this rank's share of the batch (`dp_rank`, of `dp` shares), whether every rank runs the
busiest rank's forward count (`lockstep`), who gathers and serves published weights, whose sums count in the
metrics (`counts_metrics`: tp index 0; each token once). tp > 1 splits each decoder layer inside the fsdp room
(algorithms/tensor_parallel.py; the tp ranks of a group train the same micro-batches). cp > 1 splits each packed
micro-batch's columns over the cp ranks (algorithms/ulysses.py, `self.context`: sharded after packing, Ulysses
attention on the policy and reference, the loss's per-sequence statistics summed over the cp group
(`context.sequence_sums`), the cp ranks' gradients summed before clipping; FSDP2 shards over dp_shard only, so this
sum is the one reduction over cp). Strategy (areal_mq/algorithms/strategy.py, the room the degrees
need): ddp (every rank holds the whole model, areal_mq/algorithms/ddp.py) or fsdp (FSDP2 shards parameters,
gradients and AdamW state per decoder layer, the model built on the meta device and each rank's shards read from the
checkpoint; HSDP with dp_replicate > 1; areal_mq/algorithms/fsdp.py). The strategy object owns the precision setup, how the model is
built, the checkpoint format and what each rank publishes: nothing here asks which one it is.

How to run: in-process (`Trainer(cfg, path)`), or data-parallel on CPU with
`accelerate launch --multi_gpu --num_processes 2 SCRIPT` (torchrun + gloo; accelerate 1.15's `--cpu`
launcher only starts several processes through mpirun) — see tests/integration/test_trainer_ddp.py.
The worker is workers/trainer.py.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from areal_mq.algorithms.config import TrainerConfig, compute_precision, rollout_dtype  # noqa: F401 (re-exported)
from areal_mq.algorithms.objective import StepCounts
from areal_mq.algorithms.packing import MicroBatch, SeqData, build_microbatch, plan_step, samples_to_seqs
from areal_mq.algorithms.ppo import ppo_loss

if TYPE_CHECKING:
    import torch

    from areal_mq.messages import Sample

# order of the summed metrics vector reduced over ranks: the first _N_DEVICE_SUMS are summed on the device
_SUMS = ("loss", "clipped", "weight_sum", "capped", "masked", "kl_sum", "entropy_sum", "mm_k3", "mm_n", "mm_out",
         "n_gen", "fwd_tokens")
_N_DEVICE_SUMS = 10
ICEPOP_BAND = 2.0  # the mismatch metric counts staleness-0 tokens whose p/b leaves [1/2, 2] (IcePop's band)


def mismatch_stats(trainer_logp: "torch.Tensor", behav_logp: "torch.Tensor", versions: "torch.Tensor",
                   version: int, band: float = ICEPOP_BAND) -> tuple["torch.Tensor", ...]:
    """How far the rollout engine's numbers are from the trainer's ON THE SAME WEIGHTS: over the tokens generated
    by the trainer's current version (staleness 0), with d = log p_trainer - log p_engine, returns (sum of the k3
    estimator of KL(engine || trainer), (e^d - 1) - d, >= 0; number of such tokens; number with |d| > log band;
    the largest |d|), all 0-dim float64 on the device. Anything but 0 is numerics (precision, kernels), not policy."""
    import math

    import torch

    fresh = versions == version
    d = torch.where(fresh, (trainer_logp.detach() - behav_logp).double(), 0.0)
    k3 = torch.expm1(d) - d
    return (k3.sum(), fresh.sum().double(), (fresh & (d.abs() > math.log(band))).sum().double(),
            d.abs().max() if d.numel() else torch.zeros((), dtype=torch.float64, device=d.device))


def apply_tf32_policy(device: "torch.device", allow: bool) -> None:
    """Set TF32 for fp32 matmuls and convolutions explicitly on CUDA (process-wide flags: the default differs
    across torch versions, so the trainer never relies on it); nothing on other devices."""
    import torch

    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = allow
        torch.backends.cudnn.allow_tf32 = allow


def token_logprobs(model, mb: MicroBatch, temperature: float, with_entropy: bool = False, chunk_mb: float = 256.0,
                   entropy_grad: bool = False):
    """Logprobs [N] of the generated tokens of `mb` (and their entropies [N] if asked, with gradient only if
    `entropy_grad`), computed by the LM head in chunks of tokens (areal_mq/algorithms/policy.py). `model`: the
    trainer's wrapped policy, or a plain Hugging Face causal LM (wrapped here)."""
    from areal_mq.algorithms.policy import as_policy

    extra = {"entropy_grad": True} if entropy_grad else {}  # else the call the policy always had
    if mb.segments is not None:  # trainer.attention varlen: a packed row's blocks instead of a mask
        extra["segments"] = mb.segments
    return as_policy(model, chunk_mb)(mb.input_ids, mb.position_ids, mb.attention_mask, mb.keep_cols,
                                      mb.logit_index, mb.targets, temperature, with_entropy, **extra)


class DeviceSpan:
    """How long the work queued inside a `with` block took on `device`. On CUDA the host only queues kernels,
    so a host clock would time the launches: two CUDA events time the device instead, and `seconds()` waits
    for the end event (free after the step's one readback, `Trainer._reduce`). Elsewhere, the host clock."""

    def __init__(self, device: Any):
        import torch

        self._cuda = torch.device(device).type == "cuda"
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self._cuda else []
        self._t = [0.0, 0.0]

    def __enter__(self) -> "DeviceSpan":
        if self._cuda:
            self._events[0].record()
        self._t[0] = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._cuda:
            self._events[1].record()
        self._t[1] = time.perf_counter()

    def seconds(self) -> float:
        if self._cuda:
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1]) / 1000.0
        return self._t[1] - self._t[0]


class Trainer:
    """Policy parameters, optimizer and schedule; see the module docstring."""

    def __init__(self, cfg: TrainerConfig, model_path: str | Path, accelerator: Any = None, *,
                 device: str | None = None, engine_dtype: str = "float32"):
        """`device`: a spec (auto|cpu|cuda|cuda:N, `meta` for the device-guard tests), default trainer.device
        or auto; the worker passes role_device(cfg, "trainer"). `engine_dtype`: the dtype the rollout engine
        computes in (`rollout_dtype(cfg)`), which trainer.precision auto follows."""
        from accelerate.utils import set_seed

        from areal_mq.algorithms.optim import build_optimizer, build_scheduler
        from areal_mq.algorithms.parallel import ParallelDims, refuse_unwired
        from areal_mq.algorithms.scaler import LossScaler
        from areal_mq.algorithms.strategy import build_strategy
        from areal_mq.algorithms.ulysses import ContextParallel, check_objective

        refuse_unwired(cfg)  # what no layout trains yet (tp with cp, cp with offload)
        check_objective(cfg, cfg.parallel.cp)  # cp > 1: what a slice of a sequence cannot compute
        self.cfg = cfg
        self.model_path = Path(model_path)
        self.precision = compute_precision(cfg, engine_dtype)
        self.strategy = build_strategy(cfg, self.precision)  # the precision setup, building, checkpoints, publishing
        self.accelerator, self.device = self._accelerator(accelerator, device or cfg.device or "auto")
        self.parallel = ParallelDims.of(cfg, self.accelerator.num_processes)  # the mesh; which rank does what
        self.strategy.bind(self.accelerator, self.device, self.parallel)
        apply_tf32_policy(self.device, cfg.tf32)
        set_seed(cfg.seed)
        # fp32 master weights (bf16/fp16 = autocast or FSDP2's MixedPrecisionPolicy); under fsdp sharded before
        # the optimizer is made, so AdamW's state sits beside each rank's own shards
        self.unwrapped, self.model = self.strategy.build(self.model_path, train=True)
        self.scaler = (LossScaler(cfg.loss_scale_init, cfg.loss_scale_growth_interval)
                       if self.precision == "fp16" else None)  # fp16: the loss is scaled (algorithms/scaler.py)
        self.optimizer = build_optimizer(self.unwrapped, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg)
        # cp > 1: each packed row split over the cp ranks (algorithms/ulysses.py); a no-op handle at cp 1
        self.context = ContextParallel(self.parallel.cp_group())
        self.ref_model = None
        if cfg.kl_coef > 0 and cfg.lora is not None:  # the base with the adapter off (lora.reference): no 2nd model
            self.ref_model = self.model
        elif cfg.kl_coef > 0:  # built like the policy: under fsdp 4 bytes per parameter / shard ranks more
            ref_unwrapped, self.ref_model = self.strategy.build(self.model_path, train=False)
            self._attention(ref_unwrapped)
        self._attention(self.unwrapped)
        self.version = 0
        self.optimizer_steps = 0
        self.consumed_ids: list[str] = []  # trained since the last checkpoint (algorithms/checkpoint.py)
        self.consumed_total = 0  # trained over the run
        self.checkpoint_base = 0  # the version of the checkpoint this interval started from
        self.resumed_ids: list[str] = []  # the interval the loaded checkpoint closed (load_checkpoint)

    def _attention(self, lm: Any) -> None:
        """How `lm` attends: packed rows block by block under trainer.attention varlen (algorithms/attention.py),
        then, at cp > 1, Ulysses around it (it hands every unsplit call to the same varlen function)."""
        if self.cfg.attention == "varlen":
            from areal_mq.algorithms.attention import use_varlen

            use_varlen(lm)
        self.context.attach(lm)

    def _accelerator(self, given: Any, spec: str) -> tuple[Any, "torch.device"]:
        """The Accelerator (given, or made for the resolved device) and the device this rank trains on."""
        import torch
        from accelerate import Accelerator

        from areal_mq.devices import resolve_device
        from areal_mq.errors import ConfigError

        want = resolve_device(spec)
        if given is None:
            if want.type == "cuda" and "LOCAL_RANK" not in os.environ:
                torch.cuda.set_device(want)  # one process: accelerate takes the current device for `cuda`
            # cpu=True without a GPU: under `accelerate launch --multi_gpu` (torchrun) that gives a gloo
            # MULTI_CPU group; accelerate's `--cpu` launcher starts several processes only through mpirun
            given = Accelerator(cpu=want.type != "cuda", mixed_precision=self.strategy.accelerate_precision)
        device = torch.device(given.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if want.type == "meta":  # the device-guard tests: a CPU accelerator, the model on meta
            return given, want
        if device.type != want.type:
            raise ConfigError(f"the trainer was asked for device {spec!r} ({want}) but its Accelerator runs on "
                              f"{device}; set trainer.device to match, or pass no accelerator")
        return given, device

    # ------------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def prepare(self, samples: Sequence["Sample"]) -> tuple[list[SeqData], list[list[MicroBatch]], list[StepCounts],
                                                          int]:
        """Sequences, this rank's micro-batches per mini-batch, the global counts of each mini-batch (generated
        tokens and sequences over every rank: the loss's denominators), and the number of oversized sequences."""
        seqs = samples_to_seqs(samples, self.cfg)
        if not seqs:
            raise ValueError("the batch has no generated tokens to train on (every sequence is empty or "
                             "loss_excluded); check packing.trains_anything(samples) first, as the trainer worker does")
        dp, dp_rank = self.parallel.dp, self.parallel.dp_rank(self.rank)  # this rank's share of the batch
        plan = plan_step(seqs, self.cfg, dp, dp_rank)
        packed, shared = self.cfg.packing != "padded", self.cfg.packing == "shared"
        pad_id = self.unwrapped.config.pad_token_id or 0
        varlen = self.cfg.attention == "varlen"
        minis = [[self.context.shard(build_microbatch(seqs, b, packed, pad_id, shared, self.device, varlen), pad_id)
                  for b in bins] for bins in plan.minibatches]  # cp > 1: this rank's columns of each row
        self._lockstep = [len(b) for b in plan.minibatches]
        if self.parallel.lockstep:  # every rank runs the busiest rank's micro-batch count
            counts = [[len(b) for b in plan_step(seqs, self.cfg, dp, r).minibatches] for r in range(dp)]
            self._lockstep = [max(c[i] for c in counts) for i in range(len(minis))]
        step_counts = [StepCounts(tokens, n) for tokens, n in zip(plan.gen_tokens, plan.n_seqs)]
        return seqs, minis, step_counts, plan.oversized

    def prox_from_forward(self, minis: list[list[MicroBatch]]) -> bool:
        """True when the proximal logprobs need no separate pass: with a single mini-batch nothing updates
        the weights between a recompute and the backward's forward, so both give the same numbers."""
        return self.cfg.behav_correction and len(minis) == 1 and not self.cfg.always_recompute_prox

    def recompute(self, minis: list[list[MicroBatch]]) -> None:
        """Proximal (and reference) logprobs with the current weights, stored on each micro-batch."""
        import torch

        recompute_prox = self.cfg.behav_correction and not self.prox_from_forward(minis)
        if not recompute_prox and self.ref_model is None:
            return
        self.model.eval()
        try:
            with torch.no_grad():
                for mini, n_runs in zip(minis, self._runs(minis)):
                    for mb in mini:
                        if recompute_prox:
                            mb.prox_logp, _ = token_logprobs(self.model, mb, self.cfg.temperature)
                        if self.ref_model is not None:
                            with self._reference():
                                mb.ref_logp, _ = token_logprobs(self.ref_model, mb, self.cfg.temperature)
                    for _ in range(n_runs - len(mini)):  # lockstep: join the other ranks' collectives
                        if recompute_prox:
                            self._empty_forward(self.model)
                        if self.ref_model is not None:
                            with self._reference():
                                self._empty_forward(self.ref_model)
        finally:
            self.model.train()

    def _normalize_returns(self, minis: list[list[MicroBatch]]) -> None:
        """trainer.kl_in reward_normalized: every micro-batch's advantages become REINFORCE++'s normalised returns
        (advantages.py `normalize_returns`; the mean and std over every rank's trained tokens)."""
        from areal_mq.algorithms.advantages import normalize_returns

        mbs = [mb for mini in minis for mb in mini]
        reduce = None
        if self.world_size > 1:
            import torch
            import torch.distributed as dist

            counts = self.parallel.counts_metrics(self.rank)  # tp: one rank of a group counts its tokens

            def reduce(t):  # NCCL reduces device tensors only
                on = t.to(self.device) if counts else torch.zeros_like(t, device=self.device)
                dist.all_reduce(on, op=dist.ReduceOp.SUM)
                t.copy_(on.cpu() if t.device.type == "cpu" else on)
        parts = [(mb.advantages, mb.behav_logp, mb.ref_logp, mb.seq_index) for mb in mbs]
        sums = [self.context.sequence_sums(mb) for mb in mbs]  # cp: a sequence's KL on the later ranks counts too
        for mb, adv in zip(mbs, normalize_returns(parts, self.cfg, reduce, sums)):
            mb.advantages = adv.to(mb.advantages.dtype)

    def _reference(self) -> Any:
        """The reference policy's context: under trainer.lora the adapter switched off, else nothing to do."""
        import contextlib

        if self.cfg.lora is None:
            return contextlib.nullcontext()
        from areal_mq.algorithms.lora import reference

        return reference(self.unwrapped)

    def _runs(self, minis: list[list[MicroBatch]]) -> list[int]:
        """Forwards each mini-batch takes on this rank: its micro-batches, or the busiest rank's count (lockstep)."""
        runs = getattr(self, "_lockstep", None)
        return runs if runs is not None and len(runs) == len(minis) else [len(m) for m in minis]

    def _empty_forward(self, model: Any) -> "torch.Tensor":
        """A one-token forward whose result is 0 (with the graph): a rank with nothing to compute still takes
        part in DDP's all-reduce or FSDP's per-layer all-gathers and reduce-scatters."""
        import torch

        one = self._dummy_ids()
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        logp, _ = model(one, one * 0, None, zero, zero, zero, 1.0, False)
        return logp.sum() * 0.0

    def backward_minibatch(self, mini: list[MicroBatch], step: StepCounts | int,
                           n_runs: int | None = None) -> tuple["torch.Tensor", np.ndarray, "torch.Tensor"]:
        """Accumulate the gradient of one mini-batch (zeroed first); `step`: the whole mini-batch's counts over
        every rank (an int: its generated tokens alone, enough for loss_agg token-mean). Returns this rank's
        metric sums: the value-dependent ones [_N_DEVICE_SUMS] float64 on the device, the counts (n_gen, fwd_tokens) on the
        host, and its largest behaviour weight (0-dim, device). Nothing here waits for the device."""
        import torch

        step = step if isinstance(step, StepCounts) else StepCounts(step)
        sums = torch.zeros(_N_DEVICE_SUMS, dtype=torch.float64, device=self.device)
        weight_max = torch.zeros(2, dtype=torch.float64, device=self.device)  # behaviour weight, mismatch |d|
        counts = np.zeros(len(_SUMS) - _N_DEVICE_SUMS)
        self.optimizer.zero_grad(set_to_none=True)
        n_runs = max(n_runs if n_runs is not None else len(mini), len(mini))
        for k in range(len(mini), max(n_runs, 1)):  # no sequence here (or lockstep): zeros join the reductions
            with self.strategy.accumulate(self.model, k == n_runs - 1 or n_runs == 0):
                self.accelerator.backward(self._empty_forward(self.model) * self._loss_scale)
        for k, mb in enumerate(mini):
            last = k == len(mini) - 1
            with self.strategy.accumulate(self.model, last):
                logp, entropy = token_logprobs(self.model, mb, self.cfg.temperature, with_entropy=True,
                                               entropy_grad=self.cfg.entropy_coef > 0)
                if not self.cfg.behav_correction:
                    prox = mb.behav_logp
                else:  # None: one mini-batch, so this forward runs on the proximal weights (see recompute)
                    prox = mb.prox_logp if mb.prox_logp is not None else logp.detach()
                loss, st = ppo_loss(logp, prox, mb.behav_logp, mb.advantages, step.tokens, self.cfg, mb.ref_logp,
                                    mb.seq_index, step.seqs, entropy, self.context.sequence_sums(mb))
                entropy = entropy.detach()
                self.accelerator.backward(loss * (self.parallel.dp * self._loss_scale))
            at_v = mb.prox_logp if mb.prox_logp is not None else logp  # the trainer's logprobs at version v
            mm_k3, mm_n, mm_out, mm_max = mismatch_stats(at_v, mb.behav_logp, mb.versions, self.version)
            sums += torch.stack([loss.detach().double(), st.clipped.double(), st.weight_sum.double(),
                                 st.capped.double(), st.masked.double(), st.kl_sum.double(),
                                 entropy.sum().double(), mm_k3, mm_n, mm_out])
            counts += [st.n_tokens, mb.n_tokens]
            weight_max = torch.maximum(weight_max, torch.stack([st.weight_max.double(), mm_max]))
        return sums, counts, weight_max

    @property
    def _loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def optimizer_step(self) -> "torch.Tensor":
        """Clip, step AdamW and the schedule. Returns the gradient norm before clipping (0-dim, device).
        fp16: the gradients are unscaled first, and a step whose norm is not finite (an overflow on any rank)
        is skipped, the scale backs off (LossScaler) and its norm reads 0 (counted in fp16_skipped_steps)."""
        import torch

        max_norm = self.cfg.grad_clip if self.cfg.grad_clip is not None else float("inf")
        self.context.reduce_grads(self.model)  # cp > 1: the row's gradient is the sum of the cp ranks' (FSDP: dp only)
        if self.scaler is not None:
            self.scaler.unscale_(self.model.parameters())
        norm = self.strategy.clip(self.model, max_norm)
        if self.scaler is not None and not self.scaler.update(norm):
            self.optimizer.zero_grad(set_to_none=True)
            return torch.zeros_like(norm.detach())
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer_steps += 1
        return norm.detach()

    def run_minibatches(self, minis: list[list[MicroBatch]], step_counts: list[StepCounts] | list[int]):
        """The device part of a step after `recompute`: backward and optimizer step per mini-batch. Returns
        (device sums, host counts, device max behaviour weight, [device grad norm per mini-batch]) for
        `_reduce`; no host sync, so it runs on `meta` under DeviceGuard (tests/unit/algorithms)."""
        import torch

        sums = torch.zeros(_N_DEVICE_SUMS, dtype=torch.float64, device=self.device)
        weight_max = torch.zeros(2, dtype=torch.float64, device=self.device)
        counts, norms = np.zeros(len(_SUMS) - _N_DEVICE_SUMS), []
        for mini, step, n_runs in zip(minis, step_counts, self._runs(minis)):
            mb_sums, mb_counts, mb_max = self.backward_minibatch(mini, step, n_runs)
            sums, counts, weight_max = sums + mb_sums, counts + mb_counts, torch.maximum(weight_max, mb_max)
            norms.append(self.optimizer_step())
        return sums, counts, weight_max, norms

    def close(self) -> None:
        """End this rank's process group, where one was made: its gloo/NCCL threads are joined before the interpreter
        exits. A rank that exits with them running aborts ("terminate called without an active exception", SIGABRT)
        when another rank is still finishing: a 2-rank export test failed so in CI."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    def train_step(self, samples: Sequence["Sample"]) -> dict[str, float]:
        """One training step on `samples` (the same list on every rank); returns metrics."""
        t0 = time.perf_counter()
        seqs, minis, step_counts, oversized = self.prepare(samples)
        t1 = time.perf_counter()
        with DeviceSpan(self.device) as recompute_span:
            self.recompute(minis)
            if self.cfg.kl_in == "reward_normalized" and self.cfg.kl_coef > 0:
                self._normalize_returns(minis)
        lr = self.scheduler.get_last_lr()[0]
        skipped = self.scaler.skipped if self.scaler is not None else 0
        sums, weight_max, norms = self._reduce(*self.run_minibatches(minis, step_counts))
        elapsed = time.perf_counter() - t0
        metrics = self._metrics(seqs, samples, sums, weight_max, norms, len(minis))
        metrics.update(lr=lr, oversized_seqs=oversized, prepare_s=t1 - t0,
                       prox_recompute_s=recompute_span.seconds(), step_s=elapsed,
                       tokens_per_s=sum(s.length for s in seqs) / elapsed, n_microbatches=sum(len(m) for m in minis), prox_from_forward=int(self.prox_from_forward(minis)))
        if self.scaler is not None:  # the scale each micro-batch's loss is multiplied by next
            metrics.update(loss_scale=self.scaler.scale, fp16_skipped_steps=self.scaler.skipped - skipped)
        self.version += 1
        self.consumed_ids.extend(s.sample_id for s in samples)
        self.consumed_total += len(samples)
        metrics["version"] = self.version
        return {k: v if isinstance(v, list) else int(v) if isinstance(v, (int, np.integer)) else float(v)
                for k, v in metrics.items()}

    # ------------------------------------------------------------------------------------------
    def _dummy_ids(self) -> "torch.Tensor":
        import torch

        return torch.zeros((1, 1), dtype=torch.long, device=self.device)

    def _reduce(self, sums: "torch.Tensor", counts: np.ndarray, weight_max: "torch.Tensor",
                norms: list["torch.Tensor"]) -> tuple[np.ndarray, float, list[float]]:
        """Reduce over ranks (`_all_reduce`), then read everything back in one copy: the step's only host sync.
        Returns the sums ordered as _SUMS, the largest behaviour weight and the gradient norms."""
        host = self._all_reduce(sums, counts, weight_max, norms).cpu().numpy()
        n = len(_SUMS)
        return host[:n], host[n:n + 2].tolist(), host[n + 2:].tolist()

    def _all_reduce(self, sums: "torch.Tensor", counts: np.ndarray, weight_max: "torch.Tensor",
                    norms: list["torch.Tensor"]) -> "torch.Tensor":
        """[sums (_SUMS order) summed over ranks, max weight over ranks, norms...] as one float64 tensor on
        the device (NCCL refuses CPU tensors; the norms are those of the all-reduced gradient already). Each token
        counts once: the tp ranks of a group computed the same tokens, so only tp index 0 adds its sums
        (ParallelDims.counts_metrics); cp ranks computed disjoint slices of a row and all add theirs."""
        import torch

        total = torch.cat([sums, torch.as_tensor(counts, dtype=torch.float64).to(self.device)])
        if not self.parallel.counts_metrics(self.rank):
            total = torch.zeros_like(total)
        weight_max = weight_max.reshape(-1)
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            dist.all_reduce(weight_max, op=dist.ReduceOp.MAX)
        return torch.cat([total, weight_max, torch.stack(norms).double()])

    def _metrics(self, seqs, samples, sums, weight_max, norms, n_minis) -> dict[str, float]:
        s = dict(zip(_SUMS, sums))
        n = max(s["n_gen"], 1.0)
        weight_max, mm_max = weight_max
        stale = np.concatenate([self.version - q.versions[q.train_idx] for q in seqs])  # generated tokens only
        rewards = [q.reward for smp in samples for q in smp.seqs]
        out = {
            "loss": s["loss"] / n_minis, "clip_frac": s["clipped"] / n, "entropy": s["entropy_sum"] / n,
            "behav_weight_mean": s["weight_sum"] / n, "behav_weight_max": weight_max,
            "behav_capped_frac": s["capped"] / n,
            # tokens that gave no loss (behaviour cap in mode mask, or outside [1/k, k]: offpolicy_mask_k)
            "masked_frac": s["masked"] / n, "grad_norm": float(np.mean(norms)),
            "grad_norm_max": float(np.max(norms)), "staleness_mean": float(stale.mean()),
            "staleness_max": int(stale.max()), "n_samples": len(samples), "n_seqs": len(seqs),
            # generated tokens trained at staleness 0, 1, 2, ... versions (index = staleness)
            "staleness_hist": np.bincount(np.clip(stale, 0, None)).astype(int).tolist(),
            "n_tokens": int(sum(q.length for q in seqs)), "n_gen_tokens": int(s["n_gen"]),
            # sequences not trained by controller.overlong_filter (their rewards still shaped the advantages)
            "loss_excluded_seqs": sum(q.loss_excluded for smp in samples for q in smp.seqs),
            "fwd_tokens": int(s["fwd_tokens"]),  # tokens the model computed (fewer than n_tokens when prompts are shared)
            "reward_mean": float(np.mean(rewards)), "adv_abs_mean": float(np.mean([abs(q.advantage) for q in seqs])),
        }
        if self.cfg.kl_coef > 0:
            out["kl"] = s["kl_sum"] / n
        # engine vs trainer on the same weights (staleness-0 tokens): precision is measured, not assumed
        out["mismatch_tokens"] = int(s["mm_n"])
        if s["mm_n"] > 0:
            out.update(mismatch_kl=s["mm_k3"] / s["mm_n"], mismatch_abs_max=mm_max,
                       mismatch_out_frac=s["mm_out"] / s["mm_n"])
        return out

    # ------------------------------------------------------------------------------------------
    def publish_tensors(self, dtype: str | None = None) -> dict[str, "torch.Tensor"]:
        """A snapshot of the policy weights for publishing: state-dict names, tied duplicates dropped
        (as save_pretrained does), cast to `dtype` (default cfg.publish_dtype), always copied. Under fsdp this
        is a collective (every rank calls it; the full model is gathered one tensor at a time and kept on
        rank 0 only, the others get {}): the named fallback of sharded publishing (trainer.publish_layout gather).
        `parallel.gathers_collectively` says whether ranks other than 0 must call it."""
        if self.cfg.lora is not None:  # a LoRA version is its adapter (WeightsReady.adapter); engines merge it
            from areal_mq.algorithms.lora import snapshot  # under fsdp gathered whole, every rank taking part

            return snapshot(self.unwrapped, dtype or self.cfg.publish_dtype, keep=self.is_main)
        return self.strategy.full_state_dict(self.unwrapped, dtype or self.cfg.publish_dtype, keep=self.is_main)

    def publish_slices(self, dtype: str | None = None) -> tuple[dict, dict]:
        """This rank's own slices of the policy weights for sharded publishing (areal_mq/weights/sharded.py): a copy
        in host memory in `dtype` (default cfg.publish_dtype; staged from the device through pinned buckets,
        weights/staging.py) and where each slice sits, as the strategy lays them out ({} on a rank outside the
        serving replica group). No collective."""
        return self.strategy.local_slices(self.unwrapped, dtype or self.cfg.publish_dtype)

    @property
    def hf_config_json(self) -> str:
        """The model's Hugging Face config.json text (published beside disk weights: from_pretrained loads them)."""
        return self.unwrapped.config.to_json_string()
