r"""Write the shipped sample datasets: toy GSM8K, Hendrycks MATH and MATH-500 files of our own problems.

What: procedurally generated problems (no dataset content is copied) in the three layouts users have:
    gsm8k_sample/train.jsonl, test.jsonl     question, answer = worked solution ending "#### N"      (24, 8)
    math_sample/train.parquet, test.parquet  problem, level "Level k", type, solution with \boxed{...} (24, 8)
    math500_sample/test.jsonl                problem, solution, answer, subject, level (int), unique_id   (8)
Some MATH answers are fractions or roots (\frac{1}{2}, \frac{\sqrt{3}}{2}): nested braces, non-numeric answers.
Why: tests and rehearsals (a config run without its real data files) read the same layouts as real runs.
Deterministic (seeded; Parquet via pyarrow). Regenerate, then commit the files:
    python -m areal_mq.data.samples.make_samples [--out areal_mq/data/samples]
"""
from __future__ import annotations

import argparse
import json
import random
from fractions import Fraction
from pathlib import Path

SEED = 20250611
NAMES = ["Ava", "Ben", "Chloe", "Dev", "Ema", "Farid", "Gus", "Hana", "Ivo", "Jun"]


def gsm8k_record(rng: random.Random) -> dict:
    """One GSM8K-layout word problem: question, and a worked answer ending in '#### N'."""
    name, a, b, c = rng.choice(NAMES), rng.randint(3, 40), rng.randint(2, 12), rng.randint(1, 9)
    kind = rng.randrange(4)
    if kind == 0:
        q = f"{name} has {a} marbles and wins {b} more. How many marbles does {name} have now?"
        steps, n = f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} marbles.", a + b
    elif kind == 1:
        q = f"A crate holds {a} oranges. How many oranges are in {b} crates?"
        steps, n = f"{b} crates hold {a} * {b} = <<{a}*{b}={a * b}>>{a * b} oranges.", a * b
    elif kind == 2:
        pay = a * 25
        q = f"{name} earns ${pay} a week. How much does {name} earn in {b} weeks?"
        steps, n = f"In {b} weeks {name} earns {pay} * {b} = <<{pay}*{b}={pay * b}>>{pay * b} dollars.", pay * b
    else:
        total = a * b
        q = f"{name} bakes {total} cookies, shares them equally among {b} friends and eats {c} of their own share. " \
            "How many cookies are left in that share?"
        steps = (f"Each share is {total} / {b} = <<{total}/{b}={a}>>{a} cookies.\n"
                 f"After eating {c}, {a} - {c} = <<{a}-{c}={a - c}>>{a - c} are left.")
        n = a - c
    return {"question": q, "answer": f"{steps}\n#### {n:,}"}


def _frac(x: Fraction) -> str:
    if x.denominator == 1:
        return str(x.numerator)
    sign = "-" if x < 0 else ""
    return f"{sign}\\frac{{{abs(x.numerator)}}}{{{x.denominator}}}"


def _linear(rng: random.Random) -> tuple:
    a, b, c = rng.randint(2, 9), rng.randint(1, 20), rng.randint(1, 30)
    x = Fraction(c - b, a)
    sol = f"Subtracting ${b}$ from both sides gives ${a}x = {c - b}$, so $x = \\boxed{{{_frac(x)}}}$."
    return f"Solve for $x$: ${a}x + {b} = {c}$.", sol, "Algebra", 1 + (x.denominator > 1) + rng.randint(0, 1)


def _fraction_sum(rng: random.Random) -> tuple:
    b, d = rng.randint(2, 9), rng.randint(2, 9)
    a, c = rng.randint(1, b - 1), rng.randint(1, d - 1)  # proper fractions
    s = Fraction(a, b) + Fraction(c, d)
    q = f"What is $\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{d}}}$? Express your answer as a common fraction."
    sol = f"With a common denominator, the sum is ${_frac(s)}$. So the answer is $\\boxed{{{_frac(s)}}}$."
    return q, sol, "Prealgebra", rng.randint(1, 3)


def _remainder(rng: random.Random) -> tuple:
    n, m = rng.randint(100, 999), rng.randint(3, 13)
    sol = f"Since ${n} = {m} \\cdot {n // m} + {n % m}$, the remainder is $\\boxed{{{n % m}}}$."
    return f"What is the remainder when ${n}$ is divided by ${m}$?", sol, "Number Theory", rng.randint(1, 2)


def _die(rng: random.Random) -> tuple:
    k = rng.randint(1, 4)
    p = Fraction(6 - k, 6)
    q = f"A fair six-sided die is rolled once. What is the probability of rolling a number greater than ${k}$? " \
        "Express your answer as a common fraction."
    sol = f"There are ${6 - k}$ outcomes greater than ${k}$ out of $6$, so the probability is $\\boxed{{{_frac(p)}}}$."
    return q, sol, "Counting & Probability", rng.randint(2, 3)


def _circle(rng: random.Random) -> tuple:
    r = rng.randint(2, 12)
    q = f"A circle has radius ${r}$. What is its area? Express your answer in terms of $\\pi$."
    sol = f"The area is $\\pi r^2 = \\pi \\cdot {r}^2 = \\boxed{{{r * r}\\pi}}$."
    return q, sol, "Geometry", rng.randint(1, 2)


_TRIG = [("\\sin 60^\\circ", "\\frac{\\sqrt{3}}{2}"), ("\\cos 45^\\circ", "\\frac{\\sqrt{2}}{2}"),
         ("\\tan 30^\\circ", "\\frac{\\sqrt{3}}{3}"), ("\\cos 60^\\circ", "\\frac{1}{2}")]


def _trig(rng: random.Random) -> tuple:
    expr, value = rng.choice(_TRIG)
    sol = f"From the special right triangles, ${expr} = {value}$. Thus ${expr} = \\boxed{{{value}}}$."
    return f"Compute ${expr}$.", sol, "Precalculus", rng.randint(3, 5)


MATH_KINDS = [_linear, _fraction_sum, _remainder, _die, _circle, _trig]


def math_record(rng: random.Random, i: int) -> dict:
    """One Hendrycks-MATH-layout problem; every 11th has level 'Level ?' as a few real records do."""
    problem, solution, subject, level = MATH_KINDS[i % len(MATH_KINDS)](rng)
    return {"problem": problem, "level": "Level ?" if i % 11 == 10 else f"Level {level}", "type": subject,
            "solution": solution}


def math500_record(rng: random.Random, i: int) -> dict:
    """One MATH-500-layout problem: the answer as a field, an int level, a unique_id path."""
    problem, solution, subject, level = MATH_KINDS[i % len(MATH_KINDS)](rng)
    answer = solution.rsplit("\\boxed{", 1)[1].rsplit("}", 1)[0]
    folder = subject.lower().replace(" & ", "_and_").replace(" ", "_")
    return {"problem": problem, "solution": solution, "answer": answer, "subject": subject, "level": level,
            "unique_id": f"test/{folder}/{100 + i}.json"}


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def write_parquet(path: Path, records: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)


def write_all(out: Path) -> None:
    """Write every sample file under `out` (the same files for the same SEED)."""
    rng = random.Random(SEED)
    write_jsonl(out / "gsm8k_sample" / "train.jsonl", [gsm8k_record(rng) for _ in range(24)])
    write_jsonl(out / "gsm8k_sample" / "test.jsonl", [gsm8k_record(rng) for _ in range(8)])
    write_parquet(out / "math_sample" / "train.parquet", [math_record(rng, i) for i in range(24)])
    write_parquet(out / "math_sample" / "test.parquet", [math_record(rng, i) for i in range(8)])
    write_jsonl(out / "math500_sample" / "test.jsonl", [math500_record(rng, i) for i in range(8)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    write_all(parser.parse_args().out)


if __name__ == "__main__":
    main()
