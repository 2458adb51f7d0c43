"""Worker roles. Each registers itself here as name -> "module:function" (imported lazily by the CLI).

A role entrypoint is `main(cfg: RunConfig, worker_id: str | None) -> int`.
"""
ROLES: dict[str, str] = {
    "echo": "areal_mq.workers.echo:main",
}
