"""`python benchmarks/speed/engine.py --decode`: one decode step of the paged torch engine against the contiguous KV
engine it replaced (benchmarks/baselines/contiguous_engine), alternating in one run (issue 42: on the CPU the paged path must
stay at least as fast as the engine before it).

Shapes (rows x keys per row), the KV already written:
  uniform_1024   16 x 1,024 (every row long: the case a gather of each row's blocks pays in full)
  uniform_300    16 x 300
  longtail       32 rows, 1 in 8 at 2,048 keys, the rest at 256
The paged pool's block tables are built the way the engine builds them: the rows grow side by side one block at a
time, each with its final length as the placement hint (kvcache.py, Placement). Columns: `paged` (the package's
decode: rows in few runs of consecutive blocks are read in place), `paged_gather` (the same runner with every row
gathered, the decode before in-place reads), `contiguous`. Ratios (larger is better, target 1.0):
paged_vs_contiguous_decode_<shape> = contiguous ms / paged ms, medians of alternating repeats.

--attention flex (issue 51) adds a `flex` column (the same runner with decode_attention flex: one FlexAttention call
per layer for all rows, flex.py) and the quickstart's shapes (16 / 64 / 128 rows of 150-260 keys: its rollout and
its evaluation), with ratios flex_vs_plain_decode_<shape> = plain paged ms / flex ms, and the compile time of the
first flex step per shape (`flex_compile_s`: one kernel per pool size and padded batch, cached by inductor).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402

log = common.logger("engine")

SHAPES = {"uniform_1024": [1024] * 16, "uniform_300": [300] * 16, "longtail": [2048 if i % 8 == 3 else 256
                                                                               for i in range(32)]}
QUICKSTART_SHAPES = {f"quickstart_{n}": [150 + (i * 37) % 111 for i in range(n)] for n in (16, 64, 128)}
REPEATS = (5, 11)  # quick, full
BLOCK_SIZE = 16


def _paged_tables(cache: Any, lengths: list[int]) -> list[list[int]]:
    """Block tables grown side by side, one block per row at a time, as decoding rows grow."""
    from areal_mq.engines.torch.kvcache import blocks_for

    needs = [blocks_for(n, cache.block_size) for n in lengths]
    tables: list[list[int]] = [[] for _ in lengths]
    for j in range(max(needs)):
        for table, need in zip(tables, needs):
            if j < need:
                assert cache.ensure(table, (j + 1) * cache.block_size, need)
    return tables


def run(args: Any) -> dict:
    import torch

    from contiguous_engine.forward import LlamaRunner as ContiguousRunner

    from areal_mq.engines.models import load_causal_lm, resolve_model
    from areal_mq.engines.torch import forward, inplace
    from areal_mq.engines.torch.kvcache import blocks_for

    if args.threads:
        torch.set_num_threads(args.threads)
    q = 0 if args.quick else 1
    model_dir, device = resolve_model(args.model), torch.device(args.device or "cpu")
    max_len = max(max(v) for v in SHAPES.values()) + BLOCK_SIZE
    paged = forward.LlamaRunner(load_causal_lm(model_dir, args.dtype, device), max_len)
    contiguous = ContiguousRunner(load_causal_lm(model_dir, args.dtype, device), max_len)
    with_flex = getattr(args, "attention", "auto") == "flex"
    flex = forward.LlamaRunner(paged.model, max_len, attention="flex") if with_flex else None
    gen = torch.Generator(device=device).manual_seed(0)
    results, ratios = [], {}
    shapes = {**SHAPES, **(QUICKSTART_SHAPES if with_flex else {})}
    for name, lengths in shapes.items():
        pcache = paged.new_cache(sum(blocks_for(n, BLOCK_SIZE) for n in lengths) + 1, BLOCK_SIZE)
        tables = _paged_tables(pcache, lengths)
        ccache = contiguous.new_cache(len(lengths), max(lengths) + BLOCK_SIZE)  # slots as long as the shape needs
        ccache.ensure(max(lengths))
        for t in (pcache.k, pcache.v, ccache.k, ccache.v):
            t.copy_(torch.randn(t.shape, generator=gen, device=device).to(t.dtype))
        tokens, positions = [7] * len(lengths), [n - 1 for n in lengths]
        runs = sorted(len(inplace.runs_of(t, n, BLOCK_SIZE)) for t, n in zip(tables, lengths))

        def step_paged(gather: bool = False) -> float:
            saved = inplace.MAX_RUNS
            inplace.MAX_RUNS = -1 if gather else saved  # -1: no row is read in place
            try:
                t0 = time.perf_counter()
                paged.decode(pcache, tokens, positions, tables)
                return time.perf_counter() - t0
            finally:
                inplace.MAX_RUNS = saved

        def step_contiguous() -> float:
            t0 = time.perf_counter()
            contiguous.decode(ccache, tokens, positions)
            return time.perf_counter() - t0

        columns = {"paged": step_paged, "paged_gather": lambda: step_paged(True), "contiguous": step_contiguous}
        extra = {}
        if flex is not None:
            def step_flex() -> float:
                t0 = time.perf_counter()
                flex.decode(pcache, tokens, positions, tables)
                return time.perf_counter() - t0

            columns["flex"] = step_flex
            extra["flex_compile_s"] = round(step_flex(), 1)  # the first call compiles (or loads) the kernel
        for f in columns.values():  # warm-up
            f()
        times: dict[str, list[float]] = {k: [] for k in columns}
        for r in range(REPEATS[q]):
            for k in (list(columns) if r % 2 == 0 else list(reversed(columns))):
                times[k].append(columns[k]())
        ms = {k: round(statistics.median(v) * 1e3, 1) for k, v in times.items()}
        results.append({"shape": name, "rows": len(lengths), "keys": [min(lengths), max(lengths)],
                        "runs_per_row": [runs[0], runs[-1]], **{f"{k}_ms": v for k, v in ms.items()}, **extra})
        ratios[f"paged_vs_contiguous_decode_{name}"] = round(ms["contiguous"] / ms["paged"], 3)
        if flex is not None:
            ratios[f"flex_vs_plain_decode_{name}"] = round(ms["paged"] / ms["flex"], 3)
            log(f"decode {name:13s} flex {ms['flex']} ms (first call {extra['flex_compile_s']} s)")
        log(f"decode {name:13s} paged {ms['paged']} ms, gather {ms['paged_gather']} ms, "
            f"contiguous {ms['contiguous']} ms")
    machine = common.torch_machine(threads=torch.get_num_threads(), model=args.model, dtype=args.dtype,
                                   device=common.device_name(args.device))
    return {"benchmark": "engine", "mode": "decode", "quick": args.quick, "machine": machine, "results": results,
            "ratios": ratios, "targets": {k: 1.0 for k in ratios}}


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(report: dict, command: str) -> str:
    rows = [("shape", "rows", "keys", "runs per row", "paged ms", "paged, gathered ms", "contiguous ms", "flex ms",
             "flex first call s")]
    for r in report["results"]:
        rows.append((r["shape"], str(r["rows"]), "-".join(map(str, r["keys"])),
                     "-".join(map(str, r["runs_per_row"])), f"{r['paged_ms']:.1f}", f"{r['paged_gather_ms']:.1f}",
                     f"{r['contiguous_ms']:.1f}", _ms(r.get("flex_ms")), _ms(r.get("flex_compile_s"))))
    lines = common.align(rows, rule=False) + [""] + common.align(common.ratio_rows(report), rule=False)
    m = report["machine"]
    lines.append(f"machine: {m['cpus']} cpus, {m['threads']} torch threads, {m['dtype']}, "
                 f"load at start {m['loadavg_at_start'][0]:.1f}")
    return "\n".join(lines + [f"reproduce: {command}"])
