"""`areal-mq config show` — the first command the README tells a user to run — works on every shipped config.

Run: pytest tests/unit/test_config_show.py -q
"""
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from areal_mq.cli import app

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
@pytest.mark.parametrize("plain", [False, True])
def test_config_show_every_shipped_config(path, plain):
    result = CliRunner().invoke(app, ["config", "show", str(path), *(["--plain"] if plain else [])])
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.output)  # documented output is YAML too (descriptions are comments)
    source = yaml.safe_load(path.read_text()).get("reward", {}).get("tasks", {})
    assert set(shown["reward"]["tasks"]) >= set(source)


def test_built_in_workflow_names_in_the_help_and_config_come_from_the_registry():
    """CLI help and the agent.workflow description name exactly the registry's workflows (STYLE 15)."""
    from areal_mq.cli import _builtin_workflows
    from areal_mq.workflows.builtin import BUILTINS
    from areal_mq.workflows.config import AgentConfig

    assert _builtin_workflows() == list(BUILTINS)
    assert f"a built-in ({', '.join(BUILTINS)})" in AgentConfig.model_fields["workflow"].description
