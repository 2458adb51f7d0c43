"""The `code` reward: run the completion's Python program against the reference's unit tests, sandboxed.

What: the program is the last ```python fenced block of the completion (else the last ``` block, else
the whole text); the reference is the tests (Python source whose top-level asserts are the tests, a
list of assert strings, or {"tests": ...}). Reward 1.0 when every test passes, else 0.0 — or the
fraction passed with `partial_credit: true`. `details` carries the sandbox's reason and message.
Limits come from the task kwargs: `kwargs: {sandbox: {timeout_s: 5, memory_mb: 256}}` (SandboxConfig).
Keep the reward config's `timeout_s` above the sandbox's so the sandbox, not the executor, stops a run.
Where the sandbox cannot isolate the program (root without namespaces) it raises SandboxRefused: the
executor then gives the task's default reward, and RewardResult.errors says why. Which tests count and how
they are judged (outside the program) is in sandbox/assert_judge.py and docs/rewards.md.
"""
from __future__ import annotations

import re

from areal_mq.rewards.config import SandboxConfig
from areal_mq.rewards.sandbox.runner import CodeSandbox

_FENCE = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)


def extract_program(completion: str) -> str:
    """The last ```python block, else the last fenced block, else the completion itself."""
    blocks = _FENCE.findall(completion)
    py = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if py:
        return py[-1]
    if blocks:
        return blocks[-1][1]
    return completion


def tests_source(reference) -> str:
    """Unit tests as Python source from a string, a list of statements, or {'tests': ...}."""
    if isinstance(reference, dict):
        if "tests" not in reference:
            raise ValueError(f"a code reference dict needs a 'tests' key, got keys {sorted(reference)}")
        reference = reference["tests"]
    if isinstance(reference, (list, tuple)):
        return "\n".join(str(t) for t in reference)
    if isinstance(reference, str) and reference.strip():
        return reference
    raise ValueError(f"the code reward needs unit tests as the reference, got {type(reference).__name__}")


def code_reward(prompt: str, completion: str, reference, *, sandbox: dict | None = None,
                partial_credit: bool = False, **meta) -> dict:
    """Sandboxed unit-test reward; see the module docstring."""
    box = CodeSandbox(SandboxConfig(**(sandbox or {})))
    result = box.run(extract_program(completion), tests_source(reference))
    if partial_credit and result.tests_total:
        reward = result.tests_passed / result.tests_total
    else:
        reward = 1.0 if result.passed else 0.0
    return {
        "reward": reward,
        "passed": result.passed,
        "reason": result.reason,
        "message": result.message,
        "tests_passed": result.tests_passed,
        "tests_total": result.tests_total,
        "isolation": result.isolation,
        "memory_bound": result.memory_bound,
        "duration_s": result.duration_s,
    }
