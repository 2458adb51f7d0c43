"""Config of the trainer (owned by areal_mq.algorithms)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TrainerConfig(BaseModel):
    """Decoupled-PPO trainer settings."""

    model_config = ConfigDict(extra="forbid")
    lr: float = Field(1e-6, gt=0, description="Peak learning rate of AdamW.")
