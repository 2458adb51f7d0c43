"""The training Dataset the controller iterates, and the builders that turn a DataConfig into problems.

What: `Dataset(problems, shuffle=, seed=, epochs=)` is an endless (or epoch-limited) iterator over Problems with
a seeded, per-epoch shuffle and a resumable position: `state_dict()` after any number of `next()` calls, then
`load_state_dict()` on a fresh Dataset over the same problems continues with exactly the next problem.
`MixedDataset(parts, weights)` draws from several Datasets by weight (data.sources) under the same contract.

Why this shape: the controller admits prompts one at a time (staleness throttle), so it pulls problems rather
than receiving batches; a restarted controller must not replay or skip problems. The order of epoch e is a pure
function of (seed, e), so the state is just (epoch, index) plus a fingerprint that catches a changed dataset.

Several sources (data.sources): each source's problem ids get its label as prefix ("math/train/train-12",
sources.source_labels), so ids stay unique; the held-out set is every source's eval split, interleaved.

    ds = build_dataset(DataConfig())          # shipped arith train split
    p = next(ds); ds.epoch                     # the problem and the epoch it was drawn in
    held_out = load_eval_problems(DataConfig())
"""
from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import replace
from itertools import chain, zip_longest
from typing import Any

from areal_mq.data.config import ARITH_SOURCES, DataConfig, SourceConfig
from areal_mq.data.loaders import (
    DEFAULT_TEMPLATES,
    DataFormatError,
    Problem,
    load_gsm8k,
    load_math,
    load_records,
    sniff_format,
)
from areal_mq.data.sources import source_labels
from areal_mq.errors import ConfigError


class Dataset:
    """Seeded, resumable iterator over problems. `len()` is the number of distinct problems (one epoch)."""

    def __init__(self, problems: Sequence[Problem], *, shuffle: bool = True, seed: int | str = 0,
                 epochs: int | None = None):
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
        self._epoch, self._index = checked_position(state, (self.fingerprint, self.seed, self.shuffle), len(self))
        self._order = self._order_of(self._epoch)


class MixedDataset:
    """Draws from several Datasets by weight; seeded, resumable, the same contract as Dataset.

    How: an epoch is len(self) draws (as many as there are problems over all parts). Draw i of epoch e takes the
    next problem of part schedule_e[i], where schedule_e = random.Random(f"{seed}/mix/{e}").choices(parts,
    weights, k=len(self)): a per-epoch schedule, a pure function of (seed, e) like Dataset's order. Each part
    cycles through its own seeded shuffles, so a small heavy source repeats within an epoch and a big light one
    is seen in part; over many draws a part's share is weight / sum(weights), whatever its size. The state is
    the schedule position plus each part's own Dataset state.
    """

    def __init__(self, parts: Sequence[Dataset], weights: Sequence[float], *, seed: int = 0,
                 epochs: int | None = None):
        if len(parts) != len(weights) or not parts or min(weights) <= 0:
            raise ConfigError(f"a mix needs one weight > 0 per source, got {len(parts)} sources and weights {weights}")
        self.parts, self.weights, self.seed, self.epochs = list(parts), list(weights), seed, epochs
        self.problems = list(chain.from_iterable(part.problems for part in self.parts))
        mix = "\n".join(f"{part.fingerprint}:{w!r}" for part, w in zip(self.parts, self.weights))
        self.fingerprint = hashlib.sha256(mix.encode()).hexdigest()[:16]
        self.shuffle = all(part.shuffle for part in self.parts)
        self._epoch, self._index = 0, 0
        self._schedule = self._schedule_of(0)

    def __len__(self) -> int:
        return len(self.problems)

    def __getitem__(self, i: int) -> Problem:
        return self.problems[i]

    def __iter__(self) -> MixedDataset:
        return self

    def __next__(self) -> Problem:
        if self._index == len(self):
            self._epoch, self._index = self._epoch + 1, 0
            self._schedule = self._schedule_of(self._epoch)
        if self.epochs is not None and self._epoch >= self.epochs:
            raise StopIteration
        part = self.parts[self._schedule[self._index]]
        self._index += 1
        return next(part)

    @property
    def epoch(self) -> int:
        """Epoch (of len(self) draws) of the problem returned last (0-based)."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """Problems returned so far, over all epochs."""
        return self._epoch * len(self) + self._index

    def _schedule_of(self, epoch: int) -> list[int]:
        return random.Random(f"{self.seed}/mix/{epoch}").choices(range(len(self.parts)), self.weights, k=len(self))

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe position: the schedule position and each source's position."""
        return {"epoch": self._epoch, "index": self._index, "seed": self.seed, "shuffle": self.shuffle,
                "size": len(self), "fingerprint": self.fingerprint,
                "sources": [part.state_dict() for part in self.parts]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at `state`; ConfigError if it was saved over different sources, weights or order."""
        epoch, index = checked_position(state, (self.fingerprint, self.seed, self.shuffle), len(self))
        parts = state.get("sources")
        if not isinstance(parts, list) or len(parts) != len(self.parts):
            raise ConfigError(f"bad dataset state: 'sources' must list {len(self.parts)} source positions; "
                              "pass a dict from MixedDataset.state_dict()")
        for part, part_state in zip(self.parts, parts):
            part.load_state_dict(part_state)
        self._epoch, self._index = epoch, index
        self._schedule = self._schedule_of(epoch)


def checked_position(state: dict[str, Any], current: tuple, size: int) -> tuple[int, int]:
    """(epoch, index) of a saved state, after checking it was saved for `current` (fingerprint, seed, shuffle)."""
    try:
        epoch, index = int(state["epoch"]), int(state["index"])
        saved = (state["fingerprint"], state["seed"], state["shuffle"])
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"bad dataset state {state!r}: {e}; pass a dict from Dataset.state_dict()") from None
    if saved != current:
        raise ConfigError(
            "dataset state was saved for different data or ordering "
            f"(fingerprint/seed/shuffle {saved} != {current}); "
            "resume with the same data config, or start without the saved state"
        )
    if epoch < 0 or not 0 <= index <= size:
        raise ConfigError(f"dataset state position epoch={epoch} index={index} is out of range for {size} problems")
    return epoch, index


def load_source(name: str, cfg: DataConfig, source: SourceConfig | None = None) -> list[Problem]:
    """All problems of one source ('arith', 'arith:train', 'arith:test' or a file / `datasets` directory), read
    with the mapping of `source` (a data.sources entry; None: the top-level one), levels filtered."""
    spec = cfg.resolve(source)
    fmt = "arith" if name in ARITH_SOURCES else sniff_format(name) if spec.format == "auto" else spec.format
    template = spec.prompt_template or DEFAULT_TEMPLATES.get(fmt)
    if fmt == "arith":
        if name not in ARITH_SOURCES:
            raise DataFormatError(f"format 'arith' is only for the built-in sources {ARITH_SOURCES}, got {name!r}; "
                                  "set format auto, gsm8k, math or jsonl")
        from areal_mq.data.arith_problems import shipped_path  # lazy: keeps `python -m areal_mq.data.arith_problems` warning-free

        split = {"arith:test": "test", "arith:test-large": "test_large"}.get(name, "train")
        problems = load_records(shipped_path(split), template, "answer", "id", "level")
    elif template is None:
        raise DataFormatError(
            f"{name} is neither in GSM8K layout (question + answer ending in '#### N') nor in MATH layout (problem "
            "+ solution); set data.prompt_template (with {field} placeholders) and data.answer_field to read it as "
            "generic JSONL"
        )
    elif fmt == "gsm8k":
        problems = load_gsm8k(name, template, spec.id_field)
    elif fmt == "math":
        problems = load_math(name, template, spec.answer_field, spec.id_field, spec.level_field)
    else:
        problems = load_records(name, template, spec.answer_field, spec.id_field, spec.level_field)
    if cfg.levels is not None:
        problems = [p for p in problems if p.level in cfg.levels]
    return problems


def build_dataset(cfg: DataConfig) -> Dataset | MixedDataset:
    """The training Dataset of `cfg`: source `cfg.name`, or a MixedDataset over `cfg.sources` (several)."""
    specs = cfg.training_sources()
    parts = [_training_problems(spec, cfg) for spec in specs]
    if len(parts) == 1:
        return Dataset(parts[0], shuffle=cfg.shuffle, seed=cfg.seed, epochs=cfg.epochs)
    labels = source_labels([spec.name for spec in specs])
    datasets = [Dataset([_tagged(p, label, prefix=True) for p in part], shuffle=cfg.shuffle, seed=f"{cfg.seed}/{label}")
                for part, label in zip(parts, labels)]
    return MixedDataset(datasets, [spec.weight for spec in specs], seed=cfg.seed, epochs=cfg.epochs)


def _training_problems(spec: SourceConfig, cfg: DataConfig) -> list[Problem]:
    problems = load_source(spec.name, cfg, spec)[: cfg.max_problems]
    if not problems and cfg.sources is not None:
        raise ConfigError(f"training source {spec.name!r} is empty after filtering by levels={cfg.levels}; "
                          "change data.levels or drop the source")
    return problems


def eval_sets(cfg: DataConfig) -> list[tuple[str, str, SourceConfig]]:
    """(label, name, mapping) of every held-out set, each once: the sources' eval_name (labelled like their
    training source), then the top-level eval_name when `sources` is set (labelled by its own name)."""
    specs = cfg.training_sources()
    names = [spec.name for spec in specs]
    labels = source_labels(names)  # the training labels: never changed by the eval config
    sets: dict[str, tuple[str, str, SourceConfig]] = {}
    for label, spec in zip(labels, specs):
        if spec.eval_name is not None and spec.eval_name not in sets:
            sets[spec.eval_name] = (label, spec.eval_name, spec)
    if cfg.sources is not None and cfg.eval_name is not None and cfg.eval_name not in sets:
        own = cfg.eval_name in names  # evaluating on a training file: that source's label
        label = labels[names.index(cfg.eval_name)] if own else source_labels([*names, cfg.eval_name])[-1]
        sets[cfg.eval_name] = (f"{label}-eval" if label in labels else label, cfg.eval_name,
                               cfg.resolve(SourceConfig(name=cfg.eval_name)))
    return list(sets.values())


def load_eval_problems(cfg: DataConfig) -> list[Problem]:
    """Held-out problems, or [] when the config has no eval set. Each set in file order (its first `eval_size`);
    several sets are interleaved round-robin, so that any prefix (eval.size) samples every set, and their ids
    get the set's label as prefix. meta["source"] is the set's label."""
    sets = eval_sets(cfg)
    per_set = []
    for label, name, spec in sets:
        problems = load_source(name, cfg, spec)
        if not problems:
            raise ConfigError(f"the held-out set {name!r} is empty after filtering by levels={cfg.levels}")
        problems = problems[: cfg.eval_size] if cfg.eval_size is not None else problems
        per_set.append([_tagged(p, label, prefix=len(sets) > 1) for p in problems])
    return [p for row in zip_longest(*per_set) for p in row if p is not None]


def _tagged(problem: Problem, label: str, prefix: bool) -> Problem:
    """`problem` with meta["source"] = label, and its id prefixed by the label when several sources mix."""
    return replace(problem, id=f"{label}/{problem.id}" if prefix else problem.id,
                   meta={**problem.meta, "source": label})
