"""The toy version of a run config that a rehearsal runs (launch/rehearsal.py): same layout, toy sizes.

What: `toy_config(cfg, steps, run_dir, cache)` keeps every process count (trainer ranks up to TOY_TRAINER_RANKS),
the strategy, the parallel degrees, the publishing layout, the checkpoints, the evaluations, the restart policy and
the placement of `cfg`, and replaces what a CPU cannot hold: the model by a 2-layer random model of the same family
(`toy_model`: model_type, tied head, Qwen2 biases, Qwen3 q/k norms, KV heads that tp and cp divide; the model's own
tokenizer where its directory is here), trainer ranks past TOY_TRAINER_RANKS (fewer dp_shard ranks, tp and cp kept:
`_toy_ranks`, said in the notes), the sizes (engine rows, KV, answer length, batch, steps), the devices (cpu; GPU
indices stay as pretend devices), and data files that are not on this machine (`toy_data`: the shipped sample of the
same format). A field it cannot keep is a ConfigError naming it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_mq.errors import ConfigError

TOY_ROWS = 8  # rows of a rehearsal engine
TOY_NEW_TOKENS = 16
TOY_EVAL = 4  # held-out problems per rehearsal evaluation
TOY_TRAINER_RANKS = 8  # the most trainer ranks a rehearsal starts (the 7B 2-node layout's 8 gloo ranks)

@dataclass
class Toy:
    cfg: Any
    notes: list[str] = field(default_factory=list)
    model: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)


# ---------------------------------------------------------------- the toy config
def model_family(cfg: Any) -> tuple[dict, Path | None]:
    """The architecture fields a toy model copies (model_type, tie_word_embeddings, ...) and the model directory
    when it is on this machine (its tokenizer is then the rehearsal's)."""
    from areal_mq.engines.shapes import SHAPES
    from areal_mq.launch.plan import shape_for_name

    named = Path(cfg.model.name).expanduser()
    if not (named / "config.json").is_file():
        from areal_mq.engines.models import resolve_model
        from areal_mq.errors import ModelNotFound

        shape = cfg.model.name.lower() if cfg.model.name.lower() in SHAPES else shape_for_name(cfg.model.name)
        if shape is not None:
            return dict(SHAPES[shape]), None
        try:
            named = resolve_model(cfg.model.name, cfg.model.cache_dir)
        except ModelNotFound as exc:
            raise ConfigError(f"model.name: {exc} A rehearsal needs the model's family: name a public shape "
                              f"(--set model.name=SHAPE: {', '.join(SHAPES)}) or a directory with its config.json") from None
    return json.loads((named / "config.json").read_text()), (named if _has_tokenizer(named) else None)


def _has_tokenizer(path: Path) -> bool:
    from areal_mq.engines.models import TOKENIZER_FILES

    return any((path / f).is_file() for f in TOKENIZER_FILES)


def toy_model(cfg: Any, cache: Path) -> tuple[Path, dict]:
    """A 2-layer random model of the config's family in `cache` (built once per family), and what it is."""
    from areal_mq.engines.models import TOKENIZER_COPY
    from areal_mq.engines.shapes import TINY, build_random_model

    family, local = model_family(cfg)
    kind = family.get("model_type")
    if f"tiny-{kind}" not in TINY:
        raise ConfigError(f"model.name: a rehearsal builds llama, qwen2 and qwen3 models; {cfg.model.name} is "
                          f"{kind!r}")
    tied = bool(family.get("tie_word_embeddings", False))
    overrides: dict = {"tie_word_embeddings": tied}
    if local is not None:  # the real tokenizer: its vocabulary and special ids
        overrides.update({k: family[k] for k in ("vocab_size", "bos_token_id", "eos_token_id") if family.get(k) is not None})
    split = max(cfg.trainer.parallel.tp, cfg.trainer.parallel.cp)
    tiny = TINY[f"tiny-{kind}"]
    if tiny["num_key_value_heads"] % split:  # tp and cp split whole heads and GQA groups: a KV head for each rank
        heads = max(tiny["num_attention_heads"], split)
        overrides.update(num_attention_heads=heads, num_key_value_heads=split, head_dim=tiny["hidden_size"] // heads)
    dst = cache / f"{kind}-{'tied' if tied else 'untied'}-{'own' if local else 'smollm2'}-tokenizer"
    if "num_key_value_heads" in overrides:
        dst = dst.with_name(f"{dst.name}-kv{split}")
    if local is not None:
        import hashlib  # a stable name per model directory (hash() of a str changes with every process)

        dst = dst.with_name(f"{dst.name}-{hashlib.sha256(str(local.resolve()).encode()).hexdigest()[:10]}")
    build_random_model(dst, f"tiny-{kind}", **overrides)
    if local is not None:
        import shutil

        for name in TOKENIZER_COPY:
            if (local / name).is_file():
                shutil.copy2(local / name, dst / name)
    kv = overrides.get("num_key_value_heads", tiny["num_key_value_heads"])
    return dst, {"family": kind, "tied": tied, "path": str(dst), "kv_heads": kv,
                 "tokenizer": str(local) if local else "SmolLM2's (the model is not on this machine)"}


def _exists(name: str | None) -> bool:
    from areal_mq.data.config import ARITH_SOURCES
    from areal_mq.data.sources import locate

    return name is None or name in ARITH_SOURCES or locate(name)[0].exists()


def _sample_format(name: str, fmt: str) -> str:
    """Which shipped sample stands in for a missing file: by its name (gsm8k, math500, math), else its format."""
    low = name.lower()
    if "gsm8k" in low:
        return "gsm8k"
    if "math500" in low or "math-500" in low:
        return "math500"
    return fmt if fmt in ("gsm8k", "math") else "math"


def toy_data(data: dict) -> tuple[dict, dict]:
    """The config's data where its files exist; else the shipped sample of the same format (data/samples)."""
    report: dict = {"source": "the config's own files"}
    missing: list[str] = []
    entries = data.get("sources") or [data]
    for entry in entries:
        for key in ("name", "eval_name"):
            name = entry.get(key)
            if _exists(name):
                continue
            from areal_mq.data.samples import SAMPLES

            kind = _sample_format(name, entry.get("format") or data.get("format") or "auto")
            train, test = SAMPLES[kind]
            entry[key] = str(train if key == "name" else test)
            if kind != "gsm8k":  # the sample's own layout (MATH, MATH-500), not a generic template
                entry["format"] = "math"
            missing.append(f"{name} -> the {kind} sample {entry[key]}")
    if missing:
        report = {"source": "samples shipped with areal-mq (the config's files are not on this machine)",
                  "replaced": missing}
    return data, report


def rehearsal_dir(cfg: Any) -> Path:
    run_dir = Path(cfg.run.run_dir)
    target = run_dir.with_name(run_dir.name + "-rehearsal")
    try:
        target.mkdir(parents=True, exist_ok=True)
        return target
    except OSError:  # /shared/runs/... on a laptop
        target = Path("runs") / f"{cfg.run.name}-rehearsal"
        target.mkdir(parents=True, exist_ok=True)
        return target


def toy_config(cfg: Any, steps: int, run_dir: Path, cache: Path) -> Toy:
    """The config at toy scale (the module docstring); ConfigError naming the field when it cannot be."""
    from areal_mq.config import config_from_dict

    d = cfg.model_dump(mode="json")
    toy = Toy(cfg=None)
    model_dir, toy.model = toy_model(cfg, cache)
    d["model"].update(name=str(model_dir), device="cpu", cache_dir=cfg.model.cache_dir)
    d["run"]["run_dir"] = str(run_dir)
    d["rollout"]["device"] = d["trainer"]["device"] = None
    e = d["rollout"]["engine"]
    tp = max(e["vllm"].get("tensor_parallel_size") or 1, d["placement"]["rollout"].get("gpus_per_process") or 1)
    if e["kind"] in ("vllm", "vllm-server") and not _importable("vllm"):
        toy.notes.append(f"rollout.engine.kind {e['kind']}: vLLM is not installed here; rehearsed with the torch engine")
        e["kind"] = "torch"
    elif e["kind"] == "vllm" and tp > 1:  # vLLM's CPU backend runs no tensor parallelism over pretend GPUs
        toy.notes.append(f"rollout.engine.kind vllm with tensor parallel {tp}: vLLM on this CPU cannot span pretend "
                         "GPUs; rehearsed with the torch engine (the placement of its GPUs kept)")
        e["kind"] = "torch"
    elif e["kind"] == "vllm" and e["vllm"].get("gpu_memory_utilization"):
        toy.notes.append(f"rollout.engine.vllm.gpu_memory_utilization {e['vllm']['gpu_memory_utilization']} -> the CPU "
                         "backend's default (vLLM's CPU backend fails to start above 0.5)")
        e["vllm"]["gpu_memory_utilization"] = None
    full = {k: e[k] for k in ("max_concurrent", "kv_cache_bytes", "max_kv_tokens")}
    e.update(max_concurrent=min(e["max_concurrent"], TOY_ROWS), kv_cache_bytes=None,
             max_kv_tokens=min(e["max_kv_tokens"], 4096), cuda_graphs=False,
             max_model_len=min(e["max_model_len"], 1024) if e.get("max_model_len") else None)
    # STYLE 23: an admission knob the toy changes is said with the full-scale value it stands for
    changed = ", ".join(f"{k} {full[k]} -> {e[k]}" for k in full if full[k] != e[k])
    if changed:
        toy.notes.append(f"rollout.engine admission at toy scale: {changed}; the rule is the full-scale engine's "
                         "(engines/admission.py), whose rows running at full scale the plan above reports")
    c = d["controller"]
    full_new = c["max_new_tokens"]
    c.update(group_size=min(c["group_size"], 4), batch_groups=2, max_concurrent_groups=4, total_steps=steps,
             max_new_tokens=TOY_NEW_TOKENS)
    if c.get("overlong_buffer"):  # the same share of the (shorter) toy answers, so the punishment still ramps
        buffer = min(max(1, round(c["overlong_buffer"] * TOY_NEW_TOKENS / full_new)), TOY_NEW_TOKENS - 1)
        toy.notes.append(f"controller.overlong_buffer {c['overlong_buffer']} -> {buffer}: the same share of "
                         f"max_new_tokens ({full_new} -> {TOY_NEW_TOKENS})")
        c["overlong_buffer"] = buffer
    if c.get("overlong_filter"):
        toy.notes.append("controller.overlong_filter off: a random model's answers run to max_new_tokens, so every "
                         "sequence would be excluded and no step would train")
        c["overlong_filter"] = False
    if c["drop_uniform_groups"]:
        toy.notes.append("controller.drop_uniform_groups off: a random model earns equal rewards in most groups")
        c["drop_uniform_groups"] = False
    t = d["trainer"]
    # a toy trainer publishes faster than the launcher's 1 s tick: keep every version, so the periodic evaluation
    # finds the one it is due (a real run prunes to keep_weight_versions long after that tick)
    t.update(max_tokens_per_mb=min(t["max_tokens_per_mb"], 2048), checkpoint_every=1,
             ppo_n_minibatches=min(t["ppo_n_minibatches"], 2),
             keep_weight_versions=max(t["keep_weight_versions"], steps + 1))
    lc = d["launcher"]
    _toy_ranks(t, lc, toy)
    lc["threads"] = {role: 1 for role in ("trainer", "rollout", "reward", "controller", "agent", "broker")}
    lc["stop_grace_s"] = 30.0
    lc["max_restarts"] = max(1, lc["max_restarts"])
    if lc.get("ray_address"):
        toy.notes.append(f"launcher.ray_address {lc['ray_address']}: rehearsed on a local Ray with pretend GPUs")
        lc["ray_address"] = None
    d["brokers"].update(host="127.0.0.1", auto_ports=True)
    d["eval"].update(size=min(d["eval"]["size"], TOY_EVAL), kv_cache_bytes=None,
                     every=max(1, steps // 2) if d["eval"]["every"] else 0)
    d["data"], toy.data = toy_data(d["data"])
    d["data"]["max_problems"] = min(d["data"].get("max_problems") or 64, 64)
    try:
        toy.cfg = config_from_dict(d, "the rehearsal's toy config")
    except ConfigError as exc:
        raise ConfigError(f"the toy version of this config is invalid: {exc}") from None
    return toy


def _toy_ranks(t: dict, lc: dict, toy: Toy) -> None:
    """At most TOY_TRAINER_RANKS trainer ranks: a layout past them (the 72B's 32) keeps its tp x cp group and fewer
    dp_shard ranks (the same rooms, mesh and collectives; 32 toy ranks would not fit a CI machine's memory)."""
    p = t["parallel"]
    inner = p["tp"] * p["cp"]
    if lc["trainer_ranks"] <= TOY_TRAINER_RANKS or inner > TOY_TRAINER_RANKS:
        return
    shard = max(1, TOY_TRAINER_RANKS // inner) if p["dp_shard"] != 1 else 1
    ranks = p["dp_replicate"] * shard * inner if p["dp_replicate"] > 0 else TOY_TRAINER_RANKS
    replicate = p["dp_replicate"]
    if ranks > TOY_TRAINER_RANKS:
        p["dp_replicate"] = max(1, TOY_TRAINER_RANKS // (shard * inner))
        ranks = p["dp_replicate"] * shard * inner
    also = f"dp_replicate {replicate} -> {p['dp_replicate']}, " if replicate != p["dp_replicate"] else ""
    toy.notes.append(f"launcher.trainer_ranks {lc['trainer_ranks']} -> {ranks} (trainer.parallel {also}dp_shard "
                     f"{p['dp_shard']} -> {shard}, tp {p['tp']} and cp {p['cp']} kept): the full-scale rank's memory "
                     "is the plan's above")
    p["dp_shard"], lc["trainer_ranks"] = shard, ranks


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None
