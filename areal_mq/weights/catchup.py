"""A rollout worker's way to a published version: the fewest bytes, verified, or a clear error — never wrong weights.

What: `WeightCatchup(run_dir, trainer_cfg, timeout_s, keys)` turns a WeightsReady into an `Update` (the keyword
arguments of Engine.update_weights plus what was fetched and why) and, once the engine applied it, `commit`s the
new version as the weights it holds (a CPU copy in the published dtype: the base of the next delta).

    WeightsReady(version N, base, links) ──► plans: [held version + deltas held+1..N]   (the direct delta if held = N-1)
                                                    [full F + deltas F+1..N] for every full F listed (F = N: full alone)
                                         ──► cheapest first; each delta and full tensor checked against its checksum
                                         ──► on DeltaError (checksum, corrupt, missing, base) the next plan without the
                                             failed piece; `Update.fallback` says why ("reason: detail")

Why: at RL learning rates a delta is a few percent of the full bytes; a worker that missed versions, or joined
late, catches up from what it holds or from the last full version, whichever costs less. A timeout or a dead
server is not a delta problem: it raises WeightsFetchError (the worker retries; another plan would hit the same
server). An announcement without links (deltas off) loads as before: {"path": dir} on disk, full tensors on zmq.
How to run: tests/unit/test_weights_delta.py, tests/integration/test_weight_deltas.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from areal_mq.errors import WeightsFetchError, WeightsRefused
from areal_mq.messages import WeightsLink, WeightsReady
from areal_mq.weights.adapter import refuse_other_base
from areal_mq.weights.delta import DeltaError, apply_version, changed_elements

if TYPE_CHECKING:
    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.security import Keyring


@dataclass
class Update:
    """What the worker applies: `kwargs` for Engine.update_weights; `hold` the tensors it then holds (None:
    none, deltas are off); `route` delta | chain | full | full+chain | path | none."""

    version: int
    kwargs: dict[str, Any]
    hold: dict[str, Any] | None = None
    route: str = "none"
    fetched_bytes: int = 0
    full_bytes: int = 0
    fallback: str = ""  # why the direct delta was not used ("" when it was, or when there is none)
    failures: list[str] = field(default_factory=list)  # every plan that failed, "reason: detail"
    fetch_s: float = 0.0
    # only the elements that differ from the weights held at `patch_base`, for engines that take patches=
    # (Engine.accepts_patches): the engine's pause is then a scatter of what changed, not a copy of everything
    patches: dict[str, Any] | None = None
    patch_base: int = -1
    # a LoRA version (WeightsReady.adapter): kwargs["tensors"] is the adapter, merged by the engine from its base
    adapter: Any = None


def plans(ready: WeightsReady, held: int) -> list[tuple[str, list[WeightsLink]]]:
    """Every way to `ready.version` from the listed pieces, cheapest first: (route, pieces in order)."""
    n = ready.version
    full = {link.version: link for link in ready.links if link.base < 0}
    step = {link.version: link for link in ready.links if link.base == link.version - 1}

    def chain(start: int) -> list[WeightsLink] | None:
        pieces = [step.get(v) for v in range(start + 1, n + 1)]
        return None if None in pieces else pieces  # type: ignore[return-value]

    out: list[tuple[str, list[WeightsLink]]] = []
    if 0 <= held < n and (c := chain(held)) is not None:
        out.append(("delta" if held == n - 1 else "chain", c))
    for f in sorted(v for v in full if v <= n):
        if (c := chain(f)) is not None:
            out.append(("full" if f == n else "full+chain", [full[f], *c]))
    return sorted(out, key=lambda p: (sum(link.bytes for link in p[1]), len(p[1])))


def _patches(held: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any] | None:
    """Only the elements that changed since `held`, or None when the layout differs (the engine then gets the whole
    state dict)."""
    try:
        return changed_elements(held, tensors)
    except DeltaError:
        return None


def fetch_budget_s(timeout_s: float, nbytes: int, min_mbps: float) -> float:
    """The deadline of one weight fetch: a fixed part (latency, the server's encode) plus the bytes at the
    slowest rate allowed, so a 7B model's 15 GB is not cut off at the 60 s a 270 MB model needed."""
    return timeout_s + max(nbytes, 0) / (min_mbps * 1e6)


def _largest_bytes(ready: WeightsReady) -> int:
    """The most this announcement can make a worker move: the full version (a delta is smaller)."""
    sizes = [int(ready.meta.get("bytes", 0) or 0)] + [link.bytes for link in ready.links]
    return max(sizes)


class WeightCatchup:
    """Rollout-worker side of weight publishing (see the module docstring). `prepare` may run on a thread
    other than the one that calls `commit`; only `commit` changes what is held."""

    def __init__(self, run_dir: str | Path, cfg: "TrainerConfig", timeout_s: float = 60.0,
                 keys: "Keyring | None" = None, min_mbps: float = 50.0,
                 base_checksum: Callable[[], str] | None = None):
        self.run_dir, self.cfg, self.timeout_s, self.keys = run_dir, cfg, timeout_s, keys
        # () -> this worker's base as a LoRA trainer names it (WeightsAdapter.base_checksum); None: not checked
        self.base_checksum = base_checksum
        self._base: str | None = None  # computed once, at the first adapter version that names its base
        self.min_mbps = min_mbps
        self.budget_s = timeout_s  # of the fetch under way: timeout_s + its bytes at min_mbps
        self.held_version = -1
        self.held: dict[str, Any] | None = None
        self.shard_concurrency = 8  # sharded versions: trainer ranks fetched from at once

    def commit(self, update: Update) -> None:
        self.held = update.hold
        self.held_version = update.version if update.hold is not None else -1

    def prepare(self, ready: WeightsReady) -> Update:
        """The update taking the engine to `ready.version`. Raises WeightsRefused (outside this run),
        WeightsBaseMismatch (an adapter trained on another base: nothing is fetched, never retried), WeightsFetchError (server silent
        or refusing, files gone, every plan failed)."""
        from areal_mq.weights.client import check_ready, engine_kwargs

        t0 = time.perf_counter()
        why = check_ready(ready, self.run_dir, self.cfg)
        if why:
            raise WeightsRefused(why)
        self.check_base(ready)
        self.budget_s = fetch_budget_s(self.timeout_s, _largest_bytes(ready), self.min_mbps)
        if ready.shards:
            update = self._prepare_sharded(ready, time.monotonic() + self.budget_s)
            update.fetch_s = time.perf_counter() - t0
            return update
        if ready.mode not in ("disk", "zmq") or (ready.base < 0 and not ready.links):
            kwargs = engine_kwargs(ready, self.budget_s, self.keys)
            return Update(ready.version, kwargs, route="path" if "path" in kwargs else "full" if kwargs else "none",
                          fetch_s=time.perf_counter() - t0, adapter=ready.adapter)
        held, held_version = self.held, self.held_version  # one consistent view while another thread commits
        update = self._follow_plans(ready, time.monotonic() + self.budget_s, held, held_version)
        if ready.adapter is not None:  # the engine merges the whole (small) adapter from its base: no patches
            update.adapter = ready.adapter
        elif held is not None:  # what changed since the weights the engine holds, found here, off the decode loop
            update.patches, update.patch_base = _patches(held, update.hold), held_version
        update.fetch_s = time.perf_counter() - t0
        return update

    def check_base(self, ready: WeightsReady) -> None:
        """Refuse an adapter version trained on another base than this worker's (WeightsAdapter.base_checksum; empty,
        or a worker that cannot name its base: not checked). The base's checksum is computed once, lazily."""
        want = ready.adapter.base_checksum if ready.adapter is not None else ""
        if not want or self.base_checksum is None:
            return
        if self._base is None:
            self._base = self.base_checksum()
        refuse_other_base(f"v{ready.version}", want, self._base)

    def _prepare_sharded(self, ready: WeightsReady, deadline: float) -> Update:
        """Every trainer rank's slices at once (at most `shard_concurrency` fetches in flight), each shard along
        its own cheapest plan (its delta from the rows this worker holds, or its full slices), then the whole
        tensors assembled and checked against the manifest (areal_mq/weights/sharded.py)."""
        from concurrent.futures import ThreadPoolExecutor

        from areal_mq.weights.sharded import assemble, check_manifest, check_slices, shard_ready, slice_held

        layout = check_manifest(ready)
        held, held_version = self.held, self.held_version

        def one(shard: Any) -> Update:
            part = slice_held(held, shard)
            try:
                update = self._follow_plans(shard_ready(ready, shard), deadline, part,
                                            held_version if part is not None else -1)
                check_slices(shard, update.hold or update.kwargs["tensors"])
                return update
            except WeightsFetchError as exc:
                raise WeightsFetchError(f"trainer rank {shard.rank} ({shard.endpoint}): {exc}") from exc

        with ThreadPoolExecutor(max(1, min(self.shard_concurrency, len(ready.shards)))) as pool:
            futures = [pool.submit(one, shard) for shard in ready.shards]
            errors = [f.exception() for f in futures]
            bad = [(s.rank, e) for s, e in zip(ready.shards, errors) if e is not None]
            if bad:
                ranks = ", ".join(str(r) for r, _ in bad)
                raise WeightsFetchError(f"v{ready.version}: trainer rank{'s' if len(bad) > 1 else ''} {ranks} failed: "
                                        + "; ".join(str(e) for _, e in bad)) from bad[0][1]
            parts = [f.result() for f in futures]
        try:
            tensors = assemble(ready, layout, [p.hold or p.kwargs["tensors"] for p in parts], checked=True)
        except WeightsFetchError as exc:
            raise WeightsFetchError(f"v{ready.version} does not assemble from its shards: {exc}") from exc
        routes = sorted({p.route for p in parts})
        update = Update(ready.version, {"tensors": tensors}, hold=tensors,
                        route=routes[0] if len(routes) == 1 else "+".join(routes),
                        fetched_bytes=sum(p.fetched_bytes for p in parts), full_bytes=sum(p.full_bytes for p in parts),
                        fallback="; ".join(f"rank {s.rank}: {p.fallback}" for s, p in zip(ready.shards, parts)
                                           if p.fallback),
                        failures=[f"rank {s.rank}: {f}" for s, p in zip(ready.shards, parts) for f in p.failures])
        if held is not None:
            update.patches, update.patch_base = _patches(held, tensors), held_version
        return update

    def _follow_plans(self, ready: WeightsReady, deadline: float, held: dict[str, Any] | None,
                      held_version: int) -> Update:
        options = plans(ready, held_version if held is not None else -1)
        full_bytes = next((link.bytes for link in ready.links if link.version == ready.version and link.base < 0),
                          int(ready.meta.get("bytes", 0)))
        fallback = ""
        if ready.base >= 0 and (not options or options[0][0] != "delta"):
            fallback = (f"base: the delta is from v{ready.base}, this worker holds "
                        f"{f'v{held_version}' if held is not None else 'no published weights'}")
        failed: set[tuple[int, int]] = set()
        failures: list[str] = []
        for route, pieces in options:
            if any((p.version, p.base) in failed for p in pieces):
                continue
            try:
                tensors = self._run(ready, pieces, held, deadline)
            except DeltaError as exc:
                failures.append(f"{exc.reason}: {exc}")
                failed.add(getattr(exc, "piece", (pieces[-1].version, pieces[-1].base)))
                fallback = fallback or failures[-1]
                continue
            return Update(ready.version, {"tensors": tensors}, hold=tensors, route=route,
                          fetched_bytes=sum(p.bytes for p in pieces), full_bytes=full_bytes,
                          fallback=fallback, failures=failures)
        raise WeightsFetchError(f"no verified way to version {ready.version}: "
                                f"{'; '.join(failures) or 'the listed pieces do not lead there'}; "
                                "waiting for the next WeightsReady (a full version ends any chain)")

    def _run(self, ready: WeightsReady, pieces: list[WeightsLink], held: dict[str, Any] | None,
             deadline: float) -> dict[str, Any]:
        from areal_mq.weights.client import fetch_piece

        tensors = held if pieces[0].base >= 0 else None
        for piece in pieces:
            try:
                if piece.base < 0:
                    tensors = fetch_piece(ready, piece, lambda what: self._left(deadline, what), self.keys)
                else:
                    if tensors is None:
                        raise DeltaError("base", f"the delta {piece.base}->{piece.version} needs its base")
                    tensors = apply_version(tensors, fetch_piece(ready, piece, lambda what: self._left(deadline, what),
                                                                 self.keys))
            except DeltaError as exc:
                exc.piece = (piece.version, piece.base)  # type: ignore[attr-defined]
                if exc.reason == "base" and piece.base >= 0 and pieces[0] is piece:
                    exc.piece = (-1, -1)  # the held weights are not the delta's base: no piece is at fault
                raise
        assert tensors is not None
        return tensors

    def _left(self, deadline: float, what: str) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WeightsFetchError(f"weights: ran out of time ({self.budget_s:.0f} s = rollout.weights_timeout_s "
                                    f"{self.timeout_s:g} s + the version's bytes at rollout.weights_min_mbps "
                                    f"{self.min_mbps:g} MB/s) before {what}")
        return left
