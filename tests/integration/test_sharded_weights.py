"""Sharded publishing (trainer.publish_layout sharded) between real FSDP ranks and a rollout worker's catch-up.

This file is also the rank script: the test launches it under torch.distributed.run (2 CPU ranks over gloo, then
1 rank resuming from the 2-rank checkpoint). Every rank trains a tiny Llama (tied embeddings) with FSDP2, snapshots
its own slices and serves them from its own weight server (ShardPublisher, in a BackgroundPublisher thread); rank 0
writes the manifest (WeightsReady) of each version and the checksums of the gathered model (the reference, made
with the gather path after the publish) to files, then waits until the test process has fetched that version.
The test process is the rollout worker: one WeightCatchup follows every version (deltas per shard) and must hold,
after each, exactly the trainer's weights (blake2b per tensor). Faults, each ending in correct weights or an error
naming the rank:
- a corrupted slice on the wire (a proxy in front of rank 1 flips a byte of its first reply): the delta fails its
  checksum, the worker falls back to rank 1's full slices, weights correct, the fallback names rank 1;
- a slow rank (rank 1 holds one publish past trainer.shard_publish_timeout_s): that version is never announced,
  the next one is, and the worker follows it;
- a worker that missed versions while the trainer's world size changed (2 ranks -> resume on 1): correct weights;
- a rank killed mid-serve (kill -9 of rank 1): the fetch ends in WeightsFetchError naming trainer rank 1, in time.
Run: pytest tests/integration/test_sharded_weights.py   (about 1.5 min on 2 cores)
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERSIONS = 8  # published by the 2-rank launch
SLOW_V = 4  # rank 1 is late with this one
CKPT_V = 5  # the 2-rank launch checkpoints here; the 1-rank launch resumes from it
ONE_RANK_VERSIONS = 2  # published by the 1-rank launch after its resume publish
CFG = dict(lr=1e-3, max_tokens_per_mb=64, seed=3, grad_clip=1.0, checkpoint_every=0, strategy="fsdp",
           publish_mode="zmq", publish_layout="sharded", shard_publish_timeout_s=4.0, keep_weight_versions=2,
           full_every=20)


def _batch(i: int):
    from tests.unit.algorithms.batches import make_samples

    return make_samples(40 + i, n_groups=2, group_size=2, version=i, staleness=1)


def _wait_file(path: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.02)


def run_rank(mode: str, out: Path) -> None:
    import torch
    import torch.distributed as dist

    from areal_mq.algorithms.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.trainer import Trainer
    from areal_mq.weights.background import BackgroundPublisher
    from areal_mq.weights.delta import checksum
    from areal_mq.weights.sharded import ShardPublisher
    from areal_mq.workers.trainer import _exchange_collector

    torch.set_num_threads(1)
    cfg = TrainerConfig(**CFG)
    trainer = Trainer(cfg, out / "model", device="cpu")
    rank = trainer.rank
    (out / f"pid-{mode}-{rank}").write_text(str(os.getpid()))
    if mode == "one":
        load_checkpoint(trainer, latest_checkpoint(out / "ckpt"))
    publisher = ShardPublisher(cfg, rank=rank, world=trainer.world_size, exchange=_exchange_collector)
    announced: dict[int, dict | None] = {}

    def publish(version, snapshot, _hf):
        if mode == "two" and rank == 1 and version == SLOW_V:
            # the slow rank: past rank 0's wait, which is the timeout plus 4x its own (tiny, < 1 s) publish time
            time.sleep(cfg.shard_publish_timeout_s + 6.0)
        ready = publisher.publish(version, snapshot)
        if rank == 0:
            announced[version] = ready.model_dump(mode="json") if ready is not None else None

    background = BackgroundPublisher(publish)
    first = trainer.version + 1
    last = VERSIONS if mode == "two" else CKPT_V + ONE_RANK_VERSIONS
    versions = ([trainer.version] if mode == "one" else []) + list(range(first, last + 1))
    for v in versions:
        if v > trainer.version:
            trainer.train_step(_batch(v))
        assert trainer.version == v
        background.submit(v, trainer.publish_slices(), None)
        reference = trainer.strategy.full_state_dict(trainer.unwrapped, cfg.publish_dtype, keep=rank == 0)
        background.flush()
        if mode == "two" and v == CKPT_V:
            save_checkpoint(trainer, out / "ckpt")
        if rank == 0:
            sums = {k: checksum(t) for k, t in reference.items()}
            part = out / f"{mode}-v{v}.json.part"  # renamed into place: the test polls for the name, then reads
            part.write_text(json.dumps({"ready": announced[v], "sums": sums}))
            os.replace(part, out / f"{mode}-v{v}.json")
            _wait_file(out / f"{mode}-go-v{v}")
        dist.barrier()
    if rank == 0:
        (out / f"{mode}-done").write_text("1")
    _wait_file(out / f"{mode}-end", 300.0)  # keep serving until the test is through
    background.close()
    publisher.close()


class FlipFirstReply:
    """A ROUTER/DEALER proxy in front of a weight server that flips one byte of the first reply's last frame."""

    def __init__(self, target: str):
        import zmq

        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.back = self.ctx.socket(zmq.DEALER)
        self.back.connect(target)
        self.flipped = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        client = b""
        while not self.stop.is_set():
            for sock, _ in poller.poll(50):
                frames = sock.recv_multipart()
                if sock is self.front:  # one fetcher at a time: remember whom to answer, forward its message
                    client, frames = frames[0], frames[1:]
                    self.back.send_multipart(frames)
                    continue
                frames = [client, *frames]
                if not self.flipped and len(frames) > 2 and len(frames[-1]) > 4:  # identity, header, arrays
                    last = bytearray(frames[-1])
                    last[len(last) // 2] ^= 0x40
                    frames[-1] = bytes(last)
                    self.flipped += 1
                self.front.send_multipart(frames)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.front.close(0)
        self.back.close(0)
        self.ctx.term()


def _free_port() -> int:
    from tests.integration.procs import free_ports  # below the ephemeral range, this xdist worker's slice

    return free_ports(1)[0]


def _launch(mode: str, nproc: int, out: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(_free_port()), __file__, mode, str(out)]
    log = open(out / f"{mode}.log", "w")
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _next(out: Path, mode: str, v: int, proc: subprocess.Popen) -> dict:
    path = out / f"{mode}-v{v}.json"
    deadline = time.monotonic() + 180
    while not path.exists():
        assert proc.poll() is None, (out / f"{mode}.log").read_text()[-4000:]
        assert time.monotonic() < deadline, f"{path} never came"
        time.sleep(0.05)
    return json.loads(path.read_text())


def _check(update, sums: dict) -> None:
    from areal_mq.weights.delta import checksum

    assert set(update.hold) == set(sums)
    wrong = [k for k, t in update.hold.items() if checksum(t) != sums[k]]
    assert not wrong, f"v{update.version}: tensors differ from the trainer's: {wrong[:5]}"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


@pytest.mark.slow
def test_sharded_publishing_faults_end_in_right_weights_or_a_named_error(tmp_path):
    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.engines.shapes import build_random_model
    from areal_mq.errors import WeightsFetchError
    from areal_mq.messages import WeightsReady
    from areal_mq.weights.catchup import WeightCatchup

    build_random_model(tmp_path / "model", "tiny-llama", seed=7)
    cfg = TrainerConfig(**CFG)
    worker = WeightCatchup(tmp_path, cfg, timeout_s=20.0)
    late = WeightCatchup(tmp_path, cfg, timeout_s=20.0)  # stops following at CKPT_V - 1: misses the world change
    two = _launch("two", 2, tmp_path)
    routes = {}
    try:
        for v in range(1, VERSIONS + 1):
            got = _next(tmp_path, "two", v, two)
            if v == SLOW_V:
                assert got["ready"] is None, "a version a rank did not serve in time was announced"
            else:
                ready = WeightsReady.model_validate(got["ready"])
                assert [s.rank for s in ready.shards] == [0, 1]
                proxy = None
                if v == SLOW_V + 2:  # the corrupted slice on the wire
                    proxy = FlipFirstReply(ready.shards[1].endpoint)
                    shards = [ready.shards[0], ready.shards[1].model_copy(update={"endpoint": proxy.endpoint})]
                    ready = ready.model_copy(update={"shards": shards})
                try:
                    update = worker.prepare(ready)
                finally:
                    if proxy is not None:
                        proxy.close()
                _check(update, got["sums"])
                worker.commit(update)
                routes[v] = update.route
                if proxy is not None:
                    assert proxy.flipped == 1 and update.fallback.startswith("rank 1:"), update.fallback
                if v < CKPT_V:
                    late.commit(late.prepare(ready))
            (tmp_path / f"two-go-v{v}").write_text("1")
        assert routes[1] == "full" and routes[2] == "delta" and routes[SLOW_V + 1] == "chain", routes
        _wait_file(tmp_path / "two-done")
        last = WeightsReady.model_validate(json.loads((tmp_path / f"two-v{VERSIONS}.json").read_text())["ready"])
        # rank 1 killed mid-serve: a worker holding nothing needs rank 1's full slices and gets a named error
        os.kill(int((tmp_path / "pid-two-1").read_text()), signal.SIGKILL)
        fresh = WeightCatchup(tmp_path, cfg, timeout_s=3.0, min_mbps=1e6)
        t0 = time.monotonic()
        with pytest.raises(WeightsFetchError, match="trainer rank 1"):
            fresh.prepare(last)
        assert time.monotonic() - t0 < 30
    finally:
        (tmp_path / "two-end").write_text("1")
        _stop(two)
    one = _launch("one", 1, tmp_path)  # resumes from the 2-rank checkpoint at CKPT_V
    try:
        for v in range(CKPT_V, CKPT_V + ONE_RANK_VERSIONS + 1):
            got = _next(tmp_path, "one", v, one)
            ready = WeightsReady.model_validate(got["ready"])
            assert [s.rank for s in ready.shards] == [0]
            if v == CKPT_V + ONE_RANK_VERSIONS:  # held CKPT_V - 1 from two ranks, missed the rest
                update = late.prepare(ready)
                _check(update, got["sums"])
            update = worker.prepare(ready)
            _check(update, got["sums"])
            worker.commit(update)
            (tmp_path / f"one-go-v{v}").write_text("1")
    finally:
        (tmp_path / "one-end").write_text("1")
        _stop(one)


if __name__ == "__main__":
    run_rank(sys.argv[1], Path(sys.argv[2]))
