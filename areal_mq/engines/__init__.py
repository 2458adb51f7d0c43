"""Inference engines behind one contract (areal_mq.engines.base.Engine).

`build_engine(engine_cfg, model_cfg, **kwargs)` builds the engine named by `engine_cfg.kind`,
importing its module only then (torch, transformers and vLLM are heavy; the CLI imports this package).
Each engine module exposes `build(engine_cfg, model_cfg, **kwargs) -> Engine`; to add an engine,
add its module to ENGINE_MODULES.
"""
from __future__ import annotations

import importlib
from typing import Any

from areal_mq.errors import ConfigError

# rollout.engine.kind -> module providing build(engine_cfg, model_cfg, **kwargs); vllm/engine.py's build serves both
# vLLM kinds: in process (AsyncLLM) and a running OpenAI-compatible server (vllm/server.py's VllmServerEngine)
ENGINE_MODULES = {
    "torch": "areal_mq.engines.torch.engine",
    "vllm": "areal_mq.engines.vllm.engine",
    "vllm-server": "areal_mq.engines.vllm.engine",
    "sim": "areal_mq.sim.engine",  # simulated GPU, named timing model (issue 17, areal_mq/sim/timing.py)
}


def build_engine(engine_cfg: Any, model_cfg: Any = None, **kwargs: Any) -> Any:
    """Build the configured engine. kwargs: seed=, model_dir=, tokenizer= (engine-specific extras)."""
    name = engine_cfg.kind
    module_name = ENGINE_MODULES.get(name)
    if module_name is None:
        raise ConfigError(f"unknown engine {name!r}; choose one of {sorted(ENGINE_MODULES)}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise ConfigError(f"engine {name!r} needs {exc.name!r}, which is not installed") from exc
        raise ConfigError(f"engine {name!r} is not available in this build ({module_name} missing)") from exc
    return module.build(engine_cfg, model_cfg, **kwargs)
