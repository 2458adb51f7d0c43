"""Agents for tests/unit/workflows/test_openai_agent.py, named by spec as a config names one
(`agent.workflow_args.agent: tests.unit.workflows.openai_agents:NAME`): plain `openai` client code, good and bad."""
from __future__ import annotations

import asyncio
import time

import openai

from areal_mq.workflows.calculator_agent import CALCULATOR, MODEL, calculator

NOT_AN_AGENT = 42


def raises(client, problem):
    raise ValueError("the agent's own bug")


def returns_none(client, problem):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": problem.prompt}])
    return None


def makes_no_call(client, problem):
    return "\\boxed{5}"


def sleeps(client, problem):
    time.sleep(1.5)  # past the test's episode timeout; its call afterwards is refused
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": problem.prompt}])
    return "late"


async def hangs(client, problem):
    await asyncio.sleep(3600)


async def answers_async(client: openai.AsyncOpenAI, problem):
    r = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": problem.prompt}])
    return r.choices[0].message.content


def edits_history(client, problem):
    messages = [{"role": "user", "content": problem.prompt}]
    r = client.chat.completions.create(model=MODEL, messages=messages)
    messages = [{"role": "user", "content": problem.prompt + " Think again."}, r.choices[0].message,
                {"role": "user", "content": "Sure?"}]
    return client.chat.completions.create(model=MODEL, messages=messages).choices[0].message.content


def calls_forever(client, problem):
    """Calls the tool until refused, then swallows the refusal: the episode must fail anyway."""
    messages = [{"role": "user", "content": problem.prompt}]
    try:
        for _ in range(10):
            r = client.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])
            messages.append(r.choices[0].message)
            for call in r.choices[0].message.tool_calls or []:
                result = calculator(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    except openai.BadRequestError:
        return "\\boxed{5}"
    return "never refused"


def other_episode(client, problem):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": problem.prompt}],
                                   extra_headers={"X-Episode-Id": "someone-else"})
    return "x"


def asks_two_choices(client, problem):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": problem.prompt}], n=2)
    return "x"


def streams(client, problem):
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": problem.prompt}],
                                            stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
