"""Exact tokens across turns through ChatService (areal_mq/openai/prompts.py): 300 multi-turn tool episodes, a third
each on SmolLM2's own template (no tool support: the `prompted` family), a Qwen2.5-style and a Qwen3-style template
(tests/unit/openai/fixtures, `qwen` family; Qwen3's drops earlier <think> blocks) applied to SmolLM2's tokenizer,
answered by a scripted backend whose tool calls use other JSON spacing than the template's. Every turn's trained
tokens are its generated ids in the context they were generated in (the episode audit), where a fresh render of the
history would not extend them. An edited history, another reply or other tools split the episode, recorded with the
reason.

Run: pytest tests/unit/openai/test_exact_turns.py -q   (~20 s on a busy 2-core machine, mostly loading the tokenizer)
"""
import copy
import json
import random
from pathlib import Path

import numpy as np
import pytest

from areal_mq.engines.models import load_tokenizer, resolve_model
from areal_mq.messages import GenerateResult
from areal_mq.openai.server import ChatService, ServeConfig

MODEL = "smollm2-135m-instruct"
FIXTURES = Path(__file__).parent / "fixtures"
QWEN_TEMPLATE = (FIXTURES / "qwen2_5_chat_template.jinja").read_text()
QWEN3_TEMPLATE = (FIXTURES / "qwen3_chat_template.jinja").read_text()
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


class ScriptedBackend:
    """Answers each sampling with the next scripted text as token ids (+ the end-of-turn token when `eos`), with
    per-token versions that change mid-reply (a weight update inside a generation)."""

    def __init__(self, tokenizer, rng: random.Random, eos: bool = True):
        self.tok, self.rng, self.eos, self.script = tokenizer, rng, eos, []

    def generate(self, prompt_ids, samplings, sessions, timeout_s):
        out = []
        for _ in samplings:
            text = self.script.pop(0) if self.script else self.rng.choice(REPLIES)(self.rng)
            ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
            ids += [self.tok.eos_token_id] if self.eos else []
            v = self.rng.randint(0, 5)
            versions = [v] * (len(ids) // 2) + [v + 1] * (len(ids) - len(ids) // 2)
            out.append(GenerateResult(output_ids=ids, logprobs=[-0.5] * len(ids), versions=versions,
                                      finish_reason="stop" if self.eos else "length", text=text))
        return out


def _call(rng):  # compact JSON: the Qwen template would re-render it as {"name": "add", "arguments": {"a": 1, ...}}
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return rng.choice(['<tool_call>\n{"name":"add","arguments":{"a":%d,"b":%d}}\n</tool_call>',
                       'Let me add.<tool_call>{"name": "add",  "arguments": {"b": %d, "a": %d}}</tool_call>']) % (a, b)


REPLIES = [_call, _call, lambda rng: f"<think>sum</think> The answer is {rng.randint(0, 200)}.",
           lambda rng: f"  The answer is {rng.randint(0, 200)} \n"]


@pytest.fixture(scope="module")
def tokenizers():
    smol = load_tokenizer(resolve_model(MODEL))
    qwen, qwen3 = copy.deepcopy(smol), copy.deepcopy(smol)
    qwen.chat_template, qwen3.chat_template = QWEN_TEMPLATE, QWEN3_TEMPLATE
    return {"smollm2": smol, "qwen2.5": qwen, "qwen3": qwen3}


def service(tokenizer, rng, **backend_kw):
    backend = ScriptedBackend(tokenizer, rng, **backend_kw)
    return ChatService(ServeConfig(max_context=1 << 16), MODEL, tokenizer, backend)


def run_episode(svc, episode_id, rng, turns):
    """An agent: answer every tool call with its sum, else ask a follow-up; `turns` chat calls in all."""
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 17 + 25?"}]
    for _ in range(turns):
        n = rng.choice([1, 1, 2])
        r = svc.chat({"model": MODEL, "messages": messages, "tools": TOOLS, "n": n, "max_tokens": 64}, episode_id)
        pick = r["choices"][rng.randrange(n)]
        msg = {k: v for k, v in pick["message"].items() if k in ("role", "content", "tool_calls")}
        messages.append(msg)
        if pick["finish_reason"] == "tool_calls":
            for call in msg["tool_calls"]:
                args = json.loads(call["function"]["arguments"])
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(args["a"] + args["b"])})
        else:
            messages.append({"role": "user", "content": "Check it once more."})
    return messages


@pytest.mark.parametrize("template", ["smollm2", "qwen2.5", "qwen3"])
@pytest.mark.parametrize("eos", [True, False])
def test_trained_tokens_equal_generated_tokens_for_every_turn(tokenizers, template, eos):
    tok, rng = tokenizers[template], random.Random(f"{template}{eos}")
    svc = service(tok, rng, eos=eos)
    assert svc.prompts.family.name == {"smollm2": "prompted", "qwen2.5": "qwen", "qwen3": "qwen"}[template]
    turns = exact = rerender_breaks = calls = 0
    for e in range(50):  # x 6 parameter sets = 300 episodes
        n_turns = rng.randint(3, 5)
        messages = run_episode(svc, f"ep{e}", rng, n_turns)
        ep = svc.recorder.pop(f"ep{e}")
        doc = ep.to_json()
        audit = doc["audit"]
        assert doc["single_sequence"] and audit["splits"] == [], doc["sequence_starts"]
        assert audit["turns"] == n_turns and audit["continued_turns"] == n_turns - 1
        assert audit["exact_turns"] == n_turns and audit["trained_tokens"] == audit["generated_tokens"]
        segs = ep.to_segments()
        trained = [s for s in segs if s["kind"] == "generated"]
        assert len(trained) == n_turns and all(len(set(s["versions"])) <= 2 for s in trained)
        turns += audit["turns"]
        exact += audit["exact_turns"]
        calls += sum(c["tool_calls"] for t in doc["turns"] for c in t["choices"])
        # what re-rendering the whole history would give: for most episodes no extension of the generated tokens
        last = ep.turns[-1]
        text = tok.decode(last.prompt_ids.tolist())  # every assistant message closed once, generated or not
        assert "<|im_end|><|im_end|>" not in text and text.count("<|im_start|>") == text.count("<|im_end|>") + 1
        fresh = svc.prompts._fresh(messages[:-1] if messages[-1]["role"] == "user" else messages, TOOLS)
        rerender_breaks += fresh[:len(last.prompt_ids)] != last.prompt_ids.tolist()
    assert exact == turns and turns >= 150 and calls > 20
    assert rerender_breaks > 10  # the test has teeth: naive re-rendering would have split these episodes


def test_an_edited_history_other_reply_or_other_tools_split_the_episode(tokenizers):
    tok, rng = tokenizers["qwen2.5"], random.Random(1)
    svc = service(tok, rng)
    svc.backend.script = ["The answer is 42."] * 8
    base = [{"role": "user", "content": "What is 17 + 25?"}]
    follow = [{"role": "assistant", "content": "The answer is 42."}, {"role": "user", "content": "Sure?"}]

    def call(messages, tools=TOOLS):
        return svc.chat({"model": MODEL, "messages": messages, "tools": tools, "max_tokens": 8}, "e")

    call(base)
    call(m := base + follow)  # continues
    call(m := m + [{"role": "assistant", "content": "It is 42."}, {"role": "user", "content": "Sure?"}])  # reply edited
    call(m := [{"role": "user", "content": "What is 17 + 26?"}] + m[1:] + follow)  # message 0 edited
    call(m + follow, tools=[])  # other tools
    doc = svc.episode("e", pop=False)
    assert [t["origin"] for t in doc["turns"]] == ["fresh", "continued", "split", "split", "split"]
    assert [(s["turn"], s["reason"], s["message"]) for s in doc["audit"]["splits"]] == [
        (2, "reply_not_served", 3), (3, "edited_history", 0), (4, "tools_changed", -1)]
    assert doc["sequence_starts"] == [0, 2, 3, 4] and not doc["single_sequence"]
    assert doc["audit"]["exact_turns"] == 5  # each sequence still trains exactly what was generated in it


def test_tool_choice_none_required_and_named(tokenizers):
    tok, rng = tokenizers["qwen2.5"], random.Random(2)
    svc = service(tok, rng)
    user = [{"role": "user", "content": "What is 17 + 25?"}]
    svc.backend.script = ['<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>']
    r = svc.chat({"model": MODEL, "messages": user, "tools": TOOLS, "tool_choice": "none"}, "none")
    assert r["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in r["choices"][0]["message"]
    assert "# Tools" not in tok.decode(svc.recorder.get("none").turns[0].prompt_ids.tolist())
    svc.backend.script = ['{"a": 4, "b": 5}}\n</tool_call>']
    r = svc.chat({"model": MODEL, "messages": user, "tools": TOOLS, "tool_choice":
                  {"type": "function", "function": {"name": "add"}}}, "named")
    (call,) = r["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 4, "b": 5}
    turn = svc.recorder.get("named").turns[0]
    prompt_text = tok.decode(turn.prompt_ids.tolist())
    assert prompt_text.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": ')
    assert tok.decode(turn.choices[0].output_ids.tolist()).startswith('{"a": 4')  # trained: only what was generated
    svc.backend.script = ["no call at all"]
    r = svc.chat({"model": MODEL, "messages": user, "tools": TOOLS, "tool_choice": "required"}, "req")
    (ch,) = r["choices"]
    assert ch["finish_reason"] == "stop" and ch["message"]["content"].startswith("<tool_call>")
    assert svc.recorder.get("req").turns[0].choices[0].tool_error.startswith("malformed_tool_call")


def test_qwen3_would_drop_an_earlier_think_block_and_the_continued_prompt_keeps_it(tokenizers):
    tok = tokenizers["qwen3"]
    svc = service(tok, random.Random(3))
    svc.backend.script = ["<think>17 and 25</think>\n\nIt is 42.", "Yes."]
    m = [{"role": "user", "content": "What is 17 + 25?"}]
    r = svc.chat({"model": MODEL, "messages": m}, "think")
    m += [r["choices"][0]["message"], {"role": "user", "content": "Sure?"}]
    svc.chat({"model": MODEL, "messages": m}, "think")
    continued = tok.decode(svc.recorder.get("think").turns[1].prompt_ids.tolist())
    fresh = tok.decode(svc.prompts._fresh(m, []))
    assert "<think>17 and 25</think>" in continued and "17 and 25" not in fresh
    assert svc.episode("think", pop=True)["audit"]["exact_turns"] == 2
