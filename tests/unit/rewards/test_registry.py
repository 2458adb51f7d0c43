"""Registry: names, import paths (module and file), output normalization, group flag.

Run: pytest tests/unit/rewards/test_registry.py -q
"""
import math

import pytest

from areal_mq.errors import ConfigError
from areal_mq.rewards.registry import RewardFn, RewardRegistry, group_reward, import_path, normalize_output


def test_builtins_and_import_paths(tmp_path):
    reg = RewardRegistry()
    assert {"arith", "math", "format", "code", "math_concise"} <= set(reg.names())
    assert reg.resolve("math_concise").group and not reg.resolve("arith").group
    fn = reg.resolve("tests.unit.rewards.rewardfns:length")
    assert fn("p", "abcd", None, {"truncated": False}) == [(4.0, {})]
    src = tmp_path / "myrewards.py"
    src.write_text("def score(prompt, completion, reference, **meta):\n    return {'reward': 2.5, 'why': 'file'}\n")
    assert reg.resolve(f"{src}:score")("p", "c", None, {}) == [(2.5, {"why": "file"})]


@pytest.mark.parametrize("spec,match", [
    ("nonexistent_name", "unknown reward function 'nonexistent_name'"),
    ("no_such_mod_abc:f", "cannot import module 'no_such_mod_abc'"),
    ("tests.unit.rewards.rewardfns:missing", "has no attribute 'missing'"),
    ("/no/such/file.py:f", "does not exist"),
    ("math:pi", "not a function"),
])
def test_resolution_errors_say_what_to_do(spec, match):
    with pytest.raises(ConfigError, match=match):
        RewardRegistry().resolve(spec)


def test_register_and_decorator():
    reg = RewardRegistry(builtins=False)

    @reg.register("double")
    def double(prompt, completion, reference):
        return 2.0

    reg.register("g", lambda p, cs, r, **m: [1.0] * len(cs), group=True)
    assert reg.resolve("double")("p", "c", None, {"truncated": True}) == [(2.0, {})]
    assert reg.resolve("g")("p", ["a", "b"], None, {}) == [(1.0, {}), (1.0, {})]
    assert reg.names() == ["double", "g"]


@pytest.mark.parametrize("out,expected", [
    (1, (1.0, {})), (True, (1.0, {})), (0.25, (0.25, {})),
    ({"reward": 1, "note": "x", "obj": object}, (1.0, {"note": "x", "obj": repr(object)})),
])
def test_normalize_output(out, expected):
    assert normalize_output(out) == expected


@pytest.mark.parametrize("out,match", [
    ("1.0", "must be a number"), (None, "must be a number"), ({"score": 1}, "needs a 'reward' key"),
    (math.nan, "finite"), ({"reward": math.inf}, "finite"),
])
def test_normalize_output_refuses(out, match):
    with pytest.raises((TypeError, ValueError), match=match):
        normalize_output(out)


def test_group_function_must_return_one_per_completion():
    @group_reward
    def g(prompt, completions, reference, **meta):
        return [1.0]

    with pytest.raises(TypeError, match="one reward per completion"):
        RewardFn.of("g", g)("p", ["a", "b"], None, {})


def test_import_path_requires_a_colon():
    with pytest.raises(ConfigError, match="package.module:function"):
        import_path("just_a_module")


class RecordingRegistry(RewardRegistry):
    """Remembers every reference it is asked to resolve."""

    def __init__(self):
        super().__init__()
        self.asked: list[str] = []

    def resolve(self, ref):
        self.asked.append(ref)
        return super().resolve(ref)


@pytest.mark.parametrize("task", ["os:execl", "areal_mq.rewards.arith_reward:arith_reward", "/tmp/evil.py:run", "math"])
def test_a_task_name_from_a_job_never_reaches_the_registry(task, tmp_path):
    """The executor resolves only what its config names; a job's task is looked up in the config, nothing else."""
    from areal_mq.errors import RewardError
    from areal_mq.rewards import RewardConfig, RewardExecutor, TaskConfig

    marker = tmp_path / "imported"
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef run(*a, **k): return 1.0\n")
    reg = RecordingRegistry()
    ex = RewardExecutor(RewardConfig(tasks={"arith": TaskConfig(fn="arith")}), reg)
    assert ex.plan("arith").fns == [("arith", None)]
    with pytest.raises(RewardError, match="unknown reward task"):
        ex.plan(task.replace("/tmp", str(tmp_path)))
    assert reg.asked == ["arith"] and not marker.exists()
