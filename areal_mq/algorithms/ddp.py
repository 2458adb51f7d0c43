"""Data parallelism for the trainer (trainer.strategy: ddp): every rank holds the whole model.

What: `DdpStrategy` is the strategy seam's (areal_mq/algorithms/strategy.py) plain room: the policy is read whole
straight onto the rank's device (loading.load_whole: on a GPU no fp32 copy of the model on the host first) and
wrapped by Accelerate's DDP; gradients are all-reduced once per mini-batch; bf16 is Accelerate's autocast, fp16 the
policy's own autocast (Accelerate refuses fp16 on a CPU); a checkpoint holds the model as a plain Hugging Face
directory (config.json + model.safetensors in fp32) and the optimizer in trainer_state.pt, written by rank 0 alone;
publishing is rank 0's (the others never take part).
Memory per rank: 16 bytes per parameter (fp32 weights 4, gradients 4, AdamW moments 8) plus activations; under
trainer.lora the frozen base costs its dtype's bytes only (2 in bf16) and the adapter 16 per adapter parameter.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from areal_mq.errors import ConfigError


class DdpStrategy:
    """Every rank holds the whole model; gradients all-reduced once per mini-batch (Accelerate's DDP)."""

    name = "ddp"
    checkpoint_format = "hf"  # a Hugging Face directory + the optimizer's state dict

    def __init__(self, cfg: Any, precision: str):
        self.cfg, self.precision = cfg, precision
        self.accelerator: Any = None
        self.device = torch.device("cpu")
        self.lora_identity: dict[str, str] = {}  # trainer.lora: the base's path and sha256 (checkpoints hold it)

    # ---------------------------------------------------------------- precision and building
    @property
    def accelerate_precision(self) -> str:
        """Accelerate's mixed_precision: bf16 autocast over the fp32 weights, else none (fp16: `autocast`)."""
        return "bf16" if self.precision == "bf16" else "no"

    @property
    def autocast(self) -> torch.dtype | None:
        """The policy's own autocast dtype: fp16 (Accelerate refuses fp16 on a CPU; the loss is scaled)."""
        return torch.float16 if self.precision == "fp16" else None

    def bind(self, accelerator: Any, device: torch.device, parallel: Any = None) -> None:
        """The Accelerator and the rank's device; `parallel` (ParallelDims) is every rank a whole copy here."""
        self.accelerator, self.device = accelerator, device

    def build(self, model_path: str | Path, train: bool = True) -> tuple[torch.nn.Module, Any]:
        """(the Hugging Face model, the wrapped policy): the whole model read onto the device, then DDP."""
        from areal_mq.algorithms.loading import load_whole
        from areal_mq.algorithms.policy import PolicyLogprobs

        from areal_mq.algorithms import lora

        lora_on = train and self.cfg.lora is not None
        at_dtype = lora.base_dtype(self.precision) if lora_on else torch.float32  # LoRA: no fp32 copy of the base
        lm = load_whole(model_path, self.device, at_dtype)
        if lora_on:  # the base frozen in the precision's dtype, the adapter in fp32
            lm = lora.attach(lm, self.cfg.lora, at_dtype, seed=self.cfg.seed)
            self.lora_identity = lora.base_identity(model_path)
        if train and self.cfg.gradient_checkpointing:
            enable_gradient_checkpointing(lm)
        lm.train(train)
        if not train:
            lm.requires_grad_(False)
        hf = lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # under LoRA: adapters injected in place
        policy = PolicyLogprobs(hf, self.cfg.fsdp.logprob_chunk_mb, self.autocast)
        return lm, self.accelerator.prepare_model(policy, device_placement=False, evaluation_mode=not train)

    # ---------------------------------------------------------------- the step
    def accumulate(self, model: Any, last: bool) -> Any:
        return contextlib.nullcontext() if last else self.accelerator.no_sync(model)

    def clip(self, model: Any, max_norm: float) -> torch.Tensor:
        return self.accelerator.clip_grad_norm_(model.parameters(), max_norm)

    # ---------------------------------------------------------------- publishing
    def full_state_dict(self, lm: torch.nn.Module, dtype: str | None, keep: bool) -> dict:
        from areal_mq.weights.codec import unique_tensors

        return unique_tensors(lm.state_dict(), dtype) if keep else {}

    def local_slices(self, lm: torch.nn.Module, dtype: str | None) -> tuple[dict, dict]:
        raise ConfigError("sharded publishing serves FSDP shards: trainer.strategy ddp has none (publish_layout "
                          "gather)")

    # ---------------------------------------------------------------- checkpoints
    def save_main(self, trainer: Any, tmp: Path) -> dict:
        """Rank 0's files: the model as a Hugging Face directory (under LoRA the adapter and the base's identity
        only, algorithms/lora.py); returns the blobs for trainer_state.pt."""
        if self.cfg.lora is not None:
            from areal_mq.algorithms import lora

            lora.save(trainer.unwrapped, tmp, self.lora_identity)
        else:
            trainer.unwrapped.save_pretrained(str(tmp), safe_serialization=True)
        return {"optimizer": trainer.optimizer.state_dict()}

    def save_shards(self, trainer: Any, shard_dir: Path) -> None:
        """Nothing per rank: rank 0 wrote the whole model."""

    def load(self, trainer: Any, path: Path, blobs: dict, shard_dir: Path) -> None:
        if self.cfg.lora is not None:
            from areal_mq.algorithms import lora

            lora.load(trainer.unwrapped, path, self.lora_identity)
        else:
            load_model_weights(trainer.unwrapped, path)
        trainer.optimizer.load_state_dict(blobs["optimizer"])


def enable_gradient_checkpointing(lm: torch.nn.Module) -> None:
    """Recompute activations in backward (renamed in transformers 5: the old name warns)."""
    enable = getattr(lm, "activation_checkpointing_enable", None) or lm.gradient_checkpointing_enable
    enable()


def load_model_weights(model: torch.nn.Module, path: Path) -> None:
    """A checkpoint's Hugging Face safetensors into `model` (tied names may be absent: saved once)."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"checkpoint {path} has no *.safetensors weights")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    tied = _tied_names(model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    bad_missing = [m for m in missing if m not in tied]
    if bad_missing or unexpected:
        raise ValueError(f"checkpoint {path} does not fit the model: missing {bad_missing[:5]}, "
                         f"unexpected {list(unexpected)[:5]}; was it saved from a different model?")


def _tied_names(model: torch.nn.Module) -> set[str]:
    """State-dict names that alias an earlier tensor (tied weights: saved once)."""
    seen, tied = set(), set()
    for name, t in model.state_dict().items():
        (tied.add(name) if t.data_ptr() in seen else seen.add(t.data_ptr()))
    return tied
