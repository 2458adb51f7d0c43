"""Config of the rollout engine (owned by areal_mq.engines)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from areal_mq.engines.vllm.config import VllmEngineConfig
from areal_mq.sim.config import SimEngineConfig


class EngineConfig(BaseModel):
    """Which inference engine a rollout worker runs and how (the `rollout.engine` section)."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["torch", "vllm", "vllm-server", "sim"] = Field(
        "torch", description="Inference engine (sim: a simulated GPU, see the `sim` section).")
    max_concurrent: int = Field(16, ge=1, description="Maximum sequences decoded at once (the worker's capacity).")
    kv_on_update: Literal["recompute", "keep"] = Field(
        "recompute", description="On a weight update: recompute in-flight KV caches under the new weights, or keep them."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Engine parameter dtype; 'auto' follows model.dtype. bfloat16 decodes ~2x faster on CPUs "
                    "with AMX/AVX512-BF16, at the cost of behaviour logprobs that differ more from a float32 trainer; "
                    "float16 pairs with trainer.precision fp16 (loss-scaled; slow on CPUs without fp16 matmul units).",
    )
    max_model_len: int | None = Field(
        None, ge=8,
        description="Longest prompt + generation in tokens (torch engine); default min(model context, 2048).",
    )
    max_kv_tokens: int = Field(
        65536, ge=64,
        description="torch engine on the CPU without kv_cache_bytes: the KV block pool's positions (at most "
                    "max_concurrent x max_model_len). Not an admission cap: rows are admitted while the pool holds "
                    "them (areal_mq/engines/admission.py); see max_reserved_tokens for a cap.",
    )
    max_reserved_tokens: int | None = Field(
        None, ge=64,
        description="torch engine: an optional admission cap. Where set, the running rows' reservations (prompt + "
                    "max_new_tokens each) never exceed it and requests wait until they fit. None (default): rows are "
                    "admitted while the KV pool holds them and the youngest is preempted when it runs out, so "
                    "max_new_tokens 8192 on a pool of 1.5M tokens runs every row the pool holds, not 1.5M / 8192.",
    )
    kv_cache_bytes: int | None = Field(
        None, ge=1,
        description="torch engine: memory budget in bytes of the paged KV pool (allocated once, never moved): "
                    "budget / (kv_block_size * 2 * layers * kv_heads * head_dim * dtype bytes) blocks, one of them the "
                    "scratch block, at least max_concurrent + 1. Sequences take blocks as they produce tokens; when "
                    "the pool runs out the youngest are preempted and recomputed later. None: on CUDA "
                    "kv_cache_fraction of the free device memory; on the CPU max_kv_tokens positions, at most "
                    "max_concurrent x max_model_len (pages never used cost nothing there).",
    )
    kv_cache_fraction: float = Field(
        0.5, gt=0, le=0.95,
        description="torch engine on CUDA without kv_cache_bytes: the KV pool takes this fraction of the device "
                    "memory free after the weights loaded (leave room for a trainer sharing the GPU).",
    )
    kv_block_size: int = Field(
        16, ge=1, le=1024,
        description="torch engine: positions per KV block. Smaller wastes less in each sequence's last block and "
                    "shares more of a prompt; larger gathers fewer, bigger pieces per attention read.",
    )
    cuda_graphs: bool | Literal["auto"] = Field(
        "auto",
        description="torch engine (auto: on for an engine on CUDA, off on the CPU, where the padding costs and "
                    "nothing is captured): decode in fixed-shape buckets (batch: powers of two up to max_concurrent, padded "
                    "rows write to the scratch block; blocks per row: a power of two covering >= 64 keys) and, on "
                    "CUDA, replay each bucket's captured CUDA graph with the block tables as an input. On the CPU "
                    "the padded step runs eagerly.",
    )
    decode_attention: Literal["auto", "plain", "flex"] = Field(
        "auto",
        description="torch engine: how a decode step reads the paged KV pool. flex: one FlexAttention call per "
                    "layer for all rows, reading each row's blocks in place (torch.compile'd: C++ on the CPU, Triton "
                    "on CUDA; one compiled kernel per power-of-two batch, cached on disk by inductor); plain: strided "
                    "views of runs of consecutive blocks on the CPU, else a gather of each row's blocks, then SDPA "
                    "(the reference path, no compiler needed). auto: flex on CUDA, plain on the CPU (there flex "
                    "measured 1.2-1.5x faster on ragged batches, 0.8-0.9x on uniform ones, and compiles in each "
                    "new process: engines/torch/flex.py, benchmarks/speed/RESULTS.md).",
    )
    prefill_chunk_tokens: int = Field(
        128, ge=1,
        description="torch engine: most prompt/recompute tokens prefilled per step, so long prompts and "
                    "post-update KV recomputation never stall decoding of the other sequences for long.",
    )
    recompute_chunk_tokens: int = Field(
        0, ge=0,
        description="torch engine, kv_on_update: recompute: tokens recomputed per step while rows rebuild their KV "
                    "after a weight update (0: prefill_chunk_tokens). Larger ends the post-update stall in fewer "
                    "steps; each of those steps takes longer.",
    )
    kv_gap_rows: int = Field(
        0, ge=0,
        description="torch engine: on a weight update, measure on up to this many in-flight rows the logprob gap "
                    "between decoding on the old KV (keep) and on recomputed KV (one prefill per row; returned with "
                    "the update timings as gap_logprob_mean / gap_logprob_max / gap_kl_mean). 0 = off.",
    )
    share_prefill: bool = Field(
        True,
        description="torch engine: rows whose next prefill chunk is the same tokens on an identical KV history "
                    "(the n samples of one prompt in a GRPO group) compute it once and copy the KV.",
    )
    session_kv_max_tokens: int = Field(
        0, ge=0,
        description="torch engine: KV tokens kept, over all sessions, from finished turns of multi-turn sessions "
                    "(GenerateRequest.session) so the next turn prefills only its new tokens; least recently kept "
                    "evicted first. Memory: 2 * layers * kv_heads * head_dim * dtype bytes per token (SmolLM2-135M "
                    "float32: 46 KiB). 0 = off.",
    )
    session_kv_ttl_s: float = Field(
        60.0, ge=0, description="torch engine: a kept session KV is dropped this long after its turn finished.",
    )
    threads: int | None = Field(
        None, ge=1, description="torch intra-op threads for the engine (None: leave the process setting alone).",
    )
    seed: int | None = Field(
        None,
        description="Default seed for requests without one (mixed with the request id, so each request gets "
                    "its own stream and runs are reproducible). None: fresh randomness.",
    )
    step_delay_s: float = Field(
        0.0, ge=0, le=10,
        description="Diagnostics and tests only: sleep this long after every decoding step of the torch engine, so "
                    "generation is slower than a training step by construction (0 = off).")
    vllm: VllmEngineConfig = Field(
        default_factory=VllmEngineConfig, description="engine: vllm / vllm-server settings (CPU backend, server URL)."
    )
    sim: SimEngineConfig = Field(
        default_factory=SimEngineConfig, description="engine: sim settings (timing model, lengths, virtual time).")
