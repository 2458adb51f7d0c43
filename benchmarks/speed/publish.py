"""How long a training step waits for its weight publish: in the step (as before) vs beside the next step.

What it measures, in one run, with the real Trainer and the real WeightPublisher (SmolLM2-135M-Instruct, CPU;
--quick: the tiny random Llama): S training steps on the same batches, each followed by a publish of the new
version, for publish_mode zmq (the weight server, deltas on) and disk (a full snapshot directory), once with the
publish in the step (`trainer.publish_async: false`) and once through the BackgroundPublisher (the default):
  blocked_s   what the trainer's thread spends per step on publishing (snapshot + the publish, or snapshot +
              waiting for room in the background queue): the `publish_s` of each step's metrics;
  ready_s     from the end of the optimizer step to the version being published (WeightsReady made);
  wall_s      the S steps with their publishes, end to end (the background thread shares the 2 cores).
Ratios (larger is better): `sync_vs_async_blocked_zmq` and `sync_vs_async_blocked_disk` (median blocked time).

    python benchmarks/speed/publish.py [--quick] [--json PATH]
"""
from __future__ import annotations

import argparse
import sys
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402

log = common.logger("publish")


SIZES = {"groups": 2, "group_size": 4, "prompt": 24, "gen": 40}  # 512 tokens a step (trainer_fsdp.batches)


def one(model_dir: Path, mode: str, background: bool, steps: int, work: Path) -> dict:
    from accelerate.state import AcceleratorState

    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.trainer import Trainer
    from areal_mq.weights import WeightPublisher
    from areal_mq.weights.background import BackgroundPublisher

    AcceleratorState._reset_state(reset_partial_state=True)
    cfg = TrainerConfig(lr=1e-5, checkpoint_every=0, publish_mode=mode, publish_async=background)
    trainer = Trainer(cfg, model_dir, device="cpu")
    publisher = WeightPublisher(cfg, work / f"{mode}-{background}")
    done: dict[int, float] = {}

    def announce(version, tensors, hf_config_json):
        publisher.publish(version, tensors, hf_config_json, snapshot=True)
        done[version] = time.perf_counter()

    bg = BackgroundPublisher(announce) if background else None
    blocked, ended = [], {}
    t_start = time.perf_counter()
    from trainer_fsdp import batches  # the same seeded batches the sharded trainer benchmark trains

    for b in batches(steps, SIZES):
        trainer.train_step(b)
        ended[trainer.version] = t0 = time.perf_counter()
        tensors = trainer.publish_tensors()
        if bg is not None:
            bg.submit(trainer.version, tensors, trainer.hf_config_json)
        else:
            announce(trainer.version, tensors, trainer.hf_config_json)
        blocked.append(time.perf_counter() - t0)
    if bg is not None:
        bg.close()
    wall = time.perf_counter() - t_start
    publisher.close()
    ready = [done[v] - ended[v] for v in ended]
    return {"mode": mode, "background": background, "blocked_s": [round(x, 4) for x in blocked],
            "blocked_median_s": round(statistics.median(blocked[1:] or blocked), 4),
            "ready_median_s": round(statistics.median(ready[1:] or ready), 4), "wall_s": round(wall, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny random Llama, 3 steps")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from areal_mq.engines.models import resolve_model

    torch.set_num_threads(1)
    model_dir = resolve_model("tiny-random-llama" if args.quick else "smollm2-135m-instruct")
    steps = 3 if args.quick else 6
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-publish-") as tmp:
        for mode in ("zmq", "disk"):
            for background in (False, True):
                rows.append(one(model_dir, mode, background, steps, Path(tmp)))
                log(f"{mode} background={background}: blocked {rows[-1]['blocked_median_s']} s")
    by = {(r["mode"], r["background"]): r for r in rows}
    ratios = {f"sync_vs_async_blocked_{m}": round(by[(m, False)]["blocked_median_s"]
                                                  / max(by[(m, True)]["blocked_median_s"], 1e-6), 2)
              for m in ("zmq", "disk")}
    report = {"benchmark": "publish", "quick": args.quick, "machine": common.torch_machine(device="cpu"),
              "model": "tiny-random-llama" if args.quick else "smollm2-135m-instruct", "steps": steps,
              "results": rows, "ratios": ratios}
    table = [("mode", "publish", "blocked s (median)", "ready s (median)", "wall s")] + [
        (r["mode"], "background" if r["background"] else "in the step", r["blocked_median_s"], r["ready_median_s"],
         r["wall_s"]) for r in rows]
    print("\n".join(common.align(table)))
    print("\n" + "  ".join(f"{k} {v}" for k, v in ratios.items()))
    print(f"reproduce: python benchmarks/speed/publish.py{' --quick' if args.quick else ''}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
