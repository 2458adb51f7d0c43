"""Shared test settings: nothing downloads from a hub; no test talks to anything but loopback."""
import os

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
