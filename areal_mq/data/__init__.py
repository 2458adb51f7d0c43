"""Datasets: the built-in `arith` task, GSM8K / MATH / generic loaders, mixes of sources, the resumable Dataset
(answers: areal_mq/grading.py), and small shipped samples (areal_mq/data/samples).

Light imports only (no torch/transformers): the CLI imports this package at startup.
"""
from areal_mq.data.config import DataConfig, SourceConfig
from areal_mq.data.dataset import Dataset, MixedDataset, build_dataset, load_eval_problems, load_source
from areal_mq.data.loaders import DEFAULT_MATH_TEMPLATE, DEFAULT_TEMPLATES, DataFormatError, Problem
from areal_mq.data.samples import SAMPLES, sample_path

__all__ = [
    "DEFAULT_MATH_TEMPLATE", "DEFAULT_TEMPLATES", "DataConfig", "DataFormatError", "Dataset", "MixedDataset",
    "Problem", "SAMPLES", "SourceConfig", "build_dataset", "load_eval_problems", "load_source", "sample_path",
]
