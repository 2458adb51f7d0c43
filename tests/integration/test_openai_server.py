"""`areal-mq serve-openai` end to end: the official openai client against the real endpoint, backed by a real job
broker and a real rollout worker (tiny random Llama, real SmolLM2 tokenizer), CURVE keys on (the server speaks
with the run's agent key). Episodes recorded via header and via `user`; the broker stopped -> 503, restarted ->
served again. An episode's second turn reaches its session's worker (the broker's sticky_hits grows).

Run: pytest tests/integration/test_openai_server.py -q   (~60 s: process starts dominate)
"""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import pytest

from areal_mq.client import JobClient
from areal_mq.config import load_config

from .conftest import broker_up, wait_for, worker_count
from .procs import Procs, keys, write_config

openai = pytest.importorskip("openai")  # the [test] extra has it; an image without it (the GPU machine) skips these

pytestmark = pytest.mark.slow
MODEL = "tiny-random-llama"
URL = re.compile(r"serve-openai: (http://127\.0\.0\.1:\d+/v1)")


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("openai")
    path = write_config(tmp, {"model": {"name": MODEL}, "rollout": {"engine": {"max_concurrent": 4}},
                              "launcher": {"threads": {"rollout": 1}}}, name="tiny.yaml")
    cfg = load_config(path)
    procs = Procs(tmp)
    try:
        procs.start(["broker", "--config", str(path)], "broker")
        broker_up(cfg)
        procs.start(["worker", "rollout", "--config", str(path), "--worker-id", "rollout-0"], "rollout0")
        server = procs.start(["serve-openai", "--config", str(path), "--port", "0", "--timeout", "60"], "openai")
        wait_for(lambda: worker_count(cfg, "generate") == 1, 120, interval=0.5, what="rollout worker")
        url = wait_for(lambda: (m := URL.search(procs.log(server))) and m.group(1), 60, interval=0.2,
                       what="serve-openai address")
        yield {"url": url, "procs": procs, "cfg": cfg, "path": path}
    finally:
        procs.stop_all()


def client(system):
    return openai.OpenAI(base_url=system["url"], api_key="unused", max_retries=0, timeout=60)


def episode(system, episode_id, method="GET"):
    req = urllib.request.Request(f"{system['url']}/episodes/{episode_id}", method=method)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_models_and_a_chat_completion_with_logprobs_and_two_choices(system):
    c = client(system)
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                  max_tokens=6, n=2, logprobs=True, seed=3, temperature=1.0)
    assert r.object == "chat.completion" and r.model == MODEL and len(r.choices) == 2
    for i, choice in enumerate(r.choices):
        assert choice.index == i and choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
        tokens = choice.logprobs.content
        assert 1 <= len(tokens) <= 6 and all(t.logprob <= 0.0 for t in tokens)
    assert r.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in r.choices)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens and r.usage.prompt_tokens > 5


def _two_turns(system, **episode_kw):
    c = client(system)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    for _ in range(2):
        r = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0, **episode_kw)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "That is wrong, try again."}]


def _broker_counters(system) -> dict:
    client = JobClient(system["cfg"].brokers.job_addr, keys=keys(system["cfg"]))
    try:
        return client.stats(10)["counters"]
    finally:
        client.close()


@pytest.mark.parametrize("how", ["header", "user"])
def test_turns_are_recorded_per_episode_and_popped(system, how):
    episode_id = f"ep-{how}"
    kw = {"extra_headers": {"X-Episode-Id": episode_id}} if how == "header" else {"user": episode_id}
    hits = _broker_counters(system).get("sticky_hits", 0)
    _two_turns(system, **kw)
    assert _broker_counters(system)["sticky_hits"] > hits  # the second turn went to the session's worker
    ep = episode(system, episode_id)
    assert ep["episode_id"] == episode_id and len(ep["turns"]) == 2 and ep["dropped_turns"] == 0
    first, second = ep["turns"]
    assert second["prompt_ids"][:len(first["prompt_ids"])] == first["prompt_ids"]
    # the second prompt continues the generated ids, never a re-tokenization of the text (random model: often differs)
    assert second["origin"] == "continued" and ep["single_sequence"]
    assert second["prompt_ids"][:len(first["prompt_ids"]) + len(first["choices"][0]["output_ids"])] == \
        first["prompt_ids"] + first["choices"][0]["output_ids"]
    assert ep["audit"]["exact_turns"] == 2 and ep["audit"]["trained_tokens"] == ep["audit"]["generated_tokens"]
    for t in ep["turns"]:
        (ch,) = t["choices"]
        assert len(ch["output_ids"]) == len(ch["logprobs"]) == len(ch["versions"]) >= 1
        assert set(ch["versions"]) == {0} and ch["finish_reason"] in ("stop", "length")
    popped = episode(system, episode_id, "DELETE")
    assert popped["turns"] == ep["turns"]
    with pytest.raises(urllib.error.HTTPError) as info:
        episode(system, episode_id)
    assert info.value.code == 404 and json.loads(info.value.read())["error"]["code"] == "episode_not_found"


def test_a_tools_agent_against_the_real_engine_trains_exactly_what_was_generated(system):
    """tools= with a named tool_choice on the real worker: the forced call opening is prompt, the random model's
    arguments mostly malformed (text + reason recorded) or parsed; three turns, one exact sequence either way."""
    c = client(system)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    for _ in range(3):
        r = c.chat.completions.create(model=MODEL, messages=messages, tools=tools, max_tokens=8, temperature=1.0,
                                      tool_choice={"type": "function", "function": {"name": "add"}}, user="tools-1")
        msg = r.choices[0].message
        messages.append(msg)
        if msg.tool_calls:
            messages += [{"role": "tool", "tool_call_id": t.id, "content": "5"} for t in msg.tool_calls]
        else:
            messages.append({"role": "user", "content": "Call the tool."})
    ep = episode(system, "tools-1", "DELETE")
    assert [t["origin"] for t in ep["turns"]] == ["fresh", "continued", "continued"] and ep["single_sequence"]
    assert ep["audit"]["exact_turns"] == 3 and ep["audit"]["trained_tokens"] == ep["audit"]["generated_tokens"]
    for t in ep["turns"]:
        (ch,) = t["choices"]
        assert ch["tool_calls"] > 0 or ch["tool_error"].startswith("malformed_tool_call")


def test_a_streamed_answer_is_the_plain_answer_from_the_workers_partials(system):
    """stream=True on the real worker: the broker forwards its generate_partials (counter `partials`), the chunks
    join into the answer the same greedy request gets without stream, and both episode records are the same."""
    c = client(system)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=24, temperature=0)
    plain = c.chat.completions.create(**kw, user="plain-1")
    before = _broker_counters(system).get("partials", 0)
    events = list(c.chat.completions.create(**kw, user="stream-1", stream=True,
                                            stream_options={"include_usage": True}))
    assert _broker_counters(system)["partials"] > before
    assert events[0].choices[0].delta.role == "assistant" and events[-1].usage is not None
    text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    assert text == plain.choices[0].message.content
    assert events[-2].choices[0].finish_reason == plain.choices[0].finish_reason
    a, b = episode(system, "plain-1", "DELETE"), episode(system, "stream-1", "DELETE")
    assert [t["choices"] for t in a["turns"]] == [t["choices"] for t in b["turns"]]
    assert [t["prompt_ids"] for t in a["turns"]] == [t["prompt_ids"] for t in b["turns"]]


def test_errors_reach_the_client_as_openai_errors(system):
    c = client(system)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=10 ** 6)


def test_broker_down_is_503_and_a_restarted_broker_serves_again(system):
    procs, cfg = system["procs"], system["cfg"]
    broker = next(p for p, log in procs.procs if log.name == "broker.log")
    procs.stop(broker)
    c = client(system)

    def refused():
        try:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        except openai.InternalServerError as exc:
            return exc.status_code == 503 and "not answering" in str(exc)
        return False

    wait_for(refused, 30, interval=0.5, what="503 while the broker is down")
    procs.start(["broker", "--config", str(system["path"])], "broker2")
    broker_up(cfg)
    wait_for(lambda: worker_count(cfg, "generate") == 1, 60, interval=0.5, what="rollout worker back")

    def served():
        try:
            return c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
        except openai.APIStatusError:
            return None

    assert wait_for(served, 60, interval=0.5, what="an answer after the restart").choices[0].message is not None
