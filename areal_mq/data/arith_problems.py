"""The built-in `arith` task: short procedurally generated arithmetic word problems with fixed splits.

What: problems such as "Mia has 7 stickers and gets 5 more. How many stickers does Mia have now?" at three
levels, shipped as `arith_train.jsonl`, `arith_test.jsonl` (220) and `arith_test_large.jsonl` (1,100 = those 220 + 880
new, for studies that need a tighter interval: `data.eval_name: arith:test-large`) next to this file. Each record is
`{"id", "question", "answer" (int), "level", "op", "operands"}`.

    L1  single-digit addition / subtraction          3 + 4, 9 - 5
    L2  two-digit addition / subtraction             47 + 38, 82 - 19
    L3  small multiplication, two-step add-then-sub  7 * 8, 6 + 5 - 3

Why: a 135M model on a 2-core CPU needs problems it solves *sometimes* (so RL has signal) with short prompts
and short answers (so a rollout takes seconds). Splits are fixed files, not generated at run time, so every
run and every report is measured on exactly the same held-out problems.

How the split is held out: every problem has a key = (op, operands), with the operands of commutative ops
sorted (3+4 and 4+3 share a key). Keys, not problems, are split between test and train, so no test problem
shares its arithmetic with any training problem, whatever the wording.

Regenerate (deterministic; the unit tests check the shipped files equal this output):
    python -m areal_mq.data.arith_problems --out areal_mq/data
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

SEED = 20250607
TRAIN_FILE = "arith_train.jsonl"
TEST_FILE = "arith_test.jsonl"
LARGE_TEST_FILE = "arith_test_large.jsonl"
LARGE_FACTOR = 5  # the large held-out set: the 220 shipped test problems + 4x as many new ones, per pool

_ONE_PLURAL = re.compile(r"\b(1) (\w+)s\b")
Key = tuple  # (op, *operands): the arithmetic identity of a problem, shared by all its wordings

NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Ivy", "Ben", "Lily", "Max", "Emma", "Noah")
ITEMS = ("apples", "pencils", "marbles", "cookies", "stickers", "books", "coins", "cards", "shells", "eggs")

# Wordings per op; {a} {b} {c} operands, {n} a name, {i} a plural item. Kept short: prompt tokens cost seconds.
TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": (
        "What is {a} + {b}?",
        "{n} has {a} {i} and gets {b} more. How many {i} does {n} have now?",
        "There are {a} {i} in a box and {b} on the table. How many {i} are there in all?",
    ),
    "-": (
        "What is {a} - {b}?",
        "{n} has {a} {i} and gives away {b}. How many {i} does {n} have left?",
        "A jar holds {a} {i}. {n} takes out {b}. How many {i} are still in the jar?",
    ),
    "*": (
        "What is {a} * {b}?",
        "{n} buys {a} bags with {b} {i} in each bag. How many {i} does {n} buy?",
        "There are {a} rows of {i} with {b} in each row. How many {i} are there?",
    ),
    "+-": (
        "What is {a} + {b} - {c}?",
        "{n} has {a} {i}, gets {b} more, then gives away {c}. How many {i} does {n} have now?",
    ),
}


@dataclass(frozen=True)
class KeyPool:
    """One op at one level: its key space, how many keys are held out (one test problem each) and how many
    training problems are drawn from the remaining keys."""

    level: int
    op: str
    keys: Callable[[], list[Key]]
    n_test: int
    n_train: int


def _pairs(lo: int, hi: int) -> list[tuple[int, int]]:
    return list(itertools.combinations_with_replacement(range(lo, hi + 1), 2))  # (small, big)


def _add_keys(lo: int, hi: int) -> list[Key]:
    return [("+", a, b) for a, b in _pairs(lo, hi)]


def _sub_keys(lo: int, hi: int) -> list[Key]:
    return [("-", big, small) for small, big in _pairs(lo, hi)]


def _mul_keys() -> list[Key]:
    return [("*", a, b) for a, b in _pairs(2, 12) if a <= 9]


def _two_step_keys() -> list[Key]:
    return [("+-", a, b, c) for a, b, c in itertools.product(range(2, 10), repeat=3) if c <= a + b]


# Default mix, chosen from the base-model measurement (python -m areal_mq.data.measure_base; numbers in the
# docstring of measure_base): greedy SmolLM2-135M-Instruct mostly solves bare single-digit sums and small
# products, rarely two-digit subtraction in words. Held-out sizes weight the easy pools up so overall lenient
# accuracy sits in the 20-50% band RL learns from, and total 220 (>= 200 for the report, with slack).
# L1 has only 45 keys per op, so at most half are held out.
POOLS: tuple[KeyPool, ...] = (
    KeyPool(1, "+", lambda: _add_keys(1, 9), n_test=22, n_train=300),
    KeyPool(1, "-", lambda: _sub_keys(1, 9), n_test=22, n_train=300),
    KeyPool(2, "+", lambda: _add_keys(10, 99), n_test=50, n_train=700),
    KeyPool(2, "-", lambda: _sub_keys(10, 99), n_test=36, n_train=500),
    KeyPool(3, "*", _mul_keys, n_test=24, n_train=400),
    KeyPool(3, "+-", _two_step_keys, n_test=66, n_train=800),
)


def answer_of(key: Key) -> int:
    """The exact answer of a key: ("+", 3, 4) -> 7, ("+-", 6, 5, 3) -> 8."""
    op, *xs = key
    if op == "+":
        return xs[0] + xs[1]
    if op == "-":
        return xs[0] - xs[1]
    if op == "*":
        return xs[0] * xs[1]
    if op == "+-":
        return xs[0] + xs[1] - xs[2]
    raise ValueError(f"unknown arith op {op!r}; expected one of {sorted(TEMPLATES)}")


def render(key: Key, rng: random.Random, template: str | None = None) -> str:
    """One wording of `key`; commutative operands are shown in a random order."""
    op, *xs = key
    if op in ("+", "*") and rng.random() < 0.5:
        xs = xs[::-1]
    fields = dict(zip("abc", xs), n=rng.choice(NAMES), i=rng.choice(ITEMS))
    text = (template or rng.choice(TEMPLATES[op])).format(**fields)
    return _ONE_PLURAL.sub(r"\1 \2", text)  # "1 apples" -> "1 apple"


def _record(key: Key, question: str, level: int) -> dict:
    op, *xs = key
    return {"question": question, "answer": answer_of(key), "level": level, "op": op, "operands": xs}


def _pool_split(pool: KeyPool, seed: int) -> tuple[list[dict], list[dict]]:
    # A separate generator per pool: changing one pool's sizes leaves every other pool's problems unchanged.
    rng = random.Random(f"{seed}/{pool.level}/{pool.op}")
    keys = pool.keys()
    if pool.n_test >= len(keys):
        raise ValueError(f"pool L{pool.level} {pool.op!r} has {len(keys)} keys; cannot hold out {pool.n_test}")
    rng.shuffle(keys)
    test_keys, train_keys = keys[: pool.n_test], keys[pool.n_test :]
    test = [_record(k, render(k, rng), pool.level) for k in test_keys]
    # Training problems cycle over the training keys so each key appears about equally often, in varied wordings.
    cycled = itertools.islice(itertools.cycle(train_keys), pool.n_train)
    train = [_record(k, render(k, rng), pool.level) for k in cycled]
    return train, test


def generate_splits(seed: int = SEED, pools: tuple[KeyPool, ...] = POOLS) -> tuple[list[dict], list[dict]]:
    """(train, test) records, deterministic in `seed`; ids "arith-train-00000", "arith-test-00000", ..."""
    train: list[dict] = []
    test: list[dict] = []
    for pool in pools:
        tr, te = _pool_split(pool, seed)
        train += tr
        test += te
    order = random.Random(f"{seed}/order")
    order.shuffle(train)
    order.shuffle(test)
    return _with_ids(train, "train"), _with_ids(test, "test")


def generate_large_test(seed: int = SEED, pools: tuple[KeyPool, ...] = POOLS) -> list[dict]:
    """The large held-out set (issue 27): the shipped test split unchanged (same ids), then LARGE_FACTOR - 1 times
    as many new problems per pool, so levels keep the test split's proportions. New problems take keys no training
    problem uses (a pool's keys beyond the ones the training file cycles over) first; where a pool has too few
    (L1 sums, small products, two-step), they are new wordings of that pool's held-out keys. No question repeats,
    and no key is shared with the training split."""
    train, test = generate_splits(seed, pools)
    train_keys = {key_of(r) for r in train}
    seen_questions = {r["question"] for r in test}
    extra: list[dict] = []
    for pool in pools:
        rng = random.Random(f"{seed}/large/{pool.level}/{pool.op}")
        pool_test = [r for r in test if r["level"] == pool.level and r["op"] == pool.op]
        fresh = sorted({k for k in pool.keys() if k not in train_keys} - {key_of(r) for r in pool_test})
        rng.shuffle(fresh)
        want = (LARGE_FACTOR - 1) * pool.n_test
        keys = fresh[:want]
        reused = [key_of(r) for r in pool_test]
        while len(keys) < want:  # too few unused keys: more wordings of the held-out ones
            keys.append(reused[len(keys) % len(reused)])
        for k in keys:
            for _ in range(1000):
                question = render(k, rng)
                if question not in seen_questions:
                    break
            else:
                raise ValueError(f"no new wording left for {k} in pool L{pool.level} {pool.op!r}")
            seen_questions.add(question)
            extra.append(_record(k, question, pool.level))
    random.Random(f"{seed}/large/order").shuffle(extra)
    return test + [{"id": f"arith-heldout-{i:05d}", **r} for i, r in enumerate(extra)]


def _with_ids(records: list[dict], split: str) -> list[dict]:
    return [{"id": f"arith-{split}-{i:05d}", **r} for i, r in enumerate(records)]


def key_of(record: dict) -> Key:
    """The (op, *operands) key of a stored record, canonical for commutative ops."""
    xs = list(record["operands"])
    if record["op"] in ("+", "*"):
        xs = sorted(xs)
    return (record["op"], *xs)


def to_jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def write_splits(out_dir: Path, seed: int = SEED) -> dict[str, Path]:
    """Write arith_train.jsonl / arith_test.jsonl / arith_test_large.jsonl into `out_dir`; returns their paths."""
    train, test = generate_splits(seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"train": out_dir / TRAIN_FILE, "test": out_dir / TEST_FILE}
    paths["train"].write_text(to_jsonl(train), encoding="utf-8")
    paths["test"].write_text(to_jsonl(test), encoding="utf-8")
    paths["test_large"] = out_dir / LARGE_TEST_FILE
    paths["test_large"].write_text(to_jsonl(generate_large_test(seed)), encoding="utf-8")
    return paths


def shipped_path(split: str) -> Path:
    """Path of the shipped split file ("train", "test" or "test_large")."""
    names = {"train": TRAIN_FILE, "test": TEST_FILE, "test_large": LARGE_TEST_FILE}
    if split not in names:
        raise ValueError(f"arith split must be one of {sorted(names)}, got {split!r}")
    return Path(__file__).with_name(names[split])


def iter_levels(records: list[dict]) -> Iterator[tuple[int, int]]:
    """(level, count) pairs in level order, for summaries."""
    counts: dict[int, int] = {}
    for r in records:
        counts[r["level"]] = counts.get(r["level"], 0) + 1
    yield from sorted(counts.items())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Regenerate the shipped arith train/test splits.")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent, help="output directory")
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    for split, path in write_splits(args.out, args.seed).items():
        records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        print(f"{split}: {len(records)} problems -> {path}  levels={dict(iter_levels(records))}")


if __name__ == "__main__":
    main()
