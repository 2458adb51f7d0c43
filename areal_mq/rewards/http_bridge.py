"""Forward reward jobs to a user's HTTP endpoint (stdlib http.client; JSON in, JSON out).

What: `HttpRewardBridge(cfg).score(job_id, job) -> [(reward, details), ...]` POSTs one RewardJob as JSON
and reads one reward per completion back. Each attempt has one deadline for the whole exchange: name
resolution (on a helper thread), connect, TLS handshake, request, headers and body; at the deadline a
watchdog shuts the socket down, waking any blocked read or write. A timeout, connection error, 408, 429 or
5xx is retried with exponential backoff, and at most `max_concurrency` requests are in flight. Other answers
(4xx, malformed JSON, wrong number of rewards) fail at once with a RewardError saying what the server sent.
Wire format: docs/rewards.md.

    request:  {"job_id", "task", "prompt_id", "prompt", "completions": [str], "reference",
               "truncated": [bool], "meta": {}}
    response: {"rewards": [float, ...], "details": [{...}, ...]}   (details optional)
"""
from __future__ import annotations

import http.client
import ipaddress
import json
import socket
import ssl
import threading
import time
import urllib.parse

from areal_mq.errors import RewardError
from areal_mq.messages import RewardJob
from areal_mq.rewards.config import HttpBridgeConfig
from areal_mq.rewards.registry import jsonable, normalize_output


class HttpRewardError(RewardError):
    """The reward endpoint failed, timed out or answered something unusable. `retryable` says whether
    another attempt could help."""

    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


class _Deadline:
    """One attempt's deadline over every socket it opens. At the deadline a watchdog shuts the current socket
    down, which wakes whatever connect, TLS handshake, send or read is blocked on it: a server that trickles
    bytes (each read alone would meet a per-read timeout) cannot hold the attempt longer."""

    def __init__(self, seconds: float):
        self.at = time.monotonic() + seconds
        self.expired = False
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()  # _fire never touches a socket that close() already let go
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def left(self) -> float:
        """Seconds left; TimeoutError when none are."""
        left = self.at - time.monotonic()
        if self.expired or left <= 0:
            raise TimeoutError
        return left

    def watch(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._sock = sock
            if self.expired:
                _cut(sock)
        return sock

    def _fire(self) -> None:
        with self._lock:
            self.expired = True
            if self._sock is not None:
                _cut(self._sock)

    def close(self) -> None:
        self._timer.cancel()
        with self._lock:
            self._sock = None


def _cut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class HttpRewardBridge:
    """Client of one reward endpoint. Thread-safe; share one per endpoint."""

    def __init__(self, cfg: HttpBridgeConfig, sleep=time.sleep, resolve=socket.getaddrinfo):
        self.cfg = cfg
        self._resolve = resolve
        url = urllib.parse.urlsplit(cfg.url)
        self._https = url.scheme == "https"
        self._host, self._port = url.hostname, url.port
        self._path = (url.path or "/") + (f"?{url.query}" if url.query else "")
        self._sem = threading.BoundedSemaphore(cfg.max_concurrency)
        self._sleep = sleep

    @staticmethod
    def request_body(job_id: str, job: RewardJob) -> dict:
        return {
            "job_id": job_id, "task": job.task, "prompt_id": job.prompt_id, "prompt": job.prompt,
            "completions": list(job.completions), "reference": jsonable(job.reference),
            "truncated": list(job.truncated) or [False] * len(job.completions), "meta": jsonable(job.meta),
        }

    def score(self, job_id: str, job: RewardJob) -> list[tuple[float, dict]]:
        """One (reward, details) per completion; HttpRewardError after the last failed attempt."""
        body = json.dumps(self.request_body(job_id, job)).encode()
        attempts = self.cfg.retries + 1
        for attempt in range(1, attempts + 1):
            try:
                with self._sem:
                    status, data = self._post(body)
                return self._parse(status, data, len(job.completions))
            except HttpRewardError as exc:
                if not exc.retryable or attempt == attempts:
                    raise HttpRewardError(f"{exc} (attempt {attempt}/{attempts})", exc.retryable) from None
            self._sleep(self.cfg.backoff_s * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    def _post(self, body: bytes) -> tuple[int, bytes]:
        """One attempt, all of it (DNS, connect, TLS, request, headers, body) within `timeout_s` (_Deadline)."""
        where = f"reward endpoint {self.cfg.url}"
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=self.cfg.timeout_s)
        deadline = _Deadline(self.cfg.timeout_s)
        try:
            conn.sock = self._connect(deadline)
            headers = {"Content-Type": "application/json", **self.cfg.headers}
            conn.request("POST", self._path, body=body, headers=headers)
            resp = conn.getresponse()
            chunks, size = [], 0
            while chunk := (resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)):
                deadline.left()  # between reads too: a body trickled in pieces ends at the deadline
                size += len(chunk)
                if size > self.cfg.max_response_bytes:
                    raise HttpRewardError(f"{where}: response larger than {self.cfg.max_response_bytes} bytes",
                                          False)
                chunks.append(chunk)
            deadline.left()  # the watchdog may have cut the connection: then what arrived is incomplete
            return resp.status, b"".join(chunks)
        except (TimeoutError, OSError, http.client.HTTPException) as exc:
            if deadline.expired or isinstance(exc, TimeoutError) or "timed out" in str(exc):
                raise HttpRewardError(f"{where}: no complete response within {self.cfg.timeout_s}s", True) from None
            if isinstance(exc, http.client.HTTPException):
                raise HttpRewardError(f"{where}: bad HTTP response: {type(exc).__name__}: {exc}", True) from None
            raise HttpRewardError(f"{where}: {type(exc).__name__}: {exc}", True) from None
        finally:
            deadline.close()
            conn.close()

    def _connect(self, deadline: _Deadline) -> socket.socket:
        """A connected (TLS-wrapped for https) socket. Every address of the name is tried in turn (as
        socket.create_connection does), each connect and the handshake with the time left, under the watchdog."""
        port = self._port or (443 if self._https else 80)
        error: OSError | None = None
        for family, kind, proto, _, addr in self._lookup(port, deadline):
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(deadline.left())
                deadline.watch(sock)
                sock.connect(addr)
                if self._https:  # handshake after wrapping, so the watchdog holds the socket that reads it
                    sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self._host,
                                                                    do_handshake_on_connect=False)
                    deadline.watch(sock).do_handshake()
                sock.settimeout(deadline.left())
                return sock
            except TimeoutError:
                sock.close()
                raise
            except OSError as exc:
                sock.close()
                if deadline.expired:
                    raise TimeoutError from None
                error = exc
            except BaseException:
                sock.close()
                raise
        raise error or OSError(f"{self._host!r} resolved to no address")

    def _lookup(self, port: int, deadline: _Deadline) -> list:
        """getaddrinfo within the time left. It has no timeout of its own, so it runs on a daemon thread that
        is abandoned at the deadline (it ends when the system resolver gives up). IP literals need no lookup."""
        try:
            ipaddress.ip_address(self._host)
            numeric = True
        except ValueError:
            numeric = False
        box: dict = {}
        done = threading.Event()

        def run():
            try:
                box["infos"] = self._resolve(self._host, port, 0, socket.SOCK_STREAM)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = exc
            finally:
                done.set()

        if numeric:
            run()
        else:
            threading.Thread(target=run, name="reward-http-dns", daemon=True).start()
        if not done.wait(deadline.left()):
            raise TimeoutError
        if isinstance(box.get("error"), socket.gaierror):
            raise OSError(f"cannot resolve {self._host!r}: {box['error']}")
        if "error" in box:
            raise box["error"]
        return box["infos"]

    def _parse(self, status: int, data: bytes, n: int) -> list[tuple[float, dict]]:
        where = f"reward endpoint {self.cfg.url}"
        if status != 200:
            retry = status in (408, 429) or status >= 500
            text = data[:300].decode("utf-8", "replace")
            raise HttpRewardError(f"{where} answered HTTP {status}: {text}", retry)
        try:
            doc = json.loads(data)
            rewards = doc["rewards"]
            details = doc.get("details") or [{} for _ in rewards]
            if not isinstance(rewards, list) or len(rewards) != n or len(details) != n:
                raise ValueError(f"expected {n} rewards (and details), got {len(rewards)}")
            return [normalize_output({**(d if isinstance(d, dict) else {"detail": d}), "reward": r})
                    for r, d in zip(rewards, details)]
        # OverflowError: an integer too large for a float; RecursionError: JSON nested past the parser's limit
        # (both found by fuzzing: they escaped as other exceptions than HttpRewardError)
        except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as exc:
            raise HttpRewardError(f"{where} answered an unusable body ({type(exc).__name__}: {exc}); expected "
                                  '{"rewards": [float, ...], "details": [{...}, ...]}', False) from None
