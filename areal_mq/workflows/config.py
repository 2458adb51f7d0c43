"""`agent:` section of a run config: which workflow the agent role runs and its bounds."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from areal_mq.workflows.builtin import BUILTINS


class AgentConfig(BaseModel):
    """Multi-turn episodes (docs/workflows.md). With `workflow` set, the controller sends each admitted group as
    `group_size` EpisodeJobs to service "agent" instead of GenerateRequests, and the launcher starts
    `launcher.agent_workers` agent processes."""

    model_config = ConfigDict(extra="forbid")
    workflow: str = Field("", description=f"'' = single-turn (no agent role); a built-in ({', '.join(BUILTINS)}) "
                          "or 'module:function' importable code the operator names (never from the wire).")
    workflow_args: dict[str, Any] = Field(default_factory=dict, description="Keyword settings the workflow reads as "
                                          "ctx.args, e.g. {attempts: 2} for multi_turn_retry.")
    max_episodes: int = Field(16, ge=1, le=4096, description="Episodes one agent process runs at once (its capacity).")
    episode_timeout_s: float = Field(600.0, gt=0, description="An episode still running after this fails (logged); "
                                     "the agent goes on.")
    max_turns: int = Field(8, ge=1, le=1000, description="Model turns per episode; one more is a workflow error.")
    max_episode_tokens: int = Field(4096, ge=16, le=65536, description="Tokens after the first prompt per episode "
                                    "(turns + environment text); each turn's max_new_tokens is cut to what is left.")
