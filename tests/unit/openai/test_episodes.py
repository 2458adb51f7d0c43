"""RecordedEpisode recording of the OpenAI endpoint: segments with the loss mask, single-sequence detection, bounds.

Run: pytest tests/unit/test_openai_episodes.py -q   (< 1 s)
"""
import numpy as np
import pytest

from areal_mq.openai.episodes import Choice, EpisodeRecorder, NotOneSequence, RecorderLimits, RecordedTurn


def choice(ids, version, reason="stop"):
    return Choice(np.asarray(ids, np.int32), np.full(len(ids), -0.5, np.float32), np.full(len(ids), version, np.int32),
                  reason)


def turn(prompt, *choices):
    return RecordedTurn(np.asarray(prompt, np.int32), list(choices))


def test_three_turns_make_one_sequence_with_generated_tokens_only_trained():
    rec = EpisodeRecorder()
    rec.record("e", turn([1, 2], choice([5, 6], 3)))
    rec.record("e", turn([1, 2, 5, 6, 9], choice([7], 4)))  # env token 9 between turns
    rec.record("e", turn([1, 2, 5, 6, 9, 7, 8, 8], choice([4, 4, 4], 4, "length")))
    segs = rec.pop("e").to_segments()
    assert [s["kind"] for s in segs] == ["prompt", "generated", "env", "generated", "env", "generated"]
    tokens = sum((s["tokens"] for s in segs), [])
    mask = sum((s["loss_mask"] for s in segs), [])
    versions = sum((s["versions"] for s in segs), [])
    assert tokens == [1, 2, 5, 6, 9, 7, 8, 8, 4, 4, 4]
    assert mask == [0, 0, 1, 1, 0, 1, 0, 0, 1, 1, 1]
    assert versions == [-1, -1, 3, 3, -1, 4, -1, -1, 4, 4, 4]
    assert all(lp == 0.0 for s in segs if s["kind"] != "generated" for lp in s["logprobs"])
    assert rec.pop("e") is None and rec.stats()["tokens"] == 0


def test_a_prompt_that_does_not_extend_the_previous_turn_starts_a_new_sequence():
    rec = EpisodeRecorder()
    rec.record("e", turn([1, 2], choice([5, 6], 0)))
    rec.record("e", turn([1, 2, 5, 99, 9], choice([7], 0)))  # history edited: 6 -> 99
    ep = rec.get("e")
    assert [s[0]["turn"] for s in ep.to_sequences()] == [0, 1]
    assert ep.to_json()["single_sequence"] is False and ep.to_json()["sequence_starts"] == [0, 1]
    with pytest.raises(NotOneSequence, match="turns \\[1\\]"):
        ep.to_segments()


def test_of_several_choices_the_one_the_next_prompt_continues_is_trained():
    rec = EpisodeRecorder()
    rec.record("e", turn([1], choice([5], 0), choice([6], 0)))
    rec.record("e", turn([1, 6, 9], choice([7], 1)))
    segs = rec.get("e").to_segments()
    assert sum((s["tokens"] for s in segs), []) == [1, 6, 9, 7]


def test_turns_past_the_limits_are_counted_not_stored():
    rec = EpisodeRecorder(RecorderLimits(max_turns=2, max_episode_tokens=100))
    for _ in range(3):
        rec.record("e", turn([1, 2], choice([3], 0)))
    assert rec.record("e", turn([1] * 200, choice([3], 0))) == -1
    ep = rec.get("e")
    assert len(ep.turns) == 2 and ep.dropped_turns == 2


def test_episodes_are_bounded_least_recently_used_out_and_by_total_tokens():
    rec = EpisodeRecorder(RecorderLimits(max_episodes=3, max_total_tokens=1000))
    for i in range(5):
        rec.record(f"e{i}", turn([1, 2], choice([3], 0)))
    assert rec.stats()["episodes"] == 3 and rec.get("e0") is None and rec.get("e4") is not None
    rec.record("big", turn([1] * 995, choice([3], 0)))  # pushes the total over: the oldest go first
    assert rec.get("big") is not None and rec.stats()["tokens"] <= 1000
    assert rec.stats()["evicted"] == 4 and rec.get("e4") is not None and rec.get("e3") is None


def test_idle_episodes_expire():
    now = [0.0]
    rec = EpisodeRecorder(RecorderLimits(ttl_s=10), clock=lambda: now[0])
    rec.record("old", turn([1], choice([2], 0)))
    now[0] = 5.0
    rec.record("new", turn([1], choice([2], 0)))
    now[0] = 12.0
    assert rec.get("old") is None and rec.get("new") is not None
    now[0] = 30.0
    assert rec.pop("new") is None and rec.stats() == {"episodes": 0, "tokens": 0, "evicted": 2}


def test_a_split_turn_starts_a_new_sequence_even_when_its_tokens_extend_and_the_audit_counts_turns():
    rec = EpisodeRecorder()
    rec.record("e", turn([1, 2], choice([5, 6], 0)))
    rec.record("e", RecordedTurn(np.asarray([1, 2, 5, 6, 9], np.int32), [choice([7], 1)], origin="continued"))
    rec.record("e", RecordedTurn(np.asarray([1, 2, 5, 6, 9, 7, 8], np.int32), [choice([3, 3], 1)], origin="split",
                                 split_reason="edited_history", edit_at=1))
    doc = rec.get("e").to_json()
    assert doc["sequence_starts"] == [0, 2] and not doc["single_sequence"]
    assert [t["audit"] for t in doc["turns"]] == [{"turn": 0, "generated": 2, "trained": 2, "exact": True},
                                                  {"turn": 1, "generated": 1, "trained": 1, "exact": True},
                                                  {"turn": 2, "generated": 2, "trained": 2, "exact": True}]
    assert doc["audit"] == {"turns": 3, "generated_tokens": 5, "trained_tokens": 5, "exact_turns": 3,
                            "continued_turns": 1, "splits": [{"turn": 2, "reason": "edited_history", "message": 1}]}
