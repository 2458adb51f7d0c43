"""Sticky sessions for the job broker: which worker served a multi-turn session last, and jobs waiting for it.

What: the bookkeeping behind GenerateRequest.session routing (docs/protocol.md §5.6). The job broker asks
`home(session)` for a job's worker, `park()`s a job whose worker is full, serves a worker's parked jobs first
when it frees a slot (`next_parked`), and sends the parked jobs whose wait ran out back to any worker
(`expired`). Why here: the broker's dispatch loop stays one attribute check for session-less jobs, and all
state a hostile client could grow lives behind the bounds below.

Bounds:
- `routes` holds at most `max_sessions` sessions (LRU: a lookup or an assignment refreshes one); the oldest
  is forgotten first, so a client inventing sessions costs the map nothing beyond its bound;
- a worker's parked jobs are at most its capacity (it can only free that many slots soon), and a job is
  parked at most once, for at most `wait_s`: then it goes to any worker (it never starves);
- a dropped worker's sessions are forgotten and its parked jobs handed back (`forget_worker`).
Every operation is O(1) except `forget_worker` (O(the worker's sessions and parked jobs)).
"""
from __future__ import annotations

import collections


class StickySessions:
    """session -> worker ident (LRU-bounded), plus the jobs parked on each worker waiting for a free slot."""

    def __init__(self, max_sessions: int, wait_s: float):
        self.max_sessions, self.wait_s = max_sessions, wait_s
        self.routes: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self.by_worker: dict[bytes, set[str]] = {}  # its sessions, so a dropped worker is forgotten quickly
        self.waiting: dict[bytes, dict[str, None]] = {}  # worker -> parked job ids, oldest first
        self.deadlines: collections.deque[tuple[float, str, bytes]] = collections.deque()  # oldest first

    def home(self, session: str) -> bytes | None:
        """The worker that served `session` last (it may hold its KV), or None; refreshes its LRU place."""
        ident = self.routes.get(session)
        if ident is not None:
            self.routes.move_to_end(session)
        return ident

    def remember(self, session: str, ident: bytes) -> None:
        """`ident` serves `session` now; evicts the least recently used session beyond max_sessions."""
        old = self.routes.get(session)
        if old != ident:
            if old is not None:
                self.by_worker[old].discard(session)
            self.by_worker.setdefault(ident, set()).add(session)
        self.routes[session] = ident
        self.routes.move_to_end(session)
        while len(self.routes) > self.max_sessions:
            evicted, owner = self.routes.popitem(last=False)
            self.by_worker[owner].discard(evicted)

    def park(self, job_id: str, ident: bytes, capacity: int, now: float) -> bool:
        """Let `job_id` wait up to wait_s for worker `ident`; False if it may not (no wait, or the worker is
        draining or already has `capacity` jobs waiting): the caller routes it elsewhere."""
        parked = self.waiting.setdefault(ident, {})
        if self.wait_s <= 0 or capacity <= 0 or len(parked) >= capacity:
            return False
        parked[job_id] = None
        self.deadlines.append((now + self.wait_s, job_id, ident))
        return True

    def next_parked(self, ident: bytes) -> str | None:
        """The oldest job parked on `ident` (removed), or None."""
        parked = self.waiting.get(ident)
        if not parked:
            return None
        job_id = next(iter(parked))
        del parked[job_id]
        return job_id

    def expired(self, now: float) -> list[str]:
        """Parked jobs whose wait ran out (removed), oldest first; the caller routes them to any worker."""
        out = []
        deadlines = self.deadlines
        while deadlines and deadlines[0][0] <= now:
            _, job_id, ident = deadlines.popleft()
            parked = self.waiting.get(ident)
            if parked is not None and job_id in parked:  # else: served already, or its worker was dropped
                del parked[job_id]
                out.append(job_id)
        return out

    def due(self, now: float) -> bool:
        """Whether some parked job's wait may have run out (cheap: the broker asks on every tick)."""
        return bool(self.deadlines) and self.deadlines[0][0] <= now

    def release(self, ident: bytes) -> list[str]:
        """The jobs parked on `ident` (removed), oldest first: it will free no slot for them (draining)."""
        return list(self.waiting.pop(ident, {}))

    def forget_worker(self, ident: bytes) -> list[str]:
        """Forget a dropped worker's sessions; return the jobs parked on it, oldest first."""
        for session in self.by_worker.pop(ident, ()):
            self.routes.pop(session, None)
        return self.release(ident)

    def parked_count(self) -> int:
        return sum(len(p) for p in self.waiting.values())
