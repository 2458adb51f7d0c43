"""Fixtures of the tool tests: the tiny model's tokenizer (shared with the engine tests) for the workflow tests."""
from tests.unit.engines.conftest import tiny_model_dir, tiny_tokenizer  # noqa: F401
