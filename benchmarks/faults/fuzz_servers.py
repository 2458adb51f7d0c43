"""Fuzz targets for the other servers a peer can reach: the trainer's weight server, the OpenAI endpoint, and the
HTTP reward bridge's parsing of what a reward server answers (issue 40, part 2).

- `weight-server` (areal_mq/weights: WeightServer): two servers, plaintext and CURVE, each holding versions 1 and
  2 with the delta 1->2; an input is a mutated WeightsFetch (any kind, any frames) with a role, handed to the
  server's own message handler (captured sends, as fuzz_targets.RouterTarget); 1 in K also over a real CURVE
  DEALER. A correct end: a documented `error` (§9), or the chunk asked for (a pristine fetch from a role that may
  fetch gets exactly the chunk the server published). `health`: fetch_chunks of version 2 over CURVE.
- `openai` (areal_mq/openai/server.py): the real ThreadingHTTPServer on loopback with the tiny model's tokenizer
  and a scripted backend (no job broker); an input is a mutated HTTP request (the JSON body mutated as values,
  the bytes of the head or the body damaged, Content-Length right or wrong), sent over a real TCP connection. A
  correct end: a JSON answer with a 2xx or 4xx status and the OpenAI error shape, or the stdlib's refusal of a
  malformed request line (400, 414, 431, 505); never a 500 (a bug the handler caught), a broken answer or a
  dead server. A pristine request gets 200. `health`: a valid chat completion.
- `reward-http` (areal_mq/rewards/http_bridge.py): a scripted reward server on loopback answers each of the
  bridge's POSTs with the input's bytes (a valid response mutated: status line, headers, JSON body); the bridge
  must return one finite reward per completion or raise HttpRewardError (retryable or not), nothing else.
  A pristine response gives exactly its rewards.

Run: through benchmarks/faults/fuzz.py (`--target weight-server|openai|reward-http`) and tests/integration/test_fuzz.py.
"""
from __future__ import annotations

import json
import math
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from areal_mq import protocol
from areal_mq.messages import GenerateResult, Kind, StatsRequest, WeightsFetch
from areal_mq.security import refusal, start_zap
from fuzz_mutate import HEADER_OPS, bytes_op, frames_op, hostile_value, mutate
from fuzz_targets import ERROR_CODES, CountingLog, Keys, PeerFrame, Unexpected


class _Capture:
    """A socket that keeps what the server sends (the answers are judged, not sent)."""

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def send_multipart(self, frames: list, copy: bool = True) -> None:
        self.sent.append([bytes(memoryview(f)) if not isinstance(f, bytes) else f for f in frames])


class WeightServerTarget:
    name = "weight-server"
    wire_capable = True

    def __init__(self, root: Path):
        import torch

        from areal_mq.weights import WeightServer

        self.root, self.ctx = root, zmq.Context()
        self.keys = Keys(root)
        g = torch.Generator().manual_seed(0)
        v1 = {"w": torch.randn(64, 32, generator=g), "b": torch.zeros(40, dtype=torch.bfloat16)}
        v2 = {k: t.clone() for k, t in v1.items()}
        v2["w"][3] += 1.0
        v2["b"][7] = 2
        from areal_mq.security import Keyring

        self.servers = [WeightServer(keep=2, chunk_bytes=4096, keys=k, log=CountingLog(), deltas=True, chain=4)
                        for k in (None, Keyring.load(self.keys.dir, "trainer"))]
        self.ready = []
        for server in self.servers:
            server.publish(1, {k: t.clone() for k, t in v1.items()})
            self.ready.append(server.publish(2, {k: t.clone() for k, t in v2.items()}))
        ready = self.ready[0]
        self.expected = [{  # per server, seed -> the frames a valid fetch must get (its own pre-encoded chunk)
            "full-v2-0": s._full[2].frames[0], "full-v2-last": s._full[2].frames[-1],
            "full-v1-0": s._full[1].frames[0], "delta-1-2-0": s._delta[2][1].frames[0]} for s in self.servers]
        fetches = {"full-v2-0": WeightsFetch(version=2, index=0),
                   "full-v2-last": WeightsFetch(version=2, index=ready.num_chunks - 1),
                   "full-v1-0": WeightsFetch(version=1, index=0),
                   "delta-1-2-0": WeightsFetch(version=2, index=0, base=1),
                   "stats": StatsRequest()}
        self.seeds = {k: [bytes(memoryview(f)) for f in protocol.encode(m)] for k, m in fetches.items()}
        self._wire: dict[str, zmq.Socket] = {}

    def feed(self, frames: list[bytes], role: str | None, ident: bytes, seed: str | None, i: int) -> str:
        server = self.servers[i % 2]
        role = role if i % 2 else None
        cap = _Capture()
        server._handle(cap, [PeerFrame(ident, role), *frames])
        outcome = "silent"
        for sent in cap.sent:
            if sent[0] != ident:
                raise Unexpected(f"an answer went to {sent[0][:20]!r}, not the peer {ident[:20]!r}")
            env = protocol.decode(sent[1:], 1 << 30)
            if env.kind == Kind.ERROR:
                if env.msg.code not in ERROR_CODES:
                    raise Unexpected(f"undocumented error code {env.msg.code!r}: {env.msg.message[:200]}")
                outcome = f"refused:{env.msg.code}"
            elif env.kind == Kind.WEIGHTS_CHUNK:
                outcome = "answered:weights_chunk"
            else:
                raise Unexpected(f"the weight server answered {env.kind.value}")
        want = self.expected[i % 2].get(seed or "")
        if want is not None and (not i % 2 or refusal(role, "weights:fetch") is None):
            got = cap.sent[-1][1:] if cap.sent else []
            if [bytes(memoryview(f)) for f in want] != got:
                raise Unexpected(f"the valid fetch {seed} got {outcome}, not its chunk")
        return outcome

    def tick(self, k: int) -> None:
        pass

    def size(self) -> dict:
        return {"served_chunks": sum(s.served_chunks for s in self.servers)}

    def wire(self, frames: list[bytes], role: str, timeout_s: float = 0.02) -> list[list[bytes]]:
        """One input over a real CURVE DEALER as `role` to the CURVE server (its thread answers). The server's
        key is the trainer's (until 2026-11-28 this used the broker's: every handshake failed, nothing reached
        the server over the wire, and the DEALER filled its queue and blocked, the "stuck DEALER" of seed 71)."""
        sock = self._wire.get(role)
        if sock is None:
            sock = self._wire[role] = self.keys.client(role).client(self.ctx.socket(zmq.DEALER), "trainer")
            sock.linger = 0
            sock.connect(self.servers[1].endpoint)
        if not frames:
            return []
        if not sock.poll(2000, zmq.POLLOUT):
            raise Unexpected(f"the CURVE weight server takes no frames from a {role} DEALER (its queue is full)")
        sock.send_multipart(frames)
        got, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if sock.poll(5):
                got.append(sock.recv_multipart())
                break
        return got

    def health(self) -> None:
        from areal_mq.weights import fetch_chunks

        ready = self.ready[1]
        chunks = fetch_chunks(ready.endpoint, 2, -1, ready.num_chunks, timeout_s=20,
                              keys=self.keys.client("rollout"))
        if [c.version for c in chunks] != [2] * ready.num_chunks:
            raise Unexpected(f"health: fetched versions {[c.version for c in chunks]}")

    def close(self) -> None:
        for s in self._wire.values():
            s.close(0)
        for server in self.servers:
            server.close()
        self.ctx.term()


# ---------------------------------------------------------------- HTTP: shared mutation of a request/response
def mutate_http(c: Any, head: bytes, body: bytes) -> tuple[bytes, bytes, bool]:
    """(head, body, keep Content-Length right): the body's JSON mutated as values (most inputs, so they reach the
    checks behind the parser), or bytes of either part damaged, or the parts' frames reshuffled."""
    fix_length = c.int(0, 5) > 0
    for _ in range(c.int(1, 3)):
        layer = c.int(0, 9)
        if layer < 6:
            try:
                doc = json.loads(body)
            except (ValueError, RecursionError):
                doc = None
            if isinstance(doc, dict):
                c.choice(HEADER_OPS)(c, doc)
                try:
                    body = json.dumps(doc, default=lambda b: b.hex() if isinstance(b, bytes) else str(b)).encode()
                except (ValueError, TypeError, RecursionError):
                    body = body[: len(body) // 2]
                continue
            body = bytes_op(c, body)
        elif layer < 7:
            body = _json_text_op(c, body)
        elif layer < 8:
            if c.int(0, 1):
                head = bytes_op(c, head)
            else:
                lines = head.split(b"\r\n")
                k = c.int(0, len(lines) - 1)
                lines[k] = c.choice((b"", b"X-" + c.bytes(8).hex().encode() + b": " + b"a" * c.int(0, 70_000),
                                     bytes_op(c, lines[k]), b"Transfer-Encoding: chunked", b"Content-Length: -1",
                                     b"Content-Length: 99999999999999999999", lines[k] * c.int(2, 40)))
                head = b"\r\n".join(lines)
        else:
            parts = frames_op(c, [head, body], 1 << 16)
            head, body = (parts + [b"", b""])[:2]
    return head, body, fix_length


def _json_text_op(c: Any, body: bytes) -> bytes:
    """JSON no Python value prints: a number of thousands of digits, or a value nested past the parser's
    recursion limit, put where a value was."""
    spots = [m.start() for m in re.finditer(rb"(?<=[:\[,]) ?(?=[-0-9\[{\"tfn])", body)][:200]
    if not spots:
        return body
    at = c.choice(spots)
    k = c.int(300, 5000) if c.int(0, 1) else c.int(900, 200_000)
    value = b"9" * k if c.int(0, 1) else b"[" * k + b"]" * k
    end = re.match(rb" ?(-?[0-9.eE+]+|\"[^\"]*\"|true|false|null)", body[at:])
    return body[:at] + value + (body[at + end.end():] if end else b"," + body[at:])


def _with_length(head: bytes, body: bytes, fix: bool) -> bytes:
    if fix:
        lines = [ln for ln in head.split(b"\r\n") if not ln.lower().startswith(b"content-length:")]
        lines.insert(1, b"Content-Length: %d" % len(body))
        head = b"\r\n".join(lines)
    return head + b"\r\n\r\n" + body


def _http09(data: bytes) -> None:
    """An answer to an HTTP/0.9 request line (`GET /path`, no version): http.server sends only the body, either
    its 400 page or our JSON. Anything else is Unexpected."""
    text, decoder = data.decode("latin-1"), json.JSONDecoder()
    while text:
        page = re.search(r"<p>Error code: (\d+)</p>", text[:2000]) if text.startswith("<!DOCTYPE HTML>") else None
        if page and int(page.group(1)) in HTTP_REFUSALS:
            return  # the stdlib's refusal page (400, 505, ...); the connection ends after it
        if text.startswith("HTTP/"):
            split_responses(text.encode("latin-1"))
            return
        try:
            _, end = decoder.raw_decode(text)  # a keep-alive connection: one JSON answer after another
        except ValueError:
            raise Unexpected(f"neither an HTTP/1.x answer nor an HTTP/0.9 one: {data[:200]!r}") from None
        text = text[end:]


def split_responses(data: bytes) -> list[tuple[int, dict, bytes]]:
    """Every HTTP/1.x answer in `data` (a connection may carry several: bytes after a body whose Content-Length
    was too short are read as the next request). Raises Unexpected for anything that is not one."""
    out = []
    while data:
        if not data.startswith(b"HTTP/"):
            _http09(data)  # what followed was read as an HTTP/0.9 request: an answer without a head, to the end
            return out
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            raise Unexpected(f"an incomplete HTTP answer: {data[:200]!r}")
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise Unexpected(f"not an HTTP status line: {lines[0][:200]!r}")
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(b":")
            headers[k.strip().lower().decode("latin-1")] = v.strip().decode("latin-1")
        length = headers.get("content-length", "")
        if not length.isdigit() or int(length) > len(rest):
            raise Unexpected(f"an answer without a right Content-Length ({length!r}): {data[:200]!r}")
        out.append((int(parts[1]), headers, rest[:int(length)]))
        data = rest[int(length):]
    return out


# ---------------------------------------------------------------- the OpenAI endpoint
class _ScriptedBackend:
    """The job broker's part: every choice gets the same few tokens, version 7 (what a rollout worker answers)."""

    def generate(self, prompt: list[int], samplings: list, sessions: list, timeout_s: float) -> list:
        out = []
        for s in samplings:
            n = max(1, min(4, s.max_new_tokens))
            out.append(GenerateResult(output_ids=np.arange(100, 100 + n, dtype=np.int32),
                                      logprobs=np.full(n, -0.25, np.float32), versions=np.full(n, 7, np.int32),
                                      finish_reason="length", worker_id="fuzz"))
        return out

    def broker_silent(self) -> bool:
        return False


HTTP_REFUSALS = {400, 401, 404, 405, 408, 411, 413, 414, 422, 429, 431, 501, 503, 504, 505}


class OpenAITarget:
    name = "openai"
    wire_capable = False

    def __init__(self, root: Path):
        from areal_mq.engines.models import load_tokenizer, resolve_model
        from areal_mq.openai.server import ChatService, OpenAIServer, ServeConfig

        tokenizer = load_tokenizer(resolve_model("tiny-random-llama"))
        self.log = CountingLog()
        self.servers, self.threads = [], []
        for key in ("", "sk-fuzz"):
            cfg = ServeConfig(host="127.0.0.1", port=0, api_key=key, read_timeout_s=5.0, max_body_bytes=1 << 18)
            server = OpenAIServer(ChatService(cfg, "tiny", tokenizer, _ScriptedBackend(), log=self.log))
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
            thread.start()
            self.servers.append(server)
            self.threads.append(thread)
        chat = {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "What is 2+3?"}],
                "max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "n": 2, "logprobs": True, "stop": ["\n"],
                "user": "ep-1"}
        auth = b"Authorization: Bearer sk-fuzz\r\n"
        self.seeds = {
            "chat": [b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Type: application/json"
                     b"\r\nX-Episode-Id: ep-1", json.dumps(chat).encode()],
            "models": [b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + auth.rstrip(), b""],
            "episode": [b"GET /v1/episodes/ep-1 HTTP/1.1\r\nHost: x\r\n" + auth.rstrip(), b""],
            "pop": [b"DELETE /v1/episodes/ep-2 HTTP/1.1\r\nHost: x\r\n" + auth.rstrip(), b""],
        }
        self.answers = {"chat": 200, "models": 200}  # an episode may be popped already: 404 is right too

    def mutate(self, c: Any, seed: str, frames: list[bytes]) -> list[bytes]:
        head, body, fix = mutate_http(c, frames[0], frames[1])
        return [_with_length(head, body, fix)]

    def _send(self, server: Any, data: bytes, timeout_s: float = 8.0) -> bytes:
        with socket.create_connection(server.server_address[:2], timeout=timeout_s) as s:
            try:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the server answered (413, a bad request line) and closed before reading it all
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks)

    def feed(self, frames: list[bytes], role: str | None, ident: bytes, seed: str | None, i: int) -> str:
        data = _with_length(frames[0], frames[1], True) if seed is not None else b"".join(frames)
        server = self.servers[i % 2]
        try:
            reply = self._send(server, data)
        except ConnectionResetError:
            return "reset"  # the server closed a connection whose input it refused unread (the kernel's RST)
        if not reply:
            return "closed"  # e.g. an empty request: BaseHTTPRequestHandler closes without an answer
        if not reply.startswith(b"HTTP/"):
            _http09(reply)
            return "http09"
        answers = split_responses(reply)
        for status, headers, body in answers:
            self._judge(status, headers, body)
        status, headers, body = answers[0]
        want = self.answers.get(seed or "")
        if want is not None and (status != want or len(answers) != 1):
            raise Unexpected(f"the valid {seed} request got HTTP {status} ({len(answers)} answers): {body[:300]!r}")
        return f"answered:{status}" if status < 400 else f"refused:{status}"

    @staticmethod
    def _judge(status: int, headers: dict, body: bytes) -> None:
        if "json" in headers.get("content-type", ""):
            doc = json.loads(body)
            if status >= 400 and not isinstance(doc.get("error"), dict):
                raise Unexpected(f"HTTP {status} without an OpenAI error object: {body[:200]!r}")
        elif status not in HTTP_REFUSALS:  # only the stdlib's own refusals of bad framing are not JSON
            raise Unexpected(f"HTTP {status} with {headers.get('content-type')}: {body[:200]!r}")
        if status >= 500 and status not in HTTP_REFUSALS:
            raise Unexpected(f"HTTP {status}: {body[:300]!r}")

    def tick(self, k: int) -> None:
        pass

    def size(self) -> dict:
        return {"episodes": sum(len(s.service.recorder._episodes) for s in self.servers
                                if hasattr(s.service.recorder, "_episodes"))}

    def health(self) -> None:
        inp = self.seeds["chat"]
        for i in range(2):
            if self.feed(inp, None, b"", "chat", i) != "answered:200":
                raise Unexpected("health: a valid chat completion was not answered")

    def close(self) -> None:
        for server in self.servers:
            server.shutdown()
            server.server_close()


# ---------------------------------------------------------------- the HTTP reward bridge
class RewardHttpTarget:
    name = "reward-http"
    wire_capable = False

    def __init__(self, root: Path):
        from areal_mq.messages import RewardJob
        from areal_mq.rewards.config import HttpBridgeConfig
        from areal_mq.rewards.http_bridge import HttpRewardBridge

        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listener.settimeout(0.2)  # accept wakes up to see close()
        self.answer = b""
        self.requests = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        port = self.listener.getsockname()[1]
        cfg = HttpBridgeConfig(url=f"http://127.0.0.1:{port}/score", timeout_s=3.0, retries=1, backoff_s=0.0,
                               max_response_bytes=1 << 20)
        self.bridge = HttpRewardBridge(cfg, sleep=lambda s: None)
        self.job = RewardJob(task="remote", prompt_id="p1", prompt="2+3?", completions=["5", "6", "x"],
                             reference="5")
        ok = {"rewards": [1.0, 0.0, -0.5], "details": [{"why": "right"}, {"why": "wrong"}, {}]}
        body = json.dumps(ok).encode()
        self.seeds = {"ok": [b"HTTP/1.1 200 OK\r\nContent-Type: application/json", body],
                      "no-details": [b"HTTP/1.1 200 OK\r\nContent-Type: application/json",
                                     json.dumps({"rewards": [1, 0, 0.25]}).encode()],
                      "busy": [b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1", b"busy"]}
        self.expected = {"ok": [1.0, 0.0, -0.5], "no-details": [1.0, 0.0, 0.25]}

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(2.0)
                try:
                    self._read_request(conn)
                    self.requests += 1
                    conn.sendall(self.answer)
                    conn.shutdown(socket.SHUT_WR)
                    while conn.recv(65536):  # until the bridge closes: no RST on unread input
                        pass
                except OSError:
                    pass

    @staticmethod
    def _read_request(conn: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(ln.split(b":", 1)[1]) for ln in head.split(b"\r\n")
                       if ln.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            chunk = conn.recv(65536)
            if not chunk:
                return
            body += chunk

    def mutate(self, c: Any, seed: str, frames: list[bytes]) -> list[bytes]:
        head, body, fix = mutate_http(c, frames[0], frames[1])
        return [_with_length(head, body, fix)]

    def feed(self, frames: list[bytes], role: str | None, ident: bytes, seed: str | None, i: int) -> str:
        from areal_mq.rewards.http_bridge import HttpRewardError

        self.answer = _with_length(frames[0], frames[1], True) if seed is not None else b"".join(frames)
        try:
            out = self.bridge.score(f"job-{i}", self.job)
        except HttpRewardError as exc:
            if seed in self.expected:
                raise Unexpected(f"the valid answer {seed} was refused: {exc}") from None
            return "refused:retryable" if exc.retryable else "refused:final"
        if len(out) != len(self.job.completions):
            raise Unexpected(f"{len(out)} rewards for {len(self.job.completions)} completions")
        for reward, details in out:
            if type(reward) is not float or not math.isfinite(reward) or not isinstance(details, dict):
                raise Unexpected(f"a reward the trainer cannot use: {reward!r}, {type(details).__name__}")
        want = self.expected.get(seed or "")
        if want is not None and [r for r, _ in out] != want:
            raise Unexpected(f"the valid answer {seed} gave {[r for r, _ in out]}, not {want}")
        return "answered"

    def tick(self, k: int) -> None:
        pass

    def size(self) -> dict:
        return {"requests": self.requests}

    def health(self) -> None:
        self.feed(self.seeds["ok"], None, b"", "ok", 0)

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        self._thread.join(5)


__all__ = ["WeightServerTarget", "OpenAITarget", "RewardHttpTarget", "mutate", "hostile_value"]
