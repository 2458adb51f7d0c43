"""The training Dataset the controller iterates, and the builders that turn a DataConfig into problems.

What: `Dataset(problems, shuffle=, seed=, epochs=)` is an endless (or epoch-limited) iterator over Problems with
a seeded, per-epoch shuffle and a resumable position: `state_dict()` after any number of `next()` calls, then
`load_state_dict()` on a fresh Dataset over the same problems continues with exactly the next problem.

Why this shape: the controller admits prompts one at a time (staleness throttle), so it pulls problems rather
than receiving batches; a restarted controller must not replay or skip problems. The order of epoch e is a pure
function of (seed, e), so the state is just (epoch, index) plus a fingerprint that catches a changed dataset.

    ds = build_dataset(DataConfig())          # shipped arith train split
    p = next(ds); ds.epoch                     # the problem and the epoch it was drawn in
    held_out = load_eval_problems(DataConfig())
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Any

from areal_mq.data.config import ARITH_SOURCES, DataConfig
from areal_mq.data.loaders import (
    DEFAULT_MATH_TEMPLATE,
    DataFormatError,
    Problem,
    load_gsm8k,
    load_records,
    sniff_format,
)
from areal_mq.errors import ConfigError


class Dataset:
    """Seeded, resumable iterator over problems. `len()` is the number of distinct problems (one epoch)."""

    def __init__(self, problems: Sequence[Problem], *, shuffle: bool = True, seed: int = 0, epochs: int | None = None):
        if not problems:
            raise ConfigError("the dataset is empty (after filtering); check name, levels and max_problems")
        self.problems = list(problems)
        self.shuffle = shuffle
        self.seed = seed
        self.epochs = epochs
        self.fingerprint = hashlib.sha256("\n".join(p.id for p in self.problems).encode()).hexdigest()[:16]
        self._epoch = 0
        self._index = 0
        self._order = self._order_of(0)

    def __len__(self) -> int:
        return len(self.problems)

    def __getitem__(self, i: int) -> Problem:
        return self.problems[i]

    def __iter__(self) -> Dataset:
        return self

    def __next__(self) -> Problem:
        if self._index == len(self.problems):
            self._epoch += 1
            self._index = 0
            self._order = self._order_of(self._epoch)
        if self.epochs is not None and self._epoch >= self.epochs:
            raise StopIteration
        problem = self.problems[self._order[self._index]]
        self._index += 1
        return problem

    @property
    def epoch(self) -> int:
        """Epoch of the problem returned last (0-based)."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """Problems returned so far, over all epochs."""
        return self._epoch * len(self.problems) + self._index

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        if self.shuffle:
            random.Random(f"{self.seed}/epoch/{epoch}").shuffle(order)
        return order

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe position: continue with `load_state_dict` on a Dataset over the same problems."""
        return {"epoch": self._epoch, "index": self._index, "seed": self.seed, "shuffle": self.shuffle,
                "size": len(self.problems), "fingerprint": self.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state`; ConfigError if it was saved over different problems or a different order."""
        try:
            epoch, index = int(state["epoch"]), int(state["index"])
            saved = (state["fingerprint"], state["seed"], state["shuffle"])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"bad dataset state {state!r}: {e}; pass a dict from Dataset.state_dict()") from None
        if saved != (self.fingerprint, self.seed, self.shuffle):
            raise ConfigError(
                "dataset state was saved for different data or ordering "
                f"(fingerprint/seed/shuffle {saved} != {(self.fingerprint, self.seed, self.shuffle)}); "
                "resume with the same data config, or start without the saved state"
            )
        if epoch < 0 or not 0 <= index <= len(self.problems):
            raise ConfigError(f"dataset state position epoch={epoch} index={index} is out of range for {len(self)} problems")
        self._epoch, self._index = epoch, index
        self._order = self._order_of(epoch)


def load_source(name: str, cfg: DataConfig) -> list[Problem]:
    """All problems of one source ('arith', 'arith:train', 'arith:test' or a JSONL path), levels filtered."""
    template = cfg.prompt_template or DEFAULT_MATH_TEMPLATE
    if name in ARITH_SOURCES:
        from areal_mq.data.arith_problems import shipped_path  # lazy: keeps `python -m areal_mq.data.arith_problems` warning-free

        split = {"arith:test": "test", "arith:test-large": "test_large"}.get(name, "train")
        problems = load_records(shipped_path(split), template, "answer", "id", "level")
    else:
        fmt = sniff_format(name) if cfg.format == "auto" else cfg.format
        if fmt == "gsm8k":
            problems = load_gsm8k(name, template, cfg.id_field)
        elif cfg.prompt_template is None:
            raise DataFormatError(
                f"{name} is not in GSM8K layout (question + answer ending in '#### N'); set data.prompt_template "
                "(with {field} placeholders) and data.answer_field to read it as generic JSONL"
            )
        else:
            problems = load_records(name, template, cfg.answer_field, cfg.id_field)
    if cfg.levels is not None:
        problems = [p for p in problems if p.level in cfg.levels]
    return problems


def build_dataset(cfg: DataConfig) -> Dataset:
    """The training Dataset of `cfg` (source `cfg.name`)."""
    problems = load_source(cfg.name, cfg)
    if cfg.max_problems is not None:
        problems = problems[: cfg.max_problems]
    return Dataset(problems, shuffle=cfg.shuffle, seed=cfg.seed, epochs=cfg.epochs)


def load_eval_problems(cfg: DataConfig) -> list[Problem]:
    """Held-out problems in file order (first `eval_size`), or [] when the config has no eval set."""
    name = cfg.resolved_eval_name()
    if name is None:
        return []
    problems = load_source(name, cfg)
    if not problems:
        raise ConfigError(f"the held-out set {name!r} is empty after filtering by levels={cfg.levels}")
    return problems[: cfg.eval_size] if cfg.eval_size is not None else problems
