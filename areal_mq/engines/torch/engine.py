"""The embedded torch inference engine (`engine: torch`): continuous batching, paged KV, interruptible updates.

What: `TorchEngine` implements `areal_mq.engines.base.Engine` with plain PyTorch on one device (cpu, cuda:N;
`rollout.device` else `model.device`, areal_mq/devices.py). One `step()`:

    admit waiting requests (FIFO, while max_concurrent and the free KV blocks allow, and max_reserved_tokens
             where set: engines/admission.py)
The decisions of admit, prefill and decode (which rows, which chunks, which row is preempted) are the pure scheduler's
(engines/scheduler.py, over the pool's bookkeeping in engines/blocks.py); this class does the tensor work around
them. `areal-mq plan` drives the same scheduler at full scale in virtual time (engines/twin.py).
    prefill: write KV for pending prompt / recompute tokens, at most `prefill_chunk_tokens` per step
             (chunked, so decoding never stalls for long)
    decode:  one token for every sequence whose KV is complete, each at its own position
    finish:  sequences that hit EOS / a stop token / a stop string / max_new_tokens leave at once

KV memory (kvcache.py): one pool of fixed-size blocks; each sequence holds a block table and takes a block when
its tokens reach it. When a step needs a block and the pool is empty, the youngest sequence (latest submitted)
is preempted: its blocks go back to the pool and it waits at the head of the queue, to be recomputed from its
tokens (prompt and what it generated so far, which keep their logprobs and versions) when blocks are free again
(`preempted`, `preempted_tokens` in stats()). A row is "ready" when KV covers all its tokens but the last,
which decode feeds next.

Prefix sharing (`share_prefill`): rows whose next prefill chunk is the same tokens on an identical KV history
(the n samples of one GRPO prompt) compute it once; the others point their block tables at the computing row's
blocks (reference counts). The partial last block is copied on the first write into it (copy-on-write), so a
group of 8 stores its prompt's KV once plus 8 partial blocks.

Weight updates (`update_weights`) happen between steps, in place. In-flight sequences continue: with
`kv_on_update: keep` their KV stays; with `recompute` (default) their blocks are freed and their KV rebuilt
through the same chunked prefill path (shortest sequences first, so decoding resumes quickly), in chunks of
`recompute_chunk_tokens` per step while any row recomputes. With `kv_gap_rows` > 0 the update also measures the
logprob gap keeping the old KV leaves (update_gap.py) and returns it with its timings.
Every token carries the version of the weights that produced its logits.

Session KV (`session_kv_max_tokens` > 0): a finished request with a session leaves a copy of its KV in
`self.sessions` (session.py); the session's next request reuses the rows of its common token prefix at
admission and prefills only the rest. Kept KV holds no pool blocks, so it never delays admission.

Behaviour logprobs follow the base.py convention (log_softmax(logits / T) before top-p/top-k).

Device: weights, KV pool, RoPE tables, index tensors, per-request generators, sampling and logprobs all live on
the engine's device. The decode step itself (forward.py `decode_step`) never waits for the device; the loop
reads the sampled tokens and logprobs back once per step, after it. With `cuda_graphs` the step runs in
fixed-shape buckets (batch, blocks per row), replayed as CUDA graphs on CUDA (graphs.py).

How to run: `build_engine(EngineConfig(), ModelConfig())` from areal_mq.engines; tests in
tests/unit/engines/test_torch_engine*.py; throughput in benchmarks/speed/engine.py.
"""
from __future__ import annotations

import hashlib
import itertools
import time
from collections import deque
from pathlib import Path
from typing import Any, Mapping

import torch

from areal_mq.engines.base import Engine, EngineOutput, EngineRequest
from areal_mq.engines.config import EngineConfig
from areal_mq.engines.models import load_causal_lm, load_tokenizer
from areal_mq.engines.scheduler import Scheduler
from areal_mq.engines.sampling import sample_tokens
from areal_mq.engines.torch.forward import LlamaRunner
from areal_mq.engines.torch.graphs import BucketedDecoder
from areal_mq.engines.torch.kvcache import bytes_per_token, pool_blocks
from areal_mq.engines.torch.seq import SeqState, build_output
from areal_mq.engines.torch.session import SessionKV
from areal_mq.engines.torch.update_gap import kv_logprob_gap
from areal_mq.engines.torch.adapter import AdapterState
from areal_mq.engines.torch.weights import load_weights_in_place, patch_weights_in_place, stage_patches
from areal_mq.errors import EngineRequestError

RATE_WINDOW_S = 10.0  # tokens_per_s in stats() is measured over this window


class TorchEngine(Engine):
    """Continuous-batching engine over a LlamaRunner (see module docstring)."""

    accepts_patches = True  # update_weights(version, patches=...): only the changed elements (weight deltas)
    accepts_adapters = True  # update_weights(version, adapter=stage_adapter(...)): LoRA versions (adapter.py)

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, dtype: str = "float32",
                 seed: int | None = None, tokenizer: Any = None, device: Any = "cpu"):
        from areal_mq.devices import resolve_device

        self.cfg = config or EngineConfig()
        self.device = device if isinstance(device, torch.device) else resolve_device(device)
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        self.dtype = dtype if self.cfg.dtype == "auto" else self.cfg.dtype
        t0 = time.perf_counter()
        self.model_dir = Path(model_dir)  # the base: a LoRA version's base_checksum is checked against it
        self.model = load_causal_lm(model_dir, self.dtype, device=self.device)
        self.load_s = time.perf_counter() - t0
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
        limit = getattr(self.model.config, "max_position_embeddings", 2048)
        self.max_len = min(self.cfg.max_model_len or min(limit, 2048), limit)
        self.runner = LlamaRunner(self.model, self.max_len, attention=self._attention())
        self.adapters: AdapterState | None = None  # LoRA versions: the kept base (made by the first stage_adapter)
        self.cache = self.runner.new_cache(self._pool_blocks(), self.cfg.kv_block_size)
        self.sched = Scheduler.for_config(self.cache, self.cfg)  # admission, prefill chunks, preemption: pure
        self.decoder = None  # exact-shape eager decode (runner.decode) unless cuda_graphs
        graphs = self.cfg.cuda_graphs
        if graphs == "auto":  # measured on an H200 with paged KV: 3.7x the eager long tail (benchmarks/RESULTS.md)
            graphs = self.device.type == "cuda"
        if graphs:
            self.decoder = BucketedDecoder(self.runner, self.cache, self.cfg.max_concurrent,
                                           capture=self.device.type == "cuda")
        self.vocab_size = self.runner.vocab_size
        self.eos_ids = self._eos_ids()
        self.seed = self.cfg.seed if self.cfg.seed is not None else seed
        self.version = 0
        self.paused = False
        self.live: dict[str, SeqState] = {}
        self._rate: deque[tuple[float, int]] = deque()
        self._order = itertools.count()
        self.counters = {"steps": 0, "generated_tokens": 0, "prefilled_tokens": 0, "shared_prefill_tokens": 0,
                         "finished": 0, "session_kv_hits": 0, "prefill_tokens_saved": 0}
        self.sessions = SessionKV(self.cfg.session_kv_max_tokens, self.cfg.session_kv_ttl_s)

    @property
    def cfg(self) -> EngineConfig:
        return self._cfg

    @cfg.setter
    def cfg(self, cfg: EngineConfig) -> None:  # a config replaced between steps reaches the scheduler's knobs too
        self._cfg = cfg
        if hasattr(self, "sched"):
            self.sched.configure(cfg)

    @property
    def waiting(self) -> deque[SeqState]:
        return self.sched.waiting

    @property
    def rows(self) -> list[SeqState]:
        return self.sched.rows

    def _attention(self) -> str:
        """decode_attention, `auto` resolved: FlexAttention on CUDA, the plain path on the CPU (flex.py says why)."""
        if self.cfg.decode_attention != "auto":
            return self.cfg.decode_attention
        return "flex" if self.device.type == "cuda" else "plain"

    def _pool_blocks(self) -> int:
        """Blocks of the KV pool: kv_cache_bytes; else on CUDA kv_cache_fraction of free memory; else (CPU)
        max_kv_tokens positions, at most max_concurrent x max_model_len (untouched pages cost nothing: kvcache.py)."""
        r, bs = self.runner, self.cfg.kv_block_size
        per_token = bytes_per_token(len(r.layers), r.n_kv, r.head_dim, r.dtype)
        if self.cfg.kv_cache_bytes is not None:
            budget = self.cfg.kv_cache_bytes
        elif self.device.type == "cuda":
            budget = int(torch.cuda.mem_get_info(self.device)[0] * self.cfg.kv_cache_fraction)
        else:  # never more than max_concurrent sequences of max_len could use
            tokens = min(self.cfg.max_kv_tokens, self.cfg.max_concurrent * (self.max_len + bs))
            budget = (max(tokens, self.cfg.max_concurrent * bs) + 2 * bs) * per_token
        return pool_blocks(budget, per_token, bs, self.cfg.max_concurrent)

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gen_eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        for value in (gen_eos, self.tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(int(v) for v in value)
        return frozenset(ids)

    # -- requests --------------------------------------------------------------------------------

    def submit(self, request: EngineRequest) -> None:
        sp = request.sampling
        sp.check()
        rid = request.request_id
        if rid in self.live:
            raise EngineRequestError(f"request id {rid!r} is already running; use a unique id per request")
        prompt = list(request.prompt_ids)
        if not prompt:
            raise EngineRequestError(f"request {rid!r}: empty prompt; send at least one token")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise EngineRequestError(f"request {rid!r}: token ids {bad[:5]} are outside the vocabulary "
                                     f"[0, {self.vocab_size})")
        need = len(prompt) + sp.max_new_tokens
        if need > self.max_len:
            raise EngineRequestError(
                f"request {rid!r}: prompt ({len(prompt)} tokens) + max_new_tokens ({sp.max_new_tokens}) = "
                f"{need} exceeds the context limit {self.max_len}; shorten the prompt or lower max_new_tokens")
        cap = self.cfg.max_reserved_tokens
        if cap is not None and need > cap:
            raise EngineRequestError(f"request {rid!r}: reserves {need} KV tokens, more than max_reserved_tokens "
                                     f"({cap}); raise it or shorten the request")
        if need > self.cache.capacity_tokens:
            raise EngineRequestError(f"request {rid!r}: needs {need} KV tokens, more than the whole KV pool holds "
                                     f"({self.cache.capacity_tokens}); raise kv_cache_bytes or shorten the request")
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_ids))
        seq = SeqState(request=request, tokens=prompt, n_prompt=len(prompt), stop_ids=frozenset(stops),
                        reserved=need, generator=self._generator(request), submitted_at=time.perf_counter(),
                        order=next(self._order))
        self.sched.add(seq)
        self.live[rid] = seq

    def _generator(self, request: EngineRequest) -> torch.Generator | None:
        sp = request.sampling
        if sp.temperature <= 0:
            return None
        if sp.seed is not None:
            seed = sp.seed
        elif self.seed is not None:  # reproducible, and different for every request id
            digest = hashlib.blake2b(f"{self.seed}:{request.request_id}".encode(), digest_size=8).digest()
            seed = int.from_bytes(digest, "little") >> 1
        else:
            seed = int(torch.seed())
        return torch.Generator(device=self.device).manual_seed(seed)

    def has_work(self) -> bool:
        return self.sched.has_work()

    def abort(self, request_id: str) -> EngineOutput | None:
        seq = self.live.pop(request_id, None)
        if seq is None:
            return None
        self.sched.abort(seq)
        return build_output(seq, "abort", self.tokenizer)

    def progress(self, request_id: str) -> tuple[list[int], list[float], list[int]] | None:
        seq = self.live.get(request_id)
        return None if seq is None else (seq.output_ids, seq.logprobs, seq.versions)

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    # -- stepping --------------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        if self.sessions.entries:
            self.sessions.expire()  # an idle engine frees kept KV on time too
        if self.paused or not self.has_work():
            return []
        self._admit()
        self._prefill()
        finished = self._decode()
        self.counters["steps"] += 1
        self.sched.tick()
        if self.cfg.step_delay_s:
            time.sleep(self.cfg.step_delay_s)  # test knob: generation slower than training, deterministically
        return finished

    def _admit(self) -> None:
        """Admission by the scheduler's rule (engines/scheduler.py, engines/admission.py); an admitted row of a
        session reuses the KV its previous turn left."""
        for seq in self.sched.admit():
            if seq.request.session and self.sessions.enabled:
                self._reuse_session_kv(seq)

    def _reuse_session_kv(self, seq: SeqState) -> None:
        """Fill `seq`'s first blocks with the KV the session's previous turn left for the prompt's common prefix."""
        seq.kv_reused = self.sessions.restore(self.cache, seq)
        if seq.kv_reused:
            self.counters["session_kv_hits"] += 1
            self.counters["prefill_tokens_saved"] += seq.kv_reused

    # -- prefill and decode ----------------------------------------------------------------------

    def _prefill(self) -> None:
        """Compute the KV chunks the scheduler picked (engines/scheduler.py `plan_prefill`: chunked, shared among
        the samples of one prompt, preempting for blocks only when no row is ready to decode)."""
        plan = self.sched.plan_prefill()
        if not plan.picked:
            return
        self.runner.extend(self.cache, [s.table for s in plan.picked], plan.starts, plan.chunks)
        shared = self.sched.commit_prefill(plan, self.version)
        self.counters["prefilled_tokens"] += sum(len(c) for c in plan.chunks)
        self.counters["shared_prefill_tokens"] += shared

    def _decode(self) -> list[EngineOutput]:
        rows = self.sched.decode_rows()
        if not rows:
            return []
        tokens, positions = [s.tokens[-1] for s in rows], [len(s.tokens) - 1 for s in rows]
        tables = [s.table for s in rows]
        if self.decoder is not None:  # bucketed, padded (and on CUDA graph-replayed): a view, used at once
            logits = self.decoder(tokens, positions, tables)
        else:
            logits = self.runner.decode(self.cache, tokens, positions, tables)
        sps = [s.request.sampling for s in rows]
        new, logprobs = sample_tokens(logits, [p.temperature for p in sps], [p.top_p for p in sps],
                                      [p.top_k for p in sps], [s.generator for s in rows])
        # the one read-back of the step: tokens and logprobs in one transfer (float64 holds both exactly)
        host_tokens, host_logprobs = torch.stack((new.double(), logprobs.double())).tolist()
        now = time.perf_counter()
        outputs = []
        for seq, tok, lp in zip(rows, host_tokens, host_logprobs):
            seq.advance_kv(seq.tokens[-1:], self.version)
            reason = seq.append(int(tok), lp, self.version, now, self.tokenizer)
            if reason is not None:
                if seq.request.session and self.sessions.enabled:
                    self.sessions.save(self.cache, seq)
                self.sched.remove(seq)
                del self.live[seq.request.request_id]
                outputs.append(build_output(seq, reason, self.tokenizer))
        self._count_rate(now, len(rows))
        self.counters["finished"] += len(outputs)
        return outputs

    def _count_rate(self, now: float, tokens: int) -> None:
        self.counters["generated_tokens"] += tokens
        self._rate.append((now, tokens))
        while self._rate and now - self._rate[0][0] > RATE_WINDOW_S:
            self._rate.popleft()

    # -- weights ---------------------------------------------------------------------------------

    def stage_patches(self, patches: Mapping[str, Any]) -> Any:
        """Check and convert a patch update for this engine's parameters (safe off the decode thread: it only reads
        their shapes, dtypes and devices); update_weights(patches=staged) is then only the scatter."""
        return stage_patches(self.model, patches)

    def stage_adapter(self, tensors: Mapping[str, Any], scaling: float, max_rank: int | None = None) -> Any:
        """Check and merge a LoRA adapter version from the kept base (adapter.py; safe off the decode thread);
        update_weights(adapter=staged) is then only the copies."""
        if self.adapters is None:
            self.adapters = AdapterState(self.model)
        return self.adapters.stage(tensors, scaling, max_rank)

    def update_weights(self, version: int, tensors: Mapping[str, Any] | None = None,
                       path: str | None = None, patches: Mapping[str, Any] | None = None,
                       adapter: Any = None) -> dict[str, float]:
        """A full state dict (tensors= or path=) or, from a worker that knows what changed since the weights the
        engine holds, only the changed elements (patches=: name -> (flat positions, values)), or a LoRA adapter
        version staged by stage_adapter (adapter=: merged into the weights from the kept base)."""
        t0 = time.perf_counter()
        if adapter is not None:
            n = self.adapters.apply(adapter)
        elif patches is not None:
            n = patch_weights_in_place(self.model, patches)
        else:
            n = load_weights_in_place(self.model, tensors=tensors, path=path)
            if self.adapters is not None:
                self.adapters.reset()  # the full version is the base any later adapter applies to
        t1 = time.perf_counter()
        self.version = int(version)
        gap = kv_logprob_gap(self.runner, self.cache, self.rows, self.cfg.kv_gap_rows) if self.cfg.kv_gap_rows else {}
        t_gap = time.perf_counter() - t1
        stale = 0
        if self.cfg.kv_on_update == "recompute":
            self.sessions.clear()  # kept KV of finished turns is as stale as the in-flight KV
            stale = self.sched.drop_kv()  # all KV is invalid: freed, rebuilt shortest row first
        t2 = time.perf_counter()
        return {"load_s": t1 - t0, "pause_s": t2 - t1 - t_gap, "tensors": float(n), "in_flight": float(len(self.rows)),
                "recompute_tokens": float(stale), **gap}

    # -- introspection ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        window = (self._rate[-1][0] - self._rate[0][0]) if len(self._rate) > 1 else 0.0
        rate = sum(t for _, t in list(self._rate)[1:]) / window if window > 0 else 0.0
        return {
            "engine": "torch", "version": self.version, "running": len(self.rows), "waiting": len(self.waiting),
            "ready": sum(s.ready for s in self.rows), "tokens_per_s": rate,
            "kv_tokens": sum(s.kv_len for s in self.rows),
            "kv_reserved_tokens": sum(s.reserved for s in self.rows),
            "kv_capacity_tokens": self.cache.capacity_tokens, "kv_block_size": self.cache.block_size,
            "kv_blocks": self.cache.num_blocks, "kv_blocks_used": self.cache.used,
            "kv_blocks_peak": self.cache.peak_used, "kv_cow_copies": self.cache.copies,
            "kv_bytes": self.cache.nbytes, "max_kv_tokens": self.cfg.max_kv_tokens,
            "max_reserved_tokens": self.cfg.max_reserved_tokens,
            "paused": self.paused, "device": str(self.device), "kv_static": self.cache.static,
            "preempted": self.sched.preempted, "preempted_tokens": self.sched.preempted_tokens,
            **self.counters, **self.sessions.stats(),
        }

    def close(self) -> None:
        self.waiting.clear()
        for seq in self.rows:
            self.cache.release(seq.table)
        self.rows.clear()
        self.live.clear()


def build(engine_cfg: EngineConfig, model_cfg: Any = None, seed: int | None = None, **kwargs: Any) -> TorchEngine:
    """The `engine: torch` builder used by areal_mq.engines.build_engine.

    device=: the role's device spec (the rollout worker passes role_device(cfg, "rollout")); default model.device."""
    from areal_mq.engines.models import DEFAULT_MODEL, resolve_model

    name = getattr(model_cfg, "name", DEFAULT_MODEL)
    model_dir = kwargs.pop("model_dir", None) or resolve_model(name, getattr(model_cfg, "cache_dir", None))
    device = kwargs.pop("device", None) or getattr(model_cfg, "device", None) or "auto"
    return TorchEngine(model_dir, engine_cfg, dtype=getattr(model_cfg, "dtype", "float32"), seed=seed,
                       device=device, **kwargs)
