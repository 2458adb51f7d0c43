"""The python tool on the real code sandbox: output, errors, the sandbox's timeout and refusals as results, cut
output, and calls that run beside the event loop (a ticker keeps ticking) and beside each other (bounded).
Run: pytest tests/unit/tools/test_python_tool.py -q   (~10 s on a loaded 2-core machine)
"""
from __future__ import annotations

import asyncio
import time

import pytest

from areal_mq.rewards.config import SandboxConfig
from areal_mq.rewards.sandbox.runner import CodeSandbox, namespaces_available
from areal_mq.tools import PythonTool, ToolLimits, ToolRegistry

LIMITS = dict(timeout_s=8.0, cpu_s=2, memory_mb=256, max_processes=12, max_output_bytes=8192)
HAS_NS = namespaces_available()


@pytest.fixture(scope="module")
def box():
    box = CodeSandbox(SandboxConfig(**LIMITS))
    if box.isolation == "refused":
        pytest.skip(f"the sandbox refuses to run here: {box.refusal}")
    return box


def run(box, code, max_concurrency=2, **limits):
    tool = PythonTool(box, max_concurrency)
    try:
        return asyncio.run(ToolRegistry([tool], ToolLimits(**limits)).call("python", {"code": code}))
    finally:
        tool.close()


def test_output_and_errors(box):
    ok = run(box, "import sys\nprint(sum(range(101)))\nprint('warn', file=sys.stderr)")
    assert ok.ok and ok.reason == "" and ok.output == "5050\n\n[stderr]\nwarn\n" and ok.seconds > 0
    err = run(box, "print('before')\n{}['missing']")
    assert not err.ok and err.reason == "error" and "KeyError: 'missing'" in err.message
    assert err.content.startswith("error (error): the program raised: KeyError") and err.output == "before\n"
    syntax = run(box, "def f(:")
    assert syntax.reason == "syntax_error" and "SyntaxError" in syntax.message


def test_the_sandbox_timeout_is_a_result(box):
    short = CodeSandbox(box.cfg.model_copy(update={"timeout_s": 2.0}))
    t0 = time.monotonic()
    r = run(short, "import time\nprint('started', flush=True)\ntime.sleep(60)")
    assert r.reason == "timeout" and "wall-clock" in r.message and r.output == "started\n"
    assert time.monotonic() - t0 < 15


@pytest.mark.skipif(not HAS_NS, reason="hiding host files needs namespaces (root and unshare)")
def test_a_host_file_read_is_refused(box, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host data")
    r = run(box, f"print(open({str(secret)!r}).read())")
    assert not r.ok and r.reason == "read_blocked" and "host data" not in r.content
    net = run(box, "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)")
    assert net.reason == "network_blocked"


def test_large_output_is_cut_and_a_flood_is_killed(box):
    r = run(box, "print('z' * 3000)", max_output_chars=500)
    assert r.ok and r.truncated and r.output == "z" * 500 + "\n[... 2501 more characters truncated]"
    flood = run(box, "while True:\n    print('q' * 1000)")
    assert flood.reason == "output_limit" and "8192 bytes" in flood.message and len(flood.output) <= 4000 + 50


def spans(box, max_concurrency):
    """Two programs sleeping 1.5 s in the sandbox: the loop's 20 ms ticker never stalls (a blocking call would
    stall it for the whole run) and the two run at once (each prints when it started and ended: the spans
    overlap); with max_concurrency 1 they run one after the other. Returns the spans and the loop's ticks."""
    tool = PythonTool(box, max_concurrency=max_concurrency)
    reg = ToolRegistry([tool])
    ticks: list[float] = []

    async def ticker(stop: asyncio.Event):
        while not stop.is_set():
            ticks.append(time.monotonic())
            await asyncio.sleep(0.02)

    async def main():
        stop = asyncio.Event()
        task = asyncio.create_task(ticker(stop))
        code = "import time\nt0 = time.time()\ntime.sleep(1.5)\nprint(t0, time.time())"
        results = await asyncio.gather(reg.call("python", {"code": code}), reg.call("python", {"code": code}))
        stop.set()
        await task
        return results

    try:
        results = asyncio.run(main())
    finally:
        tool.close()
    assert all(r.ok for r in results), results
    return [tuple(map(float, r.output.split())) for r in results], ticks


def test_calls_run_beside_the_event_loop_and_each_other(box):
    (a, b), ticks = spans(box, max_concurrency=2)
    assert a[1] - a[0] >= 1.5 and b[1] - b[0] >= 1.5
    assert a[0] < b[1] and b[0] < a[1], (a, b)  # the two runs overlapped
    gaps = [y - x for x, y in zip(ticks, ticks[1:])]
    assert len(ticks) > 20 and max(gaps) < 1.0, max(gaps)


def test_max_concurrency_bounds_the_runs_at_once(box):
    (a, b), _ = spans(box, max_concurrency=1)
    first, second = sorted([a, b])
    assert second[0] >= first[1], (a, b)


def test_a_refusing_sandbox_fails_closed():
    refused = CodeSandbox(SandboxConfig(isolation="namespaces", **LIMITS), namespaces=False)
    r = run(refused, "print(1)")
    assert not r.ok and r.reason == "sandbox_refused" and "isolation 'namespaces' refused" in r.message


class CountingBox:
    """The real sandbox, counting the runs it starts."""

    def __init__(self, box):
        self.box, self.started = box, 0

    def run(self, program, tests):
        self.started += 1
        return self.box.run(program, tests)


def test_a_call_that_times_out_while_queued_never_starts_its_program(box):
    """max_concurrency 1 and a 0.5 s call limit: the first program (sleeping 2 s) times out running and ends at
    its own pace; the second times out while waiting for the thread, and its program is never started."""
    counting = CountingBox(box)
    tool = PythonTool(counting, max_concurrency=1)
    reg = ToolRegistry([tool], ToolLimits(timeout_s=0.5))
    code = {"code": "import time\ntime.sleep(2)"}

    async def main():
        return await asyncio.gather(reg.call("python", code), reg.call("python", code))

    try:
        results = asyncio.run(main())
    finally:
        tool._pool.shutdown(wait=True)  # waits for queued runs too (close() would cancel them itself)
    assert [r.reason for r in results] == ["timeout", "timeout"]
    assert counting.started == 1
