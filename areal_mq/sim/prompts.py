"""A stand-in tokenizer for simulated runs: prompt token ids without model files or transformers.

What: `SimFormatter.ids(problem)` gives one token id per ~4 bytes of the problem's prompt text (the bytes,
grouped, as little-endian ints), plus a fixed 24-token chat-template overhead, so prompts have realistic lengths
and distinct contents. Why: with simulated GPUs (`rollout.engine.kind: sim`) nothing reads these ids but the
simulated engine (prefill time per token), and loading a real tokenizer costs the controller ~20 s of start-up
on a loaded 2-core machine (transformers import), once per simulated run. Used by workers/controller.main.
"""
from __future__ import annotations

from typing import Any

TEMPLATE_TOKENS = 24  # role markers and separators a chat template adds around a prompt


class SimFormatter:
    def text(self, problem: Any) -> str:
        return problem if isinstance(problem, str) else problem.prompt

    def ids(self, problem: Any) -> list[int]:
        data = self.text(problem).encode()
        grouped = [int.from_bytes(data[i:i + 4], "little") % 100_000 for i in range(0, len(data), 4)]
        return list(range(1, TEMPLATE_TOKENS + 1)) + grouped
