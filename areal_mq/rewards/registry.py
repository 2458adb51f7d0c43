"""Reward functions by name: built-ins, user registrations and import paths ('my_pkg.rewards:score').

What: a `RewardRegistry` maps names to functions and resolves import paths; `@group_reward` flags a
function that scores a whole group at once. Contract of a reward function:

    per-sample: fn(prompt: str, completion: str, reference, **meta) -> float | {"reward": float, ...}
    group:      fn(prompt: str, completions: list[str], reference, **meta) -> list[float | dict]

`meta` carries `truncated` (bool, or list[bool] for group functions), `prompt_id`, the job's `meta`
and the task's configured `kwargs`; a function that does not take `**meta` gets only the names it
declares. Extra keys of a returned dict become the completion's `details`.
Why a registry object rather than a global: each executor gets its own, so tests and users register
functions without touching shared state.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable

from areal_mq.errors import ConfigError

BUILTINS = MappingProxyType({
    "arith": "areal_mq.rewards.arith_reward:arith_reward",
    "math": "areal_mq.rewards.math_rewards:math_reward",
    "format": "areal_mq.rewards.math_rewards:format_reward",
    "math_concise": "areal_mq.rewards.math_rewards:math_concise",
    "code": "areal_mq.rewards.code_reward:code_reward",
})


def group_reward(fn: Callable) -> Callable:
    """Mark `fn` as a group reward: it gets all completions of a prompt and returns one reward each."""
    fn.__reward_group__ = True
    return fn


def is_group_reward(fn: Callable) -> bool:
    return bool(getattr(fn, "__reward_group__", False))


def import_path(spec: str) -> Callable:
    """Load 'pkg.module:function' (or 'path/to/file.py:function'); clear ConfigError when it fails."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"reward function {spec!r} is neither a registered name nor an import path "
                          "'package.module:function'")
    try:
        if module_name.endswith(".py"):
            module = _load_file(module_name)
        else:
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except Exception as exc:  # any import-time failure of user code is a config problem
        raise ConfigError(f"cannot import module {module_name!r} for reward function {spec!r}: "
                          f"{type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"module {module_name!r} has no attribute {attr!r} (reward function {spec!r})")
    if not callable(obj):
        raise ConfigError(f"reward function {spec!r} is a {type(obj).__name__}, not a function")
    return obj


def _load_file(path: str):
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise ConfigError(f"reward function file {path!r} does not exist")
    name = "areal_user_reward_" + os.path.splitext(os.path.basename(full))[0]
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == full:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@dataclass
class RewardFn:
    """A resolved reward function and how to call it."""

    name: str
    fn: Callable
    group: bool
    var_kw: bool
    params: frozenset[str]

    @classmethod
    def of(cls, name: str, fn: Callable) -> "RewardFn":
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # builtins without a signature: pass everything
            return cls(name, fn, is_group_reward(fn), True, frozenset())
        kinds = {p.kind for p in sig.parameters.values()}
        return cls(name, fn, is_group_reward(fn), inspect.Parameter.VAR_KEYWORD in kinds,
                   frozenset(sig.parameters))

    def check_kwargs(self, kwargs: dict) -> None:
        """ConfigError when configured kwargs name parameters the function does not take."""
        unknown = sorted(set(kwargs) - self.params) if not self.var_kw else []
        if unknown:
            raise ConfigError(f"reward function {self.name!r} takes no argument(s) {unknown}; "
                              f"it accepts {sorted(self.params)}")

    def __call__(self, prompt: str, completion, reference, meta: dict) -> list[tuple[float, dict]]:
        """Call with the contract above; returns one (reward, details) per completion."""
        kw = meta if self.var_kw else {k: v for k, v in meta.items() if k in self.params}
        out = self.fn(prompt, completion, reference, **kw)
        if not self.group:
            return [normalize_output(out)]
        if not isinstance(out, (list, tuple)) or len(out) != len(completion):
            got = f"{len(out)} values" if isinstance(out, (list, tuple)) else type(out).__name__
            raise TypeError(f"group reward {self.name!r} must return one reward per completion "
                            f"({len(completion)}), returned {got}")
        return [normalize_output(o) for o in out]


def normalize_output(out) -> tuple[float, dict]:
    """A function's return value as (reward, details); TypeError/ValueError say what is wrong."""
    details: dict = {}
    if isinstance(out, dict):
        if "reward" not in out:
            raise TypeError(f"a reward dict needs a 'reward' key, got keys {sorted(out)[:8]}")
        details = {str(k): jsonable(v) for k, v in out.items() if k != "reward"}
        out = out["reward"]
    if isinstance(out, str) or not hasattr(out, "__float__"):
        raise TypeError(f"a reward must be a number or a dict with 'reward', got {type(out).__name__}")
    value = float(out)
    if not math.isfinite(value):
        raise ValueError(f"reward is {value}; rewards must be finite numbers")
    return value, details


def jsonable(value, depth: int = 0):
    """`value` reduced to what JSON/msgpack carry (lists, dicts with str keys, str, numbers, None)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if depth < 6 and isinstance(value, (list, tuple)):
        return [jsonable(v, depth + 1) for v in value[:1000]]
    if depth < 6 and isinstance(value, dict):
        return {str(k): jsonable(v, depth + 1) for k, v in list(value.items())[:1000]}
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        try:
            return jsonable(value.item(), depth + 1)
        except Exception:
            pass
    return repr(value)[:500]


class RewardRegistry:
    """Name -> reward function. Starts with the built-ins (arith, math, format, math_concise, code)."""

    def __init__(self, builtins: bool = True):
        self._entries: dict[str, str | Callable] = dict(BUILTINS) if builtins else {}
        self._resolved: dict[str, RewardFn] = {}

    def __getstate__(self):  # resolved functions are re-imported in each process, not pickled
        return {"_entries": self._entries, "_resolved": {}}

    def register(self, name: str, fn: Callable | str | None = None, *, group: bool | None = None):
        """Register `fn` (a function or an import path) under `name`; usable as a decorator."""
        def add(f):
            if group is not None and callable(f):
                f.__reward_group__ = group
            self._entries[name] = f
            self._resolved.pop(name, None)
            return f

        return add if fn is None else add(fn)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def resolve(self, ref: str) -> RewardFn:
        """A registered name or an import path -> RewardFn (cached per registry)."""
        hit = self._resolved.get(ref)
        if hit is not None:
            return hit
        entry = self._entries.get(ref, ref)
        if isinstance(entry, str):
            if ":" not in entry:
                raise ConfigError(f"unknown reward function {ref!r}; registered: {', '.join(self.names())}; "
                                  "or give an import path 'package.module:function'")
            fn = import_path(entry)
        else:
            fn = entry
        resolved = RewardFn.of(ref, fn)
        self._resolved[ref] = resolved
        return resolved
