"""Chat formatting with the real SmolLM2 tokenizer (from the tiny-random-llama build, which ships it)."""
from __future__ import annotations

import pytest

from areal_mq.data.loaders import Problem
from areal_mq.data.prompts import ChatFormatter
from areal_mq.errors import ConfigError


@pytest.fixture(scope="module")
def tokenizer():
    from areal_mq.engines.models import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("tiny-random-llama"))


PROBLEM = Problem(id="p", prompt="What is 2 + 3?\nPut your final answer in \\boxed{}.", answer="5")


def test_default_system_prompt_is_the_tokenizers(tokenizer):
    text = ChatFormatter(tokenizer).text(PROBLEM)
    assert text.startswith("<|im_start|>system\n") and "SmolLM" in text
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?\nPut your final answer in \\boxed{}.<|im_end|>\n"
                         "<|im_start|>assistant\n")


def test_custom_system_prompt_and_ids(tokenizer):
    fmt = ChatFormatter(tokenizer, system_prompt="Be brief.")
    assert fmt.messages(PROBLEM)[0] == {"role": "system", "content": "Be brief."}
    assert "<|im_start|>system\nBe brief.<|im_end|>" in fmt.text(PROBLEM)
    ids = fmt.ids(PROBLEM)
    assert tokenizer.decode(ids) == fmt.text(PROBLEM)  # no extra BOS/EOS added
    assert len(ids) < 100  # arith prompts stay short


def test_tokenizer_without_chat_template_is_rejected():
    class Plain:
        chat_template = None

    with pytest.raises(ConfigError, match="no chat template"):
        ChatFormatter(Plain())


def test_worked_examples_are_earlier_chat_turns_in_order(tokenizer):
    from areal_mq.data.config import DataConfig

    cfg = DataConfig(examples=[{"user": "What is 2 + 30?", "assistant": "2 + 30 = 32. The answer is \\boxed{32}."},
                               {"user": "What is 9 * 11?", "assistant": "The answer is \\boxed{99}."}])
    fmt = ChatFormatter(tokenizer, None, cfg.examples)
    roles = [t["role"] for t in fmt.messages(PROBLEM)]
    assert roles == ["user", "assistant", "user", "assistant", "user"]
    text = fmt.text(PROBLEM)
    # the examples come before the problem, the assistant answers are complete turns, generation opens after
    assert text.index("What is 2 + 30?") < text.index("\\boxed{32}.<|im_end|>") < text.index("What is 9 * 11?")
    assert text.index("\\boxed{99}.<|im_end|>") < text.index(PROBLEM.prompt)
    assert text.endswith(PROBLEM.prompt + "<|im_end|>\n<|im_start|>assistant\n")


def test_bad_examples_are_refused_with_the_field_named():
    from pydantic import ValidationError

    from areal_mq.data.config import DataConfig

    with pytest.raises(ValidationError, match="examples.0.assistant"):
        DataConfig(examples=[{"user": "What is 2 + 30?"}])
    with pytest.raises(ValidationError, match="examples.0.answer"):
        DataConfig(examples=[{"user": "q", "assistant": "a", "answer": "32"}])
    with pytest.raises(ConfigError, match="chat example"):
        ChatFormatter(type("T", (), {"chat_template": "x"})(), None, [("only one",)])
