"""Small sample datasets shipped with the package, in the layouts users have (written by make_samples.py).

What: toy GSM8K, Hendrycks MATH and MATH-500 files of our own generated problems (no dataset content), for tests
and for rehearsing a config whose data files are not on this machine.
    SAMPLES[layout] -> (train, test) paths
    "gsm8k"   gsm8k_sample/train.jsonl, gsm8k_sample/test.jsonl     (24 / 8 records)
    "math"    math_sample/train.parquet, math_sample/test.parquet   (24 / 8; Parquet needs pyarrow)
    "math500" math_sample/train.parquet, math500_sample/test.jsonl  (MATH-500 is a test split drawn from MATH:
              its training counterpart is MATH's train split)
Regenerate with `python -m areal_mq.data.samples.make_samples` and commit the files.
"""
from __future__ import annotations

from pathlib import Path

from areal_mq.errors import ConfigError

HERE = Path(__file__).resolve().parent


def sample_path(name: str) -> str:
    """Path of a shipped sample file, e.g. sample_path('math_sample/train.parquet')."""
    path = HERE / name
    if not path.is_file():
        shipped = sorted(str(p.relative_to(HERE)) for p in HERE.glob("*_sample/*") if p.is_file())
        raise ConfigError(f"no sample file {name!r}; the shipped samples are {shipped}")
    return str(path)


SAMPLES: dict[str, tuple[str, str]] = {
    "gsm8k": (str(HERE / "gsm8k_sample" / "train.jsonl"), str(HERE / "gsm8k_sample" / "test.jsonl")),
    "math": (str(HERE / "math_sample" / "train.parquet"), str(HERE / "math_sample" / "test.parquet")),
    "math500": (str(HERE / "math_sample" / "train.parquet"), str(HERE / "math500_sample" / "test.jsonl")),
}
