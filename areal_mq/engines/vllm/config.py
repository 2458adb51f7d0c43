"""Settings of the vLLM engines (`engine: vllm` and `engine: vllm-server`), nested as `engine.vllm`.

What: CPU-backend knobs (KV cache size, OpenMP thread binding, memory utilisation), start/request
deadlines, and where to find an already running vLLM server. Pydantic only: importing this module
does not import vLLM, so the CLI and config loading stay fast and work without vLLM installed.

Why these knobs: measured on the 2-core CPU machines this project runs on: vLLM's CPU backend needs
`gpu_memory_utilization <= 0.5`; setting the KV cache size explicitly (VLLM_CPU_KVCACHE_SPACE)
skips a long memory-profiling warm-up; the OpenMP binding changes throughput by ~1.5x.
"""
from __future__ import annotations

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
    gpu_memory_utilization: float = Field(
        0.5, gt=0.0, le=0.5,
        description="vLLM's memory utilisation fraction; its CPU backend fails to start above 0.5.",
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
        description="Where in-memory weight updates are staged as a safetensors file for vLLM's worker "
                    "(tensors cannot cross vLLM's RPC; a path can). Falls back to the temp dir if missing.",
    )
    server_url: str = Field(
        "http://127.0.0.1:8000",
        description="engine: vllm-server only. Base URL of a running vLLM OpenAI-compatible server started with "
                    "VLLM_SERVER_DEV_MODE=1, --enable-scale-out and the areal-mq worker extension "
                    "(see docs/engines.md).",
    )
