"""Shared test settings: nothing downloads from a hub; no test talks to anything but loopback; `gpu` tests
skip themselves where torch sees no CUDA device (so one suite runs on a laptop, in CI and on a GPU machine)."""
import os
from collections import defaultdict

import pytest

LONG_S = 120  # a test past this on the 2-core CI machine is marked `long` and listed in tests/README.md (issue 58)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers on 2 cores: each one's torch (and its children's) must not spin its OpenMP threads while the
    # other works (spinning made a 27 s benchmark smoke take 244 s beside another test); set before torch loads
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_configure(config):
    """The tests import the checkout's areal_mq/, whose brokers/ and workers/ subpackages live at the top
    of the repository (pyproject maps them); only an editable install provides that mapping."""
    try:
        import areal_mq.brokers  # noqa: F401
        import areal_mq.workers  # noqa: F401
    except ImportError as exc:
        raise SystemExit(f"cannot import areal_mq.brokers / areal_mq.workers ({exc}): run the tests against an "
                         "editable install, `pip install -e \".[test]\"` (README), not `pip install .`") from None


# The files that take minutes, longest first (seconds on the 2-core CI machine, run alone). Under the README's
# `-n 2 --dist loadfile --no-loadscope-reorder` each file goes whole to the next free worker in collection order, so
# starting with these lets the many short files fill in around them and both workers end together (the default
# reorder, by number of tests, left the harness and a stage smoke to run last on one worker).
LONGEST_FIRST = ("test_rehearsal.py", "test_gpu_harness.py", "test_e2e.py", "test_soak.py", "test_agent.py",
                 "test_netns_hosts.py", "test_ray_backend.py", "test_gpu_stage_precision.py", "test_trainer_ranks.py",
                 "test_weight_deltas.py", "test_trainer_hsdp.py", "test_chaos.py", "test_trainer_benchmark.py",
                 "test_trainer_fsdp.py", "test_tensor_parallel.py", "test_trainer_tp_cp.py", "test_ulysses.py",
                 "test_broker_benchmark.py", "test_lora_run.py", "test_trainer_worker.py",
                 "test_quality_benchmark.py")


def pytest_collection_modifyitems(config, items):
    """The longest files first (LONGEST_FIRST, stable otherwise); skip the `gpu`-marked tests without CUDA (torch is
    imported only when such a test was collected)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # sort is stable: the rest keep their order
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device; torch {torch.__version__} sees none")
    for item in gpu:
        item.add_marker(skip)


_seconds: dict[str, float] = defaultdict(float)
_marked_long: set[str] = set()


def pytest_runtest_logreport(report):
    """Each test's setup + call + teardown seconds (under xdist the workers' reports arrive here too)."""
    _seconds[report.nodeid] += report.duration
    if "long" in report.keywords:
        _marked_long.add(report.nodeid)


def pytest_terminal_summary(terminalreporter):
    """Name every test over LONG_S that is not marked `long`: the growth of the suite is seen the day it lands,
    and tests/README.md must say what such a test proves that nothing faster proves."""
    over = sorted(((s, n) for n, s in _seconds.items() if s > LONG_S and n not in _marked_long), reverse=True)
    if over:
        terminalreporter.section(f"tests over {LONG_S} s not marked long (mark them and list them in tests/README.md)")
        for seconds, nodeid in over:
            terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}")
