"""How `areal-mq trace` shows a Timeline (areal_mq/telemetry/trace.py): a rich table, or JSON for machines.

How to run: areal-mq trace RUN_DIR GROUP_OR_SAMPLE_ID [--json]
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, TextIO

from areal_mq.telemetry.trace import Step, Timeline, build_timeline, resolve, stored_seqs


def load(run_dir: Path, ident: str, read_sample: Callable[[Path, str], Any] | None = None) -> Timeline:
    """The timeline of `ident` in the run at `run_dir` (FileNotFoundError / TraceError on bad input);
    `read_sample(log path, sample id)` adds the stored sequences (brokers/sample_log_reader.py)."""
    from areal_mq.telemetry.tail import iter_files

    records = list(iter_files(Path(run_dir), follow=False))
    group, sample = resolve(records, ident)
    return build_timeline(records, group, sample, stored_seqs(Path(run_dir), group, read_sample))


def mask_runs(mask: list[int] | None) -> str:
    """A loss mask as runs: [1,1,0,0,0,1] -> '1×2 0×3 1×1' (model turns 1, environment turns 0)."""
    if not mask:
        return "-"
    runs, cur, n = [], mask[0], 0
    for m in mask:
        if m == cur:
            n += 1
        else:
            runs.append(f"{cur}×{n}")
            cur, n = m, 1
    runs.append(f"{cur}×{n}")
    return " ".join(runs)


def describe(step: Step) -> str:
    """The detail column of one timeline line."""
    d = step.detail
    if step.stage == "generated":
        text = (f"sample {d.get('sample')} · {d.get('tokens')} tokens ({d.get('finish')}) · versions "
                f"{_versions(d.get('versions'), d.get('version_counts'))} · started at v{d.get('started_version')}")
        if d.get("seconds") is not None:
            text += f" · {d['seconds']}s"
        if d.get("interrupts"):
            text += f" · interrupted {d['interrupts']}× by weight updates, KV recomputed {d['kv_recompute_tokens']} tok"
        return text + (f" · FAILED {d['failed']}" if d.get("failed") else "")
    if step.stage == "reward":
        per = ", ".join(f"{c['sample']}: {c['reward']:g} {c.get('reason') or c.get('error') or ''}".rstrip()
                        for c in d.get("completions", []))
        return f"{d.get('task')} · {d.get('ms')} ms{' (cached)' if d.get('cached') else ''} · [{per}]"
    if step.stage == "trained":
        st = d.get("staleness")
        lag = (f"staleness/token min {st['min']} mean {st['mean']} max {st['max']} ({st['tokens']} tok)" if st
               else "staleness unknown (no token versions)")
        return f"step -> v{d['version']} (trained policy v{d['policy']}) · {lag}"
    return " · ".join(f"{k} {v}" for k, v in d.items() if v is not None)


def _versions(versions: Any, counts: Any) -> str:
    if not versions:
        return "?"
    if counts and len(counts) == len(versions):
        return ",".join(f"v{v}×{n}" for v, n in zip(versions, counts))
    return ",".join(f"v{v}" for v in versions)


def render(tl: Timeline, out: TextIO | None = None, width: int | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(file=out, width=width, highlight=False)
    title = tl.group + (f" sample {tl.sample}" if tl.sample is not None else "")
    table = Table(title=f"trace {title}", title_justify="left", expand=False)
    for col in ("time", "+s", "stage", "who", "detail"):
        table.add_column(col, overflow="fold")
    t0 = tl.steps[0].ts if tl.steps else 0.0
    for s in tl.steps:
        clock = time.strftime("%H:%M:%S", time.localtime(s.ts)) + f".{int((s.ts % 1) * 1000):03d}"
        table.add_row(clock, f"{s.ts - t0:.2f}", s.stage, s.who, describe(s))
    console.print(table)
    if tl.seqs:
        seqs = Table(title="stored sequences (sample store log)", title_justify="left")
        for col in ("sample", "reward", "reason", "tokens", "finish", "versions", "loss mask (turns)"):
            seqs.add_column(col, overflow="fold")
        for s in tl.seqs:
            vs = sorted(set(s["versions"]))
            seqs.add_row(str(s["index"]), f"{s['reward']:g}", s["reason"] or "-", str(s["tokens"]), s["finish"],
                         ",".join(f"v{v}" if v >= 0 else "env" for v in vs), mask_runs(s["loss_mask"]))
        console.print(seqs)
    for line in tl.missing:
        console.print(f"[dim]note: {line}[/dim]")


def to_json(tl: Timeline) -> str:
    return json.dumps(tl.to_dict(), default=str)
