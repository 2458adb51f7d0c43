"""Trainer checkpoints with exact resume.

What: `save_checkpoint(trainer, root, extra)` writes root/step{version:08d}/ containing
- the model as a plain Hugging Face directory (config.json + model.safetensors in fp32, plus the
  tokenizer files of the source model) — `AutoModelForCausalLM.from_pretrained(dir)` loads it;
- trainer_state.pt: optimizer and scheduler state dicts (torch.load(weights_only=True)-safe);
- rng_rank{r}.pt: python / numpy / torch RNG states of every data-parallel rank, plus the CUDA RNG state
  of the rank's GPU when it trains on one (a CPU-only resume of a GPU checkpoint restores the rest);
- trainer_state.json: policy version, optimizer steps, the ids of the samples trained since the previous
  checkpoint (`consumed_ids`: what a resume acks again and skips if served twice) with the count of all of them
  (`consumed_total`), and the caller's opaque `extra` dict (e.g. the controller's dataset position; JSON-safe).
The whole history of trained ids is stored apart, appended once per checkpoint to root/trained_ids.jsonl
(`{"version": V, "base": B, "ids": [...]}`: the ids trained from checkpoint B to V; a resumed trainer's lines
supersede the rolled-back ones, `trained_ids(root, V)` reads the chain): a checkpoint's JSON stays the size of one
checkpoint interval however long the run (it held every id of the run before, issue 52 item 6).
What holds the model and the optimizer is the strategy's (`trainer.strategy.save_main / save_shards / load`,
areal_mq/algorithms/strategy.py): ddp writes the Hugging Face directory above; fsdp writes `sharded/`, a
torch.distributed.checkpoint directory every rank writes its own shards to (resharded on load: a checkpoint of
2 ranks, or of a 2 x 2 HSDP mesh, resumes on 1 and vice versa); `export_checkpoint(dir, out)` turns it into the
plain Hugging Face directory above. A checkpoint resumes under a strategy of the same `checkpoint_format`.
The directory is written under a temporary name and renamed into place, so a crash never leaves a
half checkpoint under a real name; older checkpoints beyond `keep_checkpoints` are pruned.
`load_checkpoint(trainer, dir)` restores all of it and returns `extra`; `latest_checkpoint(root)`
finds the newest complete one. Every `torch.load` maps to the CPU, so a checkpoint written on cuda:1 loads
on a machine with one GPU or none: RNG states live on the CPU anyway, and `optimizer.load_state_dict` moves
the AdamW moments to their parameters' device while it keeps `step` on the CPU, as AdamW wants (loading
`step` onto the GPU would make every update read it back to the host).
"""
from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from areal_mq.algorithms.trainer import Trainer

STATE_JSON = "trainer_state.json"
TRAINED_IDS = "trained_ids.jsonl"  # beside the checkpoints: every trained id, one line per checkpoint
STATE_PT = "trainer_state.pt"
SHARDED = "sharded"  # torch.distributed.checkpoint directory of an fsdp trainer (model + AdamW shards)
_NAME = re.compile(r"^step(\d{8})$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")


def _rng_state(device: "torch.device") -> dict:
    """The RNG states a resumed step depends on; with a CUDA `device`, its generator's too."""
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos,
                                                      has_gauss, gauss],
             "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: "torch.device") -> None:
    """Restore `state`; its CUDA part only when this rank trains on CUDA (else there is no generator for it)."""
    import torch

    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (dst / name).exists():
            shutil.copy2(src / name, dst / name)


def save_checkpoint(trainer: "Trainer", root: Path, extra: dict | None = None, keep: int | None = None) -> Path:
    """Write a checkpoint of `trainer` (collective under data parallelism: call on every rank)."""
    import torch

    acc = trainer.accelerator
    final = root / f"step{trainer.version:08d}"
    tmp = root / f".step{trainer.version:08d}.tmp"
    extra = extra or {}
    json.dumps(extra)  # fail before writing anything if `extra` cannot be stored
    main = trainer.parallel.writes_main(trainer.rank)  # the single files: config, tokenizer, scheduler, JSON
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            _write_main_files(trainer, tmp, extra)
        except BaseException:  # a full disk: the partial copy must not hold the space a retry needs
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    acc.wait_for_everyone()
    trainer.strategy.save_shards(trainer, tmp / SHARDED)  # collective: what each rank writes (fsdp: its shards)
    torch.save(_rng_state(trainer.device), tmp / f"rng_rank{trainer.rank}.pt")
    acc.wait_for_everyone()
    if main:
        with open(root / TRAINED_IDS, "a") as f:  # before the rename: a checkpoint never lacks its line
            f.write(json.dumps({"version": trainer.version, "base": trainer.checkpoint_base,
                                "ids": trainer.consumed_ids}) + "\n")
        if final.exists():  # the same version saved again (e.g. after a resume): replace it
            shutil.rmtree(final)
        tmp.rename(final)
        prune_checkpoints(root, keep or trainer.cfg.keep_checkpoints)
    acc.wait_for_everyone()
    trainer.checkpoint_base, trainer.consumed_ids = trainer.version, []  # the next interval starts here
    return final


def trained_ids(root: str | Path, version: int) -> list[str]:
    """Every sample id trained into checkpoint `version`, in training order, from root/trained_ids.jsonl: the
    chain of lines base -> version, later lines superseding what a resume rolled back."""
    chain: list[dict] = []
    path = Path(root) / TRAINED_IDS
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash: its checkpoint was never renamed into place
        while chain and chain[-1]["version"] > rec["base"]:
            chain.pop()
        chain.append(rec)
    while chain and chain[-1]["version"] > version:
        chain.pop()
    return [sid for rec in chain for sid in rec["ids"]]


def _write_main_files(trainer: "Trainer", tmp: Path, extra: dict) -> None:
    """Rank 0's part of a checkpoint: the strategy's (the config or the whole model, maybe the optimizer), the
    tokenizer, the scheduler state and the JSON state."""
    import torch

    blobs = trainer.strategy.save_main(trainer, tmp)
    _copy_tokenizer(trainer.model_path, tmp)
    torch.save({**blobs, "scheduler": trainer.scheduler.state_dict()}, tmp / STATE_PT)
    state = {"version": trainer.version, "optimizer_steps": trainer.optimizer_steps,
             "world_size": trainer.world_size, "consumed_ids": trainer.consumed_ids,
             "consumed_total": trainer.consumed_total, "extra": extra, "strategy": trainer.strategy.name,
             "parallel": trainer.parallel.degrees(), "format": trainer.strategy.checkpoint_format}
    if trainer.scaler is not None:  # fp16: the loss scale carries on where it was
        state["loss_scaler"] = trainer.scaler.state_dict()
    (tmp / STATE_JSON).write_text(json.dumps(state))


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / STATE_JSON).is_file()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(Path(root))
    return found[-1] if found else None


def prune_checkpoints(root: Path, keep: int) -> None:
    for old in list_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def checkpoint_format(path: Path) -> str:
    """How checkpoint `path` holds its model: "dcp" (per-rank shards under sharded/) or "hf" (a Hugging Face
    directory); the JSON's "format", or for a checkpoint written before it, whether sharded/ exists."""
    state = json.loads((path / STATE_JSON).read_text())
    return state.get("format") or ("dcp" if (path / SHARDED).is_dir() else "hf")


def load_checkpoint(trainer: "Trainer", path: Path) -> dict:
    """Restore model, optimizer, scheduler, RNG, version and consumed ids; return `extra`."""
    import torch

    if not (path / STATE_JSON).is_file():
        raise FileNotFoundError(f"{path} is not a complete trainer checkpoint (no {STATE_JSON})")
    state = json.loads((path / STATE_JSON).read_text())
    saved = state.get("strategy", "ddp")
    if checkpoint_format(path) != trainer.strategy.checkpoint_format:
        raise ValueError(f"checkpoint {path} was written by a {saved} trainer and this one is "
                         f"{trainer.strategy.name}: set trainer.strategy: {saved} to resume it, or export it "
                         "(`areal-mq checkpoint export`) and start a new run from the exported model")
    blobs = torch.load(path / STATE_PT, map_location="cpu", weights_only=True)
    trainer.strategy.load(trainer, path, blobs, path / SHARDED)
    trainer.scheduler.load_state_dict(blobs["scheduler"])
    rng_file = path / f"rng_rank{trainer.rank}.pt"
    if rng_file.is_file():  # absent if the world size grew: that rank keeps its seeded RNG
        _set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=True), trainer.device)
    trainer.version = int(state["version"])
    trainer.optimizer_steps = int(state["optimizer_steps"])
    # the interval the checkpoint closed: a resume acks these again and skips them if the store serves them twice;
    # the next interval starts empty at this version (checkpoints before issue 52 held every id: the same use)
    trainer.resumed_ids = list(state["consumed_ids"])
    trainer.consumed_ids, trainer.checkpoint_base = [], trainer.version
    trainer.consumed_total = int(state.get("consumed_total", len(trainer.resumed_ids)))
    if trainer.scaler is not None and "loss_scaler" in state:
        trainer.scaler.load_state_dict(state["loss_scaler"])
    return dict(state.get("extra", {}))


def export_checkpoint(path: Path, out: Path) -> Path:
    """A plain Hugging Face directory (config, fp32 safetensors, tokenizer) from checkpoint `path`: the sharded
    model of an fsdp checkpoint is read in this one process (no process group), a ddp checkpoint is copied."""
    out = Path(out)
    if checkpoint_format(path) == "hf":
        out.mkdir(parents=True, exist_ok=True)
        for f in path.iterdir():
            if f.suffix in (".safetensors", ".json") and f.name not in (STATE_JSON,) or f.name in TOKENIZER_FILES:
                shutil.copy2(f, out / f.name)
        return out
    from areal_mq.algorithms.fsdp import export_hf

    export_hf(path / SHARDED, path, out)
    _copy_tokenizer(path, out)
    return out
