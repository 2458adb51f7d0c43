"""Stage d: the colocated weight update — trainer and engine on one device, pause -> new weights live -> decode
resumes — for each publish mode this tree has.

What it measures, on SmolLM2-135M's exact config with random weights (random_model.py): an engine with C
sequences mid-generation (full: 64) and a "trainer" copy of the model (fp32 master weights, on the same device)
publish a new version, as the trainer does (areal_mq/weights/__init__.py: bf16 CPU snapshot via unique_tensors, then):
  disk      publish_disk -> engine.update_weights(path=...)
  zmq       WeightServer.publish -> fetch_weights over loopback -> engine.update_weights(tensors=...)
  cuda_ipc  trainer.publish_mode cuda_ipc (areal_mq/weights/ipc.py): the "trainer" is a second process on the same
            device (CUDA IPC handles cannot be opened by the process that made them) holding the fp32 model;
            its IpcPublisher copies the parameters into the shared bf16 buffers (publish_s, its own clock,
            synchronized), and the engine's IpcReceiver copies them into the live model (load_s: the copy, the
            device sync and the seqlock check). The warm-up round allocates the buffers and opens the handles
            (shared once); the measured rounds are what every later version costs. On the CPU the same protocol
            runs on shared memory.
Per mode (median of rounds): publish_s (trainer side), fetch_s (zmq), then the engine's pause: load_s (weights
into the live model) + resume_s (pause bookkeeping, KV recompute of the in-flight rows, until the first token
under the new version). engine_pause_s = load_s + resume_s is what decoding loses; total_s adds publish and fetch
(for cuda_ipc also the pipe that asks the trainer process to publish and brings back its WeightsReady).
Target (issue 25): the colocated (cuda_ipc) engine pause < 100 ms for SmolLM2-135M, disk and zmq beside it.

    python benchmarks/gpu/stage_d_update.py [--device cuda] [--quick] [--out DIR]
"""
from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys

import report
from report import common

SIZES = {"in_flight": (4, 64), "tokens_before": (4, 32), "prompt": (12, 150), "rounds": (1, 3)}  # quick, full
TARGET_S = 0.1
log = common.logger("gpu-d")


PUBLISHER = r"""
import json, sys, time, torch
from areal_mq.engines.models import load_causal_lm
from areal_mq.weights.ipc import IpcPublisher

model_dir, run_dir, device = sys.argv[1:4]
model = load_causal_lm(model_dir, "float32", torch.device(device))
pub = IpcPublisher(run_dir, "bfloat16")
print("ready", flush=True)
for line in sys.stdin:
    t0 = time.perf_counter()
    ready = pub.publish(int(line), model.state_dict())  # synchronizes the device before it returns
    print(json.dumps({"ready": ready.model_dump(mode="json"), "publish_s": time.perf_counter() - t0}), flush=True)
pub.close()
"""


class IpcTrainer:
    """The trainer side of cuda_ipc in its own process on the same device: publish(version) -> (ready, publish_s)."""

    def __init__(self, model_dir, run_dir, device):
        from areal_mq.weights.ipc import IpcReceiver

        self.proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(model_dir), str(run_dir), str(device)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            self.close()
            raise RuntimeError("the cuda_ipc publisher process did not start (see its stderr above)")
        self.receiver = IpcReceiver(run_dir, timeout_s=120.0)

    def publish(self, version: int):
        from areal_mq.messages import WeightsReady

        self.proc.stdin.write(f"{version}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the cuda_ipc publisher process exited (rc {self.proc.poll()})")
        got = json.loads(line)
        return WeightsReady.model_validate(got["ready"]), got["publish_s"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc.stdout.close()


def start_requests(engine, n: int, prompt: int, steps: int, tag: str) -> list[str]:
    import numpy as np

    from areal_mq.engines.base import EngineRequest
    from areal_mq.messages import SamplingSpec

    rng = np.random.default_rng(n)
    ids = [f"upd-{tag}-{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        sp = SamplingSpec(temperature=1.0, max_new_tokens=steps * 4, ignore_eos=True, seed=i)
        engine.submit(EngineRequest(rid, rng.integers(100, 49000, prompt).tolist(), sp))
    for _ in range(steps + 4):  # prefill, then decode a while
        engine.step()
    return ids


def one_update(engine, trainer_model, mode: str, version: int, args, work, s: dict, ipc=None) -> dict:
    from areal_mq.weights import WeightServer, fetch_weights, publish_disk, unique_tensors

    clock = report.timer(args.device)
    ids = start_requests(engine, s["in_flight"], s["prompt"], s["tokens_before"], f"{mode}{version}")
    t0 = clock()
    server, publish_s = None, None
    if mode == "cuda_ipc":
        ready, publish_s = ipc.publish(version)
        t1 = t2 = clock()
        timings = ipc.receiver.update(engine, ready)
        timings["load_s"] = timings["ipc_copy_s"] - timings["pause_s"]  # the copy, its sync and the seqlock check
    elif mode == "disk":
        tensors = unique_tensors(trainer_model.state_dict(), "bfloat16")
        ready = publish_disk(work / "weights", version, tensors, keep=2)
        t1 = t2 = clock()
        timings = engine.update_weights(version, path=ready.path)
    else:
        tensors = unique_tensors(trainer_model.state_dict(), "bfloat16")
        server = WeightServer(keep=2)
        ready = server.publish(version, tensors)
        t1 = clock()
        fetched = fetch_weights(ready, timeout_s=120.0)
        t2 = clock()
        timings = engine.update_weights(version, tensors=fetched)
    t3, before, steps = clock(), engine.stats()["generated_tokens"], 0
    while engine.stats()["generated_tokens"] == before:
        engine.step()
        steps += 1
    resume = timings["pause_s"] + clock() - t3
    if server is not None:
        server.close()
    for rid in ids:
        engine.abort(rid)
    while engine.has_work():
        engine.step()
    return {"publish_s": t1 - t0 if publish_s is None else publish_s, "fetch_s": t2 - t1, "load_s": timings["load_s"], "resume_s": resume,
            "engine_pause_s": timings["load_s"] + resume, "total_s": clock() - t0,
            "recompute_tokens": int(timings["recompute_tokens"]), "steps_to_first_token": steps}


def run(args) -> dict:
    from areal_mq.engines.models import load_causal_lm
    from random_model import build, describe
    from stage_b_engine import make_engine

    q = 0 if args.quick else 1
    s = {k: v[q] for k, v in SIZES.items()}
    model_dir = build(args.work / ("smollm2-random-quick" if args.quick else "smollm2-random"), args.quick,
                      report.PACK / "smollm2")
    work = args.work / "stage_d"
    shutil.rmtree(work, ignore_errors=True)
    engine = make_engine(model_dir, args, s["in_flight"], s["prompt"] + s["tokens_before"] * 4 + 16)
    trainer_model = load_causal_lm(model_dir, "float32", engine.device)
    rows, version, ipc = [], 0, None
    try:
        for mode in ("disk", "zmq", "cuda_ipc"):
            try:  # one mode failing (CUDA IPC refused by a sandboxed runtime, say) keeps the other modes' rows
                if mode == "cuda_ipc":
                    ipc = IpcTrainer(model_dir, work / "ipc-run", engine.device)
                one_update(engine, trainer_model, mode, version := version + 1, args, work, s, ipc)  # warm-up
                runs = [one_update(engine, trainer_model, mode, version := version + 1, args, work, s, ipc)
                        for _ in range(s["rounds"])]
            except Exception as exc:  # noqa: BLE001 - recorded in the row and the log, then the next mode
                log(f"{mode}: FAILED {type(exc).__name__}: {exc}")
                rows.append({"mode": mode, "todo": f"failed: {type(exc).__name__}: {exc}"[:300]})
                for rid in list(engine.live):  # drop what the failed round left in flight
                    engine.abort(rid)
                engine.resume()
                continue
            row = {"mode": mode, **{k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}}
            rows.append(row)
            log(f"{mode}: engine pause {row['engine_pause_s'] * 1e3:.0f} ms, total {row['total_s'] * 1e3:.0f} ms")
    finally:
        if ipc is not None:
            ipc.close()
    engine.close()
    shutil.rmtree(work, ignore_errors=True)
    return {"title": "colocated weight update", "quick": args.quick, "machine": report.machine(args.device),
            "model": describe(model_dir, args.quick), "in_flight": s["in_flight"], "kv_on_update": engine.cfg.kv_on_update,
            "updates": rows, "target_engine_pause_s": TARGET_S}


def markdown(r: dict) -> str:
    head = ("mode", "engine pause ms (load + resume)", "publish ms", "fetch ms", "load ms", "resume ms", "total ms")
    rows = [head]
    for u in r["updates"]:
        if "todo" in u:
            rows.append((u["mode"], f"TODO — {u['todo']}", "", "", "", "", ""))
        else:
            ms = {k: f"{u[k] * 1e3:.1f}" for k in ("engine_pause_s", "publish_s", "fetch_s", "load_s", "resume_s", "total_s")}
            rows.append((u["mode"], ms["engine_pause_s"], ms["publish_s"], ms["fetch_s"], ms["load_s"], ms["resume_s"],
                         ms["total_s"]))
    return (report.table(rows) + f"\n\n{r['in_flight']} sequences in flight, kv_on_update={r['kv_on_update']}; target: "
            f"the colocated (cuda_ipc) engine pause < {r['target_engine_pause_s'] * 1e3:.0f} ms")


def main() -> None:
    report.stage(__doc__, "d", run, markdown)


if __name__ == "__main__":
    main()
