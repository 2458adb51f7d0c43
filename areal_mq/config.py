"""Run configuration: one YAML file per run, one pydantic model per component.

What: `RunConfig` composes the component configs (each component owns its model in its own package);
`load_config(path, overrides)` reads YAML, applies `--set a.b=value` overrides and validates. Unknown keys
are rejected with their full dotted path and a did-you-mean suggestion. An override of a key inside a dict field
(`--set reward.tasks.mine.fn=pkg:f`) merges into the file's dict or the field's default; `--set reward.tasks={..}`
replaces the dict (apply_overrides).
How: `areal-mq config show configs/quickstart.yaml --set trainer.lr=1e-5` prints the resolved config
with every field's documentation.
"""
from __future__ import annotations

import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from areal_mq.algorithms.config import TrainerConfig
from areal_mq.data.config import DataConfig
from areal_mq.engines.config import EngineConfig
from areal_mq.devices import DEVICE_RE
from areal_mq.errors import ConfigError

DEVICE_PATTERN = DEVICE_RE.pattern
from areal_mq.rewards.config import RewardConfig
from areal_mq.workflows.config import AgentConfig


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunSection(_Section):
    """Identity and location of a run."""

    name: str = Field("run", description="Run name; the run id is derived from it.")
    run_dir: str = Field("runs/run", description="Directory for config, events, samples, checkpoints, metrics, plots.")
    seed: int = Field(0, description="Global seed (dataset shuffle, sampling seeds, init).")
    mode: Literal["async", "sync"] = Field("async", description="async: AReaL-style; sync: generate-reward-train loop.")


class BrokerConfig(_Section):
    """Addresses and liveness settings of the brokers (job broker, signal bus, sample store)."""

    host: str = Field("127.0.0.1", description="Interface the brokers bind (loopback by default).")
    job_port: int = Field(5555, ge=1, le=65535, description="Job broker ROUTER port.")
    bus_in_port: int = Field(5556, ge=1, le=65535, description="Signal bus XSUB port (publishers connect here).")
    bus_out_port: int = Field(5557, ge=1, le=65535, description="Signal bus XPUB port (subscribers connect here).")
    store_port: int = Field(5558, ge=1, le=65535, description="Sample store ROUTER port.")
    auto_ports: bool | None = Field(
        None, description="What `areal-mq run` does when a broker port is taken (another run on this host): true: "
        "move all four to free consecutive ports and print them; false: stop at once (exit 2) naming the port, "
        "what holds it and the --set that moves it; unset: true while all four are at their defaults (5555-5558), "
        "else false (ports you named are never moved).")
    heartbeat_s: float = Field(1.0, gt=0, description="Heartbeat interval between peers and brokers.")
    liveness: int = Field(5, ge=1, description="Missed heartbeats before a peer is declared dead.")
    reconnect_max_s: float = Field(8.0, gt=0, description="Upper bound of the exponential reconnect backoff.")
    max_queue: int = Field(10_000, ge=1, description="Jobs queued per service before new ones are refused.")
    max_worker_capacity: int = Field(4096, ge=1, description="Largest capacity a worker may announce in READY.")
    max_services: int = Field(64, ge=1, description="Services the job broker routes at once (with queued jobs or "
                              "registered workers); a job or READY naming one more is refused with no_service.")
    max_sessions: int = Field(100_000, ge=1, description="Multi-turn sessions (GenerateRequest.session) whose "
                              "last worker the job broker remembers for sticky routing; least recently used first "
                              "out.")
    sticky_wait_s: float = Field(1.0, ge=0, description="Longest a job with a session waits for its session's worker "
                                 "(which may hold its KV) when that worker is full; then any worker. 0: never wait.")
    max_frame_mb: float = Field(512.0, gt=0, description="Largest accepted array frame, MiB.")
    lease_s: float = Field(900.0, gt=0, description="A served, un-acked sample batch returns to the store after this.")
    fsync: bool = Field(
        False, description="Sample store: fsync every log record before acknowledging it. Off: an acknowledged "
        "sample or ack survives a crash or kill -9 of the store (the OS holds it). On: it also survives power loss "
        "or a kernel crash, at the cost of one disk flush per put/ack (benchmarks/speed/store.py).")
    store_max_samples: int = Field(
        10_000, ge=1, description="Samples the store holds (pending or leased) before it refuses a put with "
        "Error store_full.")
    store_max_waiters: int = Field(
        256, ge=1, description="GetBatch requests the store keeps waiting; one more answers the oldest with an "
        "empty batch.")
    store_max_wait_ms: int = Field(
        60_000, ge=0, description="Longest GetBatch timeout_ms the store honours; a longer wait ends (empty "
        "batch) after this and the client asks again.")
    store_max_done_ids: int = Field(
        1_000_000, ge=1000, description="Acked or dropped sample ids the store remembers (newest first) to refuse "
        "re-serving and to spot duplicate puts; older ones are forgotten.")
    store_compact_mb: float = Field(
        256.0, gt=0, description="Sample store log size, MiB, past which it is compacted (rewritten with only held "
        "samples and remembered ids) once at least half of it is acked or dropped samples.")
    job_retry_s: float = Field(600.0, gt=0, description="Client resubmits a job unanswered this long.")
    job_deadline_s: float = Field(
        300.0, ge=0, description="Job broker: the lease of a job on its worker. A job not answered this long after "
        "it was assigned is taken back (the worker's slot freed) and requeued for another worker, or failed with "
        "Error job_failed after job_max_attempts assignments. 0: no deadline. Per service: job_deadlines.")
    job_deadlines: dict[str, float] = Field(
        default_factory=lambda: {"agent": 1800.0}, description="Per-service job leases, seconds, overriding "
        "job_deadline_s (e.g. {reward: 120}; an agent's whole episode gets 1800 by default). 0: none.")
    min_decode_tokens_per_s: float = Field(
        5.0, gt=0, description="The slowest per-sequence decode rate a generation job is allowed: the lease of a "
        "'generate' job (unless job_deadlines names 'generate') is at least 60 s + controller.max_new_tokens / "
        "this, so a 8k-token answer gets 1,700 s instead of 300 s and is not taken back while still decoding; "
        "clients then resubmit no sooner than that lease + 60 s (job_retry_s or more).")
    job_max_attempts: int = Field(3, ge=1, description="Assignments of a job whose lease ended before the broker "
                                  "fails it (Error job_failed) instead of requeuing it.")

    @model_validator(mode="after")
    def _leases_not_negative(self) -> "BrokerConfig":
        bad = {k: v for k, v in self.job_deadlines.items() if not v >= 0}
        if bad:
            raise ValueError(f"brokers.job_deadlines: leases are seconds >= 0 (0: none), got {bad}")
        return self

    def addr(self, port: int, host: str | None = None) -> str:
        return f"tcp://{host or self.host}:{port}"

    @property
    def job_addr(self) -> str:
        return self.addr(self.job_port)

    @property
    def bus_in_addr(self) -> str:
        return self.addr(self.bus_in_port)

    @property
    def bus_out_addr(self) -> str:
        return self.addr(self.bus_out_port)

    @property
    def store_addr(self) -> str:
        return self.addr(self.store_port)


class SecurityConfig(_Section):
    """CURVE authentication of every socket (docs/security.md)."""

    keys_dir: str | None = Field(
        None, description="Key directory (`areal-mq keys generate DIR`); default run_dir/keys, which the launcher "
        "creates for each run.")
    key_name: str | None = Field(
        None, description="Which key of keys_dir this process uses (ROLE or ROLE-SUFFIX); default its role.")
    insecure: bool = Field(
        False, description="Plaintext, unauthenticated sockets, for debugging only: refused unless every address "
        "is loopback, and every process logs a warning at start.")


class EventsConfig(_Section):
    """Structured event logging."""

    level: Literal["debug", "info", "warning", "error"] = Field("info", description="Lowest level recorded.")
    to_bus: bool = Field(True, description="Publish events on the signal bus topic 'events'.")
    to_file: bool = Field(True, description="Append events to run_dir/events/<role>-<worker>.jsonl.")
    console: Literal["pretty", "json", "off"] = Field("pretty", description="What a process prints to stderr.")


class MetricsConfig(_Section):
    """Where per-step metrics go besides run_dir/metrics.jsonl (areal_mq/telemetry/metrics.py)."""

    tensorboard: bool = Field(
        False, description="Also write TensorBoard event files to run_dir/tensorboard/ (needs `pip install "
        "'areal-mq[tensorboard]'`).")
    wandb: bool = Field(
        False, description="Also log to a Weights & Biases run (one per process, in run_dir/wandb/; needs `pip "
        "install 'areal-mq[wandb]'`), online or offline by metrics.wandb_mode.")
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="offline: nothing leaves the host, `wandb sync run_dir/wandb/offline-run-*` uploads "
        "later; online: live on the W&B server (needs `wandb login` or WANDB_API_KEY in every process's "
        "environment, and the network).")
    wandb_project: str = Field("areal-mq", description="W&B project of the run.")
    prometheus: bool = Field(
        False, description="Serve Prometheus metrics from every process, each on its own port (needs `pip install "
        "'areal-mq[prometheus]'`; areal_mq/telemetry/prometheus.py, dashboard in docker/grafana/).")
    prometheus_port: int = Field(
        9400, ge=1, le=65535, description="First port of the block the launcher hands out, one port per process "
        "in start order (it prints which process serves where); a process started alone serves on this port.")
    prometheus_host: str = Field(
        "127.0.0.1", description="Interface the metrics endpoints bind (loopback unless set; 0.0.0.0 for a "
        "Prometheus on another host or in a container).")


class ModelConfig(_Section):
    """The policy model: a built-in name or a local Hugging Face directory."""

    name: str = Field("smollm2-135m-instruct", description="smollm2-135m-instruct, tiny-random-llama, or a path.")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype for engines and trainer.")
    device: str = Field(
        "auto", pattern=DEVICE_PATTERN, description="Where the model runs: auto (cuda when available, else cpu), cpu, cuda or cuda:N; "
        "rollout.device / trainer.device override it per role (areal_mq/devices.py).")
    cache_dir: str | None = Field(None, description="Folder holding converted models (default $AREAL_MQ_CACHE/models or ~/.cache/areal-mq/models).")


class RolloutConfig(_Section):
    """A rollout worker: its engine section and the worker's own settings."""

    engine: EngineConfig = Field(default_factory=EngineConfig, description="The inference engine and its settings.")
    weights_timeout_s: float = Field(
        60.0, gt=0, description="Deadline for fetching published weights (zmq mode), plus the time the version's bytes "
        "take at weights_min_mbps: a 15 GB bf16 7B model gets 60 s + 300 s at the default floor.")
    weights_min_mbps: float = Field(
        50.0, gt=0, description="The slowest transfer rate (MB/s) a weight fetch is allowed before it gives up: the "
        "fetch deadline is weights_timeout_s + bytes / this. Set it to what the slowest link between trainer and "
        "rollout hosts sustains.")
    drain_timeout_s: float = Field(
        30.0, ge=0, description="On SIGTERM: time to finish running sequences before handing them back.")
    device: str | None = Field(None, pattern=DEVICE_PATTERN, description="This role's device, overriding model.device (auto, cpu, cuda, cuda:N).")
    interruptible: bool = Field(
        True, description="Interruptible generation (AReaL): a weight update is applied between decode steps and "
        "the sequences in flight go on under the new weights (engine.kv_on_update). false: an update waits until "
        "the sequences in flight finish and new requests wait for it, so every sequence comes from one policy "
        "version (the paper's non-interruptible ablation; slower, the engine idles while it drains).")
    audit_weights: bool = Field(
        False, description="After every weight load, log the checksum of each tensor the engine now holds, cast to "
        "trainer.publish_dtype (rollout.weights_audit): benchmarks/faults/soak.py compares them with the checksums the "
        "trainer published. Costs one pass over the weights per load (torch engine only); for audits and soaks.")


class EvalConfig(_Section):
    """Held-out evaluation of the policy during and after a run (problems from data.eval_name)."""

    every: int = Field(0, ge=0, description="Evaluate every N versions in the background (0 = only at the end).")
    via: Literal["process", "rollout"] = Field(
        "process", description="Where the periodic evaluations (every > 0) generate. process: a background `areal-mq "
        "eval` with an engine of its own on the version's pinned weights (its memory beside rollout engine 0, or "
        "placement.eval; refused under Ray with GPUs). rollout: the controller sends the held-out problems to the "
        "rollout workers as requests pinned to the version (GenerateRequest.pin_version), graded like the standalone "
        "evaluation: "
        "no engine or GPU of its own, allowed under Ray; while those requests run the workers defer newer weights, so "
        "training samples meanwhile are at that version (areal_mq/evaluation/periodic.py). The base and final "
        "evaluations run standalone either way.")
    size: int = Field(200, ge=1, description="Held-out problems per evaluation.")
    kv_cache_bytes: int | None = Field(
        None, ge=1, description="KV pool of the evaluation's own engine, bytes. None: the rollout engine's setting. "
        "A periodic evaluation (every > 0) on GPUs shares the first rollout engine's device unless placement.eval "
        "gives it one: engine + evaluation must fit that device (`areal-mq plan` counts both).")
    samples: int = Field(
        1, ge=1, le=1024, description="Answers sampled per held-out problem. 1 (default): one answer, greedy unless "
        "temperature > 0. N > 1: reports mean accuracy over the N x problems answers, pass@k by the unbiased estimator "
        "(Chen et al. 2021) and maj@k for every k in eval.k (areal_mq/evaluation/passk.py); needs temperature > 0.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature of the evaluation (0: greedy).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling of the evaluation.")
    k: list[int] = Field(default_factory=lambda: [1], description="The k of pass@k and maj@k (each 1..eval.samples).")


class ControllerConfig(_Section):
    """Dataset iteration, grouping, staleness throttle."""

    group_size: int = Field(4, ge=1, description="Samples generated per prompt (the GRPO group).")
    batch_groups: int = Field(4, ge=1, description="Groups per training batch.")
    max_staleness: int = Field(2, ge=0, description="η: max versions a trained token may lag the policy (0 = sync).")
    max_concurrent_groups: int = Field(16, ge=1, description="Cap on groups in flight at once.")
    max_new_tokens: int = Field(96, ge=1, description="Generation length cap.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature of training rollouts.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling for training rollouts.")
    total_steps: int = Field(20, ge=1, description="Training steps (policy versions) of the run.")
    drop_uniform_groups: bool = Field(
        False, description="Do not train on groups whose rewards are all equal (zero advantage, no gradient); "
        "generate a replacement instead (DAPO dynamic sampling). Dropped groups are logged and still plotted; the "
        "controller's stats report sampled_per_trained (groups sampled per group trained). What 'uniform' means: "
        "uniform_by.")
    uniform_by: Literal["reward", "outcome"] = Field(
        "reward", description="With drop_uniform_groups: reward = every reward of the group equal (zero advantage; "
        "right for any reward). outcome = every answer's reward detail `correct` equal: all right or all wrong, "
        "DAPO's rule for a verifiable reward, which still holds when rewards are shaped (overlong_buffer); a group "
        "whose details lack a boolean `correct` is judged by reward (areal_mq/rewards/shaping.py).")
    overlong_buffer: int = Field(
        0, ge=0, description="DAPO's soft overlong punishment (eq. 13): over the last N tokens before max_new_tokens "
        "an answer's reward falls linearly by up to overlong_penalty (0 = off). Reward jobs carry each answer's token "
        "count and the cap either way (RewardJob.lengths, max_tokens).")
    overlong_penalty: float = Field(1.0, ge=0.0, description="The largest overlong punishment (at max_new_tokens).")
    overlong_filter: bool = Field(
        False, description="DAPO's overlong filtering: a truncated answer (finish_reason length, max_new_tokens "
        "reached) of a single-turn group is stored loss_excluded, so the trainer trains none of its tokens (they leave "
        "the loss's token and sequence counts too) while its reward still counts in its group's advantages. A step "
        "whose every sequence is excluded is acked without an update (logged trainer.step_skipped). Multi-turn "
        "episodes are not filtered.")
    batch_order: Literal["completion", "admission"] = Field(
        "completion", description="Order in which finished groups reach the sample store (and so the trainer's "
        "batches). completion: as each finishes (a group whose answers are short finishes first and is trained "
        "first). admission: in the order the groups were admitted; a finished group waits until every group "
        "admitted before it has been stored, dropped or failed, so which groups fill a batch does not depend on "
        "how fast they were generated (costs async some speed: a slow group holds back later ones).")
    max_retries: int = Field(3, ge=0, description="Retries of a failed generation/reward job before the group is dropped.")
    reward_task: str = Field("arith", description="Task of the reward jobs: a key of reward.tasks, or a built-in "
                             "name / import path (module:function) that then becomes one.")

    @model_validator(mode="after")
    def _overlong_inside_the_cap(self) -> "ControllerConfig":
        if self.overlong_buffer >= self.max_new_tokens:
            raise ValueError(f"controller.overlong_buffer {self.overlong_buffer} must be below max_new_tokens "
                             f"({self.max_new_tokens}): the punishment ramps over the last overlong_buffer tokens")
        return self


class LauncherConfig(_Section):
    """How `areal-mq run` lays processes out: on one host, or as Ray actors over a cluster (backend)."""

    rollout_workers: int = Field(1, ge=1, description="Rollout worker processes.")
    reward_workers: int = Field(1, ge=1, description="Reward worker processes.")
    agent_workers: int = Field(1, ge=1, description="Agent worker processes (started only when agent.workflow is set).")
    trainer_ranks: int = Field(
        1, ge=1, le=64, description="Trainer processes (ranks): more than 1 starts the trainer as one unit, under "
        "torch.distributed.run on this host (backend local) or as one Ray actor per rank in a placement group "
        "(backend ray, launcher.ray_trainer_strategy), gloo on CPUs, nccl on GPUs, rank 0 talking to the brokers; "
        "pair it with trainer.strategy fsdp, or trainer.parallel's degrees (whose product it must be), to shard the "
        "model over them (docs/bigger-models.md). A rank that dies takes the unit down, and on_child_death restart brings it back from its last checkpoint.")
    stop_grace_s: float | None = Field(
        None, gt=0, description="At the end of a run, the seconds between SIGTERM (drain, checkpoint) and SIGKILL. "
        "Default: 30 s plus the trainer's checkpoint (12 bytes per parameter: fp32 weights and AdamW's two moments) "
        "written at 100 MB/s: 46 s for SmolLM2-135M (1.6 GB), ~16 min for a 7B model (91 GB) "
        "(areal_mq/launch/launcher.py, default_stop_grace_s).")
    on_child_death: Literal["restart", "stop"] = Field("stop", description="What to do when a child process dies.")
    max_restarts: int = Field(3, ge=0, description="Restarts per child before the run stops.")
    threads: dict[str, int] = Field(default_factory=dict, description="torch threads per role (rollout, trainer, ...).")
    backend: Literal["local", "ray"] = Field(
        "local", description="local: every process on this host; ray: each role a Ray actor placed over a Ray "
        "cluster (docs/many-hosts.md; needs `pip install -e .[ray]`).")
    ray_address: str | None = Field(
        None, description="backend ray: the cluster to join (HOST:PORT of its head, or 'auto'); none: "
        "$RAY_ADDRESS, else a new Ray instance on this host.")
    ray_resources: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="backend ray: Ray resources of a role's actor, replacing its default "
        "placement (docs/many-hosts.md), e.g. {trainer: {num_gpus: 1}, rollout: {num_cpus: 2, fast_node: 1}}.")
    ray_trainer_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="backend ray, launcher.trainer_ranks > 1: the Ray placement-group strategy of the "
        "trainer's bundles (one per rank). STRICT_PACK: all ranks on one node; PACK: one node where it fits, else "
        "several; (STRICT_)SPREAD: a node per rank. Ranks on several nodes meet at a rendezvous store on the "
        "brokers' host (MASTER_ADDR = brokers.host).")


class RolePlacement(_Section):
    """The GPUs of one role's processes: host indices (backend local) or a count each (backend ray)."""

    gpus: list[int] = Field(
        default_factory=list, description="GPU indices (as the host numbers them) given to this role's processes, "
        "in order: process i gets gpus[i*k:(i+1)*k] with k = gpus_per_process, as its CUDA_VISIBLE_DEVICES. "
        "A multi-rank trainer (launcher.trainer_ranks) is one unit that gets all of them, one per rank. Empty: "
        "the role gets no GPU when any role names some (CUDA_VISIBLE_DEVICES empty), else the host's as before.")
    gpus_per_process: int | None = Field(
        None, ge=1, le=64, description="GPUs of one process (e.g. 2 for a rollout engine with tensor parallelism 2; "
        "a trainer rank always has one). Backend local: how `gpus` is split (none: 1). Backend ray: the N GPUs each "
        "of this role's actors asks Ray for, Ray choosing which (none: no GPU, except the trainer's default of one "
        "per rank where the cluster has enough).")


class PlacementConfig(_Section):
    """Which GPUs each role gets: indices on this host (backend local), or N GPUs each (backend ray, Ray picks
    which: launch/ray_placement.py). Process counts stay where they are:
    launcher.trainer_ranks, launcher.rollout_workers, launcher.reward_workers, launcher.agent_workers."""

    trainer: RolePlacement = Field(default_factory=RolePlacement)
    rollout: RolePlacement = Field(default_factory=RolePlacement)
    reward: RolePlacement = Field(default_factory=RolePlacement)
    agent: RolePlacement = Field(default_factory=RolePlacement)
    eval: RolePlacement = Field(
        default_factory=RolePlacement, description="The periodic evaluation's GPUs (one process, started by the "
        "launcher every eval.every versions). Empty: beside the first rollout engine (its GPUs), never a trainer's.")

    def processes(self, launcher: "LauncherConfig") -> dict[str, tuple[int, int]]:
        """role -> (processes, GPUs each)."""
        return {"trainer": (launcher.trainer_ranks, 1),
                "rollout": (launcher.rollout_workers, self.rollout.gpus_per_process or 1),
                "reward": (launcher.reward_workers, self.reward.gpus_per_process or 1),
                "agent": (launcher.agent_workers, self.agent.gpus_per_process or 1),
                "eval": (1, len(self.eval.gpus) or 1)}

    def check(self, launcher: "LauncherConfig") -> None:
        owner: dict[int, str] = {}
        named = [r for r in ("trainer", "rollout", "reward", "agent", "eval") if getattr(self, r).gpus]
        if named and launcher.backend != "local":
            raise ConfigError(f"placement.{named[0]}.gpus names GPU indices, which is for launcher.backend local; under "
                              f"Ray say how many each process gets (placement.{named[0]}.gpus_per_process: N) and Ray "
                              "picks which (docs/many-hosts.md)")
        if self.trainer.gpus_per_process not in (None, 1):
            raise ConfigError(f"placement.trainer.gpus_per_process is {self.trainer.gpus_per_process}, but a trainer "
                              "rank has one GPU: more GPUs for the trainer are more ranks (launcher.trainer_ranks)")
        for role, (count, each) in self.processes(launcher).items():
            gpus = getattr(self, role).gpus
            if not gpus:
                continue
            if len(gpus) != count * each:
                raise ConfigError(
                    f"placement.{role}.gpus names {len(gpus)} GPU(s) ({gpus}) but {role} runs {count} process(es) "
                    f"x {each} GPU(s) = {count * each}; name exactly that many, or change the process count")
            for g in gpus:
                if g < 0:
                    raise ConfigError(f"placement.{role}.gpus: {g} is not a GPU index")
                if g in owner:
                    raise ConfigError(f"GPU {g} is given twice: to placement.{owner[g]}.gpus and placement.{role}.gpus"
                                      " (each GPU belongs to one role's processes)")
                owner[g] = role

    def visible(self, role: str, index: int, launcher: "LauncherConfig") -> str | None:
        """CUDA_VISIBLE_DEVICES for process `index` of `role` (the trainer unit: index 0, all its GPUs), or
        None to leave the environment as it is (no role names GPUs)."""
        if not any(getattr(self, r).gpus for r in ("trainer", "rollout", "reward", "agent")):
            return None
        if role == "eval" and not self.eval.gpus:  # beside the first engine: never on a trainer's device unasked
            return self.visible("rollout", 0, launcher)
        place = getattr(self, role, None)
        if place is None or not place.gpus:
            return ""
        if role == "trainer":
            return ",".join(map(str, place.gpus))
        k = place.gpus_per_process or 1
        return ",".join(map(str, place.gpus[index * k:(index + 1) * k]))


class RunConfig(_Section):
    """A whole run. Every section is optional in YAML; defaults are documented per field."""

    run: RunSection = Field(default_factory=RunSection)
    brokers: BrokerConfig = Field(default_factory=BrokerConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    controller: ControllerConfig = Field(default_factory=ControllerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    launcher: LauncherConfig = Field(default_factory=LauncherConfig)
    placement: PlacementConfig = Field(default_factory=PlacementConfig,
                                       description="Which GPUs each role's processes get (host indices, or N each under Ray).")
    agent: AgentConfig = Field(default_factory=AgentConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        from areal_mq.algorithms.config import validate_off_policy
        from areal_mq.algorithms.parallel import check_ranks
        from areal_mq.engines.vllm.config import configure as configure_vllm
        from areal_mq.sim.config import check_time_scales
        from areal_mq.weights.ipc import check_config as check_ipc_config

        validate_off_policy(self.controller.max_staleness, self.trainer)
        check_ranks(self.trainer, self.launcher.trainer_ranks)  # trainer.parallel's product is the trainer's ranks
        self.placement.check(self.launcher)
        configure_vllm(self)
        check_time_scales(self.rollout.engine.kind, self.rollout.engine.sim, self.trainer.sim)
        check_ipc_config(self)
        if abs(self.trainer.temperature - self.controller.temperature) > 1e-9:
            raise ConfigError(
                f"trainer.temperature ({self.trainer.temperature}) must equal controller.temperature "
                f"({self.controller.temperature}): behaviour logprobs are log_softmax(logits / T) at the sampling "
                "temperature, and the trainer recomputes them the same way")
        self._check_precision()
        self._check_exposure()
        hosts = self.trainer.weight_server_hosts
        if hosts and len(hosts) != self.launcher.trainer_ranks:
            raise ConfigError(f"trainer.weight_server_hosts lists {len(hosts)} hosts for launcher.trainer_ranks "
                              f"{self.launcher.trainer_ranks}: one per rank, rank 0's first")
        self._configure_reward_task()
        self._check_eval_placement()
        return self

    def _check_eval_placement(self) -> None:
        from areal_mq.launch.ray_placement import uses_placement

        if (self.launcher.backend == "ray" and self.eval.every > 0 and self.eval.via == "process"
                and uses_placement(self)):
            raise ConfigError(
                f"eval.every {self.eval.every} under launcher.backend ray with GPU placement: the periodic evaluation "
                "runs in the driver, whose GPUs Ray gives to the roles; set eval.via: rollout (it generates through "
                "the rollout engines) or eval.every: 0 (the base and final evaluations still run, while no role holds "
                "a GPU)")

    def job_leases(self) -> dict[str, float]:
        """Per-service job leases the job broker applies: brokers.job_deadlines, plus a 'generate' lease sized
        by the longest answer (brokers.min_decode_tokens_per_s) where the config does not name one."""
        b, leases = self.brokers, dict(self.brokers.job_deadlines)
        if "generate" not in leases and b.job_deadline_s > 0:
            leases["generate"] = max(b.job_deadline_s, self.generate_lease_floor_s)
        return leases

    @property
    def generate_lease_floor_s(self) -> float:
        return 60.0 + self.controller.max_new_tokens / self.brokers.min_decode_tokens_per_s

    def job_retry_s(self, *services: str) -> float:
        """How long a client of `services` waits for an answer before it resubmits: brokers.job_retry_s, and
        never less than their longest lease + 60 s (a job is taken back before anyone asks for it again)."""
        leases = self.job_leases()
        longest = max(leases.get(s, self.brokers.job_deadline_s) for s in services) if services else 0.0
        return max(self.brokers.job_retry_s, longest + 60.0) if longest > 0 else self.brokers.job_retry_s

    @property
    def staleness_bound(self) -> int:
        """η in effect, for the controller's admission and the trainer's GetBatch alike: controller.max_staleness,
        or 0 in sync mode (sync is the asynchronous loop with η = 0)."""
        return 0 if self.run.mode == "sync" else self.controller.max_staleness

    def _configure_reward_task(self) -> None:
        """The controller's reward task becomes a configured task of the reward workers when no entry (nor '*')
        covers it and it names a built-in or an import path. Decided here, from the trusted config: a reward
        worker never resolves a task name that arrives in a job (that would let any peer name code to run)."""
        from areal_mq.rewards.config import TaskConfig
        from areal_mq.rewards.registry import BUILTINS

        task, tasks = self.controller.reward_task, self.reward.tasks
        if task in tasks or "*" in tasks:
            return
        if task not in BUILTINS and ":" not in task:
            raise ConfigError(
                f"controller.reward_task {task!r} is not a task of reward.tasks ({sorted(tasks) or 'none'}), a "
                f"built-in reward function ({', '.join(BUILTINS)}) nor an import path 'pkg.module:function'; "
                f"define it under reward.tasks, e.g. reward: {{tasks: {{{task}: {{fn: my_pkg.rewards:score}}}}}}")
        tasks[task] = TaskConfig(fn=task)

    def _check_precision(self) -> None:
        # rollout_dtype (areal_mq/algorithms/trainer.py) spelled out: config validation must not import torch
        engine = self.model.dtype if self.rollout.engine.dtype == "auto" else self.rollout.engine.dtype
        if self.trainer.precision == "fp16" and engine != "float16" and self.rollout.engine.kind != "sim":
            raise ConfigError(
                f"trainer.precision fp16 needs rollout.engine.dtype float16 (it is {engine}): fp16 is chosen to make "
                "the trainer compute what the engine computes; an fp16 trainer against a bf16 or fp32 engine is "
                "off-policy by numerics alone. Set rollout.engine.dtype=float16, or trainer.precision=auto")

    def _check_exposure(self) -> None:
        from areal_mq.security import is_loopback

        if not self.security.insecure:
            return
        hosts = {"brokers.host": self.brokers.host, "trainer.weight_server_host": self.trainer.weight_server_host,
                 **{f"trainer.weight_server_hosts[{r}]": h for r, h in enumerate(self.trainer.weight_server_hosts)}}
        exposed = {k: v for k, v in hosts.items() if not is_loopback(v)}
        if exposed:
            raise ConfigError(
                f"security.insecure with non-loopback addresses ({', '.join(f'{k}={v}' for k, v in exposed.items())}): "
                "unauthenticated sockets off this host would let anyone stop workers or publish weights. Use keys "
                "(`areal-mq keys generate DIR`, security.keys_dir) or bind 127.0.0.1")


# ---------------------------------------------------------------- loading and overrides
def parse_override(item: str) -> tuple[list[str], Any]:
    """'a.b=value' -> (['a', 'b'], parsed value). Values are parsed as YAML scalars/lists."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value")
    key, raw = item.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({exc})") from None
    return path, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `--set a.b=value` overrides to raw config data, in order.

    A key INSIDE a dict-valued field (reward.tasks.NAME, brokers.job_deadlines.SERVICE, launcher.threads.ROLE)
    merges into that field: the config file's dict when it gives one, else the field's default, so
    `--set reward.tasks.mine.fn=pkg:f` adds a task and the default tasks stay. Setting the field itself
    (`--set reward.tasks={mine: {fn: pkg:f}}`) replaces the whole dict."""
    for item in overrides:
        path, value = parse_override(item)
        node: dict = data
        model: type[BaseModel] | None = RunConfig
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = _starting_value(model, part)
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node, model = child, _field_model(model, part)
        node[path[-1]] = value
    return data


def _field_model(model: type[BaseModel] | None, name: str) -> type[BaseModel] | None:
    """The section model of field `name` of `model` (Optional[Model] included), None when it is no section."""
    field = model.model_fields.get(name) if model is not None else None
    if field is None:
        return None
    ann = field.annotation
    union = typing.get_origin(ann) in (typing.Union, types.UnionType)
    for ann in (typing.get_args(ann) if union else (ann,)):
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            return ann
    return None


def _starting_value(model: type[BaseModel] | None, name: str) -> dict:
    """What an override below field `name` starts from when the config does not give it: the field's default
    when it is a dict (merge into the defaults), else {} (a section: pydantic fills in its defaults)."""
    field = model.model_fields.get(name) if model is not None else None
    if field is None or _field_model(model, name) is not None:
        return {}
    default = field.get_default(call_default_factory=True)
    return _plain(default) if isinstance(default, dict) else {}


def _model_at(path: tuple, root: type[BaseModel] = None) -> type[BaseModel] | None:
    model = root or RunConfig
    for part in path:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None) if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _explain(exc: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for err in exc.errors():
        loc = tuple(err["loc"])
        dotted = ".".join(str(p) for p in loc) or "<root>"
        if err["type"] == "extra_forbidden":
            parent = _model_at(loc[:-1])
            hint = ""
            if parent is not None:
                close = difflib.get_close_matches(str(loc[-1]), list(parent.model_fields), n=1, cutoff=0.5)
                if close:
                    hint = f" — did you mean '{'.'.join(str(p) for p in loc[:-1] + (close[0],))}'?"
                else:
                    hint = f" (known keys: {', '.join(parent.model_fields)})"
            lines.append(f"  unknown key '{dotted}'{hint}")
        else:
            lines.append(f"  {dotted}: {err['msg']} (got {err.get('input')!r})")
    return "\n".join(lines)


# Keys that moved to another section: a config still using one is refused with the new name (never guessed).
MOVED_KEYS = {
    "controller.eval_every": "eval.every",
    "controller.eval_size": "eval.size",
    **{f"rollout.{name}": f"rollout.engine.{name}" for name in EngineConfig.model_fields if name != "kind"},
}


def moved_keys(data: dict) -> list[str]:
    """'old -> new' for each moved key present in a raw config dict (rollout.engine: NAME is one too)."""
    found = []
    for old, new in MOVED_KEYS.items():
        section, key = old.split(".")
        if isinstance(data.get(section), dict) and key in data[section]:
            found.append(f"{old} -> {new}")
    rollout = data.get("rollout")
    if isinstance(rollout, dict) and isinstance(rollout.get("engine"), str):
        found.append(f"rollout.engine: {rollout['engine']} -> rollout.engine.kind: {rollout['engine']}")
    return found


def config_from_dict(data: dict, source: str = "<dict>") -> RunConfig:
    moved = moved_keys(data)
    if moved:
        raise ConfigError(f"invalid config ({source}): keys moved to their own sections; rename:\n  "
                          + "\n  ".join(moved))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_explain(exc, source)) from None
    except ValueError as exc:  # cross-section checks raise ValueError subclasses
        raise ConfigError(f"invalid config ({source}): {exc}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Read YAML (or start from defaults when path is None), apply overrides, validate."""
    data: dict = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} not found (configs/quickstart.yaml is the usual start)")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{p}: top level must be a mapping of sections, got {type(data).__name__}")
        source = str(p)
    apply_overrides(data, list(overrides or []))
    return config_from_dict(data, source)


def dump_config(cfg: RunConfig) -> str:
    """Plain YAML of a resolved config (what the launcher writes into run_dir/config.yaml)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def documented_yaml(cfg: BaseModel, indent: int = 0) -> str:
    """YAML of `cfg` with each field's description as a comment (for `config show`)."""
    pad = "  " * indent
    out: list[str] = []
    for name, field in type(cfg).model_fields.items():
        value = getattr(cfg, name)
        doc = field.description or (type(value).__doc__ or "").strip().splitlines()[0:1]
        doc = doc if isinstance(doc, str) else (doc[0] if doc else "")
        if isinstance(value, BaseModel):
            out.append(f"{pad}{name}:{'  # ' + doc if doc else ''}")
            out.append(documented_yaml(value, indent + 1))
        else:
            rendered = yaml.safe_dump({name: _plain(value)}, default_flow_style=True, width=10_000).strip()
            rendered = rendered[1:-1] if rendered.startswith("{") else rendered
            out.append(f"{pad}{rendered}{'  # ' + doc if doc else ''}")
    return "\n".join(line for line in out if line)


def _plain(value: Any) -> Any:
    """YAML-safe value: models (also inside dicts and lists, e.g. reward.tasks) become plain dicts."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_defaults=True)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
