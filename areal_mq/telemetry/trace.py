"""`areal-mq trace RUN_DIR ID`: one group's (or one sample's) journey through a run, from its event files.

What: the timeline of group ID (e.g. g0000003-arith-train-00017), or of one of its samples (ID-e1 or ID:1):
admitted (controller) -> each generation request (rollout worker, policy versions, weight updates that
interrupted it and the KV they recomputed) or episode (agent, turns) -> reward job (worker, time, each
completion's reward and reason) -> stored / dropped / failed (controller) -> leased (sample store) -> trained
(the trainer step, its version and the per-token staleness min/mean/max). Where the sample store still holds
the group (run_dir/store/samples.log, read only), its sequences are shown too: reward, tokens, the policy
versions and, for an episode, the loss mask (model turns 1, environment turns 0).
Why: "where did this sample spend its time, which weights made it, how stale was it when trained?" from the
ids every message already carries, without reading JSONL or the binary store log by hand.
Joins: generation lines need the debug events (`--set events.level=debug`: rollout.request_*, the reward
job's controller.reward_submitted / reward.completions, store.leased); at info level the timeline has the
admitted, stored and trained lines, and says what is missing.
How to run: areal-mq trace runs/quickstart g0000003-arith-train-00017 [--json]
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from areal_mq.errors import ArealError


class TraceError(ArealError):
    """The id names no group of this run (the message lists some that exist)."""


@dataclass
class Step:
    """One line of a timeline: `stage` at `ts` by `who` (role/worker), with what it knew."""

    ts: float
    stage: str  # admitted, generated, episode, retry, reward, stored, dropped, failed, leased, trained, store_dropped
    who: str
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Timeline:
    group: str
    sample: int | None  # one sample of the group, or None for all
    steps: list[Step]
    missing: list[str]  # what the events could not show, and how to get it
    seqs: list[dict] = field(default_factory=list)  # the stored sample's sequences (store log), when still there

    def to_dict(self) -> dict:
        return asdict(self)


_SAMPLE_SUFFIX = re.compile(r"^(?P<group>.+?)(?:-e|:)(?P<index>\d+)$")


def known_groups(records: Iterable[dict]) -> list[str]:
    """Group ids the events name, in order of first appearance."""
    seen: dict[str, None] = {}
    for rec in records:
        for gid in _groups_of(rec):
            seen.setdefault(gid, None)
    return list(seen)


def _groups_of(rec: dict) -> list[str]:
    event = rec.get("event", "")
    if event == "trainer.step":
        return [str(s) for s in rec.get("sample_ids") or []]
    if event == "store.leased":
        return [str(s) for s in rec.get("samples") or []]
    if event == "store.sample_dropped":
        return [str(rec.get("sample", ""))]
    group = rec.get("group")
    return [group] if isinstance(group, str) and group else []


def resolve(records: list[dict], ident: str) -> tuple[str, int | None]:
    """(group id, sample index or None) that `ident` names; TraceError listing some known ids otherwise."""
    groups = known_groups(records)
    if ident in groups:
        return ident, None
    m = _SAMPLE_SUFFIX.match(ident)
    if m and m["group"] in groups:
        return m["group"], int(m["index"])
    some = ", ".join(groups[:5]) + (f" ... ({len(groups)} in all)" if len(groups) > 5 else "")
    raise TraceError(f"no group or sample {ident!r} in these events; "
                     + (f"groups that exist: {some}; a sample is GROUP-eN or GROUP:N" if groups
                        else "they name no group at all (did the run admit anything?)"))


def _who(rec: dict) -> str:
    return f"{rec.get('role', '?')}/{rec.get('worker_id', '?')}"


def _index(records: list[dict]) -> dict[str, list[dict]]:
    by_event: dict[str, list[dict]] = {}
    for rec in records:
        by_event.setdefault(str(rec.get("event", "")), []).append(rec)
    return by_event


def build_timeline(records: list[dict], group: str, sample: int | None = None,
                   seqs: list[dict] | None = None) -> Timeline:
    """The timeline of `group` (or its sample `sample`) from event dicts (any order; sorted by time)."""
    records = sorted(records, key=lambda r: r.get("ts", 0.0))
    ev = _index(records)
    steps: list[Step] = []
    missing: list[str] = []
    mine = [r for r in records if r.get("group") == group]
    for rec in mine:
        name = rec.get("event")
        if name == "controller.group_admitted":
            steps.append(Step(rec["ts"], "admitted", _who(rec), {"problem": rec.get("problem"),
                                                                  "version": rec.get("version")}))
        elif name in ("controller.group_stored", "controller.group_dropped", "controller.group_failed",
                      "controller.retry"):
            stage = name.split(".")[1].replace("group_", "")
            steps.append(Step(rec["ts"], stage, _who(rec), _pick(rec, "versions", "reward_mean", "latency_s",
                                                                 "reason", "stage", "attempt")))
    generations = [r for r in mine if r.get("event") == "rollout.request_finished"
                   and (sample is None or r.get("sample") == sample)]
    steps += [_generation(r, ev) for r in generations]
    steps += _episodes(ev, group, sample)
    steps += _reward(ev, group, sample)
    steps += [Step(r["ts"], "leased", _who(r), {"batch": r.get("batch"), "trainer_version": r.get("version")})
              for r in ev.get("store.leased", []) if group in (r.get("samples") or [])]
    steps += [Step(r["ts"], "store_dropped", _who(r), _pick(r, "reason", "oldest_version", "version"))
              for r in ev.get("store.sample_dropped", []) if r.get("sample") == group]
    token_versions = _token_versions(generations, seqs, sample)
    steps += [_trained(r, token_versions) for r in ev.get("trainer.step", []) if group in (r.get("sample_ids") or [])]
    steps.sort(key=lambda s: s.ts)
    if not any(s.stage == "admitted" for s in steps):
        missing.append("no controller.group_admitted event (a run from before this event existed)")
    if not generations and not any(s.stage == "episode" for s in steps):
        missing.append("no generation lines: rollout.request_* are debug events (--set events.level=debug)")
    if not any(s.stage == "reward" for s in steps) and not ev.get("agent.episode_done"):
        missing.append("no reward line: controller.reward_submitted and reward.completions are debug events")
    if seqs is not None and sample is not None:
        seqs = [s for s in seqs if s["index"] == sample]
    return Timeline(group, sample, steps, missing, seqs or [])


def _pick(rec: dict, *keys: str) -> dict:
    return {k: rec[k] for k in keys if k in rec}


def _generation(fin: dict, ev: dict[str, list[dict]]) -> Step:
    """A finished generation request, joined with its start (job id) and the weight updates in between."""
    job, worker = fin.get("job"), fin.get("worker_id")
    start = next((r for r in ev.get("rollout.request_started", []) if r.get("job") == job
                  and r.get("worker_id") == worker and r["ts"] <= fin["ts"]), None)
    began = start["ts"] if start else None
    updates = [r for r in ev.get("rollout.weights_updated", []) if r.get("worker_id") == worker
               and began is not None and began <= r["ts"] <= fin["ts"]]
    detail = {"sample": fin.get("sample"), "job": job, "tokens": fin.get("tokens"), "finish": fin.get("reason"),
              "versions": fin.get("versions"), "version_counts": fin.get("version_counts"),
              "started_version": start.get("version") if start else None,
              "seconds": round(fin["ts"] - began, 3) if began is not None else None,
              "interrupts": len(updates),
              "kv_recompute_tokens": int(sum(float(r.get("recompute_tokens") or 0) for r in updates))}
    failed = [r for r in ev.get("rollout.job_failed", []) if r.get("job") == job]
    if failed:
        detail["failed"] = failed[0].get("error")
    return Step(fin["ts"], "generated", _who(fin), detail)


def _episodes(ev: dict[str, list[dict]], group: str, sample: int | None) -> list[Step]:
    out = []
    for rec in ev.get("agent.episode_done", []) + ev.get("agent.episode_failed", []):
        m = _SAMPLE_SUFFIX.match(str(rec.get("episode", "")))
        if not m or m["group"] != group[:120] or (sample is not None and int(m["index"]) != sample):
            continue
        stage = "episode" if rec["event"] == "agent.episode_done" else "episode_failed"
        out.append(Step(rec["ts"], stage, _who(rec), {"sample": int(m["index"]), **_pick(
            rec, "episode", "turns", "reward", "tokens", "seconds", "error")}))
    return out


def _reward(ev: dict[str, list[dict]], group: str, sample: int | None) -> list[Step]:
    """Reward jobs of the group: the controller names the job id, the reward worker logs it with its scores."""
    jobs = {r.get("job") for r in ev.get("controller.reward_submitted", []) if r.get("group") == group}
    done = {r.get("job"): r for r in ev.get("reward.job_done", []) if r.get("job") in jobs}
    out = []
    for rec in ev.get("reward.completions", []):
        if rec.get("job") not in jobs:
            continue
        rewards, reasons = rec.get("rewards") or [], rec.get("reasons") or []
        errors = rec.get("errors") or []
        per = [{"sample": i, "reward": rw, "reason": reasons[i] if i < len(reasons) else "",
                **({"error": errors[i]} if i < len(errors) and errors[i] else {})} for i, rw in enumerate(rewards)]
        if sample is not None:
            per = [p for p in per if p["sample"] == sample]
        info = done.get(rec.get("job"), {})
        out.append(Step(rec["ts"], "reward", _who(rec), {"job": rec.get("job"), "task": info.get("task"),
                                                          "ms": info.get("ms"), "cached": info.get("cached"),
                                                          "completions": per}))
    return out


def _token_versions(generations: list[dict], seqs: list[dict] | None, sample: int | None) -> list[tuple[int, int]]:
    """(policy version, tokens) of the generated tokens: from the stored sequences, else the rollout events."""
    counts: dict[int, int] = {}
    if seqs:
        for s in seqs:
            if sample is None or s["index"] == sample:
                for v in s["versions"]:
                    if v >= 0:
                        counts[v] = counts.get(v, 0) + 1
    else:
        for g in generations:
            for v, n in zip(g.get("versions") or [], g.get("version_counts") or []):
                if v >= 0:
                    counts[int(v)] = counts.get(int(v), 0) + int(n)
    return sorted(counts.items())


def staleness(trained_on: int, token_versions: list[tuple[int, int]]) -> dict | None:
    """min/mean/max of (policy trained - token's version) over the generated tokens, None when unknown."""
    total = sum(n for _, n in token_versions)
    if not total:
        return None
    lags = [(trained_on - v, n) for v, n in token_versions]
    return {"min": min(l for l, _ in lags), "mean": round(sum(l * n for l, n in lags) / total, 3),
            "max": max(l for l, _ in lags), "tokens": total}


def _trained(rec: dict, token_versions: list[tuple[int, int]]) -> Step:
    version = int(rec.get("version", 0))  # the version this step published; it trained policy version - 1
    return Step(rec["ts"], "trained", _who(rec), {"version": version, "policy": version - 1,
                                                   "staleness": staleness(version - 1, token_versions),
                                                   **_pick(rec, "loss", "n_samples", "step_s")})


def stored_seqs(run_dir: Path, group: str, read_sample: Callable[[Path, str], Any] | None) -> list[dict] | None:
    """The group's sequences as the sample store's log holds them (None: not there, or no `read_sample`,
    brokers/sample_log_reader.py's, which the CLI passes in)."""
    sample = read_sample(run_dir / "store" / "samples.log", group) if read_sample else None
    if sample is None:
        return None
    return [{"index": i, "reward": s.reward, "finish": s.finish_reason, "tokens": int(len(s.output_ids)),
             "versions": [int(v) for v in s.versions],
             "loss_mask": None if s.loss_mask is None else [int(m) for m in s.loss_mask],
             "reason": (s.info.get("detail") or {}).get("reason", "") if isinstance(s.info, dict) else ""}
            for i, s in enumerate(sample.seqs)]
