"""Disk publishing of policy weights: version directories under run_dir/weights, full snapshots and deltas.

What:
- `publish_disk(weights_dir, version, tensors, keep)` writes weights_dir/v{N}/model.safetensors (+ config.json
  when given, so the directory also loads with from_pretrained) under a temporary name and renames it into
  place — a reader never sees half a version — then prunes all but the last `keep` versions.
  Returns WeightsReady(mode="disk", path=...).
- With deltas (trainer.weight_deltas on): a version directory holds model.delta (`DiskDelta`: the delta from
  the previous version) and, every `full_every` versions, a full model.safetensors too; `prune_disk` keeps the
  last `keep` versions and everything back to the full snapshot they start from; `disk_links` lists the pieces
  for WeightsReady.links; the full file's metadata carries each tensor's checksum (`read_disk(verify_checksums)`).
- `disk_versions(dir)`: the version numbers present; `read_disk(path)`: a version directory's tensors.
Why apart from areal_mq/weights/__init__.py: the zmq server and the trainer-side facade live there; this module is only
files (safetensors), so the periodic evaluator and the CLI read versions without the zmq half.

How to run: tests/unit/test_weights.py, tests/unit/test_weights_delta.py (disk round trips, pruning, corrupt
delta files).
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from areal_mq.errors import WeightsFetchError
from areal_mq.messages import WeightsAdapter, WeightsLink, WeightsReady
from areal_mq.weights.adapter import refuse_other_base
from areal_mq.weights.delta import DeltaError, TensorDelta

if TYPE_CHECKING:
    import torch

VERSION_DIR = re.compile(r"^v(\d+)$")
FULL_FILE, DELTA_FILE, ADAPTER_FILE = "model.safetensors", "model.delta", "adapter.json"

def publish_disk(weights_dir: str | Path, version: int, tensors: Mapping[str, "torch.Tensor"], keep: int = 2,
                 hf_config_json: str | None = None, delta: "DiskDelta | None" = None, full: bool = True,
                 digests: Mapping[str, str] | None = None, adapter: WeightsAdapter | None = None) -> WeightsReady:
    """Write version `version` atomically under weights_dir/v{version} (model.safetensors when `full`,
    model.delta when a `delta` from version-1 is given); prune to the last `keep` and their chain.
    `digests` (the tensors' checksums, given when deltas are on) go into the full file's metadata, and the
    announcement then lists the pieces on disk (WeightsReady.links)."""
    from safetensors.torch import save_file

    if not full and delta is None:
        raise ValueError(f"version {version}: a disk version needs full weights, a delta, or both")
    root = Path(weights_dir)
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"v{version}", root / f".v{version}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if full:
            meta = {"format": "pt", "version": str(version)}
            if digests is not None:
                meta["checksums"] = json.dumps(dict(digests))
            save_file(dict(tensors), str(tmp / FULL_FILE), metadata=meta)
            if hf_config_json is not None:
                (tmp / "config.json").write_text(hf_config_json)
        if adapter is not None:  # a LoRA version: the tensors are the adapter (docs/protocol.md, weights_adapter)
            (tmp / ADAPTER_FILE).write_text(adapter.model_dump_json())
        if delta is not None:
            delta.write(tmp / DELTA_FILE, version)
        if final.exists():  # republishing a version (e.g. after a resume): swap it out
            old = root / f".v{version}.old-{os.getpid()}"
            final.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prune_disk(root, keep)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    links = disk_links(root, version) if digests is not None else []
    return WeightsReady(version=version, mode="disk", path=str(final.resolve()), meta={"bytes": int(nbytes)},
                        base=version - 1 if delta is not None else -1, links=links, adapter=adapter)


class DiskDelta:
    """A version's delta as the file model.delta: the safetensors format (header + raw bytes), one uint8
    tensor per payload, and the metadata "delta" = JSON {"version", "base", "tensors": [{name, dtype, shape,
    encoding, count, checksum}]}. Not *.safetensors: engines loading a directory never mistake it for weights."""

    def __init__(self, base: int, deltas: list[TensorDelta]):
        self.base, self.deltas = base, deltas

    def write(self, path: Path, version: int) -> None:
        from safetensors.numpy import save_file

        info = [{"name": d.name, "dtype": d.dtype, "shape": d.shape, "encoding": d.encoding, "count": d.count,
                 "checksum": d.checksum} for d in self.deltas]
        save_file({f"{i}": d.payload for i, d in enumerate(self.deltas)}, str(path),
                  metadata={"format": "areal-mq-delta", "delta": json.dumps(
                      {"version": version, "base": self.base, "tensors": info})})

    @staticmethod
    def read(path: Path, version: int, base: int) -> list[TensorDelta]:
        """The deltas of `path`; DeltaError("missing"/"corrupt") when absent or not a delta version->base."""
        from safetensors import safe_open

        if not path.is_file():
            raise DeltaError("missing", f"no delta file {path} (pruned, or never written)")
        try:
            with safe_open(str(path), framework="numpy") as fh:
                head = json.loads((fh.metadata() or {})["delta"])
                if head["version"] != version or head["base"] != base:
                    raise DeltaError("corrupt", f"{path} is the delta {head['base']}->{head['version']}, "
                                                f"expected {base}->{version}")
                return [_delta_entry(path, i, t, fh) for i, t in enumerate(head["tensors"])]
        except DeltaError:
            raise
        except Exception as exc:  # safetensors / json / key errors on a damaged file
            raise DeltaError("corrupt", f"cannot read delta file {path}: {type(exc).__name__}: {exc}") from None


def _delta_entry(path: Path, i: int, t: Any, fh: Any) -> TensorDelta:
    """Entry `i` of a delta file's manifest, its types checked (a damaged manifest is DeltaError("corrupt"),
    never a TypeError further on: fuzzing found a number as a tensor name reaching apply_version's sort)."""
    ok = (isinstance(t, dict) and all(isinstance(t.get(k), str) for k in ("name", "dtype", "encoding", "checksum"))
          and type(t.get("count")) is int and isinstance(t.get("shape"), list)
          and all(type(d) is int and d >= 0 for d in t["shape"]))
    if not ok:
        raise DeltaError("corrupt", f"{path}: manifest entry {i} is not {{name, dtype, shape, encoding, count, "
                                    f"checksum}} of the documented types: {str(t)[:200]}")
    return TensorDelta(t["name"], t["dtype"], list(t["shape"]), t["encoding"], t["count"], t["checksum"],
                       fh.get_tensor(str(i)))


def disk_links(weights_dir: str | Path, upto: int) -> list[WeightsLink]:
    """The pieces on disk up to version `upto`: full versions (model.safetensors) and deltas (model.delta)."""
    root, links = Path(weights_dir), []
    for v in disk_versions(root):
        if v > upto:
            continue
        for name, base in ((FULL_FILE, -1), (DELTA_FILE, v - 1)):
            f = root / f"v{v}" / name
            if f.is_file() and base < v:
                links.append(WeightsLink(version=v, base=base, bytes=f.stat().st_size))
    return links


def disk_versions(weights_dir: str | Path) -> list[int]:
    root = Path(weights_dir)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := VERSION_DIR.match(p.name)))


def prune_disk(weights_dir: str | Path, keep: int) -> None:
    """Keep the last `keep` versions and every version back to the newest full snapshot at or before the
    oldest of them (its deltas lead there): a snapshot and its deltas go together."""
    root = Path(weights_dir)
    versions = disk_versions(root)
    if len(versions) <= keep:
        return
    oldest = versions[-keep]
    full = [v for v in versions if v <= oldest and (root / f"v{v}" / FULL_FILE).is_file()]
    start = full[-1] if full else oldest
    for v in versions:
        if v < start:
            shutil.rmtree(root / f"v{v}", ignore_errors=True)


def read_adapter(path: str | Path) -> WeightsAdapter | None:
    """The WeightsAdapter of a LoRA version directory (its adapter.json), None for a full version."""
    f = Path(path) / ADAPTER_FILE
    if not f.is_file():
        return None
    try:
        return WeightsAdapter.model_validate_json(f.read_text()[:4096])
    except ValueError as exc:
        raise WeightsFetchError(f"{f} is not a weights_adapter description: {str(exc)[:200]}") from None


def engine_base_checksum(engine: Any) -> Callable[[], str] | None:
    """() -> the sha256 a LoRA trainer names its base by (lora.base_identity) of the directory `engine` was started
    from, for a check against an adapter version's base_checksum; None where the engine takes no adapters or does not
    say where its base is (nothing checked)."""
    path = getattr(engine, "model_dir", None)
    if path is None or not getattr(engine, "accepts_adapters", False):
        return None

    def compute() -> str:
        from areal_mq.algorithms.lora import base_identity

        return base_identity(path)["sha256"]

    return compute


def load_version_dir(engine: Any, version: int, path: str | Path) -> dict[str, float]:
    """Load a version directory into an engine as the evaluations do: a full version by path, a LoRA version
    (adapter.json beside the adapter's tensors) merged from the engine's base (Engine.accepts_adapters). An adapter
    trained on another base than the engine's (WeightsAdapter.base_checksum against lora.base_identity of the engine's
    model directory) is refused before anything is merged: its accuracy would be a number about nothing."""
    adapter = read_adapter(path)
    if adapter is None:
        return engine.update_weights(version, path=str(path))
    if not getattr(engine, "accepts_adapters", False):
        raise WeightsFetchError(f"{path} holds a LoRA adapter (trainer.lora) and this engine takes no adapters: use "
                                "engine.kind torch, or vllm started with trainer.lora in the run's config")
    base = engine_base_checksum(engine) if adapter.base_checksum else None
    if base is not None:
        refuse_other_base(str(path), adapter.base_checksum, base())
    return engine.update_weights(version, adapter=engine.stage_adapter(read_disk(path), adapter.scaling, adapter.rank))


def read_disk(path: str | Path, verify_checksums: bool = False) -> dict[str, "torch.Tensor"]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from areal_mq.weights.delta import verify

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise WeightsFetchError(f"no *.safetensors in {path}; the version may have been pruned — "
                                "wait for the next WeightsReady or raise trainer.keep_weight_versions")
    out: dict[str, Any] = {}
    for f in files:
        tensors = load_file(str(f))
        if verify_checksums:
            with safe_open(str(f), framework="pt") as fh:
                manifest = (fh.metadata() or {}).get("checksums")
            digests = json.loads(manifest) if manifest is not None else None
            # every tensor needs its checksum: a manifest damaged or missing must not pass as "nothing to check"
            # (fuzzing found a flipped bit in the key "checksums" letting damaged tensors through)
            if not isinstance(digests, dict) or set(digests) != set(tensors):
                raise DeltaError("checksum", f"{f}: the checksum manifest does not list exactly its "
                                             f"{len(tensors)} tensors; the file is damaged or was published without "
                                             "checksums")
            verify(tensors, digests)
        out.update(tensors)
    return out
