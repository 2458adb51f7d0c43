"""The controller's admission: the staleness rule (η) and the ledger that every admitted group leaves once.

What:
- `can_admit` is the one definition of the AReaL paper's staleness throttle plus a concurrency cap: a new group
  only while `counted < (η + v + 1) · batch_groups` and fewer than `max_concurrent` groups are in flight
  (the controller, the zero-infrastructure simulator areal_mq/sim/des.py and the balance sweep all call it);
- `AdmissionLedger`: `admit(group)`, then exactly one `settle(group, outcome)` with outcome
    stored            -> reached the sample store (it keeps counting: it will be trained, or later...)
    stale             -> ...the store dropped it as too stale (settled from the store's `dropped_recent`)
    dropped_uniform   -> all rewards equal: not stored (zero advantage)
    failed            -> generation, episode or reward failed after max_retries (or was non-finite)
  `counted` = admitted - dropped_uniform - failed - stale: the number `can_admit` compares with the bound.
Why: without the ledger, a group lost to a failure or a stale drop kept its place in the bound forever; once
the losses exceeded η · batch_groups the controller admitted nothing more and the trainer waited forever (in
sync mode, η = 0, one failure was enough). Settling is idempotent: a second settle of a group, or a settle of
an unknown group, changes nothing.

Run: pytest tests/unit/workers/test_ledger.py tests/unit/workers/test_admission.py -q
"""
from __future__ import annotations

from collections import Counter

OUTCOMES = ("stored", "dropped_uniform", "failed", "stale")
MAX_STALE_IDS = 200_000  # remembered so a restarted controller does not settle one drop twice


def can_admit(submitted_groups: int, version: int, max_staleness: int, batch_groups: int, in_flight: int,
              max_concurrent: int) -> bool:
    """The staleness throttle of the AReaL paper plus a concurrency cap (pure; property-tested)."""
    return submitted_groups < (max_staleness + version + 1) * batch_groups and in_flight < max_concurrent


class AdmissionLedger:
    def __init__(self) -> None:
        self.in_flight: set[str] = set()
        self.counts: Counter = Counter()
        self.stale_ids: set[str] = set()
        self.base = 0  # counted groups of a previous controller process (resume)

    def admit(self, group: str) -> None:
        if group not in self.in_flight:
            self.in_flight.add(group)
            self.counts["admitted"] += 1

    def settle(self, group: str, outcome: str) -> bool:
        """Record how `group` left; False when it was already settled (or is unknown) and nothing changed."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; one of {OUTCOMES}")
        if outcome == "stale":  # a stored group (perhaps stored by a previous controller process)
            if group in self.stale_ids or group in self.in_flight:
                return False
            if len(self.stale_ids) < MAX_STALE_IDS:
                self.stale_ids.add(group)
            self.counts["stale"] += 1
            return True
        if group not in self.in_flight:
            return False
        self.in_flight.discard(group)
        self.counts[outcome] += 1
        return True

    @property
    def counted(self) -> int:
        c = self.counts
        return self.base + c["admitted"] - c["dropped_uniform"] - c["failed"] - c["stale"]

    def balance(self) -> dict:
        """admitted == stored + dropped_uniform + failed + in_flight, per process (stale ones were stored first)."""
        return {"admitted": self.counts["admitted"], **{o: self.counts[o] for o in OUTCOMES},
                "in_flight": len(self.in_flight), "counted": self.counted}

    def state(self) -> dict:
        return {"counted": self.counted - len(self.in_flight), "stale_ids": sorted(self.stale_ids)}

    def restore(self, state: dict) -> None:
        """Resume: groups in flight then are generated again (admitted anew); the rest keep counting."""
        self.base = int(state.get("counted", 0))
        self.stale_ids = set(state.get("stale_ids", []))
