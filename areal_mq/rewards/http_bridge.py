"""Forward reward jobs to a user's HTTP endpoint (stdlib http.client; JSON in, JSON out).

What: `HttpRewardBridge(cfg).score(job_id, job) -> [(reward, details), ...]` POSTs one RewardJob as JSON
and reads one reward per completion back. Each attempt has one deadline for the whole exchange (name
resolution, connect, request, headers and body: a watchdog cuts a connection that is still open at it), a
timeout, connection error, 408, 429 or 5xx is retried with exponential backoff, and at most
`max_concurrency` requests are in flight. Other answers (4xx, malformed JSON, wrong number of rewards)
fail at once with a RewardError saying what the server sent. Wire format: docs/rewards.md.

    request:  {"job_id", "task", "prompt_id", "prompt", "completions": [str], "reference",
               "truncated": [bool], "meta": {}}
    response: {"rewards": [float, ...], "details": [{...}, ...]}   (details optional)
"""
from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from ..errors import RewardError
from ..messages import RewardJob
from .config import HttpBridgeConfig
from .registry import jsonable, normalize_output


class HttpRewardError(RewardError):
    """The reward endpoint failed, timed out or answered something unusable. `retryable` says whether
    another attempt could help."""

    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


def _cut(sock: socket.socket) -> None:
    """The deadline passed: wake whatever read or write is blocked on `sock`."""
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
        """One attempt, all of it (DNS, connect, TLS, request, headers, body) within `timeout_s`.

        A watchdog shuts the socket down at the deadline, so a server that trickles header lines or body bytes
        cannot hold the call longer than the deadline (per-read timeouts alone would let it)."""
        deadline = time.monotonic() + self.cfg.timeout_s
        where = f"reward endpoint {self.cfg.url}"
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=self.cfg.timeout_s)
        watchdog = None
        try:
            conn.sock = self._connect(deadline)
            watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), _cut, [conn.sock])
            watchdog.daemon = True
            watchdog.start()
            headers = {"Content-Type": "application/json", **self.cfg.headers}
            conn.request("POST", self._path, body=body, headers=headers)
            resp = conn.getresponse()
            chunks, size = [], 0
            while chunk := (resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)):
                size += len(chunk)
                if size > self.cfg.max_response_bytes:
                    raise HttpRewardError(f"{where}: response larger than {self.cfg.max_response_bytes} bytes",
                                          False)
                chunks.append(chunk)
            if time.monotonic() >= deadline:
                raise TimeoutError  # the watchdog cut the connection: what arrived is incomplete
            return resp.status, b"".join(chunks)
        except (TimeoutError, OSError, http.client.HTTPException) as exc:
            if time.monotonic() >= deadline or isinstance(exc, TimeoutError) or "timed out" in str(exc):
                raise HttpRewardError(f"{where}: no complete response within {self.cfg.timeout_s}s", True) from None
            if isinstance(exc, http.client.HTTPException):
                raise HttpRewardError(f"{where}: bad HTTP response: {type(exc).__name__}: {exc}", True) from None
            raise HttpRewardError(f"{where}: {type(exc).__name__}: {exc}", True) from None
        finally:
            if watchdog is not None:
                watchdog.cancel()
            conn.close()

    def _connect(self, deadline: float) -> socket.socket:
        """A connected (TLS-wrapped for https) socket; name resolution is bounded by the deadline too."""
        port = self._port or (443 if self._https else 80)
        pool = ThreadPoolExecutor(max_workers=1)  # getaddrinfo has no timeout: give it the time that is left
        try:
            infos = pool.submit(self._resolve, self._host, port, 0, socket.SOCK_STREAM).result(
                max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            raise TimeoutError from None
        except socket.gaierror as exc:
            raise OSError(f"cannot resolve {self._host!r}: {exc}") from None
        finally:
            pool.shutdown(wait=False)
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock.connect(addr)
            if self._https:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self._host)
        except BaseException:
            sock.close()
            raise
        return sock

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
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise HttpRewardError(f"{where} answered an unusable body ({type(exc).__name__}: {exc}); expected "
                                  '{"rewards": [float, ...], "details": [{...}, ...]}', False) from None
