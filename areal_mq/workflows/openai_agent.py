r"""`openai_agent`: train an agent written with the plain `openai` client, as a workflow.

What: the operator names an agent function in the config (`agent.workflow_args.agent: "my_pkg.agents:solve"`,
resolved like agent.workflow: importable code only, never from the wire) of the form

    def solve(client: openai.OpenAI, problem) -> str           # run in a thread of its own
    async def solve(client: openai.AsyncOpenAI, problem) -> str  # run on the agent's event loop

returning its final answer text. The client's base_url is an in-process OpenAI-compatible endpoint (ChatService +
OpenAIServer, areal_mq/openai/server.py, on 127.0.0.1, a random API key), started once per agent process on first
use; it sends `X-Episode-Id` = the episode id on every call, so every chat completion is recorded for this episode
(areal_mq/openai/episodes.py) with its exact token ids, behaviour logprobs and per-token versions. The endpoint's
backend (`EpisodeBridge`) forwards each generation to the episode's own `ctx.backend` on the agent's event loop,
as the GenerateRequest `ctx.generate` would send (group_id, sample_index, min_version, session = episode id):

    agent thread: client.chat.completions.create(...) --HTTP--> handler thread: ChatService (template, tools,
        exact continuation) --> EpisodeBridge.generate --run_coroutine_threadsafe--> event loop: ctx.backend.generate
        (the job broker, or workflows/local.py's engine) --> GenerateResult --> recorded, answered as chat.completion

When the agent returns, the recorded episode becomes `ctx.episode` exactly (RecordedEpisode.to_segments: the first
prompt, generated segments with their ids/logprobs/versions, environment segments with mask 0 and version -1), and
the answer is scored with `ctx.score` under controller.reward_task.
Sampling is the run's (ctx.sampling: temperature, top_p, a per-turn seed): whatever the agent asks, the behaviour
policy is the one the trainer corrects for; the agent's `max_tokens` (default 256) is cut to what is left of
agent.max_episode_tokens, its `stop` strings are kept. agent.max_turns bounds its calls; `n` must be 1.
Failures fail the episode alone, with the reason: the agent raised or returned no text, a call it made was refused
(over max_turns or the token budget, a failed turn), its history was edited (not one sequence: the turn and the
split reason), it made no call, or (run_episode) it ran past agent.episode_timeout_s. An ended episode's endpoint
calls are refused and its turn in flight cancelled; a sync agent blocked outside the client (time.sleep) cannot be
stopped by Python and keeps its thread (at most MAX_AGENT_THREADS run at once).
ctx.info: chat_calls (the agent's chat completions: model turns; not `turns`, which the agent's episode_done log
event names already), tool_calls (calls the endpoint parsed), tool_errors (replies that opened a call that was not
valid), tool_repairs (calls read as a bare argument: `agent.workflow_args.tool_family: prompted_bare`), correct_at
(1/0), exact_turns / continued_turns (the recorder's audit).
Run: python -m areal_mq.evaluation.episodes --config configs/tools-arith.yaml --workflow openai_agent --n 20
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from areal_mq.errors import ConfigError
from areal_mq.openai.api import ApiError, ApiLimits
from areal_mq.openai.episodes import EpisodeRecorder, NotOneSequence, RecordedEpisode, RecorderLimits
from areal_mq.openai.server import ChatService, OpenAIServer, ServeConfig
from areal_mq.messages import GenerateRequest, GenerateResult
from areal_mq.workflows.context import WorkflowError
from areal_mq.workflows.episode import Episode

MODEL = "policy"  # the one model the in-process endpoint serves: the policy being trained
MAX_AGENT_THREADS = 1024  # sync agents running at once (threads start on demand; a hung one keeps its thread)
MAX_EPISODES = 8192  # episodes recorded at once (agent.max_episodes is at most 4096; evaluations run n at once)
TURN_WAIT_S = 24 * 3600.0  # no deadline of its own: agent.episode_timeout_s ends a turn (an evaluation queues all
# its episodes at once, so a late one waits for the engine; the endpoint's default 300 s failed most of 100)


class AgentFailed(WorkflowError):
    """The agent function raised, returned no text, or its calls were refused: the episode fails with why."""


def load_agent(spec: Any) -> Callable:
    """The agent function `spec` ('package.module:function') names: the operator's config, never the wire."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError("openai_agent needs agent.workflow_args.agent: 'module:function' naming "
                          "`def solve(client: openai.OpenAI, problem) -> str`, e.g. "
                          "areal_mq.workflows.calculator_agent:solve")
    from areal_mq.workflows.specs import import_function

    fn = import_function(spec, f"agent.workflow_args.agent {spec!r}", "'module:function', e.g. my_pkg.agents:solve")
    if not callable(fn):
        raise ConfigError(f"agent {spec!r} is a {type(fn).__name__}, not a function `solve(client, problem)`")
    return fn


def require_openai() -> Any:
    try:
        import openai
    except ImportError:
        raise ConfigError("the openai_agent workflow runs agents written with the openai client: "
                          "pip install openai (or areal-mq[test])") from None
    return openai


@dataclass
class EpisodeLink:
    """What the endpoint's handler threads need of one running episode (guarded by the bridge's lock)."""

    ctx: Any
    loop: asyncio.AbstractEventLoop
    turns: int = 0
    first_prompt: int = 0  # tokens of the first turn's prompt (the budget counts what follows it)
    error: str = ""  # why the episode must fail although the agent may have caught the refusal
    closed: bool = False
    in_flight: set = field(default_factory=set)  # concurrent futures of turns running on the loop


class EpisodeBridge:
    """The ChatService backend: `generate(prompt_ids, samplings, sessions, timeout_s)` from handler threads runs
    the turn through the episode's own ctx.backend on its event loop. Episodes are open between `open` and
    `close`; a call for any other episode id is refused."""

    def __init__(self) -> None:
        self._links: dict[str, EpisodeLink] = {}
        self._lock = threading.Lock()

    def open(self, ctx: Any, loop: asyncio.AbstractEventLoop) -> None:
        with self._lock:
            if ctx.episode_id in self._links:
                raise WorkflowError(f"episode {ctx.episode_id} is already running in this agent")
            self._links[ctx.episode_id] = EpisodeLink(ctx, loop)

    def close(self, episode_id: str) -> EpisodeLink:
        """End the episode: later calls are refused, a turn still running is cancelled (its job forgotten)."""
        with self._lock:
            link = self._links.pop(episode_id)
            link.closed = True
            running = list(link.in_flight)
        for fut in running:
            fut.cancel()
        return link

    def error(self, episode_id: str) -> str:
        """Why a call of the running episode was refused or failed ("" when none was)."""
        with self._lock:
            link = self._links.get(episode_id)
            return link.error if link is not None else ""

    def open_episodes(self) -> int:
        with self._lock:
            return len(self._links)

    def generate(self, prompt_ids: list[int], samplings: list, sessions: list[str],
                 timeout_s: float) -> list[GenerateResult]:
        if len(samplings) != 1:
            raise ApiError(400, "n must be 1 in a training episode (one answer per turn)", "n", "unsupported_value")
        link, request = self._request(prompt_ids, samplings[0], sessions[0])
        fut = asyncio.run_coroutine_threadsafe(link.ctx.backend.generate(request), link.loop)
        with self._lock:
            if link.closed:
                fut.cancel()
            link.in_flight.add(fut)
        try:
            return [fut.result(timeout_s)]
        except concurrent.futures.CancelledError:
            raise ApiError(409, f"episode {link.ctx.episode_id} has ended", None, "episode_ended") from None
        except concurrent.futures.TimeoutError:
            fut.cancel()
            self._fail(link, f"turn {link.turns} got no answer within {timeout_s:g} s")
            raise ApiError(504, "no answer in time", None, "timeout", "server_error") from None
        except Exception as exc:  # the job failed (broker error, engine refusal): the episode fails with it
            why = self._fail(link, f"turn {link.turns} failed: {type(exc).__name__}: {str(exc)[:300]}")
            raise ApiError(502, why, None, "turn_failed", "server_error") from None
        finally:
            with self._lock:
                link.in_flight.discard(fut)

    def stream(self, prompt_ids: list[int], sampling: Any, session: str, timeout_s: float) -> Any:
        """stream: true gets the whole answer as its one event (as from an engine that sends no partials)."""
        return iter(self.generate(prompt_ids, [sampling], [session], timeout_s))

    def _request(self, prompt_ids: list[int], spec: Any, session: str) -> tuple[EpisodeLink, GenerateRequest]:
        """The turn's GenerateRequest with the run's sampling, after the episode's bounds (under the lock)."""
        with self._lock:
            link = self._links.get(session)
            if link is None or link.closed:
                raise ApiError(409, f"no running episode {session[:128]!r}: send the X-Episode-Id the client "
                               "was made with", None, "episode_ended")
            ctx = link.ctx
            if link.turns >= ctx.max_turns:
                raise self._refuse(link, f"the agent's call {link.turns + 1} exceeds agent.max_turns ({ctx.max_turns})")
            if link.turns == 0:
                link.first_prompt = len(prompt_ids)
            room = ctx.max_tokens - (len(prompt_ids) - link.first_prompt)
            if room <= 0:
                raise self._refuse(link, f"episode {ctx.episode_id} has no token budget left "
                                   f"(agent.max_episode_tokens {ctx.max_tokens})")
            sampling = ctx.sampling.model_copy(update={"stop_strings": list(spec.stop_strings),
                                                       "max_new_tokens": min(spec.max_new_tokens, room)})
            if sampling.seed is not None:
                sampling.seed = (sampling.seed + 7919 * link.turns) & 0x7FFFFFFF  # as ctx.generate: one per turn
            link.turns += 1
        return link, GenerateRequest(prompt_ids=np.asarray(prompt_ids, np.int32), sampling=sampling,
                                     group_id=ctx.group_id, sample_index=ctx.sample_index,
                                     min_version=ctx.min_version, session=session)

    def _refuse(self, link: EpisodeLink, why: str) -> ApiError:
        link.error = link.error or why
        return ApiError(400, why, None, "episode_limit")

    def _fail(self, link: EpisodeLink, why: str) -> str:
        with self._lock:
            link.error = link.error or why
        return why


class AgentServer(OpenAIServer):
    """The endpoint's HTTP server with a listen backlog for every episode's client connecting at once (an
    evaluation starts n together; the default backlog of 5 drops connections on a busy machine: a first 100-episode
    evaluation here lost some to `APIConnectionError`)."""

    request_queue_size = 1024


class AgentEndpoint:
    """The endpoint an agent process's clients talk to: ChatService + OpenAIServer on 127.0.0.1 (a free port, a
    random API key), its backend the EpisodeBridge, and the thread pool sync agents run in. `close()` stops it."""

    def __init__(self, tokenizer: Any, tool_family: str = "auto"):
        self.api_key = secrets.token_hex(16)
        self.bridge = EpisodeBridge()
        cfg = ServeConfig(host="127.0.0.1", port=0, api_key=self.api_key, max_connections=MAX_EPISODES,
                          read_timeout_s=300.0, request_timeout_s=TURN_WAIT_S, api=ApiLimits(max_tokens=4096),
                          episodes=RecorderLimits(max_episodes=MAX_EPISODES, ttl_s=24 * 3600.0),
                          tool_family=tool_family)
        self.service = ChatService(cfg, MODEL, tokenizer, self.bridge, EpisodeRecorder(cfg.episodes))
        self.server = AgentServer(self.service)
        self.threads = concurrent.futures.ThreadPoolExecutor(MAX_AGENT_THREADS, thread_name_prefix="openai-agent")
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="openai-agent-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def recorder(self) -> EpisodeRecorder:
        return self.service.recorder

    def client_kwargs(self, episode_id: str) -> dict:
        """What the episode's client is made with: this endpoint, its key, the episode id on every call, no
        retries (a retried call would be a second turn)."""
        return {"base_url": self.url, "api_key": self.api_key, "default_headers": {"X-Episode-Id": episode_id},
                "max_retries": 0, "timeout": self.service.cfg.request_timeout_s + 30}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)
        self.threads.shutdown(wait=False, cancel_futures=True)


class AgentEndpoints:
    """One endpoint per tokenizer and tool family in this process, started on first use (an agent process has one
    tokenizer and one agent.workflow_args)."""

    def __init__(self) -> None:
        self._endpoints: dict[tuple[int, str], tuple[Any, AgentEndpoint]] = {}
        self._lock = threading.Lock()

    def get(self, tokenizer: Any, tool_family: str = "auto") -> AgentEndpoint:
        key = (id(tokenizer), tool_family)
        with self._lock:
            if key not in self._endpoints:  # the tokenizer is kept: its id stays its own
                self._endpoints[key] = (tokenizer, AgentEndpoint(tokenizer, tool_family))
            return self._endpoints[key][1]

    def close(self) -> None:
        with self._lock:
            endpoints, self._endpoints = list(self._endpoints.values()), {}
        for _, endpoint in endpoints:
            endpoint.close()


PROCESS_ENDPOINTS = AgentEndpoints()  # the agent process's endpoint: a workflow is a function, so it lives here


async def openai_agent(ctx: Any, problem: Any) -> float:
    """The built-in (areal_mq/workflows/builtin.py): the configured agent on this process's endpoint."""
    return await run_agent(ctx, problem, PROCESS_ENDPOINTS.get(ctx.tokenizer, tool_family(ctx.args)))


def tool_family(args: dict) -> str:
    """agent.workflow_args.tool_family: how the endpoint offers tools and reads calls (areal_mq/openai/toolcalls.py;
    default auto, from the chat template)."""
    from areal_mq.openai.toolcalls import FAMILIES

    name = args.get("tool_family", "auto")
    if name != "auto" and name not in FAMILIES:
        raise ConfigError(f"agent.workflow_args.tool_family {name!r}: one of auto, {', '.join(FAMILIES)}")
    return name


async def run_agent(ctx: Any, problem: Any, endpoint: AgentEndpoint) -> float:
    """Run the agent `ctx.args["agent"]` names for one episode on `endpoint`; its trace, reward and info."""
    spec = ctx.args.get("agent")
    agent = load_agent(spec)
    openai = require_openai()
    endpoint.recorder.pop(ctx.episode_id)  # a turn left from an earlier try of this episode id
    endpoint.bridge.open(ctx, asyncio.get_running_loop())
    try:
        answer = await _call(agent, spec, openai, endpoint, ctx.episode_id, problem)
    except Exception as exc:
        raise AgentFailed(endpoint.bridge.error(ctx.episode_id) or
                          f"the agent {spec} raised {type(exc).__name__}: {str(exc)[:300]}") from exc
    finally:
        link = endpoint.bridge.close(ctx.episode_id)
        recorded = endpoint.recorder.pop(ctx.episode_id)
    if link.error:
        raise AgentFailed(f"the agent {spec}: {link.error}")
    if not isinstance(answer, str):
        raise AgentFailed(f"the agent {spec} returned {type(answer).__name__}, not its answer text (str)")
    fill_trace(ctx, recorded)
    last = recorded.turns[-1].choices[0]
    verdict = await ctx.score(answer, truncated=last.finish_reason == "length")
    audit = recorded.to_json()["audit"]
    ctx.info.update(chat_calls=len(recorded.turns), correct_at=1 if verdict.correct else 0,
                    tool_calls=sum(t.choices[0].tool_calls for t in recorded.turns),
                    tool_errors=sum(bool(t.choices[0].tool_error) for t in recorded.turns),
                    tool_repairs=sum(t.choices[0].tool_repairs for t in recorded.turns),
                    exact_turns=audit["exact_turns"], continued_turns=audit["continued_turns"])
    return verdict.reward


async def _call(agent: Callable, spec: str, openai: Any, endpoint: AgentEndpoint, episode_id: str,
                problem: Any) -> Any:
    kwargs = endpoint.client_kwargs(episode_id)
    if inspect.iscoroutinefunction(agent):
        async with openai.AsyncOpenAI(**kwargs) as client:
            return await agent(client, problem)

    def in_thread() -> Any:
        with openai.OpenAI(**kwargs) as client:
            return agent(client, problem)

    return await asyncio.get_running_loop().run_in_executor(endpoint.threads, in_thread)


def fill_trace(ctx: Any, recorded: RecordedEpisode | None) -> None:
    """ctx.episode from the recorded turns, token for token; AgentFailed when they are not one trainable sequence."""
    if recorded is None or not recorded.turns:
        raise AgentFailed("the agent made no chat completion through the client it was given")
    if recorded.dropped_turns:
        raise AgentFailed(f"{recorded.dropped_turns} of the agent's turns were not recorded (the endpoint's "
                          "episode limits): the episode cannot be trained whole")
    try:
        segments = recorded.to_segments()
    except NotOneSequence as exc:
        splits = [f"turn {k}: {t.split_reason} (message {t.edit_at})" for k, t in enumerate(recorded.turns)
                  if t.origin == "split"]
        raise AgentFailed(f"not one sequence, {'; '.join(splits) or 'prompts do not extend'}: {exc}. Send each "
                          "call the history as served (append to it, never edit it)") from None
    trace = Episode(segments[0]["tokens"], max_tokens=ctx.max_tokens)
    for seg in segments[1:]:
        if seg["kind"] == "generated":
            trace.add_generated(seg["tokens"], seg["logprobs"], seg["versions"])
        else:
            trace.add_env(seg["tokens"])
    ctx.episode = trace
    ctx.finish_reason = recorded.turns[-1].choices[0].finish_reason
