"""The one admission rule (areal_mq/engines/admission.py): what the torch engine asks per request and what `plan`
reports in steady state read the same fields with the same arithmetic."""
from __future__ import annotations

import pytest

from areal_mq.engines.admission import AnswerLengths, admits, reservation_allows, steady_rows, watermark_blocks


def test_the_per_request_rule():
    base = dict(running=3, max_concurrent=4, room_blocks=10, need_blocks=5, cap=None, reserved=10**9, need_reserved=9000)
    assert admits(**base)  # no cap: a reservation beyond anything never holds a request back
    assert not admits(**{**base, "running": 4})  # no slot
    assert not admits(**{**base, "need_blocks": 11})  # the pool does not hold its prompt
    assert admits(**{**base, "need_blocks": 11, "running": 0})  # an idle engine takes its head
    assert not admits(**{**base, "cap": 65536, "reserved": 60000})  # a cap the user set
    assert reservation_allows(None, 10**9, 1) and reservation_allows(100, 50, 50) and not reservation_allows(100, 50, 51)
    assert watermark_blocks(50) == 1 and watermark_blocks(2911) == 29


def test_steady_rows_is_limited_by_slots_pool_or_cap_and_says_which():
    wide = steady_rows(max_concurrent=256, pool_tokens=1_500_000, block_size=16, prompt_tokens=256,
                       max_new_tokens=8192)
    assert wide["rows"] == 256 and wide["limited_by"] == "rollout.engine.max_concurrent" and wide["running"] == 1.0
    assert wide["row_tokens"] == pytest.approx(256 + 8192 / 3 + 8, abs=0.1)  # uniform answers, length-biased
    capped = steady_rows(max_concurrent=256, pool_tokens=1_500_000, block_size=16, prompt_tokens=256,
                         max_new_tokens=8192, cap=65536)
    assert capped["rows"] == 7 and capped["limited_by"] == "rollout.engine.max_reserved_tokens"
    short = AnswerLengths.measured([100] * 9 + [4000], "ten answers")
    assert short.live_tokens() == pytest.approx((9 * 100**2 + 4000**2) / (2 * 4900))
    tight = steady_rows(max_concurrent=256, pool_tokens=200_000, block_size=16, prompt_tokens=256,
                        max_new_tokens=8192, lengths=short)
    assert tight["limited_by"] == "the KV pool" and tight["lengths"] == "ten answers"
    assert tight["rows"] == int((200_000 // 16 - watermark_blocks(200_000 // 16)) * 16 // tight["row_tokens"])
