"""A RewardJob comes off the wire: its task may only select a configured task, and its meta may not set what
the configuration decides (a function's declared parameters, e.g. the code reward's sandbox limits).

Run: pytest tests/unit/rewards/test_wire_tasks.py -q
"""
import pytest

from areal_mq.config import config_from_dict
from areal_mq.errors import RewardError
from areal_mq.messages import RewardJob
from areal_mq.rewards import RewardConfig, RewardExecutor
from areal_mq.rewards.config import TaskConfig

FNS = "tests.unit.rewards.rewardfns"


@pytest.fixture(scope="module")
def ex():
    cfg = RewardConfig(processes=1, timeout_s=10, retries=0,
                       tasks={"arith": TaskConfig(fn="arith"), "lim": TaskConfig(fn=f"{FNS}:echo_limits")})
    with RewardExecutor(cfg) as executor:
        yield executor


@pytest.mark.parametrize("task", ["os:execl", "os:system", "subprocess:getoutput", "math", "code",
                                  "areal_mq.rewards.arith_reward:arith_reward", "/tmp/evil.py:run", "*"])
def test_a_task_name_from_the_wire_selects_only_configured_tasks(ex, task):
    with pytest.raises(RewardError, match="unknown reward task"):
        ex.submit(RewardJob(task=task, completions=["x"]))


def test_job_meta_cannot_set_a_declared_parameter(ex):
    out = ex.score(RewardJob(task="lim", completions=["x"], meta={"limit": 99.0, "note": "ok"}), timeout=30)
    assert out.rewards == [1.0]  # the function's own default, not the job's 99
    assert "limit" not in out.details[0]["meta_keys"] and "note" in out.details[0]["meta_keys"]


def test_configured_kwargs_win_over_job_meta():
    cfg = RewardConfig(processes=1, tasks={"lim": TaskConfig(fn=f"{FNS}:echo_limits", kwargs={"limit": 3.0})})
    with RewardExecutor(cfg) as ex:
        assert ex.score(RewardJob(task="lim", completions=["x"], meta={"limit": 99.0}), timeout=30).rewards == [3.0]


def test_star_entry_is_configuration_too():
    cfg = RewardConfig(processes=1, tasks={"*": TaskConfig(fn="arith")})
    with RewardExecutor(cfg) as ex:
        assert ex.score(RewardJob(task="anything", completions=["\\boxed{4}"], reference=4), timeout=30).rewards == [1.0]


def test_the_controllers_reward_task_becomes_a_configured_task():
    cfg = config_from_dict({"controller": {"reward_task": "math"}})
    assert cfg.reward.tasks["math"].fn == "math"
    cfg = config_from_dict({"controller": {"reward_task": "math"}, "reward": {"tasks": {"*": {"fn": "arith"}}}})
    assert set(cfg.reward.tasks) == {"*"}
