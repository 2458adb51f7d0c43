"""Jobs flow client -> broker -> echo workers -> client, and the broker survives bad input."""
from __future__ import annotations

from areal_mq.client import JobClient
from areal_mq.messages import RewardJob, RewardResult

from .conftest import keys, wait_for, worker_count


def test_jobs_round_trip_through_two_workers(broker, procs, config_path, cfg):
    env = {"AREAL_ECHO_CAPACITY": "2"}
    for i in range(2):
        procs.start(["worker", "echo", "--config", str(config_path), "--worker-id", f"echo-{i}"], f"echo{i}", env)
    wait_for(lambda: worker_count(cfg, "echo") == 2, 30, what="two echo workers")
    client = JobClient(cfg.brokers.job_addr, keys=keys(cfg, "controller"), heartbeat_s=0.2)
    try:
        ids = {client.submit(RewardJob(task="t", completions=["x" * i]), service="echo"): i for i in range(1, 21)}
        got = {}
        wait_for(lambda: got.update(client.poll(0.1)) or len(got) == len(ids), 30, what="20 answers")
        for job_id, msg in got.items():
            assert isinstance(msg, RewardResult)
            assert msg.rewards == [float(ids[job_id])]
        assert {m.worker_id for m in got.values()} == {"echo-0", "echo-1"}
    finally:
        client.close()
