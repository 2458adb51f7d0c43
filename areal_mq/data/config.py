"""Config of datasets (owned by areal_mq.data).

`DataConfig` says which problems the controller trains on and which held-out problems evaluation uses.
Build the objects with `areal_mq.data.build_dataset(cfg)` / `areal_mq.data.load_eval_problems(cfg)`.

Sources (`name`, `eval_name`): "arith" (= "arith:train"), "arith:test" (220) and "arith:test-large" (1,100: the 220
and 880 more, same levels' proportions, no arithmetic shared with training) are the shipped splits of the built-in
task; anything else is a local source — a .jsonl or .parquet file, or a Hugging Face `datasets` directory saved
with save_to_disk (DIR, or DIR:split for a DatasetDict; areal_mq/data/sources.py) — read as GSM8K, MATH or generic
records (see `format`). A held-out split from the same source is `eval_name: DIR:test`.

Several sources in one run: `sources: [{name: ..., eval_name: ..., weight: ...}, ...]` (SourceConfig). Training
then draws from the sources by weight (areal_mq/data/dataset.py MixedDataset) and the top-level `name` is ignored;
the held-out set is the union of every source's `eval_name` and the top-level `eval_name`. A source's unset
mapping fields (format, prompt_template, answer_field, id_field, level_field) take the top-level values.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

ARITH_SOURCES = ("arith", "arith:train", "arith:test", "arith:test-large")
Format = Literal["auto", "arith", "gsm8k", "math", "jsonl"]
MAPPING_FIELDS = ("format", "prompt_template", "answer_field", "id_field", "level_field")


class ChatExample(BaseModel):
    """One worked example shown to the model as an earlier chat exchange (a one-shot/few-shot prompt)."""

    model_config = ConfigDict(extra="forbid")
    user: str = Field(..., min_length=1, description="The example question, as the user turn.")
    assistant: str = Field(..., min_length=1, description="The example answer in the wanted form, as the assistant turn.")


class SourceConfig(BaseModel):
    """One training source of a mix (data.sources), its held-out split, its weight and its record mapping.

        sources:
          - {name: /data/math/train.jsonl, eval_name: /data/math500/test.jsonl, weight: 2.0}
          - {name: /data/gsm8k/train.parquet, weight: 1.0}
    """

    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., min_length=1, description="Training problems of this source: same forms as data.name.")
    eval_name: str | None = Field(None, description="Held-out split of this source (same forms); None: none.")
    weight: float = Field(1.0, gt=0, description="Relative share of training draws: a source of weight 2 is drawn "
                          "twice as often as one of weight 1, whatever their sizes.")
    format: Format | None = Field(None, description="Record layout (see data.format); None: data.format.")
    prompt_template: str | None = Field(None, description="None: data.prompt_template, else the format's default.")
    answer_field: str | None = Field(None, min_length=1, description="None: data.answer_field.")
    id_field: str | None = Field(None, min_length=1, description="None: data.id_field.")
    level_field: str | None = Field(None, min_length=1, description="None: data.level_field.")


class DataConfig(BaseModel):
    """Which dataset the controller iterates, how prompts are built, and the held-out set."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field("arith", description="Training problems: 'arith', 'arith:test', or a local .jsonl / .parquet file or "
                      "`datasets` directory (DIR or DIR:split; Parquet and datasets need `pip install "
                      "'areal-mq[datasets]'`). Ignored when `sources` is set.")
    eval_name: str | None = Field(
        None,
        description="Held-out problems: same forms as name. None: 'arith:test' when name is arith, else no eval set. "
        "With `sources`: one more held-out set beside the sources' own eval_name.",
    )
    sources: list[SourceConfig] | None = Field(
        None,
        description="Several training sources mixed by weight, each with an optional held-out split, e.g. "
        "[{name: /data/math/train.jsonl, eval_name: /data/math500/test.jsonl, weight: 2}, {name: /data/gsm8k/"
        "train.parquet}]. When set, `name` is ignored; with several sources problem ids get the source's label "
        "as prefix ('math/train/...'). None: the one source `name`.",
    )
    format: Format = Field(
        "auto",
        description="Record layout of file sources. auto: arith for 'arith*', gsm8k if the first record has "
        "'question' and an answer with '####', math if it has 'problem' and 'solution' (Hendrycks MATH, MATH-500: "
        "answer = the 'answer' field, else the last \\boxed{} of the solution; 'Level 5' levels), else jsonl "
        "(needs prompt_template).",
    )
    prompt_template: str | None = Field(
        None,
        description="User prompt with {field} placeholders ({{ }} for literal braces). None: the format's default "
        "(areal_mq/data/loaders.py DEFAULT_TEMPLATES): arith and gsm8k '{question}' + 'End your answer with "
        "\\boxed{{N}}, where N is the number.', math '{problem}' + 'Put your final answer within \\boxed{{}}.' "
        "(required for jsonl).",
    )
    answer_field: str = Field("answer", min_length=1, description="Record field holding the reference answer "
                              "(jsonl; math: used when present, else the solution's last \\boxed{}).")
    id_field: str = Field("id", min_length=1, description="Record field holding a unique id; missing ids use "
                          "file-line (math: MATH-500's unique_id when there is no id field).")
    level_field: str | None = Field(
        "level", min_length=1,
        description="Record field holding the difficulty level (jsonl, math): an integer or 'Level N' (MATH); "
        "'Level ?' or a missing field is no level. None: ignore levels.",
    )
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
        None, description="Keep only problems of these difficulty levels (train and eval; problems without a level "
        "are dropped). None keeps all."
    )
    max_problems: int | None = Field(None, ge=1, description="Use only the first N training problems (before "
                                     "shuffle; per source with `sources`).")
    eval_size: int | None = Field(None, ge=1, description="Use only the first N held-out problems of each held-out "
                                  "set (eval.size then caps the interleaved union). None uses all.")
    shuffle: bool = Field(True, description="Shuffle the training problems, with a new seeded order every epoch "
                          "(with `sources`: within each source; the draws between sources are seeded either way).")
    seed: int = Field(0, description="Seed of the shuffle order (and of the draws between `sources`).")
    epochs: int | None = Field(None, ge=1, description="Stop after this many passes over the data (with `sources`: "
                               "this many times as many draws as there are problems); None cycles forever.")

    @model_validator(mode="after")
    def _sources_are_readable(self) -> DataConfig:
        if self.sources is not None and not self.sources:
            raise ValueError("data.sources is empty; list at least one {name: ..., weight: ...}, or drop sources "
                             "and set data.name")
        names = [s.name for s in self.sources or []]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"data.sources lists {twice} more than once; list each source once (its weight sets "
                             "its share)")
        for i, spec in enumerate(self.training_sources()):
            where = f"data.sources[{i}] ({spec.name}): " if self.sources is not None else ""
            if spec.format == "jsonl" and spec.prompt_template is None:
                raise ValueError(f"{where}format 'jsonl' needs prompt_template, e.g. '{{question}} Answer as "
                                 "\\boxed{{N}}.'")
            if spec.format == "arith" and spec.name not in ARITH_SOURCES:
                raise ValueError(f"{where}format 'arith' is only for the built-in sources {ARITH_SOURCES}, "
                                 f"got name {spec.name!r}")
        return self

    def resolved_eval_name(self) -> str | None:
        """The top-level held-out source: eval_name, or 'arith:test' for arith training without `sources`."""
        if self.eval_name is not None or self.sources is not None:
            return self.eval_name
        return "arith:test" if self.name in ARITH_SOURCES else None

    def has_eval_set(self) -> bool:
        """Whether any held-out set is configured: the top-level one, or a source's eval_name."""
        return self.resolved_eval_name() is not None or any(s.eval_name for s in self.sources or [])

    def resolve(self, source: SourceConfig | None = None) -> SourceConfig:
        """`source` with every mapping field filled (its own value, else the top-level one); None: the top-level
        source (`name`, `resolved_eval_name()`)."""
        if source is None:
            source = SourceConfig(name=self.name, eval_name=self.resolved_eval_name())
        # a dumped config reloads with every field present, so None (not "unset") means "take the top-level value"
        return source.model_copy(update={f: getattr(self, f) for f in MAPPING_FIELDS if getattr(source, f) is None})

    def training_sources(self) -> list[SourceConfig]:
        """The training sources, resolved: the `sources` entries, or the one source `name`."""
        return [self.resolve(s) for s in self.sources] if self.sources is not None else [self.resolve()]
