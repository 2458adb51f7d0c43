"""Shared test settings: nothing downloads from a hub; no test talks to anything but loopback; `gpu` tests
skip themselves where torch sees no CUDA device (so one suite runs on a laptop, in CI and on a GPU machine)."""
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    """The tests import the checkout's areal_mq/, whose brokers/ and workers/ subpackages live at the top
    of the repository (pyproject maps them); only an editable install provides that mapping."""
    try:
        import areal_mq.brokers  # noqa: F401
        import areal_mq.workers  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"cannot import areal_mq.brokers / areal_mq.workers ({exc}): run the tests against an "
                         "editable install, `pip install -e \".[test]\"` (README), not `pip install .`") from None


def pytest_collection_modifyitems(config, items):
    """Skip the `gpu`-marked tests without CUDA (torch is imported only when such a test was collected)."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device; torch {torch.__version__} sees none")
    for item in gpu:
        item.add_marker(skip)
