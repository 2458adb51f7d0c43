"""Config of datasets (owned by areal_mq.data)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class DataConfig(BaseModel):
    """Which dataset the controller iterates."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field("arith", description="Dataset name or path to a JSONL file.")
