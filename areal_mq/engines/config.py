"""Config of the rollout engine (owned by areal_mq.engines)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class EngineConfig(BaseModel):
    """Which inference engine a rollout worker runs and how."""

    model_config = ConfigDict(extra="forbid")
    engine: Literal["torch", "vllm", "vllm-server"] = Field("torch", description="Inference engine.")
    max_concurrent: int = Field(16, ge=1, description="Maximum sequences decoded at once (the worker's capacity).")
    kv_on_update: Literal["recompute", "keep"] = Field(
        "recompute", description="On a weight update: recompute in-flight KV caches under the new weights, or keep them."
    )
    weights_timeout_s: float = Field(60.0, gt=0, description="Deadline for fetching published weights (zmq mode).")
    drain_timeout_s: float = Field(30.0, ge=0, description="On SIGTERM: time to finish running sequences before handing them back.")
