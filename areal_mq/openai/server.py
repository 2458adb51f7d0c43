"""`areal-mq serve-openai`: an OpenAI-compatible chat endpoint backed by the job broker.

What: `POST /v1/chat/completions` renders the messages with the model's own chat template (the tokenizer
the rollout workers use; a later turn of an episode continues the tokens already served instead: prompts.py;
tools per model family: toolcalls.py), submits one GenerateRequest per choice to the job broker (service "generate",
this process speaks with the "agent" key), and answers in the OpenAI format (api.py); `stream: true` as
server-sent chunk events fed by the rollout worker's partial outputs (streaming.py). Every answer
is recorded for its episode (`X-Episode-Id` header or `user`; episodes.py) and can be read with
`GET /v1/episodes/{id}` or popped with `DELETE /v1/episodes/{id}`. `GET /v1/models` lists the one model.
Why: an agent written against any OpenAI client library becomes an RL workflow, with exact token ids,
behaviour logprobs and per-token versions for training.
How: `areal-mq serve-openai --config configs/quickstart.yaml --port 8000` (brokers and rollout workers
running), then `OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x")`. docs/openai.md has the limits.

Threads: stdlib ThreadingHTTPServer (a bounded number of connections, each with a read timeout) hands
requests to `OpenAIBackend`, the one thread that owns the JobClient (a ZeroMQ socket belongs to one thread).
"""
from __future__ import annotations

import functools
import hmac
import json
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import numpy as np

from areal_mq.openai.api import (ApiError, ApiLimits, ChatCall, assistant_message, chat_response, chunk,
                                 models_response, parse_chat, usage)
from areal_mq.openai.backend import OpenAIBackend
from areal_mq.openai.episodes import Choice, EpisodeRecorder, RecorderLimits, RecordedTurn, Served
from areal_mq.openai.prompts import Prompt, PromptBuilder, message_key, tools_key
from areal_mq.openai.streaming import TextStream, chunks
from areal_mq.openai.toolcalls import FAMILIES, ToolFamily, family_for, parse_reply
from areal_mq.security import RateLimited

EPISODE_PATH = re.compile(r"^/v1/episodes/([A-Za-z0-9_.:@-]{1,128})$")


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str = ""  # "" = no Authorization check (refused off loopback)
    max_body_bytes: int = 1 << 20
    max_connections: int = 128
    read_timeout_s: float = 30.0  # per socket read: a client that trickles its request is cut off
    request_timeout_s: float = 300.0  # generation deadline of one call
    max_context: int = 2048  # prompt + max_tokens, tokens
    tool_family: str = "auto"  # how tools are offered and calls parsed: auto (from the template) or a FAMILIES name
    api: ApiLimits = field(default_factory=ApiLimits)
    episodes: RecorderLimits = field(default_factory=RecorderLimits)


class ChatService:
    """The endpoint's logic without HTTP: tokenizer + backend + recorder. Handler threads share one."""

    def __init__(self, cfg: ServeConfig, model: str, tokenizer: Any, backend: OpenAIBackend | None,
                 recorder: EpisodeRecorder | None = None, log: Any = None):
        self.cfg, self.model, self.tokenizer, self.backend, self.log = cfg, model, tokenizer, backend, log
        self.recorder = recorder or EpisodeRecorder(cfg.episodes)
        self.created = int(time.time())
        self._tok_lock = threading.Lock()  # HF fast tokenizers are not safe to share between threads
        self._limited = RateLimited(log) if log is not None else None  # a client may hit a limit on every call
        family = family_for(getattr(tokenizer, "chat_template", None), cfg.tool_family)
        self.prompts = PromptBuilder(tokenizer, family, self._tok_lock)

    def decode(self, ids: list[int]) -> str:
        with self._tok_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=False)

    def decode_text(self, ids: list[int]) -> str:
        """As the engines decode an answer's text (special tokens skipped): what a streamed delta is cut from."""
        with self._tok_lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat(self, body: Any, episode_header: str | None) -> dict | Iterator[dict]:
        """The chat.completion object, or for `stream: true` an iterator of chat.completion.chunk objects (every
        check that can fail before generation has passed by then)."""
        call = parse_chat(body, self.cfg.api, self.model, episode_header)
        built = self.prompts.build(call, self.recorder.served(call.episode_id) if call.episode_id else None)
        prompt = built.ids
        want = len(prompt) + call.samplings[0].max_new_tokens
        if want > self.cfg.max_context:
            raise ApiError(400, f"prompt ({len(prompt)} tokens) + max_tokens ({call.samplings[0].max_new_tokens}) "
                           f"= {want} exceeds the context of {self.cfg.max_context} tokens", "messages",
                           "context_length_exceeded")
        if self.backend is None:
            raise ApiError(503, "no job broker configured", None, "broker_unavailable", "server_error")
        # the first choice carries the episode as its session (sticky routing, KV reuse); the others none, so
        # they do not replace the KV the next turn most likely continues
        sessions = [call.episode_id] + [""] * (len(call.samplings) - 1)
        family = self.prompts.family if call.tools and call.tool_choice != "none" else FAMILIES["none"]
        if call.stream:
            return self._stream(call, built, family)
        results = self.backend.generate(prompt, call.samplings, sessions, self.cfg.request_timeout_s)
        parsed = [parse_reply(family, built.forced + r.text, call.tools) for r in results]
        messages = [assistant_message(p.content, p.tool_calls) for p in parsed]
        if call.episode_id:
            self._record(call, built, results, parsed, messages)
        return chat_response(self.model, len(prompt), results, call.logprobs, self.decode, messages)

    def _stream(self, call: ChatCall, built: Prompt, family: ToolFamily) -> Iterator[dict]:
        """One streamed choice (streaming.py): deltas from the worker's partials, the end from its result, which is
        parsed and recorded exactly as without stream."""
        events = self.backend.stream(built.ids, call.samplings[0], call.episode_id, self.cfg.request_timeout_s)
        tools = family.name != "none"
        text = TextStream(self.decode_text, call.samplings[0].stop_strings, family.call_marker,
                          hold_all=tools and (bool(built.forced) or family.call_marker is None))

        def finish(result: Any) -> tuple[Any, dict]:
            parsed = parse_reply(family, built.forced + result.text, call.tools)
            message = assistant_message(parsed.content, parsed.tool_calls)
            if call.episode_id:
                self._record(call, built, [result], [parsed], [message])
            return parsed, message

        def diverged() -> None:
            if self._limited:
                self._limited.warning("openai.stream_diverged", "stream_diverged", episode=call.episode_id)

        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        make = functools.partial(chunk, cid, self.model, created)
        return chunks(make, events, text, finish, len(built.ids), call.include_usage, usage, diverged)

    def _record(self, call: ChatCall, built: Prompt, results: list, parsed: list, messages: list[dict]) -> None:
        """The turn (tokens exactly as generated, whatever the parser made of them) and what was served."""
        ids = np.asarray(built.ids, dtype=np.int32)
        turn = RecordedTurn(ids, [Choice(r.output_ids, r.logprobs, r.versions, r.finish_reason, len(p.tool_calls),
                                         p.error, p.repaired) for r, p in zip(results, parsed)],
                            origin=built.origin, split_reason=built.split_reason, edit_at=built.edit_at)
        served = Served([message_key(m) for m in call.messages], tools_key(call.tools), ids,
                        [(message_key(m), np.asarray(r.output_ids, dtype=np.int32)) for m, r in zip(messages, results)])
        if self.recorder.record(call.episode_id, turn, served) < 0 and self._limited:  # one key: bounded log state
            self._limited.warning("openai.turn_not_recorded", "turn_not_recorded", episode=call.episode_id,
                                  reason="episode turn or token limit")

    def episode(self, episode_id: str, pop: bool) -> dict:
        ep = self.recorder.pop(episode_id) if pop else self.recorder.get(episode_id)
        if ep is None:
            raise ApiError(404, f"no episode {episode_id!r} (never recorded, popped, expired or evicted)",
                           None, "episode_not_found")
        return ep.to_json()


DRAIN_MAX_BYTES, DRAIN_MAX_S = 16 << 20, 5.0  # what is read of a refused (413) body before the connection closes


class Handler(BaseHTTPRequestHandler):
    """One HTTP connection. Every path answers JSON; nothing raised reaches the client as a trace."""

    protocol_version = "HTTP/1.1"  # keep-alive for client connection pools; every answer has a Content-Length
    server_version = "areal-mq"
    service: ChatService  # set on the subclass the server makes
    refused_body = 0  # bytes of a body answered 413 unread, dropped after the answer (_drain_refused_body)

    def log_message(self, *args: Any) -> None:
        pass  # structured events instead (openai.request)

    def setup(self) -> None:
        self.timeout = self.service.cfg.read_timeout_s
        super().setup()

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        t0 = time.monotonic()
        status = 500
        try:
            self._authorize()
            status, doc = 200, self._route(method, self.path.split("?", 1)[0])
            if not isinstance(doc, dict):  # stream: true: the headers go now, the chunks as they come
                self._reply_stream(doc)
                doc = None
        except ApiError as exc:
            status, doc = exc.status, exc.body()
        except Exception as exc:  # noqa: BLE001 - a bug must not kill the server or leak a trace
            if self.service.log:
                self.service.log.exception("openai.internal_error", error=repr(exc)[:300])
            doc = ApiError(500, "internal error (logged by the server)", None, "internal_error", "server_error").body()
        if doc is not None:
            self._reply(status, doc)
        self._drain_refused_body()
        if self.service.log:
            self.service.log.debug("openai.request", method=method, path=self.path[:100], status=status,
                                   seconds=round(time.monotonic() - t0, 3))

    def _authorize(self) -> None:
        key = self.service.cfg.api_key
        if key and not hmac.compare_digest(self.headers.get("Authorization", "").encode(), f"Bearer {key}".encode()):
            self.close_connection = True
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", None, "invalid_api_key")

    def _route(self, method: str, path: str) -> dict:
        if method == "POST" and path == "/v1/chat/completions":
            return self.service.chat(self._json_body(), self.headers.get("X-Episode-Id"))
        if method == "GET" and path == "/v1/models":
            return models_response(self.service.model, self.service.created)
        if (m := EPISODE_PATH.match(path)) and method in ("GET", "DELETE"):
            return self.service.episode(m.group(1), pop=method == "DELETE")
        self.close_connection = method == "POST"  # an unread body would be taken for the next request
        raise ApiError(404, f"no route {method} {path[:100]}", None, "not_found")

    def _json_body(self) -> Any:
        limit = self.service.cfg.max_body_bytes
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") or length is None or not length.isdigit():
            self.close_connection = True
            raise ApiError(411, "send the body with a Content-Length (chunked bodies are not accepted)")
        if int(length) > limit:
            self.close_connection = True
            self.refused_body = int(length)
            raise ApiError(413, f"request body of {length} bytes exceeds {limit} bytes", None, "request_too_large")
        try:
            return json.loads(self.rfile.read(int(length)))
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError; nesting bombs recurse
            raise ApiError(400, f"the body is not valid JSON: {str(exc)[:200]}", None, "invalid_json") from None

    def _drain_refused_body(self) -> None:
        """Read and drop the body of a 413 before the connection closes: closing a socket with unread input
        sends a reset, and a client still writing its body then sees a broken pipe instead of the 413 (CI
        caught it). Bounded: at most DRAIN_MAX_BYTES and DRAIN_MAX_S; a bigger or slower body is cut off."""
        left = min(self.refused_body, DRAIN_MAX_BYTES)
        self.refused_body = 0
        deadline = time.monotonic() + DRAIN_MAX_S
        try:
            while left > 0 and (wait := deadline - time.monotonic()) > 0:
                self.connection.settimeout(min(wait, 1.0))
                chunk = self.rfile.read1(min(left, 1 << 16))
                if not chunk:
                    break
                left -= len(chunk)
        except OSError:  # the client stopped sending or went away: nothing more to wait for
            pass

    def _reply_stream(self, chunks: Iterator[dict]) -> None:
        """Server-sent events: `data: {chunk}` per chunk, then `data: [DONE]`; the connection closes after (no
        Content-Length). An error after the headers is sent as an event with the OpenAI error object (the openai
        package raises it); a client that goes away stops the stream (its job is forgotten)."""
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            try:
                for doc in chunks:
                    self._event(json.dumps(doc))
            except ApiError as exc:
                self._event(json.dumps(exc.body()))
            except Exception as exc:  # noqa: BLE001 - a bug must not leak a trace into the stream
                if self.service.log:
                    self.service.log.exception("openai.internal_error", error=repr(exc)[:300])
                self._event(json.dumps(ApiError(500, "internal error (logged by the server)", None, "internal_error",
                                                "server_error").body()))
            self._event("[DONE]")
        except OSError:  # the client went away mid-stream
            pass
        finally:
            getattr(chunks, "close", lambda: None)()  # ends the backend's wait: the job is cancelled and forgotten

    def _event(self, data: str) -> None:
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _reply(self, status: int, doc: dict) -> None:
        data = json.dumps(doc).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the client went away; nothing to answer
            self.close_connection = True


class OpenAIServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a cap on open connections (one more is closed at once)."""

    daemon_threads = True

    def __init__(self, service: ChatService):
        self._slots = threading.BoundedSemaphore(service.cfg.max_connections)
        handler = type("BoundHandler", (Handler,), {"service": service})
        super().__init__((service.cfg.host, service.cfg.port), handler)
        self.service = service

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        if self.service.log:  # a connection reset mid-request: logged, never printed as a trace
            self.service.log.debug("openai.connection_error", client=str(client_address)[:100])

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"


def serve_config(cfg: Any, host: str, port: int, api_key: str = "", max_tokens: int = 1024,
                 timeout_s: float = 300.0, tool_family: str = "auto") -> ServeConfig:
    """ServeConfig from the CLI flags and the run config (the engine's context length bounds every call)."""
    from areal_mq.errors import ConfigError
    from areal_mq.security import is_loopback

    if not is_loopback(host) and not api_key:
        raise ConfigError(f"--host {host} is not loopback: anyone reaching it could generate with the run's agent "
                          "key. Set an API key (the variable named by --api-key-env) or bind 127.0.0.1")
    context = cfg.rollout.engine.max_model_len or 2048
    if not 1 <= max_tokens < context:
        raise ConfigError(f"--max-tokens {max_tokens} must be between 1 and the context ({context}) - 1")
    if tool_family != "auto" and tool_family not in FAMILIES:
        raise ConfigError(f"--tool-family {tool_family!r}: one of auto, {', '.join(FAMILIES)}")
    api = ApiLimits(max_tokens=max_tokens, default_max_tokens=min(256, max_tokens))
    return ServeConfig(host=host, port=port, api_key=api_key, request_timeout_s=timeout_s, max_context=context,
                       api=api, tool_family=tool_family)


def broker_backend(cfg: Any, address: str, keys: Any, log: Any) -> OpenAIBackend:
    """An OpenAIBackend whose JobClient uses the run's liveness settings (a broker silent past them: 503)."""
    from areal_mq.client import JobClient

    b = cfg.brokers
    return OpenAIBackend(lambda: JobClient(address, keys=keys, heartbeat_s=b.heartbeat_s, liveness=b.liveness,
                                           retry_s=cfg.job_retry_s("generate"), reconnect_max_s=b.reconnect_max_s, log=log),
                         silent_after_s=b.heartbeat_s * b.liveness, log=log)


def serve(cfg: Any, serve_cfg: ServeConfig, broker: str | None = None, ready=None) -> int:
    """Run the endpoint until SIGTERM/SIGINT. `cfg` is the RunConfig (model, brokers, security, events)."""
    import signal

    from areal_mq.engines.models import load_tokenizer, resolve_model
    from areal_mq.telemetry.log import make_logger
    from areal_mq.security import Keyring, warn_if_insecure

    worker_id = f"openai-{socket.gethostname()}-{os.getpid()}"
    keys = Keyring.from_config(cfg, "agent")
    log, sink = make_logger(cfg, "agent", worker_id, keys=keys)
    warn_if_insecure(keys, log)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    address = broker or cfg.brokers.job_addr
    backend = broker_backend(cfg, address, keys, log)
    server = thread = None
    try:
        tokenizer = load_tokenizer(resolve_model(cfg.model.name, cfg.model.cache_dir))
        server = OpenAIServer(ChatService(serve_cfg, cfg.model.name, tokenizer, backend, log=log))
        backend.start()
        thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="openai-http",
                                  daemon=True)
        thread.start()
        log.info("openai.listening", url=server.url, model=cfg.model.name, broker=address)
        print(f"areal-mq serve-openai: {server.url} (model {cfg.model.name}, job broker {address})", flush=True)
        if ready is not None:
            ready(server)
        while not stop.wait(0.5):
            pass
    finally:
        if thread is not None:
            server.shutdown()
        if server is not None:
            server.server_close()
        backend.close()
        log.info("openai.stopped")
        sink.close()
    return 0
