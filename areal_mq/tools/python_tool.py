"""The `python` tool: run model-written Python in the code sandbox, off the event loop, a bounded number at once.

What: `PythonTool(sandbox=CodeSandbox(SandboxConfig(...)), max_concurrency=4)`;
`await tool.call({"code": "print(2**10)"})` -> ToolResult(ok=True, output="1024\n"). The program runs through the
code rewards' sandbox (areal_mq/rewards/sandbox/runner.py) with the same limits and the same refusals: a read of
a host file is `read_blocked`, a socket `network_blocked`, a program past the sandbox's timeout_s `timeout`
(every process of the run killed), an exception `error` with its type and message. stdout and stderr come back
(the sandbox keeps the last 4096 bytes of each; past its max_output_bytes the run is killed: `output_limit`).
Why a thread pool: CodeSandbox.run blocks (it waits on the child's pipes); run on the event loop it would stall
every other episode of the agent for the program's whole run. The pool has max_concurrency threads, so at most
that many sandboxes run at once; a call waiting for a free thread is cancelled cleanly by the registry's timeout
(a queued run never starts), while a run already started ends at the sandbox's own wall-clock limit.
Fails closed like the sandbox: where it refuses to isolate (root without namespaces) every call is
`sandbox_refused` with the sandbox's sentence.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from areal_mq.rewards.sandbox.runner import CodeSandbox, SandboxRefused
from areal_mq.tools.base import ToolResult, error

# run the program, then one trivially true test: completing the program is "passed"
_TESTS = "assert True"
MAX_CODE_CHARS = 12_000


class PythonTool:
    name = "python"
    description = ("Run a Python 3 program in an isolated sandbox (no network, no host files, limited CPU time, "
                   "memory and wall time) and return what it printed. Use print() to see values.")
    parameters = {"type": "object", "additionalProperties": False, "required": ["code"],
                  "properties": {"code": {"type": "string", "minLength": 1, "maxLength": MAX_CODE_CHARS,
                                          "description": "the whole program; its stdout and stderr are returned"}}}

    def __init__(self, sandbox: CodeSandbox | None = None, max_concurrency: int = 4):
        self.sandbox = sandbox or CodeSandbox()
        self.max_concurrency = max_concurrency
        self._pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="tool-python")

    async def call(self, arguments: dict) -> ToolResult:
        loop = asyncio.get_running_loop()
        try:
            r = await loop.run_in_executor(self._pool, self.sandbox.run, arguments["code"], _TESTS)
        except SandboxRefused as exc:
            return error(self.name, "sandbox_refused", str(exc))
        output = r.stdout + (f"\n[stderr]\n{r.stderr}" if r.stderr else "")
        if r.passed:
            return ToolResult(self.name, True, output, seconds=r.duration_s)
        return error(self.name, r.reason, r.message, output, r.duration_s)

    def close(self) -> None:
        """Stop the worker threads once the runs in flight end (each within the sandbox's timeout_s)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
