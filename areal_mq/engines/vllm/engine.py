"""`engine: vllm` — vLLM's AsyncLLM run in process, behind the synchronous Engine contract.

What: `VllmEngine(config, model_path)` starts vLLM 0.32 (CPU backend here; on GPUs with
vllm.tensor_parallel_size GPUs and vllm.gpu_memory_utilization of each) with the areal-mq worker
extension and serves the rollout worker's calls: submit / step / update_weights / abort / pause /
resume / stats. Every finished sequence carries its token ids, behaviour logprobs (see
common.py for the logprob mode) and the policy version of every token.

How it maps onto vLLM:

    rollout thread (caller)                 vllm-loop thread (asyncio)            vLLM processes
    submit(req) ---- run_coroutine -------> add_request -> collector -----------> EngineCore + worker
    step()  <------- finished outputs ----- one consumer task per request  <----- token deltas
    update_weights(v, tensors) -- staged --> collective_rpc(areal_stage_packed, bucket) per bucket, while
                                              generation goes on (staging.py: each layer made ready off to the side)
    update_weights(v) --------------------> pause_generation(keep, clear_cache=recompute?)
                                            drain collectors (tokens so far = old version)
                                            collective_rpc(areal_swap_staged) (staged), or
                                              (areal_load_packed, bucket) per bucket (weight_update: serial),
                                              or (areal_reload_safetensors, path)
                                            reset_prefix_cache; update_weight_version("v"); resume

Versions: vLLM labels each output token with the weight version current when it was sampled
(`weight_versions` spans on the final output); the engine sets the label to str(version) on every
update and uses those spans. It also stamps tokens itself as they arrive (the loop's version, which
changes only while generation is paused and drained) and counts disagreements in
stats()["version_mismatches"] — the integration test asserts the two agree.

LoRA runs (vllm.max_lora_rank, set from trainer.lora): vLLM starts with one LoRA slot holding a zero adapter;
stage_adapter checks and writes each adapter version (off the pause), update_weights(adapter=...) swaps it into the
slot in place with add_lora inside the same pause / drain / relabel / resume (lora.py says why in place).

kv_on_update: "recompute" pauses with clear_cache=True: running requests are preempted and their
KV is recomputed under the new weights on resume. "keep" pauses with clear_cache=False: requests
continue on KV computed by the old weights (faster, slightly off-policy).

Why a background thread: vLLM's client is asyncio; the Engine contract is synchronous and
single-threaded. vLLM itself decodes in its own processes, so step() only collects what finished.

How to run: `build_engine(...)` with `engine: vllm`; needs vLLM (bash docker/install-vllm.sh) and an
`if __name__ == "__main__":` guard in the script that starts it (vLLM spawns processes).
Tests: tests/integration/test_vllm_engine.py (pytest -m vllm).
"""
from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any, Coroutine

import numpy as np

from areal_mq.engines.base import Engine, EngineOutput, EngineRequest
from areal_mq.engines.config import EngineConfig
from areal_mq.engines.models import check_model_dir
from areal_mq.engines.vllm.common import (
    VllmEngineBase,
    VllmError,
    check_request,
    cpu_env,
    require_vllm,
    sampling_kwargs,
    spans_to_versions,
    start_env,
)
from areal_mq.engines.vllm.config import engine_dtype, memory_utilization
from areal_mq.engines.vllm.lora import AdapterSlot, StagedAdapter, base_shapes, lora_args
from areal_mq.engines.vllm.worker import (DROP_METHOD, EXTENSION_CLS, LOAD_METHOD, LORA_TARGETS_METHOD, RELOAD_METHOD,
                                          STAGE_METHOD, SWAP_METHOD, pack)
from areal_mq.errors import EngineRequestError, WeightsLoadError

DEFAULT_MAX_MODEL_LEN = 2048  # when engine.max_model_len is unset (vLLM would take the model's 8k)


class _Req:
    """Per-request state, touched only on the loop thread (except `output`, read after `done`)."""

    def __init__(self, request: EngineRequest):
        self.request = request
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.stamps: list[int] = []  # our own version stamp per token
        self.text = ""
        self.collector: Any = None
        self.task: asyncio.Task | None = None
        self.output: EngineOutput | None = None
        self.adapter_path = ""  # LoRA runs: the adapter directory it was submitted with (held until it finishes)


class VllmEngine(VllmEngineBase):
    """In-process vLLM behind the Engine contract (see module docstring; the caller's side is VllmEngineBase)."""

    KIND = "vllm"
    IN_MEMORY = True

    def __init__(self, config: EngineConfig, model_path: str | os.PathLike, *, dtype: str | None = None,
                 model_dtype: str = "float32", seed: int = 0, version: int = 0):
        require_vllm()
        self._init_state(config, version)
        self.model_dir = Path(model_path).expanduser()
        check_model_dir(self.model_dir)  # the common mistakes, named at once instead of after a vLLM start
        self.max_model_len = config.max_model_len or DEFAULT_MAX_MODEL_LEN
        self._loop_version = version  # the version stamped on arriving tokens (loop thread)
        self._reqs: dict[str, _Req] = {}  # loop thread
        self._counters["version_mismatches"] = 0
        self._llm: Any = None
        # LoRA runs (vllm.max_lora_rank, from trainer.lora): adapter versions through vLLM's LoRA API (lora.py)
        self.lora = (AdapterSlot(self.vcfg.lora_dir, self.vcfg.max_lora_rank, base_shapes(self.model_dir))
                     if self.vcfg.max_lora_rank else None)
        self.accepts_adapters = self.lora is not None
        self._lora_req: Any = None  # the LoRARequest new requests carry (loop thread)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-loop", daemon=True)
        self._thread.start()
        self._dtype_asked = (dtype or config.dtype, model_dtype)
        self._start(seed)

    # ---------------------------------------------------------------- start / stop
    def _start(self, seed: int) -> None:
        import psutil

        os.environ.update(cpu_env(self.vcfg))  # read by vLLM's engine process, which inherits them
        os.environ.update(start_env())  # spawn, not fork, unless the user chose
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        started = time.monotonic()
        try:
            self._call(self._create(seed), self.vcfg.start_timeout_s, "start")
        except BaseException as exc:
            self._kill_new_children(before)
            self._stop_loop()
            if self.lora is not None:
                self.lora.close()
            if isinstance(exc, VllmError):
                raise
            raise VllmError(
                f"vLLM failed to start with model {self.model_dir} after {time.monotonic() - started:.0f} s: "
                f"{type(exc).__name__}: {exc}. Check the model directory and the vLLM log above."
            ) from exc
        self.start_s = time.monotonic() - started

    async def _create(self, seed: int) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        self.on_cpu = current_platform.is_cpu()
        asked, model_dtype = self._dtype_asked
        self.dtype = dtype = engine_dtype(asked, model_dtype, self.vcfg.cuda_dtype, self.on_cpu)
        args = AsyncEngineArgs(
            model=str(self.model_dir), tokenizer=str(self.model_dir), dtype=dtype, seed=seed,
            max_model_len=self.max_model_len, max_num_seqs=self.config.max_concurrent,
            tensor_parallel_size=self.vcfg.tensor_parallel_size or 1,
            gpu_memory_utilization=memory_utilization(self.vcfg, self.on_cpu), enforce_eager=self.vcfg.enforce_eager,
            enable_prefix_caching=self.vcfg.enable_prefix_caching, logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION_CLS, disable_log_stats=True,
            **(lora_args(self.vcfg.max_lora_rank) if self.lora is not None else {}),
        )
        self._llm = AsyncLLM.from_engine_args(args)
        self._vocab = self._llm.model_config.get_vocab_size()
        await self._llm.update_weight_version(str(self.version))
        if self.lora is not None:  # the slot starts with the base (a zero adapter): every request carries it
            targets = (await self._llm.collective_rpc(LORA_TARGETS_METHOD))[0]
            self.lora.targets = frozenset(targets)
            zero = self.lora.zero(targets)
            if not await self._llm.add_lora(self.lora.request(self.version, zero, inplace=False)):
                raise VllmError(f"vLLM did not load the starting (zero) adapter {zero.path}")
            self._serve_adapter(self.version, zero)

    def _kill_new_children(self, before: set[int]) -> None:
        """After a failed start: stop the processes this start spawned (by PID), nothing else."""
        import psutil

        for child in psutil.Process().children(recursive=True):
            if child.pid not in before:
                try:
                    child.kill()
                except psutil.Error:
                    pass

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def close(self) -> None:
        """Shut vLLM down (its processes exit) and stop the loop thread. Idempotent."""
        llm, self._llm = self._llm, None
        if llm is not None and self._loop.is_running():
            async def shutdown() -> None:
                llm.shutdown()

            try:
                self._call(shutdown(), 60, "shutdown")
            except VllmError:
                pass
        self._stop_loop()
        if self.lora is not None:
            self.lora.close()

    def _call(self, coro: Coroutine, timeout: float, what: str) -> Any:
        """Run a coroutine on the loop thread and wait for it, at most `timeout` seconds."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout)
        except TimeoutError as exc:
            future.cancel()
            raise VllmError(f"vLLM {what} did not finish within {timeout:.0f} s") from exc

    # ---------------------------------------------------------------- requests
    def submit(self, request: EngineRequest) -> None:
        self._check_alive()
        check_request(request, self.max_model_len, self._vocab)
        if request.request_id in self._inflight:
            raise EngineRequestError(f"request id {request.request_id!r} is already running; ids must be unique")
        self._call(self._add(request), self.vcfg.request_timeout_s, "add_request")
        self._inflight.add(request.request_id)

    async def _add(self, request: EngineRequest) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(**sampling_kwargs(request, self.config.seed), output_kind=RequestOutputKind.DELTA)
        (engine_input,) = await self._llm.renderer.render_cmpl_async(
            [{"prompt_token_ids": [int(t) for t in request.prompt_ids]}]
        )
        state = _Req(request)
        try:
            state.collector = await self._llm.add_request(request.request_id, engine_input, params,
                                                          lora_request=self._lora_req)
        except Exception as exc:  # vLLM's own validation (e.g. a too-long prompt)
            raise EngineRequestError(f"vLLM refused request {request.request_id!r}: {exc}") from exc
        if self._lora_req is not None:
            state.adapter_path = self._lora_req.lora_path
            self.lora.hold(state.adapter_path)
        self._reqs[request.request_id] = state
        state.task = asyncio.create_task(self._consume(state))

    async def _consume(self, state: _Req) -> None:
        try:
            while state.output is None:
                out = await state.collector.get()
                self._absorb(state, out)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # engine died: every waiter must learn it
            with self._cond:
                self._dead = exc
                self._cond.notify_all()

    def _absorb(self, state: _Req, out: Any) -> None:
        """Append a delta output to the request's state; finalize it when vLLM says it finished."""
        comp = out.outputs[0]
        new = list(comp.token_ids)
        state.tokens.extend(new)
        state.stamps.extend([self._loop_version] * len(new))
        for tok, entry in zip(new, comp.logprobs or []):
            state.logprobs.append(float(entry[tok].logprob))
        state.text += comp.text or ""
        self._counters["tokens"] += len(new)
        if out.finished:
            self._finalize(state, comp)

    def _finalize(self, state: _Req, comp: Any) -> None:
        n = len(state.tokens)
        stamps = np.asarray(state.stamps, dtype=np.int32)
        spans = spans_to_versions(comp.weight_versions, n)
        if spans is None or len(state.logprobs) != n:
            raise VllmError(
                f"vLLM returned {len(state.logprobs)} logprobs and version spans {comp.weight_versions!r} for {n} "
                f"tokens of request {state.request.request_id!r}"
            )
        if not np.array_equal(spans, stamps):
            self._counters["version_mismatches"] += 1
        reason = comp.finish_reason if comp.finish_reason in ("stop", "length", "abort") else "abort"
        state.output = EngineOutput(
            request_id=state.request.request_id, prompt_ids=list(state.request.prompt_ids),
            output_ids=np.asarray(state.tokens, dtype=np.int32), logprobs=np.asarray(state.logprobs, dtype=np.float32),
            versions=spans, finish_reason=reason, text=state.text,
            stats={"prompt_tokens": len(state.request.prompt_ids), "output_tokens": n, "own_versions": stamps, "weight_versions": [(s.version, s.start, s.end) for s in comp.weight_versions]},
        )
        self._reqs.pop(state.request.request_id, None)
        if state.adapter_path:
            self.lora.release(state.adapter_path)
            state.adapter_path = ""
        if state.task is not None and state.task is not asyncio.current_task():
            state.task.cancel()
        self._finish(state.output)

    def _send_abort(self, request_id: str) -> None:
        self._call(self._llm.abort(request_id), self.vcfg.request_timeout_s, "abort")

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise VllmError(f"the vLLM engine failed: {type(self._dead).__name__}: {self._dead}") from self._dead
        if self._llm is None:
            raise VllmError("the vLLM engine is closed")

    # ---------------------------------------------------------------- weights / pause
    def _reload(self, version: int, path: str, mode: str) -> dict[str, float]:
        return self._call(self._update(version, mode, path=path), self.vcfg.request_timeout_s, "weight update")

    def _load_tensors(self, version: int, tensors: Any, mode: str) -> dict[str, float]:
        """In memory, through vLLM's RPC (no file, no /dev/shm); vllm.weight_update chooses how:

        staged: bucket by bucket while generation goes on (at most vllm.stage_buckets_in_flight packed at once),
        each made ready in the worker without changing what it computes (staging.py); then pause, swap, resume.
        serial: every bucket packed, then pause, send and load them one by one, resume (the pause holds it all)."""
        if self.vcfg.weight_update == "serial":
            t0 = time.perf_counter()
            packed = [pack(bucket) for bucket in buckets(tensors, self.vcfg.weight_bucket_mb << 20)]
            pack_s = time.perf_counter() - t0
            timeout = self.vcfg.request_timeout_s * max(1, len(packed))
            timings = self._call(self._update(version, mode, packed=packed), timeout, "weight update")
            return {"pack_s": pack_s, "buckets": float(len(packed)), **timings}
        staged = self._stage(tensors)
        return {**staged, **self._call(self._update(version, mode, swap=True), self.vcfg.request_timeout_s,
                                       "weight update")}

    def _stage(self, tensors: Any) -> dict[str, float]:
        """Send every bucket to the workers' staging while generation goes on; returns its timings."""
        from collections import deque

        t0, pack_s, window = time.perf_counter(), 0.0, deque()
        groups = buckets(tensors, self.vcfg.weight_bucket_mb << 20, whole_layers=True)
        try:
            for i, bucket in enumerate(groups):
                t = time.perf_counter()
                names, dtypes, shapes, blob = pack(bucket)
                pack_s += time.perf_counter() - t
                args = (names, dtypes, shapes, blob, i == 0, i == len(groups) - 1)
                window.append(asyncio.run_coroutine_threadsafe(self._llm.collective_rpc(STAGE_METHOD, args=args),
                                                               self._loop))
                del names, dtypes, shapes, blob, args
                while len(window) >= self.vcfg.stage_buckets_in_flight or (window and i == len(groups) - 1):
                    window.popleft().result(timeout=self.vcfg.request_timeout_s)
        except BaseException as exc:
            for future in window:
                future.cancel()
            try:
                self._call(self._llm.collective_rpc(DROP_METHOD), self.vcfg.request_timeout_s, "drop staged weights")
            except Exception:  # noqa: BLE001 - the first error is the one to report
                pass
            if isinstance(exc, TimeoutError):
                raise VllmError(f"staging a weight bucket took over {self.vcfg.request_timeout_s:.0f} s") from exc
            raise
        return {"stage_s": time.perf_counter() - t0, "pack_s": pack_s, "buckets": float(len(groups))}

    async def _load(self, path: str | None, packed: list | None, swap: bool = False,
                    adapter: Any = None) -> dict[str, float]:
        """The load step of an update, on every worker: an adapter version into the LoRA slot (in place), the staged
        version's swap, from a path, or bucket by bucket from memory."""
        if adapter is not None:  # (version, StagedAdapter): vLLM loads and checks it before evicting the old one
            t = time.perf_counter()
            if not await self._llm.add_lora(self.lora.request(adapter[0], adapter[1], inplace=True)):
                raise WeightsLoadError(f"vLLM did not load adapter version v{adapter[0]} ({adapter[1].path})")
            return {"tensors": float(2 * adapter[1].modules), "worker_load_s": time.perf_counter() - t}
        if swap:
            results = await self._llm.collective_rpc(SWAP_METHOD)
            return {"tensors": float(results[0]["tensors"]), "worker_load_s": float(results[0]["load_s"]),
                    "worker_stage_s": float(results[0]["stage_s"])}
        if packed is None:
            results = await self._llm.collective_rpc(RELOAD_METHOD, args=(path,))
            return {"tensors": float(results[0]["tensors"]), "worker_load_s": float(results[0]["load_s"])}
        tensors, load_s = 0, 0.0
        for i, (names, dtypes, shapes, blob) in enumerate(packed):
            results = await self._llm.collective_rpc(LOAD_METHOD, args=(names, dtypes, shapes, blob, i == 0,
                                                                        i == len(packed) - 1))
            tensors += int(results[0]["tensors"])
            load_s += float(results[0]["load_s"])
        return {"tensors": float(tensors), "worker_load_s": load_s}

    async def _update(self, version: int, mode: str, path: str | None = None,
                      packed: list | None = None, swap: bool = False, adapter: Any = None) -> dict[str, float]:
        llm, t = self._llm, time.perf_counter()
        await llm.pause_generation(mode="keep", clear_cache=(mode == "recompute"))
        for state in list(self._reqs.values()):  # tokens already produced belong to the old version
            out = state.collector.get_nowait()
            if out is not None:
                self._absorb(state, out)
        t_pause = time.perf_counter()
        try:
            loaded = await self._load(path, packed, swap, (version, adapter) if adapter is not None else None)
            if adapter is not None:
                self._serve_adapter(version, adapter)
            t_load = time.perf_counter()
            reset_ok = await llm.reset_prefix_cache()  # blocks cached under the old weights must not be reused
            await llm.update_weight_version(str(version))
            self._loop_version = version
        finally:
            t_reset = time.perf_counter()
            await llm.resume_generation()
        t_end = time.perf_counter()
        return {
            "pause_s": t_pause - t, "load_s": t_load - t_pause, **loaded, "reset_s": t_reset - t_load,
            "resume_s": t_end - t_reset, "prefix_cache_reset": float(bool(reset_ok)), "paused_s": t_end - t,
        }

    # ---------------------------------------------------------------- LoRA versions (lora.py)
    def stage_adapter(self, tensors: Any, scaling: float, max_rank: int | None = None) -> StagedAdapter:
        """Check a LoRA version and write it for vLLM (lora.py; off the pause, on the fetch thread); raises
        AdapterError, a WeightsLoadError, without touching what is served. update_weights(adapter=...) swaps it in."""
        if self.lora is None:
            raise WeightsLoadError("this vLLM engine was started without LoRA (rollout.engine.vllm.max_lora_rank, set "
                                   "from trainer.lora by the run's config check) and takes no adapter versions")
        return self.lora.stage(tensors, scaling, max_rank)

    def update_weights(self, version: int, tensors: Any = None, path: str | None = None,
                       kv_on_update: str | None = None, adapter: StagedAdapter | None = None) -> dict[str, float]:
        """A full version (VllmEngineBase.update_weights), or a LoRA version staged by stage_adapter (adapter=): at a
        step boundary every running sequence moves to it, its tokens from there on carry `version`."""
        if adapter is None:
            if self.lora is not None:
                raise WeightsLoadError(f"v{version} is a full version, and this vLLM engine serves the LoRA adapter "
                                       "versions of trainer.lora on its base: publish adapters, or start it without "
                                       "rollout.engine.vllm.max_lora_rank")
            return super().update_weights(version, tensors, path, kv_on_update)
        if tensors is not None or path is not None:
            raise WeightsLoadError("update_weights takes adapter= alone")
        self._check_alive()
        mode = kv_on_update or self.config.kv_on_update
        t0 = time.perf_counter()
        try:
            timings = self._call(self._update(version, mode, adapter=adapter), self.vcfg.request_timeout_s,
                                 "adapter update")
        except VllmError:
            raise
        except Exception as exc:  # vLLM refused it (its LoRA checks): the previous version is still served
            self.lora.discard(adapter)
            if isinstance(exc, WeightsLoadError):
                raise
            raise WeightsLoadError(f"vLLM refused LoRA version v{version}: {type(exc).__name__}: "
                                   f"{str(exc)[:500]}") from exc
        self.version = version
        self._counters["updates"] += 1
        timings["total_s"] = time.perf_counter() - t0
        self._last_update = timings
        return timings

    def _serve_adapter(self, version: int, staged: StagedAdapter) -> None:
        """(loop thread) The slot holds `staged` as version `version`: new requests carry it from now on."""
        self._lora_req = self.lora.request(version, staged, inplace=False)
        self.lora.swapped(staged)

    def loaded_adapters(self) -> list[int]:
        """The adapter ids vLLM holds now (at most one: the slot)."""
        self._check_alive()
        return sorted(self._call(self._llm.list_loras(), self.vcfg.request_timeout_s, "list_loras"))

    def pause(self) -> None:
        """Freeze generation (requests keep their state and KV) until resume()."""
        self._check_alive()
        self._call(self._llm.pause_generation(mode="keep", clear_cache=False), self.vcfg.request_timeout_s, "pause")

    def resume(self) -> None:
        self._check_alive()
        self._call(self._llm.resume_generation(), self.vcfg.request_timeout_s, "resume")

    def _own_stats(self) -> dict[str, Any]:
        lora = {} if self.lora is None else {"adapter": self._lora_req.lora_name if self._lora_req else "",
                                             "adapter_dirs": len(self.lora.dirs())}
        return {"version_mismatches": self._counters["version_mismatches"],
                "kv_cache_space_gib": self.vcfg.kv_cache_space_gib, **lora}


def buckets(tensors: Any, limit: int, whole_layers: bool = False) -> list[list[tuple[str, Any]]]:
    """(name, CPU tensor) pairs in groups of about `limit` bytes, in the mapping's order (a larger tensor alone).

    whole_layers (the staged path): ordered decoder layer by decoder layer, the tensors outside every layer last,
    and a decoder layer never split across buckets (one larger than `limit` travels alone)."""
    import torch

    from areal_mq.engines.vllm.staging import group_order, layer_key

    def as_tensor(t: Any) -> Any:
        return t if isinstance(t, torch.Tensor) else torch.from_numpy(np.asarray(t))

    def nbytes(t: Any) -> int:
        return t.numel() * t.element_size()

    if not whole_layers:
        units = [[(name, as_tensor(t))] for name, t in tensors.items()]
    else:
        units, last = [], None
        for name in group_order(tensors.keys()):
            key = layer_key(name)
            if key != last or key < 0:
                units.append([])
            units[-1].append((name, as_tensor(tensors[name])))
            last = key
    out: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for unit in units:
        n = sum(nbytes(t) for _, t in unit)
        if out[-1] and size + n > limit:
            out.append([])
            size = 0
        out[-1].extend(unit)
        size += n
    return out


def build(engine_cfg: EngineConfig, model_cfg: Any = None, seed: int | None = None, **kwargs: Any) -> Engine:
    """Builder for `engine: vllm` and `engine: vllm-server` (used by areal_mq.engines.build_engine)."""
    from areal_mq.engines.models import DEFAULT_MODEL, load_tokenizer, resolve_model

    model_dir = kwargs.get("model_dir") or resolve_model(
        getattr(model_cfg, "name", DEFAULT_MODEL), getattr(model_cfg, "cache_dir", None))
    if engine_cfg.kind == "vllm-server":
        from areal_mq.engines.vllm.server import VllmServerEngine

        # the server answers token ids only: without the model's tokenizer every completion's text is "",
        # so every reward is the same and every group uniform
        tokenizer = kwargs.get("tokenizer") or load_tokenizer(model_dir)
        return VllmServerEngine(engine_cfg, tokenizer=tokenizer)
    pin_cuda_device(kwargs.get("device"), engine_cfg.vllm.tensor_parallel_size or 1)
    return VllmEngine(engine_cfg, model_dir, model_dtype=getattr(model_cfg, "dtype", "float32"), seed=seed or 0)


def pin_cuda_device(spec: str | None, tp: int, environ: Any = None) -> None:
    """`cuda:N` (model.device / rollout.device) as vLLM understands a device: CUDA_VISIBLE_DEVICES starting at
    the N-th GPU this process sees (tp of them; vLLM always takes the first ones it sees). `auto`, `cuda` and
    `cpu` leave the environment alone (placement already set it, or every GPU is vLLM's to take)."""
    from areal_mq.errors import ConfigError

    env = os.environ if environ is None else environ
    if not spec or not spec.startswith("cuda:"):
        return
    index = int(spec.split(":", 1)[1])
    visible = env.get("CUDA_VISIBLE_DEVICES")
    ids = [g for g in visible.split(",") if g.strip()] if visible is not None else None
    if ids is None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(index + i) for i in range(tp))
        return
    if index + tp > len(ids):
        raise ConfigError(f"device {spec} with tensor_parallel_size {tp} needs GPUs {index}..{index + tp - 1} of the "
                          f"{len(ids)} this worker sees (CUDA_VISIBLE_DEVICES={visible!r}); use cuda or fewer GPUs")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[index:index + tp])
