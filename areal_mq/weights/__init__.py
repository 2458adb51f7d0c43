"""Publishing policy weights from the trainer to rollout workers, and loading them back: the public face.

A weight update goes publisher -> server -> client -> catchup, through each module once:
- publisher.py: what a trainer publishes, chosen once. `make_publisher(cfg, trainer, ...)` reads the layout from
  TrainerConfig (gather: a full state or a LoRA adapter from rank 0; sharded: every FSDP rank its own slices;
  live: cuda_ipc) and returns the rank's `TrainerPublisher`; the trainer worker calls `publish_version()` and
  `keep_for_eval(...)` and never branches on the layout. `WeightPublisher` is rank 0's full-state transport
  (disk, zmq, cuda_ipc), with deltas when `deltas_on(cfg)`;
- server.py: `WeightServer`, a ROUTER socket in a background thread serving full versions and deltas;
  `rank_host` (the address each trainer rank's server binds);
- client.py: `check_ready` (a WeightsReady may only point into this run), `fetch_weights`, `fetch_piece` (disk or
  zmq, the one place a receiver tells them apart), `load_published`, `resolve`;
- catchup.py: `WeightCatchup`, a rollout worker's catch-up (deltas in order, a full version when the chain is
  broken; an adapter trained on another base refused before anything is fetched).
Beside them: codec.py (tensors <-> chunks), delta.py (verified deltas, blake2b checksums), disk.py (version
directories), ipc.py (colocated cuda_ipc), sharded.py (every FSDP rank serves its own slices), background.py
(publishing beside the next step), adapter.py (the LoRA adapter form: names, checks, merge).
Security: with CURVE keys the weight server uses the trainer's key pair, so a fetcher that connects with
`keys.client(sock, "trainer")` talks to the real trainer or to nobody; only roles allowed "weights:fetch" are served.

How to run: tests/unit/test_weights.py (round trips, pruning, a server killed mid-run),
tests/unit/test_weights_publishing.py (the layouts behind make_publisher, the adapter's base check).
"""
from areal_mq.weights.catchup import WeightCatchup  # noqa: F401
from areal_mq.weights.client import (  # noqa: F401
    check_ready, fetch_chunks, fetch_delta, fetch_piece, fetch_weights, load_published, resolve)
from areal_mq.weights.codec import (  # noqa: F401
    DTYPES, bytes_tensor, chunk_deltas, make_chunks, make_delta_chunks, same_layout, tensor_bytes, unique_tensors)
from areal_mq.weights.disk import (  # noqa: F401
    DELTA_FILE, FULL_FILE, VERSION_DIR, DiskDelta, disk_links, disk_versions, prune_disk, publish_disk, read_disk)
from areal_mq.weights.publisher import (  # noqa: F401
    Publication, TrainerPublisher, WeightPublisher, deltas_on, make_publisher)
from areal_mq.weights.server import WeightServer, rank_host  # noqa: F401
