"""Config of the reward service (owned by areal_mq.rewards).

What: `RewardConfig` (the `reward:` section of a run config) says how many reward processes run, the
deadline and retries of one job, the cache, and which function scores each task (`tasks`). A task is
scored by a registry name or import path (`fn`), a weighted sum of several (`combine`), or a user's
HTTP endpoint (`http`). `SandboxConfig` holds the limits of the code sandbox (pass them to the `code`
task as `kwargs: {sandbox: {...}}`).

Example (YAML):
    reward:
      processes: 2
      tasks:
        arith: {fn: arith}
        gsm8k: {combine: {math: 1.0, format: 0.1}}
        mine:  {fn: "my_pkg.rewards:score", default_reward: -1.0}
        remote: {http: {url: "http://10.0.0.5:8000/reward"}}
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SandboxConfig(BaseModel):
    """Limits of one sandboxed Python run (code rewards)."""

    model_config = ConfigDict(extra="forbid")
    timeout_s: float = Field(10.0, gt=0, description="Wall-clock limit of one run; the whole process tree is killed after it.")
    cpu_s: int = Field(5, ge=1, description="CPU seconds (RLIMIT_CPU) of the program.")
    memory_mb: int = Field(512, ge=32, description="Memory limit, MiB: the address space (RLIMIT_AS) of each process, "
                           "and the whole process tree's memory where a cgroup can be made (see `cgroup`).")
    max_processes: int = Field(16, ge=1, description="Process limit (RLIMIT_NPROC) of the sandbox user; stops fork bombs.")
    max_output_bytes: int = Field(65536, ge=1024, description="stdout+stderr beyond this kills the run (reason output_limit).")
    disk_mb: int = Field(32, ge=1, description="Size of the private tmpfs working directory (namespace isolation only).")
    isolation: Literal["auto", "namespaces", "rlimits", "unsafe"] = Field(
        "auto",
        description="namespaces: fresh network+IPC+mount+pid namespaces via `unshare`, seccomp, no_new_privs (needs "
        "root); rlimits: limits and in-process guards only, for a non-root worker (refused as root); auto: "
        "namespaces when the OS allows, else rlimits when not root, else refuse (fail closed); unsafe: rlimits "
        "mode even as root (debugging only: the program runs with the worker's privileges).",
    )
    site_packages: bool = Field(False, description="Let the program import installed packages (python -I -S otherwise).")
    cgroup: bool = Field(True, description="Cap the memory of the whole process tree at memory_mb with a fresh cgroup "
                         "per run where the worker may create one (cgroup v2 with memory delegated, or v1); else the "
                         "tree is bounded by memory_mb x max_processes (rlimits).")
    hide: list[str] = Field(default_factory=list, description="More directories the program must not read (e.g. "
                            "the run directory when it is not under the worker's working directory); with "
                            "namespaces each is covered by an empty tmpfs. /tmp, /var/tmp, /dev/shm and the "
                            "worker's working directory always are.")


class HttpBridgeConfig(BaseModel):
    """Forward a task's jobs to a user's HTTP endpoint (request/response JSON in docs/rewards.md)."""

    model_config = ConfigDict(extra="forbid")
    url: str = Field(..., pattern=r"^https?://", description="POST endpoint, e.g. http://127.0.0.1:8000/reward.")
    timeout_s: float = Field(10.0, gt=0, description="Deadline of one HTTP attempt (connect + response).")
    retries: int = Field(2, ge=0, le=20, description="Extra attempts after a timeout, connection error, 429 or 5xx.")
    backoff_s: float = Field(0.5, ge=0, description="Wait before retry k is backoff_s * 2**(k-1).")
    max_concurrency: int = Field(4, ge=1, description="Requests in flight to this endpoint at most.")
    headers: dict[str, str] = Field(default_factory=dict, description="Extra request headers (e.g. Authorization).")
    max_response_bytes: int = Field(10_000_000, ge=1024, description="Larger responses are refused.")


class TaskConfig(BaseModel):
    """How one task (RewardJob.task) is scored. Exactly one of fn, combine, http."""

    model_config = ConfigDict(extra="forbid")
    fn: str | None = Field(None, description="Registry name (arith, math, format, code, ...) or import path 'pkg.mod:func'.")
    combine: dict[str, float] = Field(
        default_factory=dict, description="Weighted sum of per-sample functions: {name or path: weight}."
    )
    http: HttpBridgeConfig | None = Field(None, description="Score on a remote HTTP endpoint instead.")
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments passed to the function(s); a job's meta never "
        "overrides them, nor any parameter the function declares.")
    default_reward: float | None = Field(
        None, description="Reward of a completion whose scoring failed; None = RewardConfig.default_reward."
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> "TaskConfig":
        given = [name for name, v in (("fn", self.fn), ("combine", self.combine), ("http", self.http)) if v]
        if len(given) != 1:
            raise ValueError(f"a task needs exactly one of fn, combine, http; got {given or 'none'}")
        return self


class RewardConfig(BaseModel):
    """Reward worker settings."""

    model_config = ConfigDict(extra="forbid")
    processes: int = Field(1, ge=1, description="Reward function processes per reward worker (its capacity).")
    timeout_s: float = Field(10.0, gt=0, description="Deadline of one reward function call; a hung call is killed.")
    retries: int = Field(1, ge=0, le=10, description="Extra attempts after a call raised, hung or crashed.")
    default_reward: float = Field(0.0, description="Reward of a completion whose scoring failed (tasks may override).")
    cache_size: int = Field(4096, ge=0, description="LRU entries keyed on (task, prompt id, completion); 0 disables.")
    start_method: Literal["spawn", "forkserver", "fork"] = Field(
        "spawn",
        description="How pool processes start. spawn/forkserver need importable functions; fork also takes "
        "closures but is unsafe in a process with threads.",
    )
    tasks: dict[str, TaskConfig] = Field(
        default_factory=lambda: {"arith": TaskConfig(fn="arith")},
        description="Task name -> how to score it; the key '*' catches every other task. A job naming a task "
        "that is not listed (and no '*') is refused: a job's task never names code to load. Default: arith (the "
        "default controller.reward_task). `--set reward.tasks.NAME.fn=...` adds a task to these (the config's "
        "tasks, else the default); a `reward: {tasks: ...}` in the YAML file or `--set reward.tasks={...}` "
        "replaces them.",
    )
