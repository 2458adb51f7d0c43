"""Turn a Problem's user prompt into chat-formatted text / token ids with the model's own chat template.

What: `ChatFormatter(tokenizer, system_prompt)` -> `.messages(p)`, `.text(p)`, `.ids(p)`.
Why: the rollout engine receives token ids with the chat template already applied (GenerateRequest.prompt_ids),
and evaluation must format prompts exactly the same way training does, so both go through this one class.

`system_prompt=None` keeps the tokenizer's default (SmolLM2 inserts its own system line); "" sends an empty
system message; any other string is sent as the system message. The tokenizer is passed in (no loading here).
"""
from __future__ import annotations

from typing import Any

from areal_mq.data.loaders import Problem
from areal_mq.errors import ConfigError


class ChatFormatter:
    """Applies `tokenizer.apply_chat_template` to problems, with an optional system prompt."""

    def __init__(self, tokenizer: Any, system_prompt: str | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError(
                "the tokenizer has no chat template; use an instruct/chat model or a tokenizer that defines "
                "chat_template"
            )
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt

    def messages(self, problem: Problem | str) -> list[dict[str, str]]:
        """The chat turns: optional system message, then the user prompt."""
        prompt = problem.prompt if isinstance(problem, Problem) else problem
        turns = [] if self.system_prompt is None else [{"role": "system", "content": self.system_prompt}]
        return [*turns, {"role": "user", "content": prompt}]

    def text(self, problem: Problem | str) -> str:
        """Chat-formatted text ending with the assistant turn opener, ready for generation."""
        return self.tokenizer.apply_chat_template(
            self.messages(problem), tokenize=False, add_generation_prompt=True
        )

    def ids(self, problem: Problem | str) -> list[int]:
        """Token ids of `text(problem)`; no extra BOS/EOS (the chat template already has its special tokens)."""
        return list(self.tokenizer(self.text(problem), add_special_tokens=False)["input_ids"])
