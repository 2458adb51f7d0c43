"""Datasets: the built-in `arith` task, GSM8K / generic JSONL loaders, the resumable Dataset (answers: areal_mq/grading.py).

Light imports only (no torch/transformers): the CLI imports this package at startup.
"""
from areal_mq.data.config import DataConfig
from areal_mq.data.dataset import Dataset, build_dataset, load_eval_problems, load_source
from areal_mq.data.loaders import DEFAULT_MATH_TEMPLATE, DataFormatError, Problem

__all__ = [
    "DEFAULT_MATH_TEMPLATE", "DataConfig", "DataFormatError", "Dataset", "Problem",
    "build_dataset", "load_eval_problems", "load_source",
]
