"""Config of the simulation: `rollout.engine.sim` (the simulated engine and its swarm) and `trainer.sim`.

Owned by areal_mq.sim; the engine and trainer configs include these sections. Timing models and length
distributions are chosen by name from areal_mq/sim/timing.py (unknown names: ConfigError listing the known).
`check_time_scales(cfg)` is the cross-section rule RunConfig calls: a simulated engine and a simulated trainer
in one run must run on the same virtual clock.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from areal_mq.errors import ConfigError


def check_timing_name(name: str) -> str:
    from areal_mq.sim.timing import timing_model

    timing_model(name)  # raises ConfigError naming the known models (and refuses an unfilled slot)
    return name


class SimEngineConfig(BaseModel):
    """`rollout.engine.kind: sim`: a simulated GPU behind the Engine contract (areal_mq/sim/engine.py)."""

    model_config = ConfigDict(extra="forbid")
    timing: str = Field("r1-1.5b-h800-roofline", description="Timing model name (areal_mq/sim/timing.py).")
    lengths: str = Field("lognormal-8k", description="Completion length distribution name (areal_mq/sim/timing.py); "
                         "each length is also capped by the request's max_new_tokens.")
    time_scale: float = Field(0.1, gt=0, le=100, description="Real seconds per simulated second (0.1: the "
                              "simulation runs 10x faster than the GPUs it models). Must equal trainer.sim.time_scale.")
    vocab_size: int = Field(151_936, ge=2, description="Token ids are drawn below this (Qwen2.5's vocabulary).")
    workers: int = Field(8, ge=1, le=4096, description="`areal-mq worker swarm`: simulated rollout workers hosted by "
                         "one process, each its own DEALER identity with READY and heartbeats.")
    reward_capacity: int = Field(0, ge=0, le=100_000, description="`areal-mq worker swarm`: also serve the 'reward' "
                                 "service with a simulated reward (instant, Bernoulli(0.5) per completion) at this "
                                 "capacity; 0 = no (real reward workers score).")

    @field_validator("timing")
    @classmethod
    def _known_timing(cls, v: str) -> str:
        return check_timing_name(v)

    @field_validator("lengths")
    @classmethod
    def _known_lengths(cls, v: str) -> str:
        from areal_mq.sim.timing import length_model

        length_model(v)
        return v


class SimTrainerConfig(BaseModel):
    """`trainer.sim`: a simulated training step (workers/sim_trainer.py): no model, no weights; each step sleeps
    the timing model's train_step_s(tokens, devices) on the virtual clock and publishes WeightsReady(mode=sim)."""

    model_config = ConfigDict(extra="forbid")
    enabled: bool = Field(False, description="Run the simulated trainer instead of the real one.")
    timing: str = Field("r1-1.5b-h800-roofline", description="Timing model name (areal_mq/sim/timing.py).")
    devices: int = Field(1, ge=1, description="Training GPUs this simulated trainer stands for (the step's token "
                         "work is divided among them).")
    time_scale: float = Field(0.1, gt=0, le=100, description="Real seconds per simulated second; must equal "
                              "rollout.engine.sim.time_scale when both are simulated.")

    @field_validator("timing")
    @classmethod
    def _known_timing(cls, v: str) -> str:
        return check_timing_name(v)


def check_time_scales(engine_kind: str, engine_sim: SimEngineConfig, trainer_sim: SimTrainerConfig) -> None:
    if engine_kind == "sim" and trainer_sim.enabled and abs(engine_sim.time_scale - trainer_sim.time_scale) > 1e-12:
        raise ConfigError(
            f"rollout.engine.sim.time_scale ({engine_sim.time_scale}) and trainer.sim.time_scale "
            f"({trainer_sim.time_scale}) differ: simulated generation and training must share one virtual clock; "
            "set both to the same value")
