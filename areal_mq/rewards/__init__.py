"""The reward service: reward functions, verifiers, a sandbox, an executor and an HTTP bridge.

    from areal_mq.rewards import RewardConfig, RewardExecutor, RewardRegistry, group_reward
    with RewardExecutor(RewardConfig(processes=2)) as ex:
        result = ex.score(RewardJob(task="arith", completions=["\\boxed{4}"], reference=4))

Modules: config (RewardConfig, TaskConfig, SandboxConfig, HttpBridgeConfig), registry (names, import
paths, @group_reward), math_rewards/arith (verifiers: they read and judge answers with areal_mq.grading,
as evaluation does), sandbox/code_reward (code tests), executor/slots/_pool (the process pool),
http_bridge (remote endpoints), cli (`areal-mq reward ...`).
The reward worker role and `serve(fn, broker="tcp://HOST:PORT")` are areal_mq.workers.reward (a role: the
core never imports it). See docs/rewards.md.
Names are imported lazily so `import areal_mq.rewards` stays cheap for the CLI.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "RewardConfig": "config", "TaskConfig": "config", "SandboxConfig": "config", "HttpBridgeConfig": "config",
    "RewardRegistry": "registry", "group_reward": "registry", "import_path": "registry",
    "RewardExecutor": "executor", "HttpRewardBridge": "http_bridge", "HttpRewardError": "http_bridge",
    "CodeSandbox": "sandbox.runner", "SandboxResult": "sandbox.runner",
    "math_equal": "math_rewards", "math_reward": "math_rewards", "format_reward": "math_rewards",
    "arith_reward": "arith_reward", "code_reward": "code_reward",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'areal_mq.rewards' has no attribute {name!r}")
    return getattr(importlib.import_module(f"areal_mq.rewards.{module}"), name)
