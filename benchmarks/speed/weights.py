"""Weight updates as deltas vs full versions (issue 26 item 6): bytes, CPU time, engine pause, end-to-end time.

What it measures, in one run, on SmolLM2-135M-Instruct trained by the real Trainer (fp32 master weights, CPU):
- the batch: real rollouts of the quickstart task (configs/quickstart.yaml: arith prompts with its two worked
  examples, 4 samples per prompt at temperature 0.7) generated once by the torch engine at version 0 and graded
  by the task's strict grader; groups whose rewards all agree are dropped (they carry no gradient), as the
  quickstart does. That batch is trained for STEPS steps at lr 1e-6 (the trainer's default) and again, from
  the same start, at lr 1e-5 (the quickstart's);
- per update, for bf16 and fp32 publishing: the full version's bytes and the delta's (areal_mq/weights/delta.py:
  sparse or XOR per tensor, zstd), the encode CPU time (trainer side) and the apply CPU time (receiver side,
  checksums included);
- at lr 1e-6, per update, for zmq (WeightServer, deltas on) and disk (model.delta beside full snapshots), with
  1 and 4 fetching workers (WeightCatchup objects fetching at once, on threads): the transfer (announcement to
  update in hand, delta verified), the engine pause (TorchEngine.update_weights, what the rollout worker times
  as engine_pause_s) and the end-to-end update (transfer + pause). The full-version route is measured the same
  way on every FULL_EVERY-th update (its size does not change with the step): zmq through the catch-up with
  checksums, disk as today without deltas (the engine reads the directory inside its pause);
- at lr 1e-5 the zmq delta route with 1 worker.
Ratios (larger is better): full_vs_delta_bytes_bf16 (lr 1e-6; target 20: a delta <= 5 % of the full bytes),
full_vs_delta_bytes_bf16_lr1e-5, full_vs_delta_bytes_fp32 (reported as they are), full_vs_delta_pause_zmq (the
engine pause of a full zmq update over a delta one; target 3). Byte ratios are the mean delta share over the steps;
time ratios are medians over the updates where both routes were measured. A delta's engine pause writes only the
changed elements (update_weights(patches=...), as the rollout worker does when the engine holds the delta's base);
a full update copies the whole state dict.
The machine's load average is recorded before and after (the CPU is shared: times are noisy, bytes are not).
A plot of bytes per update over the steps goes to --plot (default docs/weights-deltas.png).

    python benchmarks/speed/weights.py [--quick] [--json PATH] [--plot PATH] [--threads N] [--from-json PATH]
    python benchmarks/speed/weights.py --sharded [--quick] [--json PATH]   (sharded vs gather: benchmarks/speed/weights_sharded.py)
    python benchmarks/speed/weights.py --codec [--quick] [--device D]      (the delta encoder per GB: weights_codec.py)
    python benchmarks/speed/weights.py --vllm [--quick] [--json PATH]     (vLLM's update pause, serial vs staged:
                                                                           weights_vllm.py)
    python benchmarks/speed/weights.py --lora [--quick] [--json PATH]      (an adapter version vs a full one: weights_lora.py)

`--quick`: the tiny random Llama, 3 steps, 2 prompts, 16 tokens (same code path), under 2 minutes on 2 cores.
benchmarks/RESULTS.md records runs.
"""
from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TARGETS = {"full_vs_delta_bytes_bf16": 20.0, "full_vs_delta_pause_zmq": 3.0}
SIZES = {  # quick, full
    "model": ("tiny-random-llama", "smollm2-135m-instruct"), "steps": (3, 20), "prompts": (2, 8),
    "max_new_tokens": (16, 64), "full_every": (2, 5),
}
LRS = (1e-6, 1e-5)
WORKERS = (1, 4)
log = common.logger("weights")


# ---------------------------------------------------------------- the batch: real rollouts of the quickstart task
def quickstart_batch(model: str, prompts: int, max_new_tokens: int, seed: int = 0) -> tuple[list, dict]:
    """Rollouts of the quickstart task by the torch engine at version 0, graded; groups with mixed rewards
    (all groups when none is mixed, e.g. the tiny random model). Returns (samples, facts)."""
    from transformers import AutoTokenizer

    from areal_mq.config import load_config
    from areal_mq.data.dataset import build_dataset
    from areal_mq.data.prompts import ChatFormatter
    from areal_mq.engines import build_engine
    from areal_mq.engines.base import EngineRequest
    from areal_mq.engines.models import resolve_model
    from areal_mq.grading import grade
    from areal_mq.messages import Sample, SamplingSpec, SeqSample

    cfg = load_config(ROOT / "configs" / "quickstart.yaml", [f"model.name={model}"])
    group = cfg.controller.group_size
    tok = AutoTokenizer.from_pretrained(resolve_model(model))
    fmt = ChatFormatter(tok, cfg.data.system_prompt, cfg.data.examples)
    data = build_dataset(cfg.data)
    problems = [next(data) for _ in range(prompts)]
    engine = build_engine(cfg.rollout.engine, cfg.model, seed=seed, device="cpu")
    for p, problem in enumerate(problems):
        ids = fmt.ids(problem)
        for i in range(group):
            engine.submit(EngineRequest(f"{p}/{i}", ids, SamplingSpec(
                temperature=cfg.controller.temperature, max_new_tokens=max_new_tokens, seed=seed * 1000 + p * 10 + i)))
    outs: dict[str, Any] = {}
    t0 = time.perf_counter()
    while engine.has_work():
        outs.update((o.request_id, o) for o in engine.step())
    gen_s = time.perf_counter() - t0
    engine.close()
    samples = []
    for p, problem in enumerate(problems):
        seqs = []
        for i in range(group):
            o = outs[f"{p}/{i}"]
            seqs.append(SeqSample(prompt_ids=np.asarray(o.prompt_ids, np.int32), output_ids=o.output_ids,
                                  logprobs=o.logprobs, versions=o.versions,
                                  reward=float(grade(o.text, problem.answer).strict)))
        samples.append(Sample(sample_id=f"q{p}", prompt_id=problem.id, seqs=seqs))
    mixed = [s for s in samples if len({q.reward for q in s.seqs}) > 1]
    facts = {"prompts": prompts, "group_size": group, "generated_tokens": int(sum(len(o.output_ids) for o in outs.values())),
             "generate_s": round(gen_s, 1), "correct": int(sum(q.reward for s in samples for q in s.seqs)),
             "mixed_groups": len(mixed)}
    return (mixed or samples), facts


# ---------------------------------------------------------------- measuring one update
def _cpu(fn, *args) -> tuple[Any, float]:
    t0 = time.thread_time()
    out = fn(*args)
    return out, time.thread_time() - t0


def codec_row(prev: dict, new: dict) -> dict:
    """Bytes and CPU seconds of one version's delta in this dtype (encode on the trainer, apply on a worker)."""
    from areal_mq.weights.delta import apply_version, checksum, encode_version

    digests = {k: checksum(t) for k, t in new.items()}
    deltas, enc_s = _cpu(encode_version, prev, new, digests)
    _, app_s = _cpu(apply_version, prev, deltas)
    full = sum(t.numel() * t.element_size() for t in new.values())
    changed = sum(d.count for d in deltas if d.encoding == "sparse")
    return {"full_bytes": full, "delta_bytes": sum(d.nbytes for d in deltas), "encode_cpu_s": round(enc_s, 3),
            "apply_cpu_s": round(app_s, 3), "xor_tensors": sum(d.encoding == "xor" for d in deltas),
            "sparse_changed_elements": int(changed)}


def _prepare_all(catchups: list, ready: Any) -> tuple[list, float]:
    """Every catch-up prepares `ready` at once, each on its own thread, as W workers would; (updates, wall s)."""
    updates: list[Any] = [None] * len(catchups)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            updates[i] = catchups[i].prepare(ready)
        except BaseException as exc:  # surfaced below: a benchmark never hides a failed fetch
            errors.append(exc)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(catchups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return updates, wall


def route_row(catchups: list, engine: Any, ready: Any, commit: bool = True) -> dict:
    """Transfer with len(catchups) workers at once, then worker 0's update applied to the engine (the pause)."""
    updates, transfer = _prepare_all(catchups, ready)
    u = updates[0]
    # as the rollout worker does: only the changed elements when the engine holds the diff's base (patches carry
    # the new values, not increments, so rewriting them on an engine already at this version changes nothing;
    # the rows of one version share one engine)
    patch = u.patches is not None and engine.version in (u.patch_base, ready.version)
    kwargs, t0 = u.kwargs, time.perf_counter()
    if patch:  # staged on the fetch thread, as the rollout worker does (checks and dtype conversion off the pause)
        stager = getattr(engine, "stage_patches", None)
        kwargs = {"patches": stager(u.patches) if stager is not None else u.patches}
    transfer += time.perf_counter() - t0  # the worker stages before it applies: part of the transfer, not the pause
    t0 = time.perf_counter()
    engine.update_weights(ready.version, **kwargs)
    pause = time.perf_counter() - t0
    if commit:
        for c, u in zip(catchups, updates):
            c.commit(u)
    return {"route": u.route, "fetched_bytes": u.fetched_bytes, "transfer_s": round(transfer, 3),
            "engine_pause_s": round(pause, 5), "end_to_end_s": round(transfer + pause, 5),
            "applied": "patches" if patch else "full"}


class Fleet:
    """The receiving side for one publish mode: 1 + 4 workers' catch-ups (each holds the previous version) and
    the publisher. `update(v, tensors, full)` publishes and measures the delta routes, and the full route too."""

    def __init__(self, mode: str, run_dir: Path, engine: Any):
        from areal_mq.algorithms.config import TrainerConfig
        from areal_mq.weights import WeightPublisher
        from areal_mq.weights.catchup import WeightCatchup

        self.mode, self.run_dir, self.engine = mode, run_dir, engine
        self.cfg = TrainerConfig(publish_mode=mode, weight_deltas="on", weight_server_port=0)
        self.publisher = WeightPublisher(self.cfg, run_dir)
        self.catchups = {w: [WeightCatchup(run_dir, self.cfg, 600.0) for _ in range(w)] for w in WORKERS}
        self.fresh = lambda: WeightCatchup(run_dir, self.cfg, 600.0)

    def update(self, version: int, tensors: dict, full: bool) -> dict:
        from areal_mq.weights import publish_disk

        t0 = time.perf_counter()
        ready = self.publisher.publish(version, tensors, snapshot=True)
        out: dict[str, Any] = {"publish_s": round(time.perf_counter() - t0, 3)}
        for w, catchups in self.catchups.items():
            out[f"delta_w{w}"] = route_row(catchups, self.engine, ready)
        if full:
            if self.mode == "zmq":  # workers holding nothing: the full version, every tensor's checksum verified
                for w in WORKERS:
                    out[f"full_w{w}"] = route_row([self.fresh() for _ in range(w)], self.engine, ready, commit=False)
            else:  # disk as before deltas: the engine reads the version directory inside its pause
                plain = publish_disk(self.run_dir / "full" / "weights", version, tensors, keep=1)
                for w in WORKERS:
                    out[f"full_w{w}"] = self._disk_full(plain, w)
        return out

    def _disk_full(self, ready: Any, workers: int) -> dict:
        from areal_mq.weights import read_disk

        others = [threading.Thread(target=read_disk, args=(ready.path,)) for _ in range(workers - 1)]
        t0 = time.perf_counter()
        for t in others:  # the other workers' engines read the same files at the same time
            t.start()
        self.engine.update_weights(ready.version, path=ready.path)
        pause = time.perf_counter() - t0
        for t in others:
            t.join()
        wall = time.perf_counter() - t0
        return {"route": "path", "fetched_bytes": int(ready.meta["bytes"]), "transfer_s": 0.0,
                "engine_pause_s": round(pause, 3), "end_to_end_s": round(wall, 3)}

    def close(self) -> None:
        self.publisher.close()


# ---------------------------------------------------------------- the run
def train_run(trainer: Any, start: dict, batch: list, steps: int, lr: float, fleets: list, full_every: int,
              engine: Any) -> list[dict]:
    """`steps` train steps at `lr` from the `start` weights; per update the codec rows and the fleets' routes."""
    import torch

    with torch.no_grad():
        params = dict(trainer.unwrapped.named_parameters())
        for k, t in start.items():
            params[k].copy_(t)
    for group in trainer.optimizer.param_groups:
        group["lr"], group["initial_lr"] = lr, lr
    trainer.optimizer.state.clear()
    if trainer.scheduler is not None:
        trainer.scheduler.base_lrs = [lr for _ in trainer.scheduler.base_lrs]
    prev = {d: trainer.publish_tensors(d) for d in ("bfloat16", "float32")}
    for fleet in fleets:
        fleet.update(0, prev["bfloat16"], full=False)  # every worker holds v0 (a full fetch, not measured)
    rows = []
    for v in range(1, steps + 1):
        t0 = time.perf_counter()
        metrics = trainer.train_step(batch)
        row: dict[str, Any] = {"lr": lr, "version": v, "train_s": round(time.perf_counter() - t0, 2),
                               "loss": float(metrics.get("loss", float("nan")))}
        new = {d: trainer.publish_tensors(d) for d in ("bfloat16", "float32")}
        for d in new:
            row[d] = codec_row(prev[d], new[d])
        full = v == 1 or v % full_every == 0
        for fleet in fleets:
            row[fleet.mode] = fleet.update(v, new["bfloat16"], full)
        prev = new
        rows.append(row)
        log(f"lr {lr:g} v{v}: bf16 delta {row['bfloat16']['delta_bytes'] / row['bfloat16']['full_bytes']:.2%} "
            f"fp32 {row['float32']['delta_bytes'] / row['float32']['full_bytes']:.2%} of full; "
            f"train {row['train_s']} s; load {os.getloadavg()[0]:.1f}")
    return rows


def run(args: Any, tmp: Path) -> dict:
    import torch

    from areal_mq.algorithms.trainer import Trainer
    from areal_mq.config import load_config
    from areal_mq.engines import build_engine
    from areal_mq.engines.models import resolve_model

    torch.set_num_threads(args.threads)
    q = 0 if args.quick else 1
    size = {k: v[q] for k, v in SIZES.items()}
    load_start = list(os.getloadavg())
    batch, facts = quickstart_batch(size["model"], size["prompts"], size["max_new_tokens"])
    log(f"batch: {len(batch)} groups ({facts})")
    qcfg = load_config(ROOT / "configs" / "quickstart.yaml", [f"model.name={size['model']}"])
    tcfg = qcfg.trainer.model_copy(update={"lr_schedule": "constant", "warmup_steps": 0})
    trainer = Trainer(tcfg, resolve_model(size["model"]), device="cpu")
    start = {k: t.detach().clone() for k, t in trainer.unwrapped.named_parameters()}
    engine = build_engine(qcfg.rollout.engine, qcfg.model, seed=0, device="cpu")
    rows: list[dict] = []
    for lr in LRS:
        fleets = [Fleet(m, tmp / f"{m}-{lr:g}", engine) for m in (("zmq", "disk") if lr == LRS[0] else ("zmq",))]
        if lr != LRS[0]:
            for f in fleets:
                f.catchups = {1: f.catchups[1]}
        try:
            rows += train_run(trainer, start, batch, size["steps"], lr, fleets, size["full_every"], engine)
        finally:
            for f in fleets:
                f.close()
    engine.close()
    summary, ratios = summarize(rows)
    machine = common.torch_machine(model=size["model"], threads=args.threads, loadavg_at_end=list(os.getloadavg()))
    machine["loadavg_at_start"] = load_start
    report = {"benchmark": "weights", "quick": args.quick, "machine": machine,
              "results": [{"name": "setup", **facts, "steps": size["steps"], "lrs": list(LRS),
                           "full_route_every": size["full_every"], "trainer_lr_schedule": "constant"},
                          {"name": "summary", **summary}, *rows],
              "ratios": ratios, "targets": dict(TARGETS)}
    plot(rows, args.plot)
    return report


def _mean(values: list[float]) -> float:
    return float(statistics.fmean(values)) if values else float("nan")


def summarize(rows: list[dict]) -> tuple[dict, dict]:
    """Means over the steps per (lr, dtype) (bytes, CPU), medians per (mode, route, workers) (times); the ratios,
    the time ratios over the updates where both the full and the delta route were measured."""
    out: dict[str, Any] = {}
    for lr in LRS:
        rs = [r for r in rows if r["lr"] == lr]
        for d in ("bfloat16", "float32"):
            share = _mean([r[d]["delta_bytes"] / r[d]["full_bytes"] for r in rs])
            out[f"lr{lr:g}_{d}"] = {"full_bytes": rs[0][d]["full_bytes"], "delta_share": share,
                                    "delta_bytes": _mean([r[d]["delta_bytes"] for r in rs]),
                                    "encode_cpu_s": _mean([r[d]["encode_cpu_s"] for r in rs]),
                                    "apply_cpu_s": _mean([r[d]["apply_cpu_s"] for r in rs])}
        for mode in ("zmq", "disk"):
            for key in [k for k in (rs[0].get(mode) or {}) if k != "publish_s"] + ["full_w1", "full_w4"]:
                got = [r[mode][key] for r in rs if mode in r and key in r[mode]]
                if got:
                    out[f"lr{lr:g}_{mode}_{key}"] = {  # medians: one descheduled update must not lead
                        "n": len(got), "route": got[0]["route"],
                        **{f: float(np.median([g[f] for g in got])) for f in (
                            "fetched_bytes", "transfer_s", "engine_pause_s", "end_to_end_s")}}
    lo, hi = f"lr{LRS[0]:g}", f"lr{LRS[1]:g}"
    paired = [r for r in rows if r["lr"] == LRS[0] and "full_w1" in r["zmq"]]  # full and delta on the same updates

    def paired_ratio(field: str, w: int) -> float | None:
        den = float(np.median([r["zmq"][f"delta_w{w}"][field] for r in paired]))
        # None: the delta side took no measurable time (an empty delta: --quick's tiny model learns nothing)
        return float(np.median([r["zmq"][f"full_w{w}"][field] for r in paired])) / den if den > 0 else None

    ratios = {"full_vs_delta_bytes_bf16": 1 / out[f"{lo}_bfloat16"]["delta_share"],
              "full_vs_delta_bytes_bf16_lr1e-5": 1 / out[f"{hi}_bfloat16"]["delta_share"],
              "full_vs_delta_bytes_fp32": 1 / out[f"{lo}_float32"]["delta_share"],
              "full_vs_delta_pause_zmq": paired_ratio("engine_pause_s", 1),
              "full_vs_delta_update_zmq": paired_ratio("end_to_end_s", 1),
              "full_vs_delta_update_zmq_4_workers": paired_ratio("end_to_end_s", 4)}
    return out, ratios


def resummarize(path: Path, plot_path: Path | None) -> dict:
    """An earlier report with its summary and ratios computed again from its per-update rows."""
    import json

    report = json.loads(Path(path).read_text())
    rows = [r for r in report["results"] if "version" in r]
    summary, report["ratios"] = summarize(rows)
    report["results"] = [report["results"][0], {"name": "summary", **summary}, *rows]
    plot(rows, plot_path)
    return report


def plot(rows: list[dict], path: Path | None) -> None:
    if path is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for lr, style in zip(LRS, ("-", "--")):
        rs = [r for r in rows if r["lr"] == lr]
        for d, color in (("bfloat16", "tab:blue"), ("float32", "tab:orange")):
            ax.plot([r["version"] for r in rs], [r[d]["delta_bytes"] / 1e6 for r in rs], style, color=color,
                    marker="o", ms=3, label=f"delta, {d}, lr {lr:g}")
    for d, color in (("bfloat16", "tab:blue"), ("float32", "tab:orange")):
        ax.axhline(rows[0][d]["full_bytes"] / 1e6, color=color, lw=0.8, ls=":", label=f"full version, {d}")
    ax.set_yscale("log")
    ax.set_xlabel("update (training step)")
    ax.set_ylabel("MB per update per worker")
    ax.set_title("Weight update bytes: delta vs full (SmolLM2-135M, quickstart task)", fontsize=10)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(report: dict, command: str) -> str:
    s = next(r for r in report["results"] if r["name"] == "summary")
    lo, hi = f"lr{LRS[0]:g}", f"lr{LRS[1]:g}"
    mb = lambda b: f"{b / 1e6:.1f} MB"  # noqa: E731
    rows = [("publish", "full", "delta (mean)", "delta share", "encode CPU", "apply CPU")]
    for lr in (lo, hi):
        for d in ("bfloat16", "float32"):
            c = s[f"{lr}_{d}"]
            rows.append((f"{d} {lr}", mb(c["full_bytes"]), mb(c["delta_bytes"]), f"{c['delta_share']:.2%}",
                         f"{c['encode_cpu_s']:.2f} s", f"{c['apply_cpu_s']:.2f} s"))
    upd = [("update (bf16)", "route", "workers", "fetched", "transfer", "engine pause", "end to end", "n")]
    for lr in (lo, hi):
        for mode in ("zmq", "disk"):
            for kind in ("full", "delta"):
                for w in WORKERS:
                    c = s.get(f"{lr}_{mode}_{kind}_w{w}")
                    if c:
                        upd.append((f"{mode} {kind} {lr}", c["route"], str(w), mb(c["fetched_bytes"]),
                                    f"{c['transfer_s']:.3f} s", f"{c['engine_pause_s']:.3f} s",
                                    f"{c['end_to_end_s']:.3f} s", str(c["n"])))
    setup = report["results"][0]
    m = report["machine"]
    note = (f"{m['model']}: {setup['prompts']} quickstart prompts x {setup['group_size']}, {setup['mixed_groups']} "
            f"groups with mixed rewards trained, {setup['steps']} steps per lr; load avg {m['loadavg_at_start'][0]:.1f}"
            f" at start, {m['loadavg_at_end'][0]:.1f} at end ({m['cpus']} CPUs)")
    return "\n".join([*common.align(rows), "", *common.align(upd), "", *common.align(common.ratio_rows(report)),
                      note, f"command: {command}"])


def main() -> None:
    parser = common.arg_parser(__doc__, quick_help="Tiny random model, 3 steps: under 2 minutes on 2 cores.")
    parser.add_argument("--threads", type=int, default=2, help="torch threads.")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "weights-deltas.png",
                        help="Where the bytes-per-update plot goes (PNG).")
    parser.add_argument("--from-json", type=Path, help="Summarize the updates of an earlier run's JSON again "
                        "(table, ratios, plot; nothing is measured).")
    parser.add_argument("--sharded", action="store_true", help="Sharded publishing against the rank-0 gather "
                        "(benchmarks/speed/weights_sharded.py: 2 FSDP ranks, a Qwen2.5-0.5B shape).")
    parser.add_argument("--lora", action="store_true", help="A LoRA adapter version against a full version: bytes "
                        "and the engine's pause (benchmarks/speed/weights_lora.py).")
    parser.add_argument("--codec", action="store_true", help="The delta encoder per GB, host numpy against torch "
                        "on --device (benchmarks/speed/weights_codec.py).")
    parser.add_argument("--vllm", action="store_true", help="engine: vllm's full in-memory update, serial against "
                        "staged: how long generation stops (benchmarks/speed/weights_vllm.py; needs vLLM).")
    common.add_device_arg(parser)
    parser.add_argument("--versions", type=int, default=6, help="--sharded: versions published.")
    parser.add_argument("--changed", type=float, default=0.025, help="--sharded: share of elements a version changes.")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.device != "cpu" and not args.codec:
        parser.error("--device applies to --codec only (the update benchmarks run the trainer on the CPU)")
    mode = next((m for m in ("codec", "vllm", "lora", "sharded") if getattr(args, m)), None)
    if mode is not None:  # a mode of its own: weights_<mode>.py beside this file
        import importlib

        importlib.import_module(f"weights_{mode}").main(args)
        return
    if args.from_json:
        report = resummarize(args.from_json, args.plot)
        common.finish(report, args.json, table(report, report.get("command", common.command("weights.py"))))
        return
    report = common.timed(run, args, tmp_prefix="amq-weights-bench-")
    report["command"] = common.command("weights.py")
    common.finish(report, args.json, table(report, common.command("weights.py")))


if __name__ == "__main__":
    sys.exit(main())
