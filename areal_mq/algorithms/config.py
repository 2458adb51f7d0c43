"""Config of the trainer (owned by areal_mq.algorithms).

What: `TrainerConfig` holds every knob of the decoupled-PPO trainer — optimisation, the loss
(clipping, behaviour-policy correction and the off-policy corrections — TIS, IcePop masking, CISPO — each
with its source in its field description, KL), advantages, micro-batch packing, weight publishing and
checkpoints. `validate_off_policy(max_staleness, cfg)` is the cross-section rule the root RunConfig
calls: asynchronous training (max_staleness > 0) without the behaviour correction is refused unless
the user opts in explicitly.
Why: one documented model, unknown keys rejected, so a typo in a YAML file fails loudly.
"""
from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from areal_mq.devices import DEVICE_RE
from areal_mq.errors import ConfigError
from areal_mq.sim.config import SimTrainerConfig


_MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")


class LoraConfig(BaseModel):
    """trainer.lora: train a low-rank adapter on a frozen base instead of every weight."""
    model_config = ConfigDict(extra="forbid")

    rank: int = Field(16, ge=1, le=1024, description="the adapter's rank r (A is r x in, B is out x r)")
    alpha: float = Field(32.0, gt=0, description="the update is scaled by alpha / rank (PEFT's lora_alpha)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input while training")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="linear modules that get an adapter: 'all-linear' (every linear of the decoder "
        "layers, not the output head) or names such as [q_proj, k_proj, v_proj, o_proj]")

    @field_validator("target_modules")
    @classmethod
    def _names(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v or len(v) > 32:
                raise ValueError("target_modules: give 1 to 32 module names, or 'all-linear'")
            bad = [n for n in v if not _MODULE_NAME.match(n)]
            if bad:
                raise ValueError(f"target_modules: {bad} are not module names (letters, digits, _)")
        return v

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class FsdpConfig(BaseModel):
    """FSDP2 settings (trainer.strategy: fsdp; areal_mq/algorithms/fsdp.py)."""

    model_config = ConfigDict(extra="forbid")

    reshard_after_forward: bool = Field(
        True, description="Free each decoder layer's gathered parameters after its forward and gather them again "
        "in backward (ZeRO-3: least memory, one more all-gather per layer); false keeps them until backward "
        "(ZeRO-2-like: +1 full layer set of parameters per rank, less communication).")
    offload: bool = Field(
        False, description="Keep the sharded fp32 parameters, gradients and AdamW state in host memory (FSDP2 "
        "CPUOffloadPolicy): the device then holds only the layers being computed; the optimizer step runs on the "
        "CPU. For a model whose 16 bytes per parameter / world size do not fit the device.")
    load: Literal["slices", "broadcast", "full"] = Field(
        "slices", description="How each rank gets its shards (areal_mq/algorithms/loading.py). slices: the model is "
        "built on the meta device, sharded, and every rank reads only the rows it owns from the checkpoint's "
        "safetensors, memory-mapped (host peak per rank ~ its fp32 shard, 4 bytes x parameters / shard ranks); "
        "broadcast: the same, rank 0 reading each tensor whole and broadcasting it (+ the largest tensor per rank); "
        "full: the old path, every rank loads the whole model in fp32 first (4 bytes x parameters per rank), kept "
        "for comparison (benchmarks/speed/trainer.py --load).")
    replicate: int = Field(
        1, ge=1, description="HSDP: replica groups of the trainer's ranks. 1: one flat FSDP mesh over every rank. "
        "R > 1: a 2-D mesh, R groups of launcher.trainer_ranks / R ranks; parameters sharded within a group and "
        "replicated across groups (16 bytes x parameters / (ranks / R) per rank), gradients reduce-scattered "
        "within a group and all-reduced across groups. Set ranks / R to the GPUs of one node so each layer's "
        "all-gather stays on the node's links and only one gradient all-reduce crosses nodes "
        "(docs/bigger-models.md). Sharded publishing is served by group 0 alone. The older key for "
        "trainer.parallel.dp_replicate: read under strategy fsdp when trainer.parallel is not given; given with "
        "trainer.parallel, a value other than 1 must equal dp_replicate.")
    logprob_chunk_mb: float = Field(
        256.0, gt=0, description="Byte budget of one chunk of fp32 logits in the chunked logprob/entropy "
        "computation (any strategy): tokens per chunk = budget / (4 * vocabulary).")


class ParallelConfig(BaseModel):
    """trainer.parallel: the trainer's parallel degrees (areal_mq/algorithms/parallel.py `ParallelDims` owns the mesh
    they make and answers which rank does what)."""

    model_config = ConfigDict(extra="forbid")
    _source: str = PrivateAttr("trainer.parallel")  # where the degrees came from, for error messages

    dp_replicate: int = Field(
        1, description="Whole copies of the model (data parallelism across them: gradients all-reduced). -1: the "
        "ranks the other degrees leave (launcher.trainer_ranks / (dp_shard x cp x tp)).")
    dp_shard: int = Field(
        -1, description="Ranks one copy's parameters, gradients and AdamW state are sharded over (FSDP2; data "
        "parallel too: each takes its own share of the batch). -1 (default): the ranks the other degrees leave. "
        "1 with tp and cp 1: no sharding, every rank a whole copy (what trainer.strategy ddp was).")
    tp: int = Field(
        1, description="Tensor parallelism: ranks that split each decoder layer's matrices (the innermost dim: keep a "
        "tp group on one node; areal_mq/algorithms/tensor_parallel.py: Megatron's split of q/k/v/o and the MLP, "
        "embeddings and head whole on every tp rank). tp must divide the attention heads, KV heads and MLP width; "
        "refused with trainer.lora, with publish_layout sharded (auto gathers) and with cp > 1.")
    cp: int = Field(
        1, description="Context parallelism: ranks that split one packed micro-batch's tokens (Ulysses, "
        "areal_mq/algorithms/ulysses.py: two all-to-alls around each attention call); the cp ranks hold the same "
        "parameter shards (FSDP shards over dp_shard only) and their gradients are summed. cp must divide the "
        "attention heads and KV heads; sequence-level objectives (gspo, seq-mean loss_agg, sequence / geometric "
        "behaviour weights, kl_in reward and reward_normalized) sum each sequence's statistics over the cp ranks; "
        "ulysses.check_objective names what it refuses at start: padded packing, shared packing under attention "
        "sdpa; refused with tp > 1 and with fsdp.offload.")

    @field_validator("dp_replicate", "dp_shard")
    @classmethod
    def _dp(cls, v: int, info: Any) -> int:
        if v != -1 and v < 1:
            raise ValueError(f"trainer.parallel.{info.field_name} must be a positive number of ranks, or -1 (the "
                             f"ranks the other degrees leave); got {v}")
        return v

    @field_validator("tp", "cp")
    @classmethod
    def _split(cls, v: int, info: Any) -> int:
        if v < 1:
            raise ValueError(f"trainer.parallel.{info.field_name} must be a positive number of ranks (1: off); got {v}")
        return v

    @model_validator(mode="after")
    def _one_free(self) -> "ParallelConfig":
        if self.dp_replicate == -1 and self.dp_shard == -1:
            raise ValueError("trainer.parallel: dp_replicate and dp_shard are both -1; at most one may take the ranks "
                             "the others leave (give the other a number)")
        return self

    @property
    def shards(self) -> bool:
        """Whether the degrees split the model (dp_shard other than 1, tp or cp above 1): no rank holds it whole."""
        return self.dp_shard != 1 or self.tp > 1 or self.cp > 1

    def degrees(self) -> str:
        return (f"(dp_replicate {self.dp_replicate}, dp_shard {self.dp_shard}, cp {self.cp}, tp {self.tp})")


class TrainerConfig(BaseModel):
    """Decoupled-PPO trainer settings."""

    model_config = ConfigDict(extra="forbid")

    # ---------------------------------------------------------------- optimisation
    lr: float = Field(1e-6, gt=0, description="Peak learning rate of AdamW.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW (beta1, beta2).")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear LR warmup from 0 to `lr`.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="LR after warmup: constant, or linear/cosine decay to lr*min_lr_ratio at decay_steps."
    )
    decay_steps: int = Field(1000, ge=1, description="Optimizer step at which linear/cosine decay reaches its floor.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Floor of the decayed LR as a fraction of `lr`.")
    grad_clip: float | None = Field(1.0, gt=0, description="Clip the global gradient norm to this (null: no clipping).")
    device: str | None = Field(
        None, pattern=DEVICE_RE.pattern, description="The trainer's device, overriding model.device: auto (cuda when "
        "available, else cpu), cpu, cuda or cuda:N. Under `accelerate launch` each rank takes its own GPU (LOCAL_RANK)."
    )
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="Compute precision; the master weights and AdamW state are always fp32. bf16: autocast "
        "over the fp32 weights (Accelerate mixed precision); fp16: fp16 autocast with dynamic loss scaling "
        "(trainer.loss_scale_*; requires rollout.engine.dtype float16, the remedy measured for the bf16 "
        "trainer/engine mismatch, arXiv 2510.26788); fp32: no autocast; auto: the rollout engine's precision "
        "(bf16 when rollout.engine.dtype, or model.dtype where that is auto, is bfloat16; fp16 when it is float16; "
        "else fp32), on any device: "
        "the behaviour weights compare the trainer's logprobs with the engine's, and a bf16 trainer against an "
        "fp32 engine is off-policy by numerics alone (benchmarks/quality/RESULTS.md, GPU stage q). Under strategy fsdp, "
        "bf16 and fp16 are FSDP2's MixedPrecisionPolicy (parameters cast for compute, gradients reduced in fp32). "
        "Each step's metrics carry mismatch_kl (engine vs trainer on the same weights) to choose by evidence."
    )
    loss_scale_init: float = Field(
        65536.0, ge=1, description="fp16 only: the initial dynamic loss scale (halved at every optimizer step whose "
        "gradient overflows, which is then skipped and counted in fp16_skipped_steps).")
    loss_scale_growth_interval: int = Field(
        200, ge=1, description="fp16 only: finite optimizer steps in a row after which the loss scale doubles.")
    tf32: bool = Field(
        False, description="TF32 policy on CUDA, set explicitly when the trainer starts "
        "(torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32): off by default, so an fp32 op "
        "computes in fp32 (logprob ratios compare fp32 numbers); under bf16 autocast the matmuls are bf16 anyway "
        "and this only touches the fp32 ops autocast leaves (losses, softmax). No effect on CPU."
    )
    seed: int = Field(1, description="Seed of torch/numpy/python RNGs and of the mini-batch shuffle.")
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="The older way to say trainer.parallel, still read (and, after loading, the strategy module "
        "trainer.parallel needs: areal_mq/algorithms/strategy.py). ddp: every rank holds the whole model, fp32 weights "
        "+ gradients + AdamW state (16 bytes per parameter, ~1.5B parameters on an 80 GB GPU); fsdp: FSDP2 "
        "fully_shard per decoder layer and the root, so a rank holds 16 / world_size bytes per parameter plus one "
        "gathered layer (docs/bigger-models.md). Runs on CPU (gloo) and GPU (nccl); `trainer.fsdp` tunes it. "
        "Given without trainer.parallel, it maps onto it: ddp is dp_replicate -1 (every rank), dp_shard 1; fsdp is "
        "dp_replicate trainer.fsdp.replicate, dp_shard -1 (the ranks left). Given with trainer.parallel it must agree "
        "(fsdp exactly when dp_shard is not 1 or tp or cp is above 1), else the config is refused.")
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig, description="FSDP2 settings (strategy: fsdp).")
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig, description="The trainer's parallel degrees, dp_replicate x dp_shard x cp x tp "
        "= launcher.trainer_ranks (one of dp_replicate, dp_shard may be -1: the ranks the others leave; "
        "areal_mq/algorithms/parallel.py, docs/bigger-models.md). Not given, it is read from the older keys: strategy "
        "ddp = {dp_replicate: -1, dp_shard: 1}; strategy fsdp = {dp_replicate: fsdp.replicate, dp_shard: -1} (HSDP "
        "when replicate > 1). Given, it decides trainer.strategy (fsdp when dp_shard is not 1 or tp or cp is above 1, "
        "else ddp); an explicit trainer.strategy or trainer.fsdp.replicate (other than 1) that says otherwise is "
        "refused. E.g. {dp_shard: 8, tp: 4} on 32 ranks; {dp_replicate: 2, dp_shard: 8} is HSDP over 2 nodes of 8.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    lora: LoraConfig | None = Field(
        None, description="Train a LoRA adapter on a frozen base instead of every weight (areal_mq/algorithms/lora.py, "
        "docs/bigger-models.md): the base is held in the training precision's dtype with no gradients or optimizer "
        "state, only the adapter trains (fp32); the reference model is the base with the adapter off; versions "
        "publish the adapter only (WeightsReady.adapter) and engines merge it from their base. null: full "
        "fine-tuning. Under strategy fsdp the base and the adapter are sharded together per decoder layer.")

    # ---------------------------------------------------------------- loss
    temperature: float = Field(
        1.0, ge=0, description="Sampling temperature of the rollouts; logprobs are log_softmax(logits/temperature) "
        "(0 means greedy: no scaling). Must equal the rollout temperature."
    )
    eps_clip_low: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip below: r >= 1 - eps_clip_low.")
    eps_clip_high: float = Field(0.2, gt=0, description="PPO ratio clip above: r <= 1 + eps_clip_high (clip-higher).")
    behav_correction: bool = Field(
        True, description="Decoupled PPO: recompute proximal logprobs and weight tokens by exp(prox - behaviour). "
        "Off: plain PPO centred on the behaviour logprobs (no recompute)."
    )
    always_recompute_prox: bool = Field(
        False, description="Recompute proximal logprobs in a separate no-grad pass even with one mini-batch (where "
        "the training forward already gives the same numbers; default reuses it and saves a forward)."
    )
    behav_weight_cap: float | None = Field(
        5.0, ge=1, description="Cap of the behaviour importance weight w = exp(prox - behaviour) (null: no cap; "
        ">= 1, since on-policy tokens have w = 1). With behav_cap_mode truncate this IS truncated importance "
        "sampling (TIS: min(w, C); Yao et al. 2025, 'Your efficient RL framework secretly brings you off-policy "
        "RL training', verl's rollout_is=token/truncate; they use C = 2)."
    )
    behav_cap_mode: Literal["truncate", "mask"] = Field(
        "truncate", description="truncate: use min(w, cap) (TIS); mask: tokens with w > cap contribute no loss "
        "(one-sided masked importance sampling, verl's MIS)."
    )
    behav_weight_level: Literal["token", "sequence", "geometric"] = Field(
        "token", description="What the behaviour weight is taken over. token: w = exp(prox - behaviour) of each "
        "token (decoupled PPO, AReaL). sequence: every token of a sequence gets the weight of the whole sequence, "
        "exp(sum of (prox - behaviour) over its tokens): it also corrects for the prefixes the behaviour policy "
        "chose, which a token's own weight does not (verl's rollout_is level 'sequence'; high variance: keep a "
        "behav_weight_cap). geometric: exp(mean of (prox - behaviour)) per sequence (verl's 'geometric', the "
        "length-normalised sequence ratio of GSPO, arXiv 2507.18071). The cap and masks below act on this weight."
    )
    offpolicy_mask_k: float | None = Field(
        None, gt=1, description="Two-sided token masking (IcePop, Ling team 2025 'Small leak can sink a great "
        "ship', AReaL 2.0's KPop): tokens whose behaviour weight exp(prox - behaviour) leaves [1/k, k] contribute "
        "no loss (and no gradient); kept tokens keep their weight (capped as above). null: off; k > 1 "
        "(e.g. 2). Needs behav_correction (without it the weight is 1 everywhere)."
    )
    policy_loss: Literal["ppo", "cispo", "gspo"] = Field(
        "ppo", description="The policy loss (a registry: areal_mq/algorithms/objective.py POLICY_LOSSES). "
        "ppo: the clipped surrogate min(r*A, clip(r)*A), which drops the gradient of clipped "
        "tokens. cispo: CISPO (MiniMax-M1, arXiv 2506.13585; AReaL 2.0): -sg(clip(r, 1-eps_clip_low, "
        "1+eps_clip_high)) * A * logp, every token keeps a gradient, its IS ratio is clipped instead. gspo: GSPO "
        "(Zheng et al. 2025, arXiv 2507.18071): the ratio is the sequence's s = exp(mean of (logp - prox) over its "
        "tokens), clipped per sequence with eps_clip_low/high (the paper uses ~3e-4 / 4e-4, not 0.2), every token "
        "carrying its sequence's s as value and s * grad(logp) as gradient (GSPO-token); the paper's objective is "
        "gspo with loss_agg seq-mean-token-mean. All are weighted by the behaviour weight and masks above; "
        "r = exp(logp - prox)."
    )
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "constant"] = Field(
        "token-mean", description="How per-token losses make the step's loss (verl's loss_agg_mode; registry "
        "LOSS_AGGREGATIONS in areal_mq/algorithms/objective.py). token-mean: sum over the step's tokens / their "
        "count (long answers weigh more, DAPO). seq-mean-token-mean: the mean over the step's sequences of each "
        "sequence's token mean (GRPO as published, GSPO). seq-mean-token-sum: the mean over sequences of each "
        "sequence's token sum. constant: sum over tokens / (sequences x loss_agg_constant) (Dr. GRPO, arXiv "
        "2503.20783: no length bias). Counts are of the whole optimizer step (every micro-batch and rank)."
    )
    loss_agg_constant: float | None = Field(
        None, gt=0, description="loss_agg constant only: the normaliser per sequence, e.g. the rollouts' "
        "max_new_tokens (Dr. GRPO divides by the generation budget); required there, unused otherwise."
    )
    allow_uncorrected_off_policy: bool = Field(
        False, description="Allow max_staleness > 0 with behav_correction off (biased; you must opt in)."
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty to the frozen initial model (0: off).")
    kl_in: Literal["loss", "reward", "reward_normalized"] = Field(
        "loss", description="Where the KL to the frozen initial model goes (kl_coef > 0). loss: kl_coef x the "
        "kl_estimator term in each token's loss (GRPO). reward: no KL in the loss; the k1 estimate log(behaviour / "
        "reference) of every generated token is a per-token reward, folded into the advantage as REINFORCE++ does "
        "(arXiv 2501.03262): A_t = A - kl_coef x (sum of the KL over the sequence's tokens from t on), after the "
        "advantage estimator (the KL is not normalised with the rewards; kl_estimator is not used). "
        "reward_normalized (adv_estimator reinforce_pp or reinforce_pp_baseline only): the paper's order, as OpenRLHF runs it: each token's "
        "return G_t = reward - kl_coef x (the KL summed from t on), then normalised over every trained token of the "
        "step on every rank ((G - mean) / (std + adv_eps); adv_std_norm false: minus the mean only), after the "
        "reference pass (areal_mq/algorithms/advantages.py `normalize_returns`).")
    entropy_coef: float = Field(
        0.0, ge=0, description="Entropy bonus: each token's loss gets -entropy_coef x the entropy of the policy's "
        "next-token distribution there, aggregated like the rest (loss_agg; verl's entropy_coeff). 0: off, and "
        "the entropy (always logged) is computed without gradient; > 0 backpropagates it through the chunked "
        "LM head (one more [chunk, vocabulary] fp32 tensor in backward)."
    )
    kl_estimator: Literal["k1", "k3"] = Field("k3", description="KL estimator: k1 = logp - ref, k3 = e^(ref-logp) - (ref-logp) - 1.")

    # ---------------------------------------------------------------- advantages
    reward_scale: float = Field(1.0, description="Rewards are transformed as clip((r + reward_bias) * reward_scale).")
    reward_bias: float = Field(0.0, description="Added to every reward before scaling.")
    reward_clip: float | None = Field(None, gt=0, description="Clip transformed rewards to [-reward_clip, reward_clip].")
    adv_estimator: Literal["group", "reinforce_pp", "reinforce_pp_baseline"] = Field(
        "group", description="The advantage estimator (registry ADVANTAGE_ESTIMATORS in "
        "areal_mq/algorithms/advantages.py). group: each prompt's group of sequences against a baseline within the "
        "group (adv_baseline), optionally divided by the group's std (adv_std_norm; GRPO; adv_std_norm false is "
        "Dr. GRPO's unnormalised advantage, leave_one_out without it is RLOO). reinforce_pp: REINFORCE++ (arXiv "
        "2501.03262): no group baseline, the rewards minus the mean over every sequence of the step, divided by "
        "their std (adv_std_norm; adv_baseline unused); the paper pairs it with kl_in reward. reinforce_pp_baseline: "
        "REINFORCE++-baseline: each group's rewards minus the group's mean first, then the same normalisation over "
        "the step."
    )
    adv_baseline: Literal["group_mean", "leave_one_out", "none"] = Field(
        "group_mean", description="Baseline subtracted within a group: its mean, the mean of the others, or none."
    )
    adv_std_norm: bool = Field(True, description="Divide group advantages by the group's reward std (GRPO).")
    adv_eps: float = Field(1e-6, gt=0, description="Added to the std before dividing.")

    # ---------------------------------------------------------------- batching
    ppo_n_minibatches: int = Field(1, ge=1, description="Optimizer steps per training step (the batch is split).")
    # Not "as large as memory allows": a packed row of L tokens attends through a block-diagonal mask, and on
    # CPU scaled-dot-product attention with an explicit mask takes the math path, which materializes an
    # L x L score matrix per head and layer (kept for backward). Cost then grows with L^2 of the ROW, not of
    # the sequences: measured on SmolLM2-135M, a 2,762-token step took 45-57 s as one row and 20-22 s as
    # rows of <= 1,024 or 512 tokens (budget 300: 28 s, per-row overhead wins again).
    max_tokens_per_mb: int = Field(1024, ge=16, description="Token budget of one packed micro-batch (per rank); "
                                   "keep rows near 1k tokens on CPU (attention cost grows with the row length squared).")
    packing: Literal["shared", "dynamic", "padded"] = Field(
        "shared", description="shared: like dynamic, with each group's prompt computed once for all its "
        "completions (tree attention mask); dynamic: first-fit-decreasing packing into one padding-free row; "
        "padded: fixed `padded_mb_size` sequences per micro-batch, right-padded (baseline)."
    )
    padded_mb_size: int = Field(4, ge=1, description="Sequences per micro-batch when packing == padded.")
    attention: Literal["sdpa", "varlen"] = Field(
        "sdpa", description="How a packed micro-batch attends. sdpa: through an L x L mask over its row (shared: "
        "packing.py's boolean tree mask; dynamic: transformers' block-diagonal one from the position ids), quadratic "
        "in the row (3 GiB at 32k tokens in bf16) and off SDPA's flash kernels. varlen: block by block, one causal SDPA "
        "call per completion over [its prompt; itself] (areal_mq/algorithms/attention.py): nothing quadratic in the "
        "row, equal to sdpa to fp32 rounding, each prompt's attention computed once per completion of its group. "
        "Padded micro-batches attend the same way under both.")

    # ---------------------------------------------------------------- weights and checkpoints
    publish_mode: Literal["disk", "zmq", "cuda_ipc"] = Field(
        "disk", description="How new weights reach rollout workers: disk (run_dir/weights), zmq (the trainer's weight "
        "server), cuda_ipc (colocated: shared buffers on the trainer's device, one device copy; on cpu the same "
        "protocol on shared memory; trainer and rollout on one device, areal_mq/weights/ipc.py).")
    publish_dtype: Literal["bfloat16", "float32", "float16"] = Field("bfloat16", description="dtype of published weights.")
    keep_weight_versions: int = Field(2, ge=1, description="Published versions kept (disk dirs / zmq server).")
    publish_async: bool = Field(
        True, description="Publish each version beside the next step (areal_mq/weights/background.py): the step "
        "waits only for its snapshot (a copy in publish_dtype), then encoding, checksums, deltas, the disk write or "
        "the server hand-off and WeightsReady happen in a thread; at most 2 snapshots alive. false: the step waits "
        "for the whole publish, as before. cuda_ipc always publishes in the step (it copies the live parameters).")
    weight_server_host: str = Field("127.0.0.1", description="Interface the zmq weight server binds to.")
    weight_server_port: int = Field(0, ge=0, le=65535, description="Port of the zmq weight server (0: any free port). "
                                    "Sharded publishing: trainer rank r binds this port + r (0: any free port each).")
    weight_server_hosts: list[str] = Field(
        default_factory=list, description="Sharded publishing by a trainer spanning hosts: the address trainer rank r "
        "binds (and the only one rollout workers and the bus accept for rank r), one per rank; rank 0's must be "
        "weight_server_host. Empty: every rank binds weight_server_host (one host). The Ray backend fills it from "
        "the nodes its placement group holds.")
    publish_layout: Literal["auto", "gather", "sharded"] = Field(
        "auto", description="Who serves the weights of a sharded trainer. sharded: every rank snapshots, encodes "
        "and serves its own FSDP shards from its own weight server (no rank gathers the model; WeightsReady.shards "
        "lists the slices; areal_mq/weights/sharded.py). gather: the named fallback, the full model is gathered to "
        "rank 0 one tensor at a time and served from there. auto: sharded when strategy is fsdp and publish_mode "
        "zmq, else gather; gather under trainer.parallel.tp > 1, where sharded is refused (a tp shard is not a row "
        "slice a WeightsShard describes: areal_mq/algorithms/parallel.py refuse_under_tp).")
    shard_publish_timeout_s: float = Field(
        120.0, gt=0, description="Sharded publishing: how long rank 0 waits for every other rank to serve a version "
        "before it announces it, plus 4x the time rank 0's own publish of its shard took (so the wait grows with the "
        "shard's bytes); a rank that does not is named in a trainer.shard_missing error and the version is not "
        "announced (the next one is).")
    weight_chunk_mb: float = Field(64.0, gt=0, description="Target size of one WeightsChunk (a tensor is never split).")
    weight_deltas: Literal["auto", "on", "off"] = Field(
        "auto", description="Also publish each version as a lossless, checksummed delta against the previous one "
        "(areal_mq/weights/delta.py; workers holding that version fetch only it): auto = on for zmq, off for disk.")
    full_every: int = Field(20, ge=1, description="With deltas: disk writes a full snapshot every N versions (deltas "
                            "between); the zmq server keeps the last N deltas. Bounds a lagging worker's chain.")
    checkpoint_every: int = Field(50, ge=0, description="Checkpoint every N training steps (0: only at shutdown).")
    keep_checkpoints: int = Field(2, ge=1, description="Checkpoints kept in run_dir/checkpoints.")
    sim: SimTrainerConfig = Field(default_factory=SimTrainerConfig,
                                  description="A simulated training step instead of this trainer (issue 17).")

    @property
    def sharded_publish(self) -> bool:
        """Whether every rank serves its own shards (publish_layout, resolved; a LoRA adapter is small: rank 0's)."""
        return self.lora is None and (self.publish_layout == "sharded" or (
            self.publish_layout == "auto" and self.parallel.shards and self.parallel.tp == 1
            and self.publish_mode == "zmq"))

    @model_validator(mode="after")
    def _check(self) -> "TrainerConfig":
        from areal_mq.algorithms.parallel import map_degrees, refuse_under_tp

        map_degrees(self)  # trainer.parallel and the older trainer.strategy / fsdp.replicate, one resolved answer
        refuse_under_tp(self)  # LoRA and sharded publishing under tp > 1
        if self.publish_layout == "sharded" and (not self.parallel.shards or self.publish_mode != "zmq"):
            raise ValueError(f"publish_layout sharded serves FSDP shards over zmq: it needs strategy fsdp and "
                             f"publish_mode zmq (got strategy {self.strategy!r}, publish_mode {self.publish_mode!r}); "
                             "use publish_layout auto or gather")
        if self.weight_server_hosts:
            if not self.sharded_publish:
                raise ValueError("trainer.weight_server_hosts names each rank's weight server, which only sharded "
                                 "publishing has (strategy fsdp, publish_mode zmq, publish_layout auto or sharded); "
                                 "leave it empty")
            if self.weight_server_hosts[0] != self.weight_server_host:
                raise ValueError(f"trainer.weight_server_hosts[0] ({self.weight_server_hosts[0]!r}) is rank 0's host "
                                 f"and must equal trainer.weight_server_host ({self.weight_server_host!r})")
            if any(not h or any(c in h for c in "/:@ ") for h in self.weight_server_hosts):
                raise ValueError(f"trainer.weight_server_hosts must be host names or IPv4 addresses, got "
                                 f"{self.weight_server_hosts}")
        if self.parallel.shards and self.publish_mode == "cuda_ipc":
            raise ValueError("publish_mode cuda_ipc shares the live parameters of one whole model, which no FSDP rank "
                             "holds; use publish_mode disk or zmq with strategy fsdp")
        if self.lora is not None and self.publish_mode == "cuda_ipc":
            raise ValueError("trainer.lora publishes the adapter only, which cuda_ipc (the live parameters of the whole "
                             "model) cannot carry; use publish_mode disk or zmq")
        if self.lora is not None and self.publish_layout == "sharded":
            raise ValueError("trainer.lora publishes the adapter only, gathered to rank 0 (it is small); "
                             "publish_layout sharded serves a full model's shards: use publish_layout auto or gather")
        if self.loss_agg == "constant" and self.loss_agg_constant is None:
            raise ValueError("trainer.loss_agg 'constant' divides each sequence's token sum by trainer.loss_agg_constant, "
                             "which is not set: give the normaliser (Dr. GRPO uses the generation budget, e.g. the "
                             "rollouts' max_new_tokens)")
        if self.kl_in == "reward_normalized" and (not self.adv_estimator.startswith("reinforce_pp") or self.kl_coef <= 0):
            raise ValueError(f"trainer.kl_in 'reward_normalized' folds the KL into REINFORCE++'s returns before their "
                             f"batch normalisation: it needs adv_estimator reinforce_pp or reinforce_pp_baseline (got "
                             f"{self.adv_estimator!r}) "
                             f"and kl_coef > 0 (got {self.kl_coef}); use kl_in 'reward' with another estimator")
        if self.behav_cap_mode == "mask" and self.behav_weight_cap is None:
            raise ValueError("behav_cap_mode 'mask' needs a behav_weight_cap; set one (e.g. 5.0) or use 'truncate'")
        if self.behav_weight_level != "token" and not self.behav_correction:
            raise ValueError(f"behav_weight_level {self.behav_weight_level!r} weights sequences by exp(prox - "
                             "behaviour), which is 1 everywhere with behav_correction=false; set "
                             "behav_correction=true or keep behav_weight_level 'token'")
        if self.offpolicy_mask_k is not None and not self.behav_correction:
            raise ValueError("offpolicy_mask_k masks tokens by the behaviour weight exp(prox - behaviour), which is 1 "
                             "everywhere with behav_correction=false (nothing would ever be masked); set "
                             "behav_correction=true or drop offpolicy_mask_k")
        return self


def validate_off_policy(max_staleness: int, cfg: TrainerConfig) -> None:
    """Refuse asynchronous training without behaviour correction unless explicitly allowed.

    With max_staleness > 0 a batch mixes tokens sampled by several older policies. Without the
    decoupled correction PPO's trust region is centred on those stale behaviour policies and the
    gradient is biased. Raises ConfigError explaining the two ways out.
    """
    if max_staleness > 0 and not cfg.behav_correction and not cfg.allow_uncorrected_off_policy:
        raise ConfigError(
            f"asynchronous training (max_staleness={max_staleness}) with trainer.behav_correction=false "
            "trains on stale samples without correcting for the policy that generated them (biased updates). "
            "Set trainer.behav_correction=true (recommended), or max_staleness=0 for synchronous training, "
            "or trainer.allow_uncorrected_off_policy=true to accept the bias explicitly."
        )

# The precision rules the trainer, the engines and `plan` share: here, not in trainer.py, so that `plan` and the
# launcher's memory check read them without importing torch (issue 58).
def rollout_dtype(cfg: Any) -> str:
    """The dtype the rollout engine computes in: rollout.engine.dtype, or model.dtype where that is auto."""
    return cfg.model.dtype if cfg.rollout.engine.dtype == "auto" else cfg.rollout.engine.dtype


def compute_precision(cfg: "TrainerConfig", engine_dtype: str) -> str:
    """trainer.precision with `auto` resolved: the precision the rollout engine computes in (bf16 autocast for
    a bfloat16 engine, else fp32), whatever the device. Why not "bf16 on CUDA": the behaviour weights
    (areal_mq/algorithms/ppo.py) divide the trainer's probabilities by the engine's, so a bf16 trainer
    against an fp32 engine is off-policy by numerics alone, and more so as the policy sharpens; on an H200 the
    weight at staleness 0 grew from 1.3 at the first step to 106 by version 36 of the quickstart, whose
    held-out accuracy at v50 was 30 % against the fp32 CPU runs' 42 % (benchmarks/quality/RESULTS.md, GPU stage q)."""
    if cfg.precision != "auto":
        return cfg.precision
    return {"bfloat16": "bf16", "float16": "fp16"}.get(engine_dtype, "fp32")
