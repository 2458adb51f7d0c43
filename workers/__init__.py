"""Worker roles. Each registers itself here as name -> "module:function" (imported lazily by the CLI).

A role entrypoint is `main(cfg: RunConfig, worker_id: str | None) -> int`.
"""
ROLES: dict[str, str] = {
    "rollout": "areal_mq.workers.rollout:main",
    "reward": "areal_mq.workers.reward:main",
    "trainer": "areal_mq.workers.trainer:main",
    "controller": "areal_mq.workers.controller:main",
    "echo": "areal_mq.workers.echo:main",
    "swarm": "areal_mq.workers.swarm:main",  # N simulated rollout workers in one process (issue 17)
    "agent": "areal_mq.workers.agent:main",
}
