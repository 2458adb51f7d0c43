"""Publishing policy weights from the trainer to rollout workers, and loading them back: the public face.

The room by concern (a weight update's path runs publisher -> server -> client -> catchup, each once):
- codec.py: tensors <-> raw bytes, WeightsChunk groups, tied duplicates dropped (`unique_tensors`);
- delta.py: versions as deltas from the previous one, blake2b checksums of every resulting tensor;
- publisher.py: `WeightPublisher`, the trainer-side facade choosing the mode from TrainerConfig (disk, zmq, cuda_ipc);
- server.py: `WeightServer`, a ROUTER socket in a background thread serving full versions and deltas;
- client.py: `check_ready` (a WeightsReady may only point into this run), `fetch_weights`, `load_published`, `resolve`;
- catchup.py: a rollout worker's catch-up (deltas in order, a full version when the chain is broken);
- disk.py (version directories), ipc.py (colocated cuda_ipc), sharded.py (every FSDP rank serves its own slices),
  background.py (publishing beside the next step).
Security: with CURVE keys the weight server uses the trainer's key pair, so a fetcher that connects with
`keys.client(sock, "trainer")` talks to the real trainer or to nobody; only roles allowed "weights:fetch" are served.

How to run: tests/unit/test_weights.py (round trips, pruning, a server killed mid-run).
"""
from areal_mq.weights.client import (  # noqa: F401
    check_ready, fetch_chunks, fetch_delta, fetch_weights, load_published, rank_host, resolve)
from areal_mq.weights.codec import (  # noqa: F401
    DTYPES, bytes_tensor, chunk_deltas, make_chunks, make_delta_chunks, same_layout, tensor_bytes, unique_tensors)
from areal_mq.weights.disk import (  # noqa: F401
    DELTA_FILE, FULL_FILE, VERSION_DIR, DiskDelta, disk_links, disk_versions, prune_disk, publish_disk, read_disk)
from areal_mq.weights.publisher import WeightPublisher, deltas_on  # noqa: F401
from areal_mq.weights.server import WeightServer  # noqa: F401
