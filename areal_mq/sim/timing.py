"""Named timing models and completion-length distributions for the simulated engine and trainer.

What: every number the simulation uses for "how long does a GPU take" or "how long is an answer" lives here,
under a name, with where it comes from. Nothing else in the code holds such a number. Config selects them by
name (`rollout.engine.sim.timing`, `rollout.engine.sim.lengths`, `trainer.sim.timing`); an unknown name is a
ConfigError that lists the known ones.

Sources and how each figure was obtained (read this before quoting a simulated throughput):
- The workload follows the AReaL paper's setup (Fu et al., "AReaL: A Large-Scale Asynchronous Reinforcement
  Learning System for Language Reasoning", arXiv 2505.24298): R1-Distill-Qwen models trained with
  decoupled PPO on math, generation on ~3/4 of the GPUs and training on the rest, long reasoning traces with
  a maximum generation length cap. The paper does not publish per-step kernel times, so:
- `r1-1.5b-h800-roofline` is DERIVED HERE, not measured: a roofline estimate for Qwen2.5-1.5B geometry
  (1.54e9 parameters, 28 layers, 2 KV heads x 128 dims, bf16) on an H800/H100-SXM-class GPU (3.35 TB/s HBM,
  989 TFLOP/s dense bf16), with the efficiencies stated next to each term. Decode is memory bound: a step
  reads the weights once plus the KV cache of every running sequence; prefill and training are compute bound
  (2 and 8 FLOPs per parameter per token: forward; forward + backward + the proximal recompute forward).
- `h100-measured` is a SLOT for measured H100 figures: filled from areal_mq/sim/h100_measured.json, which
  benchmarks/gpu/fit_sim.py --install writes from a GPU run's stages b, c and d (its `name` and `source` say
  which model and GPU were measured). Without that file selecting it raises. No H100 number here is invented.
- `constant` is a synthetic model for the simulator's correctness test (closed-form throughput).
- Length distributions: the issue asks for a long-tailed law "e.g. lognormal fitted to reasoning traces with a
  max cap". There are no traces in this repository to fit, so the lognormal parameters below are CHOSEN, not
  fitted: a median well below the cap and a tail that reaches it for a few percent of answers, the shape the
  AReaL paper describes (most answers short, a few hitting the cap, which is what stalls synchronous RL).

    from areal_mq.sim.timing import timing_model, length_model
    tm = timing_model("r1-1.5b-h800-roofline"); tm.decode_step_s(batch=32, mean_context=4096)
    lengths = length_model("lognormal-8k"); lengths.sample(rng, 1000)
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from areal_mq.errors import ConfigError


@dataclass(frozen=True)
class TimingModel:
    """Time of a simulated device's work, in simulated seconds.

    decode step  = decode_fixed_s + (weight_bytes + batch * mean_context * kv_bytes_per_token) / mem_bw
    prefill      = prefill_s_per_token per prompt (or recomputed) token, added to the step that admits it
    weight load  = update_pause_s (a rollout device stops decoding while it loads new weights)
    train step   = train_fixed_s + tokens * train_s_per_token / devices   (tokens: prompt + generated)
    """

    name: str
    source: str
    decode_fixed_s: float
    weight_bytes: float
    kv_bytes_per_token: float
    mem_bw_bytes_per_s: float
    prefill_s_per_token: float
    update_pause_s: float
    train_fixed_s: float
    train_s_per_token: float

    def decode_step_s(self, batch: int, mean_context: float) -> float:
        if batch <= 0:
            return 0.0
        moved = self.weight_bytes + batch * max(0.0, mean_context) * self.kv_bytes_per_token
        return self.decode_fixed_s + (moved / self.mem_bw_bytes_per_s if self.mem_bw_bytes_per_s > 0 else 0.0)

    def prefill_s(self, tokens: int) -> float:
        return tokens * self.prefill_s_per_token

    def train_step_s(self, tokens: int, devices: int) -> float:
        return self.train_fixed_s + tokens * self.train_s_per_token / max(1, devices)


# ---------------------------------------------------------------- r1-1.5b-h800-roofline (derived, see docstring)
_HBM = 3.35e12 * 0.6  # H800/H100 SXM HBM3 bandwidth, 60 % achieved (assumption)
_FLOPS = 989e12  # dense bf16 peak
_PARAMS = 1.54e9  # Qwen2.5-1.5B (R1-Distill-Qwen-1.5B)
_KV_TOKEN = 2 * 28 * 2 * 128 * 2  # K and V x layers x kv heads x head dim x bf16 bytes = 28,672 B

TIMING_MODELS: dict[str, TimingModel | None] = {
    "r1-1.5b-h800-roofline": TimingModel(
        name="r1-1.5b-h800-roofline",
        source="derived here (roofline, not measured): AReaL (arXiv 2505.24298) workload, Qwen2.5-1.5B geometry, "
               "H800-class GPU; HBM 3.35 TB/s at 60 %, bf16 989 TFLOP/s at 40 % (prefill) / 35 % (training)",
        decode_fixed_s=4e-3,  # scheduler, sampling, launch per step: assumption (CUDA graphs, SGLang/vLLM class)
        weight_bytes=_PARAMS * 2,
        kv_bytes_per_token=_KV_TOKEN,
        mem_bw_bytes_per_s=_HBM,
        prefill_s_per_token=2 * _PARAMS / (_FLOPS * 0.40),  # ~7.8 us
        update_pause_s=1.5,  # 3.1 GB of bf16 weights at an assumed ~2 GB/s effective load path
        train_fixed_s=2.0,  # optimizer step + weight publish per training step: assumption
        train_s_per_token=8 * _PARAMS / (_FLOPS * 0.35),  # ~35.6 us per token per device
    ),
    "constant": TimingModel(
        name="constant", source="synthetic: every decode step 10 ms whatever the batch; for closed-form tests",
        decode_fixed_s=0.01, weight_bytes=0.0, kv_bytes_per_token=0.0, mem_bw_bytes_per_s=0.0,
        prefill_s_per_token=0.0, update_pause_s=0.0, train_fixed_s=0.0, train_s_per_token=1e-4,
    ),
    "h100-measured": None,  # slot: filled below from h100_measured.json (benchmarks/gpu/fit_sim.py) when it exists
}
MEASURED_FILE = Path(__file__).with_name("h100_measured.json")


def load_measured(path: Path) -> TimingModel | None:
    """A TimingModel from a fit_sim.py JSON file (None when the file does not exist; ConfigError when it is bad)."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return TimingModel(**{f.name: data[f.name] for f in fields(TimingModel)})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path} is not a timing model written by benchmarks/gpu/fit_sim.py ({exc!r}); "
                          "re-run the fit or delete the file") from exc


TIMING_MODELS["h100-measured"] = load_measured(MEASURED_FILE)


def timing_model(name: str) -> TimingModel:
    if name not in TIMING_MODELS:
        raise ConfigError(f"unknown simulation timing model {name!r}; choose one of {sorted(TIMING_MODELS)} "
                          "(areal_mq/sim/timing.py names each one's source)")
    model = TIMING_MODELS[name]
    if model is None:
        raise ConfigError(f"timing model {name!r} is a slot for measured figures that do not exist yet; use "
                          "'r1-1.5b-h800-roofline' (derived), or fill it from a GPU run (bash benchmarks/gpu/run.sh "
                          "b/c/d, then benchmarks/gpu/fit_sim.py --install; docs/gpu.md)")
    return model


# ---------------------------------------------------------------- completion lengths
@dataclass(frozen=True)
class LengthModel:
    """Completion lengths in tokens: lognormal(median, sigma) capped at `cap` (sigma 0: always the median)."""

    name: str
    source: str
    median: float
    sigma: float
    cap: int

    def sample(self, rng: np.random.Generator, n: int = 1) -> np.ndarray:
        """`n` lengths, int64 in [1, cap]."""
        raw = np.full(n, self.median) if self.sigma == 0 else rng.lognormal(math.log(self.median), self.sigma, n)
        return np.clip(np.rint(raw), 1, self.cap).astype(np.int64)

    def mean(self, samples: int = 200_000, seed: int = 0) -> float:
        """Mean length after the cap (Monte Carlo, deterministic)."""
        return float(self.sample(np.random.default_rng(seed), samples).mean())


_CHOSEN = "chosen, not fitted (no traces here): lognormal with a cap, the long tail the issue and AReaL describe"
LENGTH_MODELS: dict[str, LengthModel] = {
    "lognormal-32k": LengthModel("lognormal-32k", _CHOSEN + "; paper-like 32k cap", 6000, 0.9, 32768),
    "lognormal-8k": LengthModel("lognormal-8k", _CHOSEN + "; scaled down 4x to fit this machine's message volume",
                                1500, 0.9, 8192),
    "lognormal-8k-narrow": LengthModel("lognormal-8k-narrow", "chosen: a short tail (sigma 0.3), same cap",
                                       2500, 0.3, 8192),
    "lognormal-8k-heavy": LengthModel("lognormal-8k-heavy", "chosen: a heavy tail (sigma 1.4), same cap",
                                      900, 1.4, 8192),
    "constant-1k": LengthModel("constant-1k", "synthetic: every answer 1,000 tokens (closed-form tests)",
                               1000, 0.0, 1000),
}


def length_model(name: str) -> LengthModel:
    if name not in LENGTH_MODELS:
        raise ConfigError(f"unknown simulation length distribution {name!r}; choose one of {sorted(LENGTH_MODELS)} "
                          "(areal_mq/sim/timing.py)")
    return LENGTH_MODELS[name]
