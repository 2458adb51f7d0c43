"""Sharded weight publishing against the rank-0 gather, side by side (issue 38 item 6).

    python benchmarks/speed/weights.py --sharded [--quick] [--json PATH] [--versions N]

What: a Qwen2.5-0.5B-shaped model (random weights, seeded; 494M parameters, 0.99 GB in bf16) trained under FSDP2 by
2 CPU ranks over gloo (torch.distributed.run, the real Trainer), publishing in bf16 over zmq with deltas, through
both layouts for every version, one after the other on the same ranks and the same weights:
- gather (trainer.publish_layout gather, the fallback): the step waits for Trainer.publish_tensors (the whole model
  gathered to rank 0 one tensor at a time, every rank taking part); rank 0's BackgroundPublisher then encodes the
  delta, hands the chunks to its one WeightServer and announces;
- sharded (the default under fsdp + zmq): the step waits for Trainer.publish_slices (a copy of the rank's own
  shards); each rank's BackgroundPublisher encodes and serves its slices and rank 0 announces the manifest.
The weights change between versions by a SYNTHETIC update (no forward/backward: a 0.5B step takes minutes on this
CPU and does not change what is measured): on every rank, a seeded `--changed` share of its shard's elements moves
by 1 % of its value (enough to change the bf16 value), the share verl reports per RL step (2.1-2.6 %).
The receiving side is this process: 1 and 2 workers (WeightCatchup objects fetching at once, on threads, each
following every version by deltas; each route of a version is measured from the same held version, as both layouts
publish the same bytes) and one TorchEngine in bf16 taking worker 0's update (patches of what changed, as the
rollout worker applies them; the engine pause). Every worker must end holding, bit for bit, the trainer's last
version (checksums of the gathered model).
Measured per version and layout: bytes fetched per worker, trainer-blocked time (the slowest rank), announce time
(step end to WeightsReady), time until every engine holds the version (announce + fetch by all workers + the
pause), engine pause. Ratios (medians over versions 2.., larger is better): gather_vs_sharded_blocked (target 5),
gather_vs_sharded_update (target 1.5, with 2 workers), and the same for 1 worker.
`--quick`: a tiny random Qwen2 and 3 versions (same code path), about a minute.
"""
from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TARGETS = {"gather_vs_sharded_blocked": 5.0, "gather_vs_sharded_update": 1.5}
LAYOUTS = ("gather", "sharded")
WORKERS = (1, 2)


def _cfg(layout: str) -> Any:
    from areal_mq.algorithms.config import TrainerConfig

    return TrainerConfig(strategy="fsdp", publish_mode="zmq", publish_layout=layout, publish_dtype="bfloat16",
                         keep_weight_versions=1, full_every=20, checkpoint_every=0, shard_publish_timeout_s=600.0)


HARNESS_PID = 0  # rank_main: the measuring process; the ranks stop waiting when it is gone


def _wait(path: Path, timeout: float = 1800.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        if HARNESS_PID:
            try:
                os.kill(HARNESS_PID, 0)
            except ProcessLookupError:
                raise SystemExit(f"the benchmark process {HARNESS_PID} is gone") from None
        time.sleep(0.01)


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    tmp.rename(path)


# ---------------------------------------------------------------- the trainer ranks (under torch.distributed.run)
def rank_main(out: Path, versions: int, changed: float) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from areal_mq.algorithms.trainer import Trainer
    from areal_mq.weights import WeightPublisher
    from areal_mq.weights.background import BackgroundPublisher
    from areal_mq.weights.sharded import ShardPublisher
    from areal_mq.workers.trainer import _exchange_collector

    torch.set_num_threads(1)
    trainer = Trainer(_cfg("sharded"), out / "model", device="cpu")
    rank, world = trainer.rank, trainer.world_size
    shard_pub = ShardPublisher(_cfg("sharded"), rank=rank, world=world, exchange=_exchange_collector)
    gather_pub = WeightPublisher(_cfg("gather"), out / "gather") if rank == 0 else None
    t_start: dict[tuple[str, int], float] = {}

    def announce(layout: str):
        def publish(version: int, snapshot: Any, _hf: Any) -> None:
            ready = (gather_pub.publish(version, snapshot, snapshot=True) if layout == "gather"
                     else shard_pub.publish(version, snapshot))
            if rank == 0:
                _write(out / f"{layout}-v{version}.json", {"ready": ready.model_dump(mode="json"),
                                                          "announce_s": time.time() - t_start[layout, version]})
        return publish

    background = {"sharded": BackgroundPublisher(announce("sharded")),
                  "gather": BackgroundPublisher(announce("gather")) if rank == 0 else None}
    gen = torch.Generator().manual_seed(1000 + rank)
    for v in range(1, versions + 1):
        with torch.no_grad():  # the synthetic update (see the module docstring)
            for p in trainer.unwrapped.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                mask = torch.rand(local.shape, generator=gen) < changed
                local.add_(local * mask * 0.01)
        trainer.version = v
        for layout in LAYOUTS:
            dist.barrier()
            t0 = time.time()
            t_start[layout, v] = t0
            snap = trainer.publish_tensors() if layout == "gather" else trainer.publish_slices()
            blocked = time.time() - t0
            if background[layout] is not None:
                background[layout].submit(v, snap, None)
            _write(out / f"blocked-{layout}-v{v}-r{rank}.json", {"blocked_s": blocked})
            if rank == 0:
                _wait(out / f"go-{layout}-v{v}")
            dist.barrier()
    for bg in background.values():
        if bg is not None:
            bg.close()
    from areal_mq.weights.delta import checksum

    final = trainer.strategy.full_state_dict(trainer.unwrapped, "bfloat16", keep=rank == 0)  # the reference
    if rank == 0:
        _write(out / "final-sums.json", {k: checksum(t) for k, t in final.items()})
        del final
        _write(out / "done.json", {})
    _wait(out / "end")
    shard_pub.close()
    if gather_pub is not None:
        gather_pub.close()


# ---------------------------------------------------------------- the receiving side (this process)
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: Any, tmp: Path) -> dict:
    import torch

    import common
    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.shapes import build_random_model
    from areal_mq.engines.torch.engine import TorchEngine
    from areal_mq.messages import WeightsReady
    from areal_mq.weights.catchup import WeightCatchup
    from weights import route_row

    log = common.logger("weights-sharded")
    torch.set_num_threads(2)
    shape = "tiny-qwen2" if args.quick else "qwen2.5-0.5b"
    versions = 3 if args.quick else args.versions
    log(f"building a random {shape} (seeded) ...")
    build_random_model(tmp / "model", shape, seed=0)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}", OMP_NUM_THREADS="1",
               HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="", MALLOC_MMAP_THRESHOLD_="1048576")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), __file__, "--rank-main", str(tmp), str(versions), str(args.changed), str(os.getpid())]
    trainer_log = open(tmp / "ranks.log", "w")
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=trainer_log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    # one engine and two workers serve both layouts: both publish the same bytes for a version, so every route
    # is measured from the same held version (prepare changes nothing until commit), and only the last route's
    # update is committed. Worker 0 alone is the 1-worker fleet; workers 0 and 1 at once the 2-worker fleet.
    engine = TorchEngine(tmp / "model", EngineConfig(), dtype="bfloat16")
    workers = [WeightCatchup(tmp, _cfg("sharded"), 600.0) for _ in range(max(WORKERS))]
    rows: list[dict] = []
    try:
        from tqdm import tqdm

        for v in tqdm(range(1, versions + 1), desc="versions (gather, then sharded)", unit="v"):
            for layout in LAYOUTS:
                path = tmp / f"{layout}-v{v}.json"
                while not path.exists():
                    if proc.poll() is not None:
                        raise RuntimeError(f"the trainer ranks exited: {(tmp / 'ranks.log').read_text()[-3000:]}")
                    time.sleep(0.01)
                got = json.loads(path.read_text())
                ready = WeightsReady.model_validate(got["ready"])
                blocked = []
                for r in range(2):
                    _wait(tmp / f"blocked-{layout}-v{v}-r{r}.json", 600)
                    blocked.append(json.loads((tmp / f"blocked-{layout}-v{v}-r{r}.json").read_text())["blocked_s"])
                row = {"version": v, "layout": layout, "shards": len(ready.shards), "blocked_s": round(max(blocked), 4),
                       "announce_s": round(got["announce_s"], 4), "full_bytes": int(ready.meta.get("bytes", 0))}
                for w in WORKERS:
                    last = layout == LAYOUTS[-1] and w == WORKERS[-1]
                    r = route_row(workers[:w], engine, ready, commit=last)
                    row[f"w{w}"] = {**r, "update_s": round(got["announce_s"] + r["end_to_end_s"], 4)}
                rows.append(row)
                (tmp / f"go-{layout}-v{v}").write_text("1")
        _wait(tmp / "done.json", 600)
        # bit-identical: every worker holds the trainer's last version (the ranks wrote its checksums, gathered)
        from areal_mq.weights.delta import checksum

        want = json.loads((tmp / "final-sums.json").read_text())
        identical = all({k: checksum(t) for k, t in c.held.items()} == want for c in workers)
    finally:
        (tmp / "end").write_text("1")
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            common.stop_process(proc)
        engine.close()
    return report(rows, identical, shape, versions, args, common)


def _median(rows: list[dict], layout: str, key: str, workers: int | None = None) -> float:
    vals = [(r[f"w{workers}"][key] if workers else r[key]) for r in rows if r["layout"] == layout and r["version"] > 1]
    return statistics.median(vals or [float("nan")])


def report(rows: list[dict], identical: bool, shape: str, versions: int, args: Any, common: Any) -> dict:
    summary = {layout: {"blocked_s": _median(rows, layout, "blocked_s"),
                        "announce_s": _median(rows, layout, "announce_s"),
                        **{f"update_s_w{w}": _median(rows, layout, "update_s", w) for w in WORKERS},
                        **{f"pause_s_w{w}": _median(rows, layout, "engine_pause_s", w) for w in WORKERS},
                        "fetched_bytes_w1": _median(rows, layout, "fetched_bytes", 1),
                        "full_bytes": rows[-1]["full_bytes"]} for layout in LAYOUTS}
    g, s = summary["gather"], summary["sharded"]
    ratios = {"gather_vs_sharded_blocked": g["blocked_s"] / s["blocked_s"],
              "gather_vs_sharded_update": g["update_s_w2"] / s["update_s_w2"],
              "gather_vs_sharded_update_1_worker": g["update_s_w1"] / s["update_s_w1"]}
    return {"benchmark": "weights_sharded", "quick": args.quick,
            "machine": common.torch_machine(model=shape, ranks=2, loadavg_at_end=list(os.getloadavg())),
            "setup": {"model": shape, "versions": versions, "changed_share": args.changed, "publish_dtype": "bfloat16",
                      "trainer_ranks": 2, "workers": list(WORKERS), "bit_identical_workers": identical},
            "summary": summary, "results": rows, "ratios": ratios, "targets": dict(TARGETS)}


def table(rep: dict, command: str, common: Any) -> str:
    head = [("layout", "blocked", "announce", "update 1 worker", "update 2 workers", "pause", "fetched/worker")]
    for layout, s in rep["summary"].items():
        head.append((layout, f"{s['blocked_s']:.3f} s", f"{s['announce_s']:.3f} s", f"{s['update_s_w1']:.3f} s",
                     f"{s['update_s_w2']:.3f} s", f"{s['pause_s_w1']:.3f} s", f"{s['fetched_bytes_w1'] / 1e6:.1f} MB"))
    lines = [f"sharded vs gather publishing, {rep['setup']['model']}, 2 ranks, {rep['setup']['versions']} versions "
             f"(medians from v2), workers bit-identical: {rep['setup']['bit_identical_workers']}",
             *common.align(head), "", *common.align(common.ratio_rows(rep)), command]
    return "\n".join(lines)


def main(args: Any) -> None:
    import common

    rep = common.timed(run, args, tmp_prefix="amq-weights-sharded-")
    rep["command"] = common.command("weights.py")
    common.finish(rep, args.json, table(rep, rep["command"], common))
    if not rep["setup"]["bit_identical_workers"]:
        raise SystemExit("workers do not hold bit-identical weights")


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "--rank-main":
    HARNESS_PID = int(sys.argv[5])
    rank_main(Path(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
