"""Code the operator names in a config: 'package.module:function' resolved to the object, or a ConfigError.

What: `import_function(spec, what, usage)`, the one resolution for agent.workflow (runner.load_workflow) and
openai_agent's agent.workflow_args.agent. Specs come from the operator's config or CLI, never from the wire.
"""
from __future__ import annotations

import importlib
from typing import Any

from areal_mq.errors import ConfigError


def import_function(spec: str, what: str, usage: str) -> Any:
    """The object 'package.module:function' names (the operator's config or CLI, never the wire); ConfigError naming
    `what` (e.g. "workflow 'x:y'") and `usage` (the accepted forms, with an example) when it is not one."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name.isidentifier():
        raise ConfigError(f"{what}: use {usage}")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise ConfigError(f"{what}: cannot import {module!r} ({exc}); is it on PYTHONPATH?") from None
    except AttributeError:
        raise ConfigError(f"{what}: module {module!r} has no {name!r}") from None
