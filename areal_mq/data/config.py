"""Config of datasets (owned by areal_mq.data).

`DataConfig` says which problems the controller trains on and which held-out problems evaluation uses.
Build the objects with `areal_mq.data.build_dataset(cfg)` / `areal_mq.data.load_eval_problems(cfg)`.

Sources (`name`, `eval_name`): "arith" (= "arith:train"), "arith:test" (220) and "arith:test-large" (1,100: the 220
and 880 more, same levels' proportions, no arithmetic shared with training) are the shipped splits of the built-in
task; anything else is a local source — a .jsonl or .parquet file, or a Hugging Face `datasets` directory saved
with save_to_disk (DIR, or DIR:split for a DatasetDict; areal_mq/data/sources.py) — read as GSM8K or generic records
(see `format`). A held-out split from the same source is `eval_name: DIR:test`.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ARITH_SOURCES = ("arith", "arith:train", "arith:test", "arith:test-large")


class ChatExample(BaseModel):
    """One worked example shown to the model as an earlier chat exchange (a one-shot/few-shot prompt)."""

    model_config = ConfigDict(extra="forbid")
    user: str = Field(..., min_length=1, description="The example question, as the user turn.")
    assistant: str = Field(..., min_length=1, description="The example answer in the wanted form, as the assistant turn.")


class DataConfig(BaseModel):
    """Which dataset the controller iterates, how prompts are built, and the held-out set."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field("arith", description="Training problems: 'arith', 'arith:test', or a local .jsonl / .parquet file or "
                      "`datasets` directory (DIR or DIR:split; Parquet and datasets need `pip install "
                      "'areal-mq[datasets]'`).")
    eval_name: str | None = Field(
        None,
        description="Held-out problems: same forms as name. None: 'arith:test' when name is arith, else no eval set.",
    )
    format: Literal["auto", "arith", "gsm8k", "jsonl"] = Field(
        "auto",
        description="Record layout of file sources. auto: arith for 'arith*', gsm8k if the first record has "
        "'question' and an answer with '####', else jsonl (needs prompt_template).",
    )
    prompt_template: str | None = Field(
        None,
        description="User prompt with {field} placeholders ({{ }} for literal braces). None: the built-in math "
        "prompt '{question}' + 'End your answer with \\boxed{{N}}, where N is the number.' (required for jsonl).",
    )
    answer_field: str = Field("answer", min_length=1, description="Record field holding the reference answer (jsonl).")
    id_field: str = Field("id", min_length=1, description="Record field holding a unique id; missing ids use file-line.")
    system_prompt: str | None = Field(
        None, description="System message for the chat template. None keeps the tokenizer's default; '' sends none."
    )
    examples: list[ChatExample] = Field(
        default_factory=list,
        description="Worked examples sent as earlier user/assistant turns before every problem (training and eval "
        "alike), e.g. [{user: 'What is 2 + 30?', assistant: '2 + 30 = 32. The answer is \\boxed{32}.'}]. Pick "
        "examples outside the held-out set.",
    )
    levels: list[int] | None = Field(
        None, description="Keep only problems of these difficulty levels (train and eval). None keeps all."
    )
    max_problems: int | None = Field(None, ge=1, description="Use only the first N training problems (before shuffle).")
    eval_size: int | None = Field(None, ge=1, description="Use only the first N held-out problems. None uses all.")
    shuffle: bool = Field(True, description="Shuffle the training problems, with a new seeded order every epoch.")
    seed: int = Field(0, description="Seed of the shuffle order.")
    epochs: int | None = Field(None, ge=1, description="Stop after this many passes over the data; None cycles forever.")

    @model_validator(mode="after")
    def _jsonl_needs_template(self) -> DataConfig:
        if self.format == "jsonl" and self.prompt_template is None:
            raise ValueError("format 'jsonl' needs prompt_template, e.g. '{question} Answer as \\boxed{{N}}.'")
        if self.format == "arith" and self.name not in ARITH_SOURCES:
            raise ValueError(f"format 'arith' is only for the built-in sources {ARITH_SOURCES}, got name {self.name!r}")
        return self

    def resolved_eval_name(self) -> str | None:
        """The held-out source actually used: eval_name, or 'arith:test' for arith training."""
        if self.eval_name is not None:
            return self.eval_name
        return "arith:test" if self.name in ARITH_SOURCES else None
