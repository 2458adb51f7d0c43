"""Sample store benchmark: puts/s and acks/s with `brokers.fsync` off and on, side by side.

What it measures, in one run: a real SampleStore (its ROUTER on a loopback TCP port, served by a thread) and
a StoreClient putting Samples one at a time, each waiting for its Ack, as the controller does. A sample is
one group of 4 sequences of 256 generated tokens (about 13 KB on the wire). Rounds alternate fsync off /
on, each with a fresh log in a temporary directory under --dir (default: the current directory, so the
disk is the one a run's run_dir would be on; /tmp may be a RAM disk where fsync costs nothing). After each
round's puts, the samples are taken in batches of 8 and acked (one log record per ack).
Headline: fsync_on_vs_off_puts_per_s (on / off, median over round pairs): what power-loss safety costs.

    python benchmarks/speed/store.py [--quick] [--json PATH] [--dir DIR]
"""
from __future__ import annotations

import shutil
import sys
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py (it adds the kinds' folders)
import common  # noqa: E402
from common import free_ports

from areal_mq.brokers.sample_store import SampleStore
from areal_mq.client import StoreClient
from areal_mq.messages import Sample, SeqSample

SIZES = {"rounds": (2, 4), "samples": (300, 2000)}  # quick, full
TARGETS = {"fsync_on_vs_off_puts_per_s": None}  # no target: this reports what the durability costs


class _Quiet:
    def __getattr__(self, name):
        return lambda *a, **k: None


def _sample(i: int, tokens: int = 256) -> Sample:
    rng = np.random.default_rng(i)
    seqs = [SeqSample(prompt_ids=rng.integers(0, 50_000, 64, dtype=np.int32),
                      output_ids=rng.integers(0, 50_000, tokens, dtype=np.int32),
                      logprobs=-rng.random(tokens, dtype=np.float32), versions=np.zeros(tokens, np.int32),
                      reward=float(i % 2)) for _ in range(4)]
    return Sample(sample_id=f"bench-{i:08d}", seqs=seqs)


def one_round(fsync: bool, samples: list[Sample], parent: Path) -> dict:
    """Put every sample (one at a time, acked), then take and ack them in batches of 8."""
    store_dir = Path(tempfile.mkdtemp(prefix="store-bench-", dir=parent))
    ctx = zmq.Context()
    addr = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    store = SampleStore(ctx, addr, store_dir, lease_s=600, max_frame_bytes=1 << 26, log=_Quiet(), fsync=fsync)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if store.sock.poll(20):
                store.handle()
            store.tick(time.monotonic())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    client = StoreClient(addr, ctx=ctx)
    try:
        t0 = time.perf_counter()
        for s in samples:
            client.put(s)
        put_s = time.perf_counter() - t0
        t0, acked = time.perf_counter(), 0
        while acked < len(samples) - len(samples) % 8:
            batch = client.get_batch(8, version=0, wait_s=0)
            client.ack(batch)
            acked += len(batch.samples)
        ack_s = time.perf_counter() - t0
        return {"fsync": fsync, "samples": len(samples), "puts_per_s": len(samples) / put_s,
                "put_ms": 1000 * put_s / len(samples), "batches_per_s": (acked / 8) / ack_s,
                "log_bytes": store.log_file.size}
    finally:
        client.close()
        stop.set()
        thread.join(5)
        store.close()
        ctx.term()
        shutil.rmtree(store_dir, ignore_errors=True)


def run(quick: bool, parent: Path) -> dict:
    i = 0 if quick else 1
    samples = [_sample(k) for k in range(SIZES["samples"][i])]
    results, ratios = [], []
    for _ in range(SIZES["rounds"][i]):
        pair = {}
        for fsync in (False, True):  # alternating: both see the same drift of a shared machine
            pair[fsync] = one_round(fsync, samples, parent)
            results.append(pair[fsync])
        ratios.append(pair[True]["puts_per_s"] / pair[False]["puts_per_s"])
    return {"benchmark": "store", "quick": quick, "machine": common.machine(zmq=zmq.zmq_version()),
            "results": results, "ratios": {"fsync_on_vs_off_puts_per_s": statistics.median(ratios)},
            "targets": TARGETS}


def table(report: dict, argv: str) -> str:
    rows = ["| fsync | puts/s | ms per put | acked batches/s |", "|---|---|---|---|"]
    for fsync in (False, True):
        got = [r for r in report["results"] if r["fsync"] == fsync]
        med = {k: statistics.median(r[k] for r in got) for k in ("puts_per_s", "put_ms", "batches_per_s")}
        rows.append(f"| {'on' if fsync else 'off'} | {med['puts_per_s']:.0f} | {med['put_ms']:.2f} | "
                    f"{med['batches_per_s']:.0f} |")
    ratio = report["ratios"]["fsync_on_vs_off_puts_per_s"]
    rows.append(f"\nfsync_on_vs_off_puts_per_s: {ratio:.3f} (target: none, larger is better)")
    rows.append(f"reproduce: python benchmarks/speed/store.py {argv}".rstrip())
    return "\n".join(rows)


def main() -> None:
    ap = common.arg_parser(__doc__)
    ap.add_argument("--dir", default=".", help="where the temporary logs go (the disk under test)")
    args = ap.parse_args()
    report = run(args.quick, Path(args.dir))
    common.save(report, args.json)
    flags = " ".join(f for f, on in (("--quick", args.quick), (f"--dir {args.dir}", args.dir != ".")) if on)
    print(table(report, flags))


if __name__ == "__main__":
    main()
