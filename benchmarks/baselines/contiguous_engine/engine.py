"""The embedded torch inference engine (`engine: torch`): continuous batching, interruptible updates.

What: `TorchEngine` implements `areal_mq.engines.base.Engine` with plain PyTorch on one device (cpu, cuda:N;
`rollout.device` else `model.device`, areal_mq/devices.py). One `step()`:

    admit waiting requests into free slots (FIFO, while slots and the KV budget allow)
    prefill: write KV for pending prompt / recompute tokens, in slot order, at most
             `prefill_chunk_tokens` per step (chunked, so decoding never stalls for long)
    decode:  one token for every sequence whose KV is complete, each at its own position
    finish:  sequences that hit EOS / a stop token / a stop string / max_new_tokens leave at once

Slot layout invariant: `rows[i]` lives in KV slot i; sequences ready to decode occupy slots 0..r-1
and sequences still prefilling occupy r..n-1, so decoding reads the KV cache as a view (no gather).
A finished sequence's slot is refilled by moving the last ready row (and then the last pending row).
A row is "ready" when KV covers all its tokens but the last, which decode feeds next.

Weight updates (`update_weights`) happen between steps, in place. In-flight sequences continue: with
`kv_on_update: keep` their KV stays; with `recompute` (default) their KV is marked stale and rebuilt
through the same chunked prefill path (shortest sequences first, so decoding resumes quickly).
Every token carries the version of the weights that produced its logits.

Session KV (`session_kv_max_tokens` > 0): a finished request with a session leaves a copy of its KV in
`self.sessions` (session.py); the session's next request reuses the rows of its common token prefix at
admission and prefills only the rest. Kept KV never holds a slot, so it never delays admission.

Behaviour logprobs follow the base.py convention (log_softmax(logits / T) before top-p/top-k).

Device: weights, KV cache, RoPE tables, index tensors, per-request generators, sampling and logprobs all live on
the engine's device. The decode step itself (forward.py `decode_step`) never waits for the device; the loop
reads the sampled tokens and logprobs back once per step, after it. With `cuda_graphs` the step runs in
fixed-shape buckets over a static KV cache, replayed as CUDA graphs on CUDA (graphs.py).

How to run: `build_engine(EngineConfig(), ModelConfig())` from areal_mq.engines; tests in
tests/unit/engines/test_torch_engine*.py; throughput in benchmarks/speed/engine.py.
"""
from __future__ import annotations

import hashlib
import time
from collections import deque
from pathlib import Path
from typing import Any, Mapping

import torch

from areal_mq.engines.base import Engine, EngineOutput, EngineRequest
from areal_mq.engines.config import EngineConfig
from areal_mq.engines.models import load_causal_lm, load_tokenizer
from areal_mq.engines.sampling import sample_tokens
from contiguous_engine.forward import LlamaRunner
from contiguous_engine.graphs import BucketedDecoder
from contiguous_engine.kvcache import bytes_per_token, static_capacity
from contiguous_engine.seq import SeqState, build_output
from contiguous_engine.session import SessionKV
from areal_mq.engines.torch.weights import load_weights_in_place, patch_weights_in_place
from areal_mq.errors import EngineRequestError

RATE_WINDOW_S = 10.0  # tokens_per_s in stats() is measured over this window


class TorchEngine(Engine):
    """Continuous-batching engine over a LlamaRunner (see module docstring)."""

    accepts_patches = True  # update_weights(version, patches=...): only the changed elements (weight deltas)

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, dtype: str = "float32",
                 seed: int | None = None, tokenizer: Any = None, device: Any = "cpu"):
        from areal_mq.devices import resolve_device

        self.cfg = config or EngineConfig()
        self.device = device if isinstance(device, torch.device) else resolve_device(device)
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)
        self.dtype = dtype if self.cfg.dtype == "auto" else self.cfg.dtype
        t0 = time.perf_counter()
        self.model = load_causal_lm(model_dir, self.dtype, device=self.device)
        self.load_s = time.perf_counter() - t0
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
        limit = getattr(self.model.config, "max_position_embeddings", 2048)
        self.max_len = min(self.cfg.max_model_len or min(limit, 2048), limit)
        self.runner = LlamaRunner(self.model, self.max_len)
        self.cache = self.runner.new_cache(self.cfg.max_concurrent, self._static_capacity())
        self.max_len = min(self.max_len, self.cache.capacity) if self.cache.static else self.max_len
        self.decoder = None  # exact-shape eager decode (runner.decode) unless cuda_graphs
        if self.cfg.cuda_graphs:
            self.decoder = BucketedDecoder(self.runner, self.cache, self.cfg.max_concurrent,
                                           capture=self.device.type == "cuda")
        self.vocab_size = self.runner.vocab_size
        self.eos_ids = self._eos_ids()
        self.seed = self.cfg.seed if self.cfg.seed is not None else seed
        self.version = 0
        self.paused = False
        self.waiting: deque[SeqState] = deque()
        self.rows: list[SeqState] = []
        self.live: dict[str, SeqState] = {}
        self._rate: deque[tuple[float, int]] = deque()
        self.counters = {"steps": 0, "generated_tokens": 0, "prefilled_tokens": 0, "shared_prefill_tokens": 0,
                         "finished": 0, "session_kv_hits": 0, "prefill_tokens_saved": 0}
        self.sessions = SessionKV(self.cfg.session_kv_max_tokens, self.cfg.session_kv_ttl_s)

    def _static_capacity(self) -> int | None:
        """Positions per slot of a static KV cache (kv_cache_bytes; CUDA or cuda_graphs: max_len), None: growing."""
        if self.cfg.kv_cache_bytes is not None:
            r = self.runner
            per_token = bytes_per_token(len(r.layers), r.n_kv, r.head_dim, r.dtype)
            return static_capacity(self.cfg.kv_cache_bytes, self.cfg.max_concurrent, per_token, self.max_len)
        return self.max_len if self.cfg.cuda_graphs or self.device.type == "cuda" else None

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
            where = " (the static KV cache's positions per slot: kv_cache_bytes)" if self.cache.static else ""
            raise EngineRequestError(
                f"request {rid!r}: prompt ({len(prompt)} tokens) + max_new_tokens ({sp.max_new_tokens}) = "
                f"{need} exceeds the context limit {self.max_len}{where}; shorten the prompt or lower max_new_tokens")
        if need > self.cfg.max_kv_tokens:
            raise EngineRequestError(f"request {rid!r}: needs {need} KV tokens, more than max_kv_tokens "
                                     f"({self.cfg.max_kv_tokens}); raise it or shorten the request")
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_ids))
        seq = SeqState(request=request, tokens=prompt, n_prompt=len(prompt), stop_ids=frozenset(stops),
                        reserved=need, generator=self._generator(request), submitted_at=time.perf_counter())
        self.waiting.append(seq)
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
        return bool(self.waiting or self.rows)

    def abort(self, request_id: str) -> EngineOutput | None:
        seq = self.live.pop(request_id, None)
        if seq is None:
            return None
        if seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self._remove(self.rows.index(seq))
        return build_output(seq, "abort", self.tokenizer)

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
        if self.cfg.step_delay_s:
            time.sleep(self.cfg.step_delay_s)  # test knob: generation slower than training, deterministically
        return finished

    def _admit(self) -> None:
        reserved = sum(s.reserved for s in self.rows)
        while self.waiting and len(self.rows) < self.cfg.max_concurrent:
            seq = self.waiting[0]
            if reserved + seq.reserved > self.cfg.max_kv_tokens:
                break  # FIFO: the head waits for room rather than being overtaken
            self.waiting.popleft()
            reserved += seq.reserved
            seq.reset_kv()
            self.rows.append(seq)
            if seq.request.session and self.sessions.enabled:
                self._reuse_session_kv(len(self.rows) - 1, seq)

    def _reuse_session_kv(self, slot: int, seq: SeqState) -> None:
        """Fill `slot` with the KV the session's previous turn left for the prompt's common prefix."""
        seq.kv_reused = self.sessions.restore(self.cache, slot, seq)
        if seq.kv_reused:
            self.counters["session_kv_hits"] += 1
            self.counters["prefill_tokens_saved"] += seq.kv_reused

    def _ready_count(self) -> int:
        r = 0
        while r < len(self.rows) and self.rows[r].ready:
            r += 1
        return r

    def _prefill(self) -> None:
        """Compute KV chunks for pending rows; a row whose next chunk another row computes this step from
        an identical KV history (the n samples of one prompt) copies that KV instead (`share_prefill`)."""
        budget = self.cfg.prefill_chunk_tokens
        slots, starts, chunks = [], [], []
        leaders: dict[tuple[int, int], list[int]] = {}  # (start, kv_sig) -> indices into chunks
        followers: list[tuple[int, int]] = []  # (row slot, index of the chunk it copies)
        for i in range(self._ready_count(), len(self.rows)):
            seq = self.rows[i]
            if self.cfg.share_prefill and (j := self._shared_chunk(seq, leaders, chunks)) is not None:
                followers.append((i, j))
                continue
            if budget <= 0:
                continue  # no compute left this step, but later rows may still follow a leader
            take = min(len(seq.tokens) - 1 - seq.kv_len, budget)
            leaders.setdefault((seq.kv_len, seq.kv_sig), []).append(len(chunks))
            slots.append(i)
            starts.append(seq.kv_len)
            chunks.append(seq.tokens[seq.kv_len : seq.kv_len + take])
            budget -= take
        if not slots:
            return
        self.runner.extend(self.cache, slots, starts, chunks)
        for i, chunk in zip(slots, chunks):
            self.rows[i].advance_kv(chunk, self.version)
        for i, j in followers:
            self.cache.move(slots[j], i, len(chunks[j]), start=starts[j])
            self.rows[i].advance_kv(chunks[j], self.version)
        self.counters["prefilled_tokens"] += sum(len(c) for c in chunks)
        self.counters["shared_prefill_tokens"] += sum(len(chunks[j]) for _, j in followers)

    @staticmethod
    def _shared_chunk(seq: SeqState, leaders: dict, chunks: list[list[int]]) -> int | None:
        """Index of a chunk computed this step that `seq` can copy: same start, same KV history (kv_sig
        covers tokens and weight versions so far) and the same next tokens."""
        for j in leaders.get((seq.kv_len, seq.kv_sig), ()):
            chunk = chunks[j]
            end = seq.kv_len + len(chunk)
            if end <= len(seq.tokens) - 1 and seq.tokens[seq.kv_len:end] == chunk:
                return j
        return None

    def _decode(self) -> list[EngineOutput]:
        r = self._ready_count()
        if r == 0:
            return []
        rows = self.rows[:r]
        tokens, positions = [s.tokens[-1] for s in rows], [len(s.tokens) - 1 for s in rows]
        if self.decoder is not None:  # bucketed, padded (and on CUDA graph-replayed): a view, used at once
            logits = self.decoder(tokens, positions)
        else:
            logits = self.runner.decode(self.cache, tokens, positions)
        sps = [s.request.sampling for s in rows]
        new, logprobs = sample_tokens(logits, [p.temperature for p in sps], [p.top_p for p in sps],
                                      [p.top_k for p in sps], [s.generator for s in rows])
        # the one read-back of the step: tokens and logprobs in one transfer (float64 holds both exactly)
        host_tokens, host_logprobs = torch.stack((new.double(), logprobs.double())).tolist()
        now = time.perf_counter()
        done: list[tuple[int, str]] = []
        for i, (seq, tok, lp) in enumerate(zip(rows, host_tokens, host_logprobs)):
            tok = int(tok)
            seq.advance_kv(seq.tokens[-1:], self.version)
            reason = seq.append(tok, lp, self.version, now, self.tokenizer)
            if reason is not None:
                done.append((i, reason))
        self._count_rate(now, r)
        outputs = []
        for i, reason in sorted(done, reverse=True):  # descending: earlier slots stay valid
            seq = self.rows[i]
            if seq.request.session and self.sessions.enabled:
                self.sessions.save(self.cache, i, seq)
            self._remove(i)
            del self.live[seq.request.request_id]
            outputs.append(build_output(seq, reason, self.tokenizer))
        self.counters["finished"] += len(outputs)
        return outputs[::-1]

    def _remove(self, i: int) -> None:
        """Free slot i keeping the ready-prefix layout: refill it from the last ready row, then the
        hole that leaves from the last row overall."""
        r = self._ready_count()
        hole = i
        if i < r and i != r - 1:
            self._place(r - 1, i)
            hole = r - 1
        last = len(self.rows) - 1
        if hole != last:
            self._place(last, hole)
        self.rows.pop()

    def _place(self, src: int, dst: int) -> None:
        seq = self.rows[src]
        self.cache.move(src, dst, seq.kv_len)
        self.rows[dst] = seq

    def _count_rate(self, now: float, tokens: int) -> None:
        self.counters["generated_tokens"] += tokens
        self._rate.append((now, tokens))
        while self._rate and now - self._rate[0][0] > RATE_WINDOW_S:
            self._rate.popleft()

    # -- weights ---------------------------------------------------------------------------------

    def update_weights(self, version: int, tensors: Mapping[str, Any] | None = None,
                       path: str | None = None, patches: Mapping[str, Any] | None = None) -> dict[str, float]:
        """A full state dict (tensors= or path=) or, from a worker that knows what changed since the weights the
        engine holds, only the changed elements (patches=: name -> (flat positions, values))."""
        t0 = time.perf_counter()
        if patches is not None:
            n = patch_weights_in_place(self.model, patches)
        else:
            n = load_weights_in_place(self.model, tensors=tensors, path=path)
        t1 = time.perf_counter()
        self.version = int(version)
        stale = 0
        if self.cfg.kv_on_update == "recompute":
            self.sessions.clear()  # kept KV of finished turns is as stale as the in-flight KV
            # All KV is invalid, so rows may be re-slotted freely: shortest first resumes decoding soonest.
            self.rows.sort(key=lambda s: len(s.tokens))
            for seq in self.rows:
                stale += seq.kv_len
                seq.reset_kv()
        t2 = time.perf_counter()
        return {"load_s": t1 - t0, "pause_s": t2 - t1, "tensors": float(n), "in_flight": float(len(self.rows)),
                "recompute_tokens": float(stale)}

    # -- introspection ---------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        window = (self._rate[-1][0] - self._rate[0][0]) if len(self._rate) > 1 else 0.0
        rate = sum(t for _, t in list(self._rate)[1:]) / window if window > 0 else 0.0
        return {
            "engine": "torch", "version": self.version, "running": len(self.rows), "waiting": len(self.waiting),
            "ready": self._ready_count(), "tokens_per_s": rate,
            "kv_tokens": sum(s.kv_len for s in self.rows),
            "kv_reserved_tokens": sum(s.reserved for s in self.rows),
            "kv_capacity_tokens": self.cfg.max_concurrent * self.cache.capacity,
            "kv_bytes": self.cache.nbytes, "max_kv_tokens": self.cfg.max_kv_tokens,
            "paused": self.paused, "device": str(self.device), "kv_static": self.cache.static,
            **self.counters, **self.sessions.stats(),
        }

    def close(self) -> None:
        self.waiting.clear()
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
