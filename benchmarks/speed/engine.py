"""Engine benchmark: the embedded torch engine vs Hugging Face `generate` on SmolLM2-135M-Instruct.

What it measures, in one run, on the same chat-templated prompts and the same weights:
  uniform   every request generates exactly L tokens; all arrive at once. HF generate runs them in
            fixed batches of `max_concurrent` (left-padded prompts).
  longtail  most requests generate L tokens, every 8th one 8L; they arrive as a stream (one every
            `gap` seconds). HF generate takes them in arrival order in fixed batches, each batch starting
            when its last member has arrived and generating as long as its longest member (padding).
            The engine submits each request when it arrives and refills slots as sequences finish.
  update    16 (8 with --quick) sequences mid-generation, then `update_weights(path=<model dir>)`:
            load_s (135M params from disk into the live model) and resume_s = time from the end of the
            load to the first token decoded under the new version (pause + KV recompute/keep + a step),
            for kv_on_update recompute (default) and keep.
A third column, contiguous_engine, runs the same workloads on the engine before paged KV (benchmarks/baselines/
contiguous_engine, same config): ratios paged_vs_contiguous_{uniform,longtail} (target 1.0, issue 42: the paged
engine must not be slower), and `contiguous_ratios` in the JSON holds that engine's own *_vs_hf_generate ratios.
Both sides sample at temperature 1.0 and count only requested tokens (HF's padding steps are waste).
Rounds alternate the order of the engines (the machine is shared); ratios are medians of per-round
ratios. Headline ratios (larger is better): uniform_vs_hf_generate (target 1.0) and
longtail_vs_hf_generate (1.5); the time targets are expressed as ratios too:
update_resume_vs_0.5s = 0.5 s / resume_s (target 1.0) and weights_load_vs_3s = 3 s / load_s (1.0).

To add an engine column: write `run_<name>(ctx, workload) -> seconds` and add it to
RUNNERS; each runner gets the same Workload (prompts, lengths, arrival times).

--vllm adds vLLM (engine: vllm, in process; needs bash docker/install-vllm.sh) as a third column on the
same workloads plus its update timings, with ratios vllm_vs_hf_generate_{uniform,longtail} and
vllm_vs_torch_engine_longtail. Opt-in: a vLLM start alone takes 1-4 min here (beyond --quick's minute).

--reasoning runs benchmarks/speed/engine_reasoning.py instead: paged KV against the contiguous KV it replaced (issue 42)
at one KV memory budget, groups of 8 on a 150-token prompt, 1 in 8 answers long (2,048 tokens; 512 with --quick),
ratios contiguous_vs_paged_concurrency and paged_vs_contiguous_tokens_per_s.

--decode runs benchmarks/speed/engine_decode.py instead: one decode step of the paged engine against the contiguous one
(and against the paged decode that gathers every row), 16 x 1,024 / 16 x 300 / a 32-row long tail of keys, ratios
paged_vs_contiguous_decode_{uniform_1024,uniform_300,longtail} (target 1.0: the CPU path stays as fast as before).

--eval runs benchmarks/speed/engine_eval.py instead: the quickstart's held-out evaluation (200 problems, greedy, 128 at
once, fp32) on the paged engine against the contiguous one, identical answers checked, ratio paged_vs_contiguous_eval.

--device cuda (or cuda:N) puts both engines' weights, KV cache and sampling on that GPU (default cpu);
benchmarks/gpu/run.sh stage b runs the long tail at 64 and 256 concurrent on it (docs/gpu.md).

    python benchmarks/speed/engine.py [--quick] [--json PATH] [--dtype bfloat16|float32] [--threads N] [--vllm]
                                [--device cpu|cuda|cuda:N] [--attention auto|plain|flex]
                                [--reasoning | --decode | --eval]
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TARGETS = {"uniform_vs_hf_generate": 1.0, "longtail_vs_hf_generate": 1.5,
           "update_resume_vs_0.5s": 1.0, "weights_load_vs_3s": 1.0,
           "paged_vs_contiguous_uniform": 1.0, "paged_vs_contiguous_longtail": 1.0}
VLLM_TARGETS = {"vllm_vs_hf_generate_uniform": 1.0, "vllm_vs_hf_generate_longtail": 1.5,
                "vllm_vs_torch_engine_longtail": 1.0}
# quick, full
SIZES = {"slots": (8, 16), "rounds": (1, 2), "uniform_n": (16, 32), "uniform_len": (16, 64),
         "longtail_n": (16, 64), "short_len": (6, 32), "update_tokens": (16, 32)}
LONG_EVERY, LONG_FACTOR, ARRIVAL_GAP_S = 8, 8, 0.05
QUESTIONS = [
    "What is 17 * 23?", "Name three rivers in Europe.", "Write a haiku about autumn leaves.",
    "Explain what a prime number is.", "How many legs does a spider have?", "Give me a synonym for happy.",
    "What is the capital of Australia?", "Summarize the water cycle in one sentence.",
    "If a train travels 60 km in 45 minutes, what is its speed?", "List four primary colors of light.",
    "Translate 'good morning' into Spanish.", "Why is the sky blue?", "What is 2 to the power of 10?",
    "Suggest a name for a small bakery.", "Describe a cat in five words.", "What does CPU stand for?",
]


log = common.logger("engine")


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    lengths: list[int]  # tokens to generate per request
    arrivals: list[float]  # seconds after the start

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


@dataclass
class Context:
    model_dir: Path
    tokenizer: object
    hf_model: object
    engine: object  # a TorchEngine, reused across runs
    slots: int
    vllm: object = None  # a VllmEngine with --vllm
    contiguous: object = None  # the engine before paged KV (benchmarks/baselines/contiguous_engine), same config


def make_workloads(tokenizer, q: int) -> list[Workload]:
    from areal_mq.engines.models import apply_chat_template

    def prompts(n: int) -> list[list[int]]:
        return [apply_chat_template(tokenizer, QUESTIONS[i % len(QUESTIONS)] + f" (#{i})") for i in range(n)]

    n_u, n_l = SIZES["uniform_n"][q], SIZES["longtail_n"][q]
    short = SIZES["short_len"][q]
    uniform = Workload("uniform", prompts(n_u), [SIZES["uniform_len"][q]] * n_u, [0.0] * n_u)
    lengths = [short * LONG_FACTOR if i % LONG_EVERY == 3 else short for i in range(n_l)]
    longtail = Workload("longtail", prompts(n_l), lengths, [i * ARRIVAL_GAP_S for i in range(n_l)])
    return [uniform, longtail]


# -- runners: one per engine; each returns wall seconds until every request finished -------------


def run_torch_engine(ctx: Context, wl: Workload) -> float:
    from areal_mq.engines.base import EngineRequest
    from areal_mq.messages import SamplingSpec

    engine, pending, done = ctx.engine, list(range(len(wl.prompts))), 0
    start = time.perf_counter()
    while done < len(wl.prompts):
        now = time.perf_counter() - start
        while pending and wl.arrivals[pending[0]] <= now:
            i = pending.pop(0)
            sp = SamplingSpec(temperature=1.0, max_new_tokens=wl.lengths[i], ignore_eos=True, seed=i)
            engine.submit(EngineRequest(f"{wl.name}-{i}-{start}", wl.prompts[i], sp))
        if engine.has_work():
            done += len(engine.step())
        else:
            time.sleep(0.001)
    return time.perf_counter() - start


def run_hf_generate(ctx: Context, wl: Workload) -> float:
    import torch

    tok, model = ctx.tokenizer, ctx.hf_model
    start = time.perf_counter()
    for b in range(0, len(wl.prompts), ctx.slots):
        idx = list(range(b, min(b + ctx.slots, len(wl.prompts))))
        wait = wl.arrivals[idx[-1]] - (time.perf_counter() - start)
        if wait > 0:  # a fixed batch starts once its last member has arrived
            time.sleep(wait)
        width = max(len(wl.prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), tok.pad_token_id, dtype=torch.long, device=model.device)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(idx):  # left padding
            ids[row, width - len(wl.prompts[i]):] = torch.tensor(wl.prompts[i], device=model.device)
            mask[row, width - len(wl.prompts[i]):] = 1
        longest = max(wl.lengths[i] for i in idx)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=tok.pad_token_id)
    return time.perf_counter() - start


def run_vllm(ctx: Context, wl: Workload) -> float:
    return run_torch_engine(replace(ctx, engine=ctx.vllm), wl)  # same driver, the vLLM engine


def run_contiguous(ctx: Context, wl: Workload) -> float:
    return run_torch_engine(replace(ctx, engine=ctx.contiguous), wl)  # same driver, the pre-paged engine


RUNNERS = {"torch_engine": run_torch_engine, "hf_generate": run_hf_generate}


# -- weight update timing --------------------------------------------------------------------------


def measure_update(ctx: Context, mode: str, tokens_before: int) -> dict:
    """Sequences mid-generation, then a weight update from disk; time to the first new-version token."""
    from areal_mq.engines.base import EngineRequest
    from areal_mq.messages import SamplingSpec

    engine = ctx.engine
    engine.cfg = engine.cfg.model_copy(update={"kv_on_update": mode})
    ids = [f"upd-{mode}-{i}" for i in range(ctx.slots)]
    for i, rid in enumerate(ids):
        sp = SamplingSpec(temperature=1.0, max_new_tokens=tokens_before * 4, ignore_eos=True, seed=i)
        engine.submit(EngineRequest(rid, make_prompt(ctx, i), sp))
    for _ in range(tokens_before):
        engine.step()
    timings = engine.update_weights(engine.version + 1, path=str(ctx.model_dir))
    t0, before = time.perf_counter(), engine.stats()["generated_tokens"]
    steps = 0
    while engine.stats()["generated_tokens"] == before:
        engine.step()
        steps += 1
    resume = timings["pause_s"] + time.perf_counter() - t0
    for rid in ids:
        engine.abort(rid)
    return {"mode": mode, "load_s": round(timings["load_s"], 3), "pause_s": round(timings["pause_s"], 4),
            "resume_s": round(resume, 3), "steps_to_first_token": steps,
            "recompute_tokens": int(timings["recompute_tokens"]), "in_flight": int(timings["in_flight"])}


def measure_update_vllm(ctx: Context, mode: str, tokens_before: int) -> dict:
    """As measure_update, for vLLM: it decodes in its own process, so wait on token counts, not steps.

    resume_s = pause + prefix reset + resume + time until the first token under the new version."""
    from areal_mq.engines.base import EngineRequest
    from areal_mq.messages import SamplingSpec

    engine, n = ctx.vllm, ctx.slots
    base = engine.stats()["tokens_total"]
    prompts = [make_prompt(ctx, i) for i in range(n)]
    for i in range(n):
        sp = SamplingSpec(temperature=1.0, max_new_tokens=tokens_before * 4, ignore_eos=True, seed=i)
        engine.submit(EngineRequest(f"vupd-{mode}-{i}", prompts[i], sp))
    while engine.stats()["tokens_total"] - base < n * tokens_before:
        engine.step()
    timings = engine.update_weights(engine.version + 1, path=str(ctx.model_dir), kv_on_update=mode)
    t0, before = time.perf_counter(), engine.stats()["tokens_total"]
    while engine.stats()["tokens_total"] == before:
        time.sleep(0.001)
    resume = timings["pause_s"] + timings["reset_s"] + timings["resume_s"] + time.perf_counter() - t0
    for i in range(n):
        engine.abort(f"vupd-{mode}-{i}")
    recomputed = sum(len(p) for p in prompts) + n * tokens_before if mode == "recompute" else 0  # approx.
    return {"mode": mode, "load_s": round(timings["load_s"], 3), "pause_s": round(timings["pause_s"], 4),
            "resume_s": round(resume, 3), "steps_to_first_token": "-", "recompute_tokens": recomputed,
            "in_flight": n}


def make_prompt(ctx: Context, i: int) -> list[int]:
    from areal_mq.engines.models import apply_chat_template

    return apply_chat_template(ctx.tokenizer, QUESTIONS[i % len(QUESTIONS)])


# -- driver ----------------------------------------------------------------------------------------


def machine(args) -> dict:
    import torch

    return common.torch_machine(threads=torch.get_num_threads(), model=args.model, dtype=args.dtype,
                                device=common.device_name(args.device))


def setup(args, q: int) -> Context:
    import torch

    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.models import load_causal_lm, load_tokenizer, resolve_model
    from areal_mq.engines.torch.engine import TorchEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    tokenizer = load_tokenizer(model_dir)
    slots = SIZES["slots"][q]
    cfg = EngineConfig(max_concurrent=slots, dtype=args.dtype, seed=0)
    engine = TorchEngine(model_dir, cfg.model_copy(update={"decode_attention": args.attention}), dtype=args.dtype,
                         tokenizer=tokenizer, device=args.device)
    from contiguous_engine import ContiguousEngine

    contiguous = ContiguousEngine(model_dir, cfg, dtype=args.dtype, tokenizer=tokenizer, device=args.device)
    hf_model = load_causal_lm(model_dir, args.dtype, engine.device)
    log(f"engine loaded the model in {engine.load_s:.2f}s on {engine.device}; threads={torch.get_num_threads()}")
    vllm = None
    if args.vllm:
        from areal_mq.engines.vllm.engine import VllmEngine

        vllm = VllmEngine(cfg, model_dir, dtype=args.dtype, seed=0)
        log(f"vLLM started in {vllm.start_s:.1f}s")
    return Context(model_dir, tokenizer, hf_model, engine, slots, vllm, contiguous)


def run(args) -> dict:
    from tqdm import tqdm

    q = 0 if args.quick else 1
    ctx = setup(args, q)
    workloads = make_workloads(ctx.tokenizer, q)
    runners = dict(RUNNERS, contiguous_engine=run_contiguous, **({"vllm": run_vllm} if ctx.vllm else {}))
    warm = Workload("warm", workloads[0].prompts[:2], [4, 4], [0.0, 0.0])
    for runner in runners.values():
        runner(ctx, warm)
    times: dict[tuple[str, str], list[float]] = {}
    jobs = [(r, wl) for r in range(SIZES["rounds"][q]) for wl in workloads]
    for r, wl in tqdm(jobs, desc="runs", file=sys.stderr):
        names = list(runners) if r % 2 == 0 else list(reversed(runners))
        for name in names:
            seconds = runners[name](ctx, wl)
            times.setdefault((wl.name, name), []).append(seconds)
            log(f"{wl.name:9s} {name:13s} {wl.tokens / seconds:7.1f} tok/s ({seconds:.1f}s)")
    updates = [measure_update(ctx, mode, SIZES["update_tokens"][q]) for mode in ("recompute", "keep")]
    vllm_updates = [measure_update_vllm(ctx, mode, SIZES["update_tokens"][q])
                    for mode in ("recompute", "keep")] if ctx.vllm else []
    ctx.engine.close()
    ctx.contiguous.close()
    if ctx.vllm:
        ctx.vllm.close()
    results = [{"workload": wl.name, "engine": name, "requests": len(wl.prompts), "tokens": wl.tokens,
                "seconds": [round(s, 2) for s in times[(wl.name, name)]],
                "tokens_per_s": round(wl.tokens / statistics.median(times[(wl.name, name)]), 1)}
               for wl in workloads for name in runners]
    results += [{"workload": "update", "engine": "torch_engine", **u} for u in updates]
    results += [{"workload": "update", "engine": "vllm", **u} for u in vllm_updates]

    def ratio(wl: str, base: str = "hf_generate", engine: str = "torch_engine") -> float:  # per round, the median
        pairs = zip(times[(wl, base)], times[(wl, engine)])
        return round(statistics.median(b / eng for b, eng in pairs), 3)

    default = updates[0]
    ratios = {"uniform_vs_hf_generate": ratio("uniform"), "longtail_vs_hf_generate": ratio("longtail"),
              "update_resume_vs_0.5s": round(0.5 / default["resume_s"], 3),
              "weights_load_vs_3s": round(3.0 / max(u["load_s"] for u in updates), 3),
              "paged_vs_contiguous_uniform": ratio("uniform", "contiguous_engine"),
              "paged_vs_contiguous_longtail": ratio("longtail", "contiguous_engine")}
    # the same HF ratios for the engine before paged KV: what the paged engine's must not fall below
    before = {"uniform_vs_hf_generate": ratio("uniform", engine="contiguous_engine"),
              "longtail_vs_hf_generate": ratio("longtail", engine="contiguous_engine")}
    if ctx.vllm:
        def versus(wl: str, base: str) -> float:
            return round(statistics.median(b / v for b, v in zip(times[(wl, base)], times[(wl, "vllm")])), 3)

        ratios.update(vllm_vs_hf_generate_uniform=versus("uniform", "hf_generate"),
                      vllm_vs_hf_generate_longtail=versus("longtail", "hf_generate"),
                      vllm_vs_torch_engine_longtail=versus("longtail", "torch_engine"))
    return {"benchmark": "engine", "quick": args.quick, "machine": machine(args), "results": results,
            "ratios": ratios, "contiguous_ratios": before,
            "targets": {k: v for k, v in {**TARGETS, **VLLM_TARGETS}.items() if k in ratios}}


def table(report: dict, command: str) -> str:
    rows = [("workload / engine", "tokens/s", "seconds per round")]
    for r in report["results"]:
        if r["workload"] == "update":
            rows.append((f"update {r['engine']} kv={r['mode']}", "-", f"load {r['load_s']:.2f}s, resume {r['resume_s']:.3f}s "
                         f"(pause {r['pause_s'] * 1e3:.1f}ms, {r['recompute_tokens']} tokens recomputed, "
                         f"{r['steps_to_first_token']} steps)"))
        else:
            rows.append((f"{r['workload']} {r['engine']}", f"{r['tokens_per_s']:.1f}",
                         " ".join(f"{s:.1f}" for s in r["seconds"]) + f"  ({r['tokens']} tokens)"))
    rows += [("", "", ""), *common.ratio_rows(report)]
    rows += [(f"{name} (contiguous engine, before paged KV)", f"{value:.3f}", "")
             for name, value in report.get("contiguous_ratios", {}).items()]
    lines = common.align(rows, rule=False)
    m = report["machine"]
    lines.append(f"machine: {m['cpus']} cpus, {m['threads']} torch threads, {m['dtype']}, "
                 f"load at start {m['loadavg_at_start'][0]:.1f}")
    return "\n".join(lines + [f"reproduce: {command}"])


def main() -> None:
    parser = common.arg_parser(__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct", help="Model name or directory.")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="Parameter dtype of both engines (bfloat16: fast on AMX/AVX512-BF16 CPUs).")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for both engines (default 1: on a shared 2-core machine a second "
                             "thread mostly waits for a busy core; measured up to 10x slower under load).")
    parser.add_argument("--vllm", action="store_true",
                        help="Also run vLLM in process (bash docker/install-vllm.sh; its start takes 1-4 min).")
    parser.add_argument("--reasoning", action="store_true",
                        help="Paged vs contiguous KV at one memory budget on a reasoning long tail (engine_reasoning.py).")
    parser.add_argument("--decode", action="store_true",
                        help="One decode step, paged vs contiguous KV, at three shapes (engine_decode.py).")
    parser.add_argument("--admission", action="store_true",
                        help="Rows running against the KV pool: the pool rule vs the old reservation cap "
                             "(engine_admission.py, issue 59).")
    parser.add_argument("--eval", action="store_true",
                        help="The quickstart's held-out evaluation, paged vs contiguous KV (engine_eval.py).")
    parser.add_argument("--attention", choices=("auto", "plain", "flex"), default="auto",
                        help="The torch engine's decode_attention (auto: flex on CUDA, plain on the CPU); with --decode, "
                             "flex adds a FlexAttention column and the quickstart's shapes (flex_vs_plain_decode_*).")
    common.add_device_arg(parser)
    args = parser.parse_args()
    if args.reasoning or args.decode or args.eval or args.admission:
        import engine_admission
        import engine_decode
        import engine_eval
        import engine_reasoning

        mode, module = (("reasoning", engine_reasoning) if args.reasoning else ("decode", engine_decode)
                        if args.decode else ("admission", engine_admission) if args.admission
                        else ("eval", engine_eval))
        report = common.timed(module.run, args)
        dtype = None if args.eval else args.dtype  # the evaluation runs in the quickstart's own dtype
        extra = "".join(f" --{k} {v}" for k, v in (("model", args.model), ("dtype", dtype),
                                                    ("threads", args.threads), ("device", args.device)) if v)
        extra += f" --attention {args.attention}" if args.attention != "auto" else ""
        command = f"python benchmarks/speed/engine.py --{mode}" + (" --quick" if args.quick else "") + extra
        common.finish(report, args.json, module.table(report, command))
        return
    report = common.timed(run, args)
    extra = "".join(f" --{k} {v}" for k, v in (("model", args.model), ("dtype", args.dtype),
                                                ("threads", args.threads), ("device", args.device)) if v)
    extra += " --vllm" if args.vllm else ""
    extra += f" --attention {args.attention}" if args.attention != "auto" else ""
    common.finish(report, args.json, table(report, "python benchmarks/speed/engine.py" + (" --quick" if args.quick else "") + extra))


if __name__ == "__main__":
    main()
