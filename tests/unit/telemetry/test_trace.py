"""`areal-mq trace`'s pure parts: the timeline of a group built from event dicts, id resolution, staleness."""
import json

import pytest

from areal_mq.telemetry.trace import TraceError, build_timeline, known_groups, resolve, staleness
from areal_mq.telemetry.trace_view import describe, mask_runs, render

G = "g0000003-arith-train-00017"


def ev(ts, event, role, worker, **kw):
    return {"ts": ts, "event": event, "role": role, "worker_id": worker, "level": "debug", **kw}


def journey():
    """One group of two samples: admitted at v0, sample 1 interrupted by a weight update (v1) with KV recompute."""
    return [
        ev(10.0, "controller.group_admitted", "controller", "c", group=G, problem="arith-train-00017", version=0),
        ev(10.1, "rollout.request_started", "rollout", "r0", job="j0", version=0),
        ev(10.1, "rollout.request_started", "rollout", "r0", job="j1", version=0),
        ev(10.5, "rollout.weights_updated", "rollout", "r0", version=1, recompute_tokens=12.0),
        ev(10.4, "rollout.request_finished", "rollout", "r0", job="j0", tokens=8, reason="stop", versions=[0],
           version_counts=[8], group=G, sample=0),
        ev(11.0, "rollout.request_finished", "rollout", "r0", job="j1", tokens=10, reason="length",
           versions=[0, 1], version_counts=[6, 4], group=G, sample=1),
        ev(11.1, "controller.reward_submitted", "controller", "c", group=G, job="rj"),
        ev(11.2, "reward.job_done", "reward", "w0", job="rj", task="arith", n=2, cached=False, ms=3.5),
        ev(11.2, "reward.completions", "reward", "w0", job="rj", prompt_id="arith-train-00017",
           rewards=[1.0, -0.5], reasons=["correct", "truncated"], errors=None),
        ev(11.3, "controller.group_stored", "controller", "c", group=G, reward_mean=0.25, versions=[0, 1]),
        ev(12.0, "store.leased", "broker", "all", batch="b1", samples=["other", G], version=1),
        ev(13.0, "trainer.step", "trainer", "t", sample_ids=[G, "other"], version=3, loss=0.1),
        ev(13.5, "controller.group_stored", "controller", "c", group="g0000004-x", reward_mean=0.0),
    ]


def test_a_group_timeline_is_in_order_with_every_stage():
    tl = build_timeline(journey(), G)
    assert [s.stage for s in tl.steps] == ["admitted", "generated", "generated", "reward", "stored", "leased",
                                           "trained"]
    assert tl.missing == []
    gen1 = tl.steps[2].detail
    assert gen1["sample"] == 1 and gen1["interrupts"] == 1 and gen1["kv_recompute_tokens"] == 12
    assert tl.steps[1].detail["interrupts"] == 0  # finished before the update
    reward = tl.steps[3]
    assert reward.who == "reward/w0" and reward.detail["ms"] == 3.5
    assert reward.detail["completions"][1] == {"sample": 1, "reward": -0.5, "reason": "truncated"}
    trained = tl.steps[-1].detail
    # step published v3, so it trained policy v2: tokens of v0 are 2 stale, of v1 1 stale
    assert trained["version"] == 3 and trained["policy"] == 2
    assert trained["staleness"] == {"min": 1, "mean": round((14 * 2 + 4 * 1) / 18, 3), "max": 2, "tokens": 18}


def test_one_sample_keeps_its_own_generation_and_reward():
    tl = build_timeline(journey(), G, sample=1)
    gens = [s for s in tl.steps if s.stage == "generated"]
    assert [g.detail["job"] for g in gens] == ["j1"]
    assert [c["sample"] for c in next(s for s in tl.steps if s.stage == "reward").detail["completions"]] == [1]
    assert tl.steps[-1].detail["staleness"]["tokens"] == 10


def test_stored_sequences_give_token_versions_and_episode_masks():
    seqs = [{"index": 0, "reward": 1.0, "finish": "stop", "tokens": 5, "versions": [2, 2, -1, -1, 2],
             "loss_mask": [1, 1, 0, 0, 1], "reason": ""}]
    tl = build_timeline(journey(), G, seqs=seqs)
    assert tl.steps[-1].detail["staleness"] == {"min": 0, "mean": 0.0, "max": 0, "tokens": 3}  # env tokens skipped
    assert mask_runs(seqs[0]["loss_mask"]) == "1×2 0×2 1×1"
    assert mask_runs(None) == "-"


def test_episodes_show_up_by_episode_id():
    recs = journey() + [ev(10.9, "agent.episode_done", "agent", "a0", episode=f"{G}-e1", turns=3, reward=0.5,
                           tokens=40, seconds=0.8)]
    tl = build_timeline(recs, G, sample=1)
    ep = [s for s in tl.steps if s.stage == "episode"]
    assert len(ep) == 1 and ep[0].detail["turns"] == 3 and ep[0].detail["sample"] == 1
    assert not [s for s in build_timeline(recs, G, sample=0).steps if s.stage == "episode"]


def test_info_level_events_say_what_is_missing():
    recs = [r for r in journey() if r["event"] in ("controller.group_stored", "trainer.step")]
    tl = build_timeline(recs, G)
    assert [s.stage for s in tl.steps] == ["stored", "trained"]
    assert tl.steps[-1].detail["staleness"] is None
    assert any("events.level=debug" in m for m in tl.missing)
    assert any("group_admitted" in m for m in tl.missing)


def test_ids_resolve_to_groups_and_samples_and_unknown_ids_list_real_ones():
    recs = journey()
    assert known_groups(recs)[:2] == [G, "other"]
    assert resolve(recs, G) == (G, None)
    assert resolve(recs, f"{G}-e1") == (G, 1)
    assert resolve(recs, f"{G}:0") == (G, 0)
    with pytest.raises(TraceError, match="groups that exist: g0000003-arith-train-00017"):
        resolve(recs, "g9999999-nope")
    with pytest.raises(TraceError, match="name no group"):
        resolve([ev(1.0, "rollout.stats", "rollout", "r0")], G)


def test_staleness_summary():
    assert staleness(5, [(5, 10)]) == {"min": 0, "mean": 0.0, "max": 0, "tokens": 10}
    assert staleness(5, []) is None


def test_render_and_json(tmp_path):
    import io

    from areal_mq.telemetry.trace_view import to_json

    tl = build_timeline(journey(), G)
    buf = io.StringIO()
    render(tl, out=buf, width=200)
    text = buf.getvalue()
    assert "admitted" in text and "trained policy v2" in text and "0: 1 correct" in text
    assert "interrupted 1× by weight updates, KV recomputed 12 tok" in describe(tl.steps[2])
    assert json.loads(to_json(tl))["steps"][0]["stage"] == "admitted"
