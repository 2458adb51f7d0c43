"""Forward reward jobs to a user's HTTP endpoint (stdlib http.client; JSON in, JSON out).

What: `HttpRewardBridge(cfg).score(job_id, job) -> [(reward, details), ...]` POSTs one RewardJob as JSON
and reads one reward per completion back. Each attempt has a deadline (connect + full response), a
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
import threading
import time
import urllib.parse

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


class HttpRewardBridge:
    """Client of one reward endpoint. Thread-safe; share one per endpoint."""

    def __init__(self, cfg: HttpBridgeConfig, sleep=time.sleep):
        self.cfg = cfg
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
        deadline = time.monotonic() + self.cfg.timeout_s
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=self.cfg.timeout_s)
        where = f"reward endpoint {self.cfg.url}"
        try:
            headers = {"Content-Type": "application/json", **self.cfg.headers}
            conn.request("POST", self._path, body=body, headers=headers)
            sock = conn.sock  # http.client may drop conn.sock once the response says "close"
            resp = conn.getresponse()
            chunks, size = [], 0
            while True:  # read in pieces so a server that trickles bytes still meets the deadline
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                chunk = resp.read1(65536) if hasattr(resp, "read1") else resp.read(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > self.cfg.max_response_bytes:
                    raise HttpRewardError(f"{where}: response larger than {self.cfg.max_response_bytes} bytes",
                                          False)
                chunks.append(chunk)
            return resp.status, b"".join(chunks)
        except (TimeoutError, OSError) as exc:
            if isinstance(exc, TimeoutError) or "timed out" in str(exc):
                raise HttpRewardError(f"{where}: no complete response within {self.cfg.timeout_s}s", True) from None
            raise HttpRewardError(f"{where}: {type(exc).__name__}: {exc}", True) from None
        except http.client.HTTPException as exc:
            raise HttpRewardError(f"{where}: bad HTTP response: {type(exc).__name__}: {exc}", True) from None
        finally:
            conn.close()

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
