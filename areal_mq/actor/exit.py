"""`exit_now(code)`: end an `areal-mq` process the way the interpreter would, without its final teardown.

What: joins every non-daemon thread (as the interpreter does first), runs the atexit handlers (logging's shutdown,
weakref finalizers, coverage, torch's own), flushes stdout and stderr, then `os._exit(code)`.
Why: what it skips is the module teardown and garbage collection of a process that loaded torch and transformers,
measured at 2.5-4 s a process on the 2-core CI machine under load (issue 58), and on a run's critical path: the
launcher stops the rollout and reward workers when the trainer has exited, and the broker when they have. Nothing
of ours needs that teardown: the event log writes through an unbuffered descriptor (telemetry/log.py), the sample
log unbuffered (brokers/sample_log.py), metrics sinks and sockets are closed by the workers themselves before
they return, checkpoints and weights are written and closed in full before a step ends.
Used by areal_mq/cli.py `main` for every command run as a program (a worker, the launcher, the broker, `eval`);
a test calling the Typer app in-process (CliRunner) never reaches it.
AREAL_MQ_EXIT=full keeps the interpreter's own exit (a leak checker that wants every finalizer).
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    if os.environ.get("AREAL_MQ_EXIT") == "full":
        sys.exit(code)
    main = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to save
            pass
    os._exit(code)
