"""Fixtures of the workflow tests: the tiny model's engine and tokenizer (shared with the engine tests)."""
from tests.unit.engines.conftest import hf_tiny, make_engine, tiny_model_dir, tiny_tokenizer  # noqa: F401
