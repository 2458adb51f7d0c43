"""Config of the reward service (owned by areal_mq.rewards)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RewardConfig(BaseModel):
    """Reward worker settings."""

    model_config = ConfigDict(extra="forbid")
    processes: int = Field(1, ge=1, description="Reward function processes per reward worker.")
    timeout_s: float = Field(10.0, gt=0, description="Deadline of one reward job.")
