r"""Math answer equivalence (math-verify), the format reward and the arith reward (answer reading itself is
tested in tests/unit/test_grading.py).

Run: pytest tests/unit/rewards/test_math.py -q
"""
import pytest

from areal_mq.rewards.arith_reward import arith_reward, reference_int, repetition_reason
from areal_mq.rewards.math_rewards import format_reward, math_concise, math_equal, math_reward

EQUIVALENT = [
    (r"\boxed{\frac{1}{2}}", "0.5"),
    (r"$\frac{1}{2}$", "0.5"),
    (r"\boxed{0.5}", r"\frac{1}{2}"),
    (r"\boxed{\dfrac12}", "1/2"),
    (r"\boxed{1,000}", "1000"),
    (r"\boxed{1{,}000}", "1000"),
    (r"\boxed{1000}", "1,000"),
    ("The total is 1,000 dollars", 1000),
    (r"\boxed{42}", 42),
    (r"\boxed{-7}", "-7"),
    ("so we get 3.50", "3.5"),
    (r"\boxed{\sqrt{2}}", r"\sqrt{2}"),
    (r"\boxed{x+1}", "1+x"),
    (r"\boxed{50\%}", "0.5"),
    (r"\boxed{\pi}", r"\pi"),
    (r"The answer is \boxed{\frac{3}{4}}.", "0.75"),
    ("no box, the answer is 12", "#### 12"),
    (r"\boxed{18}", "She sells 16 - 3 - 4 = 9 eggs and makes 9 * 2 = $18.\n#### 18"),
    (r"\boxed{1234}", "#### 1,234"),
]
DIFFERENT = [
    (r"\boxed{41}", "42"),
    (r"\boxed{7}", "-7"),
    ("0.333", "1/3"),
    (r"\boxed{\frac{1}{3}}", "0.5"),
    (r"\boxed{100}", "1000"),
    ("no answer here", "5"),
    (r"\boxed{}", "5"),
    (r"\boxed{x+2}", "x+1"),
    (r"\boxed{19}", "#### 18"),
]


@pytest.mark.parametrize("prediction,reference", EQUIVALENT)
def test_equivalent_answers(prediction, reference):
    assert math_equal(prediction, reference)
    assert math_reward("", prediction, reference)["reward"] == 1.0


@pytest.mark.parametrize("prediction,reference", DIFFERENT)
def test_different_answers(prediction, reference):
    assert not math_equal(prediction, reference)
    assert math_reward("", prediction, reference)["reward"] == 0.0


def test_unparsable_reference_is_a_clear_error():
    with pytest.raises(ValueError, match="reference"):
        math_equal("1", None)
    with pytest.raises(ValueError, match="could not parse the reference"):
        math_equal("1", "")


@pytest.mark.parametrize("text,reason", [
    (r"so \boxed{5}", "ok"),
    ("5", "no_box"),
    (r"\boxed{5} \boxed{5}", "multiple_boxes"),
    (r"\boxed{}", "empty_box"),
    (r"\boxed{5", "unclosed_box"),
])
def test_format_reward(text, reason):
    out = format_reward("", text)
    assert out["format"] == reason and out["reward"] == (1.0 if reason == "ok" else 0.0)


REPEATED_BOXES = "7 + 5 = 12\n" + "The answer is \\boxed{12}.\n" * 12
ARITH = [
    (r"7 + 5 = 12, so the answer is \boxed{12}.", False, 1.0, "correct"),
    (r"\boxed{12}", False, 1.0, "correct"),
    (r"\boxed{ 12 }", False, 1.0, "correct"),
    (r"\boxed{13}", False, 0.0, "wrong"),
    ("The answer is 12.", False, 0.0, "no_box"),
    (r"\boxed{12} \boxed{12}", False, -0.5, "multiple_boxes"),
    (REPEATED_BOXES, False, -0.5, "multiple_boxes"),
    (r"\boxed{12} and then \boxed{12", False, -0.5, "unclosed_box"),
    (r"\boxed{12", False, -0.5, "unclosed_box"),
    (r"\boxed{12}", True, -0.5, "truncated"),
    (r"The answer is \boxed{12}. " + "Let me check again. " * 10, False, 0.0, "box_not_final"),
    ("I think\nI think\nI think\nI think\nso \\boxed{12}", False, -0.5, "repetition"),
    (r"\boxed{12.0}", False, 1.0, "correct"),  # the same number (grading compares values)
    (r"\boxed{12.5}", False, 0.0, "wrong"),
    (r"\boxed{x}", False, 0.0, "not_a_number"),
    (r"\boxed{N}", False, 0.0, "not_a_number"),
    (r"\boxed{}", False, 0.0, "empty_box"),
]


@pytest.mark.parametrize("completion,truncated,reward,reason", ARITH)
def test_arith_reward(completion, truncated, reward, reason):
    out = arith_reward("7 + 5 = ?", completion, 12, truncated=truncated)
    assert (out["reward"], out["reason"]) == (reward, reason)
    assert out["correct"] == (reason == "correct")


def test_arith_does_not_pay_for_degenerate_repetition_of_a_correct_box():
    """The failure a peer's GRPO run fell into: a correct box, then boxes until the length cap."""
    for text, truncated in ((REPEATED_BOXES, False), (REPEATED_BOXES, True), ("\\boxed{12}" * 50, True)):
        assert arith_reward("", text, 12, truncated=truncated)["reward"] < 0


def test_arith_rewards_are_configurable():
    out = arith_reward("", r"\boxed{12}\boxed{12}", 12, penalty=0.0)
    assert out["reward"] == 0.0
    assert arith_reward("", r"\boxed{12}", 12, truncated=True, truncated_reward=0.0)["reward"] == 0.0


def test_arith_references():
    assert reference_int("#### 1,234") == 1234
    assert reference_int(7) == 7 and reference_int("-3") == -3
    with pytest.raises(ValueError, match="integer reference"):
        reference_int("1/2")


def test_repetition_detector_leaves_normal_text_alone():
    normal = "\n".join(f"Step {i}: {i} + {i} = {2 * i}" for i in range(30))
    assert repetition_reason(normal) is None
    assert repetition_reason("abc " * 300) is not None


def test_math_concise_group_reward():
    out = math_concise("", [r"\boxed{4}", r"long reasoning ... \boxed{4}", r"\boxed{5}"], "4")
    rewards = [o["reward"] for o in out]
    assert rewards[0] == 1.0 and 0.0 < rewards[1] < 1.0 and rewards[2] == 0.0
