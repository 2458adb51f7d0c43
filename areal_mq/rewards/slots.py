"""The process slots behind RewardExecutor: start, feed, time out, kill and replace pool processes.

What: `SlotPool` owns `n` pool processes (areal_mq.rewards._pool) and one dispatcher thread. The thread
takes calls from the executor (`take()`), sends each to an idle process, waits on all pipes at once and
hands results back (`done(call, out)`) or failures (`failed(call, kind, error, traceback)`, kind one of
exception | timeout | crashed). A call past its deadline gets its process group SIGKILLed and the slot
a fresh process; so does a process that died. Processes are started from the dispatcher thread only,
because PR_SET_PDEATHSIG ties each child to the thread that forked it.
Each process holds up to PREFETCH calls: it starts the next one the moment it sends a result, without
waiting for this thread to wake up (which takes milliseconds on a loaded machine). The deadline runs for
the call at the head only; calls queued behind a call that hangs or crashes go back to the queue unharmed
(`requeue`), they were never started.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from collections import deque
from multiprocessing.connection import wait
from typing import Callable

from areal_mq.errors import RewardError
from areal_mq.rewards._pool import pool_main

PREFETCH = 2


class _Slot:
    def __init__(self, proc, conn):
        self.proc, self.conn = proc, conn
        self.ready = False
        self.calls: deque = deque()  # sent, in order; the head is running
        self.deadline = 0.0


class SlotPool:
    """See the module docstring. `take`, `done` and `failed` run on the dispatcher thread."""

    def __init__(self, ctx, n: int, timeout_s: float, registry, warm: list[str], *,
                 take: Callable, done: Callable, failed: Callable, requeue: Callable):
        self._ctx, self._n, self._timeout = ctx, n, timeout_s
        self._registry, self._warm = registry, warm
        self._take, self._done, self._failed, self._requeue = take, done, failed, requeue
        self._slots: list[_Slot] = []
        self._stopping = False
        self._startup_failures = 0
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="reward-dispatcher", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            raise RewardError(f"could not start the reward processes: {self._start_error}") from self._start_error

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):  # pipe full (already awake) or closed (stopping)
            pass

    def alive(self) -> int:
        return sum(1 for s in list(self._slots) if s.proc.is_alive())

    def pids(self) -> list[int]:
        return [s.proc.pid for s in list(self._slots) if s.proc.pid is not None]

    def stop(self) -> None:
        self._stopping = True
        self.wake()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ dispatcher thread
    def _spawn(self) -> _Slot:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(target=pool_main, args=(child, self._registry, self._warm),
                                 name="reward-pool", daemon=True)
        proc.start()
        child.close()
        return _Slot(proc, parent)

    def _run(self) -> None:
        try:
            self._slots = [self._spawn() for _ in range(self._n)]
        except BaseException as exc:  # noqa: BLE001 - reported by start()
            self._start_error = exc
            self._started.set()
            return
        self._started.set()
        try:
            while not self._stopping:
                self._assign()
                self._wait_once()
                self._expire()
        finally:
            self._shutdown()

    def _assign(self) -> None:
        for depth in range(1, PREFETCH + 1):  # first one call per idle process, then top up
            for slot in list(self._slots):
                if not slot.ready or len(slot.calls) >= depth:
                    continue
                call = self._take()
                if call is None:
                    return
                self._send(slot, call)

    def _send(self, slot: _Slot, call) -> None:
        try:
            slot.conn.send((call.id, call.plan.fns, call.plan.group, *call.args))
        except (BrokenPipeError, EOFError, OSError):
            slot.calls.append(call)
            self._replace(slot, "crashed", "the pool process was gone when the call was sent")
            return
        except Exception as exc:  # unpicklable arguments: the call cannot run anywhere
            self._failed(call, "exception", f"cannot send the job to a pool process: {type(exc).__name__}: {exc}", "")
            return
        if not slot.calls:
            slot.deadline = time.monotonic() + self._timeout
        slot.calls.append(call)

    def _wait_once(self) -> None:
        busy = [s.deadline for s in self._slots if s.calls]
        timeout = max(0.0, min(busy) - time.monotonic()) if busy else 1.0
        by_conn = {s.conn: s for s in self._slots}
        for obj in wait(list(by_conn) + [self._wake_r], timeout=min(timeout, 1.0)):
            if obj == self._wake_r:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
                continue
            if by_conn[obj] in self._slots:  # not replaced by an earlier message of this round
                self._receive(by_conn[obj])

    def _receive(self, slot: _Slot) -> None:
        try:
            msg = slot.conn.recv()
        except (EOFError, OSError):
            slot.proc.join(timeout=1)
            if not slot.ready:
                self._startup_failed(slot)
            self._replace(slot, "crashed", f"pool process {slot.proc.pid} died "
                                           f"(exit code {slot.proc.exitcode}) while scoring")
            return
        if msg[0] == "ready":
            slot.ready = True
            self._startup_failures = 0
            return
        if not slot.calls or msg[0] != slot.calls[0].id:
            return  # cannot happen with one pipe per process; ignore rather than mis-assign
        call = slot.calls.popleft()
        if slot.calls:  # the process started the next call as it sent this result
            slot.deadline = time.monotonic() + self._timeout
        if msg[1] == "ok":
            self._done(call, msg[2])
        else:
            self._failed(call, "exception", msg[2], msg[3])

    def _startup_failed(self, slot: _Slot) -> None:
        """A process died before it was ready: back off, and after 3 in a row fail the waiting calls
        (default reward + error) rather than leave their jobs hanging."""
        self._startup_failures += 1
        if self._startup_failures >= 3:
            error = (f"reward pool processes exit during startup (last exit code {slot.proc.exitcode}); "
                     "see the worker's stderr (a script using RewardExecutor needs `if __name__ == '__main__':`)")
            while (call := self._take()) is not None:
                self._failed(call, "crashed", error, "")
        time.sleep(min(0.1 * 2 ** self._startup_failures, 5.0))

    def _expire(self) -> None:
        now = time.monotonic()
        for slot in list(self._slots):
            if slot.calls and now > slot.deadline:
                self._replace(slot, "timeout", f"no result within {self._timeout}s; pool process "
                                               f"{slot.proc.pid} was killed and replaced")

    def _replace(self, slot: _Slot, kind: str, error: str) -> None:
        """Kill the slot's process (group), start a new one, report the call it was running (if any)
        and put the calls queued behind it back."""
        calls = list(slot.calls)
        self._kill(slot)
        self._slots[self._slots.index(slot)] = self._respawn()
        for call in reversed(calls[1:]):
            self._requeue(call)
        if calls:
            self._failed(calls[0], kind, error, "")

    def _respawn(self) -> _Slot:
        delay = 0.1
        while True:
            try:
                return self._spawn()
            except Exception:  # out of processes or memory right now: back off and try again
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _kill(self, slot: _Slot) -> None:
        pid = slot.proc.pid
        if pid is not None:
            for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
                try:
                    kill()
                except (ProcessLookupError, PermissionError):
                    pass
        slot.proc.join(timeout=5)
        slot.conn.close()

    def _shutdown(self) -> None:
        for slot in self._slots:
            try:
                slot.conn.send(None)
            except (OSError, EOFError):
                pass
        deadline = time.monotonic() + 2
        for slot in self._slots:
            slot.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if slot.proc.is_alive():
                self._kill(slot)
            else:
                slot.conn.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
