"""`engine: vllm-server` — attach to a running vLLM OpenAI-compatible server, behind the Engine contract.

What: `VllmServerEngine(config)` talks HTTP to `config.vllm.server_url`:

    generate        POST /inference/v1/generate (stream)   token ids in, token ids + logprobs +
                                                           weight-version spans out (SSE chunks)
    abort           POST /abort_requests {"request_ids"}   ids are "generate-tokens-<request_id>"
    pause / resume  POST /pause?mode=keep&clear_cache=..   POST /resume
    weight reload   POST /collective_rpc {"method": "areal_reload_safetensors", "args": [path]}
    prefix cache    POST /reset_prefix_cache
    version label   POST /update_weight_version {"new_version": "<v>"}
    attach checks   GET /health, GET /server_info?config_format=json

(all verified in the vLLM 0.32.0 source: /inference/v1/generate needs --enable-scale-out; /pause,
/resume, /abort_requests, /update_weight_version (RL router), /collective_rpc, /reset_prefix_cache
and /server_info need VLLM_SERVER_DEV_MODE=1.) Start a matching server with
`python -m areal_mq.engines.vllm.server --model DIR --port 8000` (prints and runs the command).

Why: one vLLM server can be shared, started once and kept warm across runs (a start costs 0.5-4 min
on CPU). Weight updates travel as a path (a published safetensors dir, or in-memory tensors staged
in /dev/shm), so the server must share this host's filesystem.

A broken stream (an error chunk, a dropped connection, no finish_reason, missing spans or logprobs) ends
as an output with finish_reason "abort" and stats["error"]; the rollout worker answers it as an error,
never as a result (its versions are -1 and its missing logprobs NaN).

Versions come from vLLM's `weight_versions` spans only (the label is set to str(version) on every
update): unlike the in-process engine there is no race-free local stamp, because tokens already
sampled before a pause may still be in flight on the HTTP stream.

How to run: build_engine(...) with `engine: vllm-server`; tests: tests/integration/test_vllm_server.py.
"""
from __future__ import annotations

import http.client
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from areal_mq.engines.base import EngineOutput, EngineRequest
from areal_mq.engines.config import EngineConfig
from areal_mq.engines.vllm.common import (
    VllmEngineBase,
    VllmError,
    check_request,
    cpu_env,
    sampling_kwargs,
    spans_to_versions,
)
from areal_mq.engines.vllm.config import memory_utilization, vllm_on_cpu
from areal_mq.engines.vllm.worker import EXTENSION_CLS, RELOAD_METHOD
from areal_mq.errors import ConfigError, EngineRequestError

SERVER_PREFIX = "generate-tokens-"  # vLLM prefixes /inference/v1/generate request ids with this


class VllmServerEngine(VllmEngineBase):
    """A running vLLM server behind the Engine contract (see module docstring; the caller's side is
    VllmEngineBase)."""

    KIND = "vllm-server"

    def __init__(self, config: EngineConfig, *, version: int = 0, tokenizer: Any = None):
        """tokenizer (optional, a HF tokenizer): decodes EngineOutput.text; the server returns token ids only."""
        self._init_state(config, version)
        self._tokenizer = tokenizer
        url = urlsplit(self.vcfg.server_url)
        if url.scheme != "http" or not url.hostname:
            raise ConfigError(f"engine.vllm.server_url must be http://HOST:PORT, got {self.vcfg.server_url!r}")
        self._host, self._port = url.hostname, url.port or 80
        self._attach()
        self._pool = ThreadPoolExecutor(max_workers=config.max_concurrent, thread_name_prefix="vllm-stream")

    # ---------------------------------------------------------------- HTTP
    def _conn(self, timeout: float | None = None) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout or self.vcfg.request_timeout_s)

    def _http(self, method: str, path: str, body: Any = None, timeout: float | None = None) -> Any:
        """One JSON call; returns the parsed body (None if empty). Raises VllmError naming the endpoint."""
        conn = self._conn(timeout)
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
        except OSError as exc:
            raise VllmError(f"vLLM server {self.vcfg.server_url} unreachable on {method} {path}: {exc}. "
                            f"Start one with: python -m areal_mq.engines.vllm.server --model MODEL_DIR --port {self._port}") from exc
        finally:
            conn.close()
        if resp.status == 404:
            raise VllmError(f"vLLM server has no {path}: start it with VLLM_SERVER_DEV_MODE=1 and --enable-scale-out "
                            "(python -m areal_mq.engines.vllm.server prints the full command)")
        if resp.status >= 400:
            raise VllmError(f"vLLM server answered {resp.status} to {method} {path}: {data[:500]!r}")
        return json.loads(data) if data.strip() else None

    def _attach(self) -> None:
        self._http("GET", "/health")
        info = self._http("GET", "/server_info?config_format=json")["vllm_config"]
        ext = info["parallel_config"].get("worker_extension_cls")
        mode = info["model_config"].get("logprobs_mode")
        if ext != EXTENSION_CLS or mode != "processed_logprobs":
            raise ConfigError(
                f"the vLLM server at {self.vcfg.server_url} runs with worker_extension_cls={ext!r} and "
                f"logprobs_mode={mode!r}; areal-mq needs {EXTENSION_CLS!r} (weight reload) and 'processed_logprobs' "
                "(the trainer's logprob convention). Restart it with python -m areal_mq.engines.vllm.server"
            )
        self.max_model_len = int(info["model_config"]["max_model_len"])
        self._http("POST", "/update_weight_version", {"new_version": str(self.version)})

    # ---------------------------------------------------------------- requests
    def submit(self, request: EngineRequest) -> None:
        check_request(request, self.max_model_len)
        rid = request.request_id
        if rid in self._inflight:
            raise EngineRequestError(f"request id {rid!r} is already running; ids must be unique")
        body = {"request_id": rid, "token_ids": [int(t) for t in request.prompt_ids], "stream": True,
                "sampling_params": sampling_kwargs(request, self.config.seed)}
        conn = self._conn()
        try:
            conn.request("POST", "/inference/v1/generate", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
        except OSError as exc:
            conn.close()
            raise VllmError(f"vLLM server {self.vcfg.server_url} unreachable: {exc}") from exc
        if resp.status != 200:
            detail = resp.read()[:500]
            conn.close()
            raise EngineRequestError(f"vLLM server refused request {rid!r} ({resp.status}): {detail!r}")
        conn.sock.settimeout(None)  # tokens stop flowing while paused; the server closing the stream ends it
        self._inflight.add(rid)
        self._pool.submit(self._stream, request, conn, resp)

    def _stream(self, request: EngineRequest, conn: http.client.HTTPConnection, resp: Any) -> None:
        tokens: list[int] = []
        logprobs: list[float] = []
        spans, reason, finished = None, "abort", False
        try:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    raise VllmError(f"vLLM server error for {request.request_id!r}: {chunk['error']}")
                for choice in chunk.get("choices", []):
                    new = choice.get("token_ids") or []
                    tokens.extend(new)
                    content = (choice.get("logprobs") or {}).get("content") or []
                    logprobs.extend(float(c["logprob"]) for c in content)
                    self._counters["tokens"] += len(new)
                    if choice.get("finish_reason"):
                        reason, spans = choice["finish_reason"], choice.get("weight_versions")
                        finished = True
        except Exception as exc:  # noqa: BLE001 - the output records the failure; the request is not lost
            reason = "abort"
            err = f"{type(exc).__name__}: {exc}"
        else:
            err = None if finished else f"the stream ended after {len(tokens)} tokens without a finish_reason"
        finally:
            conn.close()
        versions = spans_to_versions(spans, len(tokens))
        if versions is None or len(logprobs) != len(tokens):
            err = err or f"no usable version spans ({spans!r}) or logprobs ({len(logprobs)}) for {len(tokens)} tokens"
            versions = np.full(len(tokens), -1, dtype=np.int32)
        out = EngineOutput(
            request_id=request.request_id, prompt_ids=list(request.prompt_ids),
            output_ids=np.asarray(tokens, dtype=np.int32),
            logprobs=np.asarray(logprobs[: len(tokens)] + [np.nan] * (len(tokens) - len(logprobs)), dtype=np.float32),
            versions=versions, finish_reason=reason if not err and reason in ("stop", "length") else "abort",
            text=self._tokenizer.decode(tokens, skip_special_tokens=True) if self._tokenizer and tokens else "",
            stats={"prompt_tokens": len(request.prompt_ids), "output_tokens": len(tokens),
                   "weight_versions": spans, **({"error": err} if err else {})},
        )
        self._finish(out)

    def _send_abort(self, request_id: str) -> None:
        self._http("POST", "/abort_requests", {"request_ids": [SERVER_PREFIX + request_id]})

    # ---------------------------------------------------------------- weights / pause
    def _reload(self, version: int, path: str, mode: str) -> dict[str, float]:
        """Pause (keep requests), reload in place via the worker extension, reset the prefix cache, relabel, resume."""
        t = time.perf_counter()
        self._http("POST", f"/pause?mode=keep&clear_cache={'true' if mode == 'recompute' else 'false'}")
        t_pause = time.perf_counter()
        try:
            result = self._http("POST", "/collective_rpc", {"method": RELOAD_METHOD, "args": [path]})["results"][0]
            t_load = time.perf_counter()
            reset = self._http("POST", "/reset_prefix_cache")
            self._http("POST", "/update_weight_version", {"new_version": str(version)})
        finally:
            t_reset = time.perf_counter()
            self._http("POST", "/resume")
        return {"pause_s": t_pause - t, "load_s": t_load - t_pause, "worker_load_s": float(result["load_s"]),
                "tensors": float(result["tensors"]), "reset_s": t_reset - t_load,
                "resume_s": time.perf_counter() - t_reset, "prefix_cache_reset": float(bool(reset["success"]))}

    def pause(self) -> None:
        self._http("POST", "/pause?mode=keep&clear_cache=false")

    def resume(self) -> None:
        self._http("POST", "/resume")

    def _own_stats(self) -> dict[str, Any]:
        return {"server_url": self.vcfg.server_url}

    def close(self) -> None:
        """Abort what is still running on the server (it would generate for nobody) and stop the stream threads."""
        if self._inflight:
            try:
                self._http("POST", "/abort_requests", {"request_ids": [SERVER_PREFIX + r for r in self._inflight]})
            except VllmError:
                pass
        self._pool.shutdown(wait=True, cancel_futures=True)


def server_command(model_dir: str, port: int = 8000, config: EngineConfig | None = None,
                   dtype: str = "bfloat16") -> list[str]:
    """The command that starts a vLLM server areal-mq can attach to (run it with server_env())."""
    cfg = config or EngineConfig()
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
        "--max-model-len", str(cfg.max_model_len or 2048), "--max-num-seqs", str(cfg.max_concurrent),
        "--gpu-memory-utilization", str(memory_utilization(cfg.vllm, vllm_on_cpu())),
        "--tensor-parallel-size", str(cfg.vllm.tensor_parallel_size or 1),
        "--logprobs-mode", "processed_logprobs", "--worker-extension-cls", EXTENSION_CLS,
        "--enable-scale-out", "--disable-log-stats",
        *([] if cfg.vllm.enable_prefix_caching else ["--no-enable-prefix-caching"]),
        *(["--enforce-eager"] if cfg.vllm.enforce_eager else []),
    ]


def server_env(config: EngineConfig | None = None) -> dict[str, str]:
    """Environment for server_command: this one plus dev mode and the CPU settings."""
    return {**os.environ, **cpu_env((config or EngineConfig()).vllm), "VLLM_SERVER_DEV_MODE": "1"}


def main(argv: list[str] | None = None) -> None:
    """python -m areal_mq.engines.vllm.server --model DIR [--port 8000] [--dtype bfloat16]: print and exec."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model", required=True, help="model directory (e.g. from areal_mq.engines.models)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    cmd = server_command(args.model, args.port, dtype=args.dtype)
    print("VLLM_SERVER_DEV_MODE=1", " ".join(cmd), flush=True)
    os.execvpe(cmd[0], cmd, server_env())


if __name__ == "__main__":
    main()
