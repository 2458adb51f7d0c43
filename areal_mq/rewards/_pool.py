"""One reward pool process: receive calls on a pipe, run reward functions, send back results.

What: `pool_main` is the target of each process the RewardExecutor starts. Wire (pickled tuples):
    parent -> child: (call_id, fns, group, prompt, completion_or_list, reference, meta) or None (= exit)
        fns is [(ref, None)] for one function or [(ref, weight), ...] for a weighted combination
    child -> parent: ("ready", pid) once warm; (call_id, "ok", [(reward, details), ...]) or
        (call_id, "error", "ExcType: message", traceback_text)
Why a hand-made pool: concurrent.futures cannot kill a hung task; the executor kills this whole process
(and its process group) and starts another. The child dies with its parent (PR_SET_PDEATHSIG), so a
killed reward worker leaves no orphans behind.
"""
from __future__ import annotations

import ctypes
import os
import signal
import traceback

from areal_mq.rewards.registry import RewardRegistry


def _die_with_parent() -> None:
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: rely on the pipe closing
        return
    if os.getppid() == 1:  # the parent already died before prctl took effect
        os._exit(1)


def run_call(registry: RewardRegistry, fns, group: bool, prompt, completion, reference, meta) -> list:
    """Score one call; one (reward, details) per completion it covers."""
    if len(fns) == 1 and fns[0][1] is None:
        return registry.resolve(fns[0][0])(prompt, completion, reference, meta)
    total, details = 0.0, {}
    for ref, weight in fns:  # weighted combination of per-sample functions
        (reward, det), = registry.resolve(ref)(prompt, completion, reference, meta)
        total += weight * reward
        details[ref] = {"reward": reward, **det}
    return [(total, details)]


def pool_main(conn, registry: RewardRegistry, warm: list[str]) -> None:
    """Serve calls until the parent sends None or goes away."""
    _die_with_parent()
    try:
        # Our own session (so our own process group): the executor can kill what a hung function started,
        # and on kernels with autogroup scheduling each pool process gets its own CPU share instead of
        # splitting one share with its parent's whole session.
        os.setsid()
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    for ref in warm:
        try:
            registry.resolve(ref)
        except Exception:  # the parent validated these; a failure shows up again on the first call
            pass
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        call_id, fns, group, prompt, completion, reference, meta = msg
        try:
            out = run_call(registry, fns, group, prompt, completion, reference, meta)
            reply = (call_id, "ok", out)
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
            reply = (call_id, "error", f"{type(exc).__name__}: {exc}"[:2000], traceback.format_exc(limit=-8)[-4000:])
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
        except Exception as exc:  # e.g. unpicklable details
            conn.send((call_id, "error", f"cannot send the result back: {type(exc).__name__}: {exc}", ""))
