"""Turn a Problem's user prompt into chat-formatted text / token ids with the model's own chat template.

What: `ChatFormatter(tokenizer, system_prompt, examples)` -> `.messages(p)`, `.text(p)`, `.ids(p)`.
Why: the rollout engine receives token ids with the chat template already applied (GenerateRequest.prompt_ids),
and evaluation must format prompts exactly the same way training does, so both go through this one class.

`system_prompt=None` keeps the tokenizer's default (SmolLM2 inserts its own system line); "" sends an empty
system message; any other string is sent as the system message. `examples` (user, assistant) pairs are sent
as earlier chat turns before the problem: a small model copies the answer form from them far more reliably
than it follows an instruction. The tokenizer is passed in (no loading here).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from areal_mq.data.loaders import Problem
from areal_mq.errors import ConfigError


class ChatFormatter:
    """Applies `tokenizer.apply_chat_template` to problems, with an optional system prompt."""

    def __init__(self, tokenizer: Any, system_prompt: str | None = None, examples: Sequence[Any] = ()):
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "the tokenizer has no chat template; use an instruct/chat model or a tokenizer that defines "
                "chat_template"
            )
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.examples = [_pair(e) for e in examples]

    def messages(self, problem: Problem | str) -> list[dict[str, str]]:
        """The chat turns: optional system message, the worked examples, then the user prompt."""
        prompt = problem.prompt if isinstance(problem, Problem) else problem
        turns = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        for user, assistant in self.examples:
            turns += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        return [*turns, {"role": "user", "content": prompt}]

    def text(self, problem: Problem | str) -> str:
        """Chat-formatted text ending with the assistant turn opener, ready for generation."""
        return self.tokenizer.apply_chat_template(
            self.messages(problem), tokenize=False, add_generation_prompt=True
        )

    def ids(self, problem: Problem | str) -> list[int]:
        """Token ids of `text(problem)`; no extra BOS/EOS (the chat template already has its special tokens)."""
        return list(self.tokenizer(self.text(problem), add_special_tokens=False)["input_ids"])


def _pair(example: Any) -> tuple[str, str]:
    """(user, assistant) from a ChatExample, a {'user', 'assistant'} dict or a 2-sequence."""
    if hasattr(example, "user") and hasattr(example, "assistant"):
        return example.user, example.assistant
    if isinstance(example, dict) and set(example) == {"user", "assistant"}:
        return example["user"], example["assistant"]
    if isinstance(example, (list, tuple)) and len(example) == 2 and all(isinstance(x, str) for x in example):
        return example[0], example[1]
    raise ConfigError(f"a chat example must be {{user: ..., assistant: ...}}, got {example!r}")
