"""FSDP2 for the trainer: the one room where the policy is sharded (trainer.strategy: fsdp).

What: `FsdpStrategy` is the strategy seam's (areal_mq/algorithms/strategy.py) sharded room. Its `build` makes the
policy on the meta device, shards it and materialises this rank's shards only from the checkpoint
(areal_mq/algorithms/loading.py, trainer.fsdp.load), so no rank ever holds the whole model.
The mesh is the trainer's (areal_mq/algorithms/parallel.py `ParallelDims.mesh`, dims dp_replicate, dp_shard, cp,
tp); FSDP2 shards over its data-parallel slice: dp_shard (1-D), or with trainer.parallel.dp_replicate R > 1 (the
older trainer.fsdp.replicate) HSDP's (dp_replicate, dp_shard): R replica groups of world / R ranks each;
parameters are sharded within a group and replicated across groups, FSDP2 reduce-scatters gradients within a group
and all-reduces them across groups. Put a group on one node (launcher placement) and only the all-reduce crosses
nodes. Which rank serves which slices when publishing is ParallelDims' `publish_group`.
`shard_policy(policy, cfg, precision, device)` applies `fully_shard` to each decoder layer, to the input embeddings
and to the final norm + LM head as one group (untied models, as torchtitan lays them out), and then to the root
(the PolicyLogprobs wrapper: what is left; a tied model's embeddings, norm and head stay in it), with a
MixedPrecisionPolicy from trainer.precision (parameters cast for compute, gradients reduced in fp32) and an
optional CPUOffloadPolicy (trainer.fsdp.offload); under trainer.parallel.tp > 1 `build` splits each decoder layer
over the mesh's tp dim first (`parallelize`, with algorithms/tensor_parallel.py `apply_tp`). `clip_grad_norm` is the
DTensor-aware global norm clip (grouped by mesh: tensor parallelism puts parameters on two),
`full_state_dict` gathers the whole model one tensor at a time (the named fallback of the publish path: every
rank takes part, rank 0 keeps the result), and `save_sharded` / `load_sharded` write and read
`torch.distributed.checkpoint` directories, which reshard on load, so a checkpoint saved by 2 ranks resumes on 1
and vice versa.
Why not Accelerate's FSDP plugin: Accelerate 1.15 builds its FSDP2 path around a CUDA/XPU device and refuses
(or silently falls back from) a CPU-only gloo process group, and this trainer must be tested sharded on the CPU;
`fully_shard` itself runs on gloo. The Accelerator still owns the process group, seeds and the device.
Memory per rank (fp32 master weights, AdamW): 16 bytes x parameters / world size (weights 4, gradients 4, Adam
moments 8), plus one gathered decoder layer in compute precision (two with reshard_after_forward: false and
all of them kept), plus activations; with offload the 16 bytes live in host memory. The vocabulary-sized tensors
are gathered one unit at a time (`vocab_units`): the embeddings for their forward (resharded after it, gathered
again for their backward at the very end), the norm + head from the decoder's last norm through the loss to
their backward, with the head's full gradient; never both at once. A tied model (one Parameter for both) keeps
them in the root, gathered through the whole forward and backward: one matrix, so the same bytes.
launch/plan.py trainer_rank counts exactly these.
Under trainer.lora (algorithms/lora.py) the PEFT adapter is attached before sharding: each decoder layer's unit
holds its frozen base in the compute dtype and its fp32 adapter (`mixed_precision` explains how FSDP2 takes both),
so a rank holds the base's bytes / world size and 16 bytes per adapter parameter / world size; the reference is
the same model with the adapter off; a version is the adapter gathered to rank 0; a checkpoint holds the adapter's
shards and AdamW state (never the base) beside rank 0's PEFT adapter files and the base's identity.
Run: tests/integration/test_trainer_fsdp.py (2 CPU ranks under torch.distributed.run).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from areal_mq.errors import ConfigError

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")  # decoder stacks at `model.layers`, tested: llama, qwen2, qwen3


def ensure_process_group(device: torch.device) -> None:
    """FSDP needs a process group even at world size 1: make a one-rank group (an in-memory store) when neither
    torchrun nor Accelerate made one."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("WORLD_SIZE > 1 but no process group exists: start the trainer under torch.distributed.run "
                          "or accelerate launch")
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def decoder_layers(lm: nn.Module) -> list[nn.Module]:
    """The decoder layers FSDP wraps one by one; a clear error for a model family laid out otherwise."""
    layers = getattr(getattr(lm, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        kind = getattr(getattr(lm, "config", None), "model_type", type(lm).__name__)
        raise ConfigError(f"trainer.strategy fsdp: model type {kind!r} has no decoder layers at `model.layers` "
                          f"(supported: {', '.join(FAMILIES)}); use strategy ddp for it")
    return list(layers)


def mixed_precision(precision: str) -> Any:
    """FSDP2's MixedPrecisionPolicy for trainer.precision: compute dtype for parameters, fp32 reductions.

    Under trainer.lora a decoder layer's unit mixes a frozen base in the compute dtype with an fp32 adapter. What
    FSDP2 (torch 2.13, _fully_shard/) allows: `FSDPParamGroup._init_mp_dtypes` requires one original dtype and
    one reduce dtype among the TRAINABLE parameters only (the adapter: fp32), frozen ones may differ; and
    `foreach_all_gather` gathers inputs of mixed dtypes by viewing them all as bytes (uint8). The policy below
    makes that case never arise: `param_dtype` bf16 casts the fp32 adapter shards to bf16 for the all-gather and
    is a no-op for the base already in bf16 (FSDPParam.init_dtype_attrs clamps it to None), so every layer
    gathers one bf16 buffer; the adapter computes in bf16 like the base (what autocast does under ddp), its
    gradients are reduce-scattered in fp32 into the fp32 shards AdamW updates. The byte all-gather (no param_dtype)
    would work too, but would compute the adapter in fp32 where ddp's bf16 autocast computes it in bf16: the
    policy keeps the two strategies the same computation. fp32: nothing cast."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def vocab_units(lm: nn.Module) -> tuple[nn.Module | None, list[nn.Module]]:
    """(the input embeddings, [final norm, LM head]) that get FSDP units of their own, or (None, []) where they
    must stay in the root: tied embeddings (one Parameter in both: an FSDP unit owns a parameter once, and the
    embeddings' unit would reshard what the head needs at the other end of the forward), or a family without the
    three modules where we look (`get_input_embeddings`, `get_output_embeddings`, `model.norm`; under trainer.lora
    `lm` is the PEFT model's base, where the same names hold)."""
    embed = lm.get_input_embeddings() if hasattr(lm, "get_input_embeddings") else None
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    norm = getattr(getattr(lm, "model", None), "norm", None)
    if not all(isinstance(m, nn.Module) for m in (embed, head, norm)):
        return None, []
    mine = {id(p) for p in embed.parameters()}
    if any(id(p) in mine for p in (*head.parameters(), *norm.parameters())):
        return None, []  # tied
    return embed, [norm, head]


def parallelize(policy: nn.Module, mesh: Any, dp_mesh: Any, fsdp_cfg: Any, precision: str,
                train: bool = True) -> nn.Module:
    """Tensor parallelism over `mesh`'s tp dimension (algorithms/tensor_parallel.py `apply_tp`), then FSDP2 over
    `dp_mesh` (`shard_policy`); in place, returns `policy`. `mesh`: the trainer's whole mesh (ParallelDims.mesh);
    `dp_mesh`: its slice FSDP2 shards over (ParallelDims.dp_mesh: dp_shard, or (dp_replicate, dp_shard)). At tp 1
    it is `shard_policy` alone. (Here, not in tensor_parallel.py, so that module needs nothing of this one.)"""
    from areal_mq.algorithms.tensor_parallel import TP, apply_tp, tp_size

    if tp_size(mesh) > 1:
        apply_tp(policy.lm, mesh[TP])
    return shard_policy(policy, fsdp_cfg, precision, torch.device(mesh.device_type), train=train, mesh=dp_mesh)


def shard_policy(policy: nn.Module, fsdp_cfg: Any, precision: str, device: torch.device,
                 train: bool = True, mesh: Any = None, root_units: bool = True) -> nn.Module:
    """`fully_shard` every decoder layer of `policy.lm`, its input embeddings, its final norm + LM head (one group),
    then `policy` itself (the root: what is left), over `mesh` (the trainer passes ParallelDims.dp_mesh(); default:
    a flat mesh of every rank). In place; returns it.

    Why each unit reshards as it does: the embeddings run first in the forward and last in the backward, so they
    are resharded after the forward (gathered again for their backward) and never held through the step. The
    norm + head group is gathered by the norm's forward hook at the decoder's end; PolicyLogprobs then uses the
    head's weight directly (chunked logprobs, never `head(...)`), so FSDP2 completes this partly-run group's
    post-forward at the root's end (`_force_complete_incomplete_states`), after the loss's last chunk. Training,
    it keeps reshard_after_forward False: it is the last unit of the forward and the first of the backward, so
    resharding would only gather the same bytes again at once. The reference model (train False) reshards it.
    `root_units` False is the old layout (embeddings, norm and head all in the root, gathered through the whole
    step): kept only for benchmarks/speed/trainer_root.py's side-by-side measurement."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    ensure_process_group(device)
    if mesh is None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    offload = fsdp_cfg.offload and device.type != "cpu"  # on a CPU device the shards are in host memory already
    kw = dict(mesh=mesh, mp_policy=mixed_precision(precision),
              offload_policy=CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy())
    embed, head_group = vocab_units(policy.lm) if root_units else (None, [])
    if embed is not None:
        fully_shard(embed, reshard_after_forward=True, **kw)
    for layer in decoder_layers(policy.lm):
        fully_shard(layer, reshard_after_forward=fsdp_cfg.reshard_after_forward if train else True, **kw)
    if head_group:
        fully_shard(head_group, reshard_after_forward=not train, **kw)
    fully_shard(policy, reshard_after_forward=False, **kw)  # the root: backward needs its parameters at once
    return policy


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Global L2 norm of the (sharded) gradients before clipping, as a plain 0-dim tensor; clips in place.
    A DTensor norm is a partial sum over shards: `full_tensor()` reduces it over its mesh (collective). Under tensor
    parallelism (algorithms/tensor_parallel.py) a TP weight's gradient is a DTensor on the (dp, tp) mesh and a
    replicated one's on the dp mesh alone, and DTensor refuses to stack norms across meshes ("All operands must have
    the same mesh"): each mesh's gradients are normed apart and their squares summed. One mesh (plain FSDP2) and
    plain tensors are the one-group case."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[nn.Parameter]] = {}  # mesh -> the parameters whose gradients live on it
    for p in params:
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if len(norms) == 1:
        total = norms[0]
    else:
        total = torch.stack(norms).square().sum().sqrt() if norms else torch.zeros(())
    if max_norm != float("inf"):
        for group in groups.values():  # it takes the PARAMETERS and scales their .grad (given gradients, whose
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)  # own .grad is None, it scaled nothing)
    return total


def unique_state(lm: nn.Module) -> Any:
    """(name, tensor, this rank's local part) for each entry of `lm`'s state dict, tied tensors (lm_head ==
    embed_tokens) once under their first name, as `areal_mq.weights.unique_tensors` keeps them. Every rank walks the
    same names in the same order."""
    from torch.distributed.tensor import DTensor

    seen = set()
    for name, t in lm.state_dict().items():
        local = t.to_local() if isinstance(t, DTensor) else t
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            yield name, t, local


def full_state_dict(lm: nn.Module, dtype: str | None, keep: bool) -> dict[str, torch.Tensor]:
    """The whole model's state dict, gathered one tensor at a time (collective: call on every rank; each rank
    walks the same names in the same order). Tied tensors are gathered once under their first name (unique_state).
    Tensors go to the CPU in `dtype` (a torch dtype name, None: unchanged); only a rank with `keep` stores them
    (the others return {})."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, t, _ in unique_state(lm):
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if keep:
            want = getattr(torch, dtype) if dtype is not None and full.is_floating_point() else full.dtype
            out[name] = full.detach().to("cpu", dtype=want, copy=True).contiguous()
    return out


def _states(trainer: Any) -> tuple[dict, dict]:
    """The model's and AdamW's sharded state dicts, frozen parameters left out: they are the base model's, read
    from model.name at every start (trainer.lora), and a full fine-tuning run has none."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(trainer.model, trainer.optimizer, options=StateDictOptions(ignore_frozen_params=True))


def save_sharded(trainer: Any, path: Path) -> None:
    """Each rank writes its own shards of the model and AdamW state under `path` (torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp

    model_sd, optim_sd = _states(trainer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))


def load_sharded(trainer: Any, path: Path) -> None:
    """Read a `save_sharded` directory into this trainer's shards, whatever world size wrote it. Loaded non-strict
    (the frozen parameters are absent by design), then checked: every missing entry must be a frozen parameter."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    model_sd, optim_sd = _states(trainer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    missing, unexpected = set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                                         optim_state_dict=state["optim"],
                                         options=StateDictOptions(ignore_frozen_params=True, strict=False))
    frozen = {n for n, p in trainer.model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    bad = [k for k in missing if k not in frozen] + list(unexpected)
    if bad:
        raise ConfigError(f"checkpoint {path} does not fit this trainer's model: {bad[:4]}")


def export_hf(path: Path, config_dir: Path, out: Path) -> Path:
    """A plain Hugging Face directory (config, fp32 safetensors) from a sharded checkpoint's model, in one
    process without a process group (areal_mq.algorithms.checkpoint.export_checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from transformers import AutoConfig, AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(config_dir)), dtype=torch.float32)
    policy_sd = {f"lm.{k}": v for k, v in lm.state_dict().items()}
    state = {"model": policy_sd}
    dcp.load(state, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    lm.load_state_dict({k[3:]: v for k, v in state["model"].items()})
    out.mkdir(parents=True, exist_ok=True)
    lm.save_pretrained(str(out), safe_serialization=True)
    return out


def local_slices(lm: nn.Module, dtype: str | None, shard_index: int) -> tuple[dict[str, torch.Tensor],
                                                                              dict[str, tuple[int, int, list[int]]]]:
    """This rank's own rows of `lm`'s state dict for sharded publishing, copied to host memory in `dtype` (floating
    tensors; from an accelerator through pinned buckets, weights/staging.py: no device copy of the shard), and where
    each sits: name -> (start row, rows, whole shape). No collective. A tensor FSDP did not
    shard is served whole by shard index 0. The rows come from the DTensor's own layout (loading.local_box), so
    a 1-D mesh and HSDP's (replicate, shard) mesh read the same; anything but dim-0 sharding is refused
    (WeightsFetchError: use trainer.publish_layout gather)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from areal_mq.algorithms.loading import local_box
    from areal_mq.errors import WeightsFetchError

    from areal_mq.weights.staging import stage_to_host

    want = getattr(torch, dtype) if dtype else None
    parts: list[tuple[str, torch.Tensor, torch.dtype]] = []
    where: dict[str, tuple[int, int, list[int]]] = {}
    for name, t, local in unique_state(lm):
        shape = list(t.shape)
        placements = tuple(t.placements) if isinstance(t, DTensor) else ()
        if any(isinstance(p, Shard) and p.dim != 0 for p in placements) or \
                not all(isinstance(p, (Shard, Replicate)) for p in placements):
            raise WeightsFetchError(f"{name}: placements {placements} are not FSDP2's dim-0 sharding; use "
                                    "trainer.publish_layout gather")
        if any(isinstance(p, Shard) for p in placements):
            box, offset = local_box(t)
            start, rows = (offset[0], box[0]) if shape else (0, 0)
        elif shard_index != 0:
            continue
        else:
            start, rows = 0, (shape[0] if shape else 0)
        if shape and rows == 0:
            continue  # more ranks than rows: this rank holds none of it
        parts.append((name, local, want if want is not None and local.is_floating_point() else local.dtype))
        where[name] = (start, rows, shape)
    return stage_to_host(parts), where


def _base_identity_once(model_path: Any) -> dict[str, str]:
    """lora.base_identity (a sha256 over every base weight file: seconds for a 7B model) read by rank 0 alone and
    broadcast, not once per rank of the host."""
    import torch.distributed as dist

    from areal_mq.algorithms import lora

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return lora.base_identity(model_path)
    box = [lora.base_identity(model_path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]

class FsdpStrategy:
    """FSDP2: parameters, gradients and AdamW state sharded over the ranks (HSDP with dp_replicate > 1)."""

    name = "fsdp"
    checkpoint_format = "dcp"  # torch.distributed.checkpoint shards, resharded on load

    def __init__(self, cfg: Any, precision: str):
        self.cfg, self.precision = cfg, precision
        self.accelerator: Any = None
        self.device = torch.device("cpu")
        self.parallel: Any = None  # ParallelDims (bind): its mesh is made once, at the first build
        self.lora_identity: dict[str, str] = {}  # trainer.lora: the base's path and sha256 (checkpoints hold it)

    # ---------------------------------------------------------------- precision and building
    @property
    def accelerate_precision(self) -> str:
        return "no"  # bf16 and fp16 are FSDP2's MixedPrecisionPolicy (mixed_precision), not Accelerate's autocast

    @property
    def autocast(self) -> torch.dtype | None:
        return None

    def bind(self, accelerator: Any, device: torch.device, parallel: Any = None) -> None:
        """The Accelerator, the rank's device and the trainer's ParallelDims (default: every rank one shard)."""
        from areal_mq.algorithms.parallel import ParallelDims

        self.accelerator, self.device = accelerator, device
        self.parallel = parallel or ParallelDims(1, accelerator.num_processes if accelerator else 1, room=self.name)

    def build(self, model_path: str | Path, train: bool = True) -> tuple[nn.Module, Any]:
        """(the Hugging Face model, or under trainer.lora its PEFT wrapper; the sharded policy). trainer.fsdp.load
        slices/broadcast: built on the meta device, sharded, then this rank's shards materialised from the
        checkpoint (loading.py); full: the old path, the whole model loaded on every rank (fp32; trainer.lora: the
        base's dtype), then sharded.
        Under trainer.lora the adapter is attached before sharding, so each decoder layer's unit holds its frozen
        base (in the compute dtype) and its adapter (fp32; `mixed_precision` says how one unit holds both); the
        base's shards are read under their checkpoint names (lora.base_name), the adapter's from
        lora.initial_adapter."""
        from areal_mq.algorithms import loading, lora
        from areal_mq.algorithms.ddp import enable_gradient_checkpointing
        from areal_mq.algorithms.policy import PolicyLogprobs

        how = self.cfg.fsdp.load
        whole = how == "full" or self.device.type == "meta"
        lora_on = train and self.cfg.lora is not None
        at_dtype = lora.base_dtype(self.precision) if lora_on else torch.float32  # LoRA: no fp32 copy of the base
        lm = loading.load_whole(model_path, self.device, at_dtype) if whole else loading.meta_causal_lm(model_path)
        outer, rename, given = lm, None, None
        if lora_on:
            outer = lora.attach(lm, self.cfg.lora, at_dtype, seed=self.cfg.seed)
            self.lora_identity = _base_identity_once(model_path)
            lm, rename, given = outer.get_base_model(), lora.base_name, lora.initial_adapter(outer, self.cfg.seed)
        if train and self.cfg.gradient_checkpointing:
            enable_gradient_checkpointing(lm)
        outer.train(train)
        if not train:
            lm.requires_grad_(False)
        ensure_process_group(self.device)
        mesh = self.parallel.mesh(self.device)  # made at the first build; the reference shares it
        # tp > 1: each decoder layer split over the mesh's tp dim first; then FSDP2 over its dp slice (tp 1: that alone)
        policy = parallelize(PolicyLogprobs(lm, self.cfg.fsdp.logprob_chunk_mb), mesh, self.parallel.dp_mesh(),
                             self.cfg.fsdp, self.precision, train=train)
        if not whole:  # offload: the shards live in host memory, FSDP moves each layer to the device to compute
            at = torch.device("cpu") if self.cfg.fsdp.offload else self.device
            loading.materialise(policy, lm, model_path, at, how, rename=rename, given=given)
        return outer, policy

    # ---------------------------------------------------------------- the step
    def accumulate(self, model: Any, last: bool) -> Any:
        return contextlib.nullcontext()  # each micro-batch reduce-scatters into the sharded gradients

    def clip(self, model: Any, max_norm: float) -> torch.Tensor:
        return clip_grad_norm(list(model.parameters()), max_norm).to(self.device)  # offload: computed on the CPU

    # ---------------------------------------------------------------- publishing
    def full_state_dict(self, lm: nn.Module, dtype: str | None, keep: bool) -> dict:
        return full_state_dict(lm, dtype, keep)

    def local_slices(self, lm: nn.Module, dtype: str | None) -> tuple[dict, dict]:
        """This rank's slices and where they sit ({} on a rank that serves nothing: ParallelDims.publish_group)."""
        import torch.distributed as dist

        group = self.parallel.publish_group(dist.get_rank() if dist.is_initialized() else 0)
        if group is None:
            return {}, {}
        return local_slices(lm, dtype, group[0])

    # ---------------------------------------------------------------- checkpoints
    def save_main(self, trainer: Any, tmp: Path) -> dict:
        """Rank 0's files: the config (for export); the model and AdamW state are every rank's shards. Under
        trainer.lora the adapter's files come from save_shards (gathering it is a collective)."""
        if self.cfg.lora is None:
            trainer.unwrapped.config.save_pretrained(str(tmp))
        return {}

    def save_shards(self, trainer: Any, shard_dir: Path) -> None:
        """Every rank's shards of the trained parameters and their AdamW state (never the frozen base); under
        trainer.lora also the adapter gathered whole, written by rank 0 in PEFT's form beside the base's identity
        (lora.save: what export and `PeftModel.from_pretrained` read)."""
        if self.cfg.lora is not None:
            from areal_mq.algorithms import lora

            lora.save(trainer.unwrapped, shard_dir.parent, self.lora_identity, keep=trainer.is_main)
        save_sharded(trainer, shard_dir)  # looked up at call time: the torn-save test replaces it

    def load(self, trainer: Any, path: Path, blobs: dict, shard_dir: Path) -> None:
        from areal_mq.algorithms import lora

        if self.cfg.lora is not None:
            lora.check(path, self.lora_identity)
        elif (path / lora.ADAPTER_FILE).is_file():
            raise ConfigError(f"checkpoint {path} holds a LoRA adapter, not the whole model: resume it with the "
                              "run's trainer.lora, or export it merged (`areal-mq checkpoint export`)")
        load_sharded(trainer, shard_dir)  # resharded on load: any world size and mesh shape resumes it
