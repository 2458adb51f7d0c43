"""Config loading: YAML files, --set overrides, unknown keys with did-you-mean, every field documented."""
from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from areal_mq.config import RunConfig, documented_yaml, load_config, parse_override
from areal_mq.errors import ConfigError

CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*.yaml"))


def test_overrides_parse_yaml_values(tmp_path):
    cfg = load_config(None, ["brokers.job_port=7001", "controller.max_staleness=0", "run.name=abc"])
    assert cfg.brokers.job_port == 7001 and cfg.controller.max_staleness == 0 and cfg.run.name == "abc"
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])


@pytest.mark.parametrize("override, message", [
    ("controller.group_sise=3", "did you mean 'controller.group_size'"),
    ("brokers.job_port=notaport", "brokers.job_port"),
    ("controller.max_staleness=-1", "controller.max_staleness"),
    ("noequals", "section.key=value"),
])
def test_bad_overrides_are_explained(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_yaml_file_unknown_nested_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("brokers:\n  heartbeat: 2\n")
    with pytest.raises(ConfigError, match=r"unknown key 'brokers.heartbeat' — did you mean 'brokers.heartbeat_s'"):
        load_config(path)
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def _fields(model: type[BaseModel], prefix=""):
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _fields(ann, prefix + name + ".")
        else:
            yield prefix + name, field


def test_every_field_is_documented():
    missing = [name for name, field in _fields(RunConfig) if not field.description]
    assert not missing, f"fields without description: {missing}"
    assert "# Job broker ROUTER port." in documented_yaml(RunConfig())


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_validate(path):
    load_config(path)


def test_the_controllers_reward_task_is_configured_at_load_time(tmp_path):
    """A reward worker only scores configured tasks, so the controller's task is made one here (trusted config)."""
    for path in CONFIGS:  # tiny.yaml has no reward.tasks: it relies on this
        cfg = load_config(path)
        assert cfg.controller.reward_task in cfg.reward.tasks
    path_task = "tests/integration/varied_reward.py:varied"
    assert load_config(None, [f"controller.reward_task={path_task}"]).reward.tasks[path_task].fn == path_task
    with pytest.raises(ConfigError, match=r"controller.reward_task 'gsm8k' .* define it under reward.tasks"):
        load_config(None, ["controller.reward_task=gsm8k"])
    named = tmp_path / "named.yaml"
    named.write_text("controller: {reward_task: gsm8k}\nreward: {tasks: {gsm8k: {fn: math}}}\n")
    assert set(load_config(named).reward.tasks) == {"gsm8k"}


def test_set_inside_a_dict_field_merges_into_the_defaults(tmp_path):
    """issue 28 item 6: `--set reward.tasks.X.fn=...` on a config without a reward: section adds task X; the
    default tasks stay (also when the controller's task becomes X). Other dict fields merge the same way."""
    cfg = load_config(None, ["reward.tasks.mine.fn=tests.integration.varied_reward:varied",
                             "controller.reward_task=mine"])
    assert set(cfg.reward.tasks) == {"arith", "mine"} and cfg.reward.tasks["arith"].fn == "arith"
    assert load_config(None, ["brokers.job_deadlines.reward=120"]).brokers.job_deadlines == {"agent": 1800.0,
                                                                                           "reward": 120.0}
    # a key of a default entry: that entry is kept and changed, not replaced by a bare {kwargs: ...}
    arith = load_config(None, ["reward.tasks.arith.kwargs.penalty=-1"]).reward.tasks["arith"]
    assert (arith.fn, arith.kwargs) == ("arith", {"penalty": -1})
    # the config file's dict, when it has one, is what --set merges into
    own = tmp_path / "own.yaml"
    own.write_text("reward: {tasks: {gsm8k: {fn: math}}}\ncontroller: {reward_task: gsm8k}\n")
    assert set(load_config(own, ["reward.tasks.fmt.fn=format"]).reward.tasks) == {"gsm8k", "fmt"}


def test_setting_a_whole_dict_field_replaces_it():
    cfg = load_config(None, ["reward.tasks={mine: {fn: 'tests.integration.varied_reward:varied'}}",
                             "controller.reward_task=mine"])
    assert set(cfg.reward.tasks) == {"mine"}
    assert load_config(None, ["brokers.job_deadlines={}"]).brokers.job_deadlines == {}
    with pytest.raises(ConfigError, match="'tasks' is not a section"):
        load_config(None, ["reward.tasks=3", "reward.tasks.mine.fn=x:y"])


def test_config_show_prints_the_merged_tasks():
    import yaml
    from typer.testing import CliRunner

    from areal_mq.cli import app

    result = CliRunner().invoke(app, ["config", "show", "--plain", "--set", "reward.tasks.mine.fn=format"])
    assert result.exit_code == 0, result.output
    tasks = yaml.safe_load(result.output)["reward"]["tasks"]
    assert {name: task["fn"] for name, task in tasks.items()} == {"arith": "arith", "mine": "format"}
    assert "merges into it" in CliRunner().invoke(app, ["config", "show", "--help"]).output


def test_moved_keys_are_refused_with_their_new_names(tmp_path):
    """issue 14 item 4: rollout: holds an engine: section; eval_* left controller: for eval:. An old config
    gets one error naming each key's new place (nothing is guessed or silently dropped)."""
    old = tmp_path / "old.yaml"
    old.write_text("rollout:\n  engine: vllm\n  max_concurrent: 8\ncontroller:\n  eval_every: 5\n  eval_size: 20\n")
    with pytest.raises(ConfigError) as err:
        load_config(old)
    text = str(err.value)
    for line in ("rollout.engine: vllm -> rollout.engine.kind: vllm",
                 "rollout.max_concurrent -> rollout.engine.max_concurrent",
                 "controller.eval_every -> eval.every", "controller.eval_size -> eval.size"):
        assert line in text, text
    with pytest.raises(ConfigError, match="rollout.kv_on_update -> rollout.engine.kv_on_update"):
        load_config(None, ["rollout.kv_on_update=keep"])
    cfg = load_config(None, ["rollout.engine.kind=vllm", "rollout.engine.max_concurrent=8", "eval.every=5",
                             "rollout.drain_timeout_s=3"])
    assert (cfg.rollout.engine.kind, cfg.rollout.engine.max_concurrent, cfg.eval.every) == ("vllm", 8, 5)
    assert cfg.rollout.drain_timeout_s == 3.0


def test_generation_leases_and_retries_grow_with_the_longest_answer():
    """An 8k-token answer is not taken back at the 300 s default while it still decodes, and no client asks
    for a job again before its lease can end (brokers.min_decode_tokens_per_s)."""
    short = load_config(None, ["controller.max_new_tokens=64"])
    assert short.job_leases()["generate"] == 300.0 and short.job_retry_s("generate", "reward") == 600.0
    long = load_config(None, ["controller.max_new_tokens=8192"])
    assert long.job_leases()["generate"] == pytest.approx(60 + 8192 / 5.0)
    assert long.job_retry_s("generate") == pytest.approx(60 + 8192 / 5.0 + 60)
    assert long.job_retry_s("reward") == 600.0  # a reward lease is not an answer's length
    named = load_config(None, ["controller.max_new_tokens=8192", "brokers.job_deadlines={generate: 100}"])
    assert named.job_leases()["generate"] == 100.0  # what the config names wins
    off = load_config(None, ["controller.max_new_tokens=8192", "brokers.job_deadline_s=0"])
    assert "generate" not in off.job_leases()  # no deadlines at all stays no deadline


def test_per_rank_weight_hosts_are_one_per_trainer_rank_and_never_exposed_without_keys():
    sets = ["trainer.strategy=fsdp", "trainer.publish_mode=zmq", "launcher.trainer_ranks=2",
            "trainer.weight_server_hosts=[127.0.0.1, 127.0.0.2]"]
    cfg = load_config(None, sets)
    assert cfg.trainer.weight_server_hosts == ["127.0.0.1", "127.0.0.2"]
    with pytest.raises(ConfigError, match="lists 2 hosts for launcher.trainer_ranks 3"):
        load_config(None, [*sets, "launcher.trainer_ranks=3"])
    with pytest.raises(ConfigError, match=r"trainer.weight_server_hosts\[1\]=10.0.0.7"):
        load_config(None, [*sets[:3], "trainer.weight_server_hosts=[127.0.0.1, 10.0.0.7]", "security.insecure=true"])
