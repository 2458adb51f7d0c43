"""`areal-mq run CONFIG --rehearse`: a config's whole layout, at toy scale, on the machine at hand.

What: before anyone pays for a GPU node, run the same layout end to end on a CPU:
  1. the full-scale plan of the config as written (`areal-mq plan`, against the public shape when the model is not
     here yet): its refusals fail the rehearsal, its engine occupancy is reported;
  2. the toy config (`toy_config`): the model becomes a small random model of the same family (model_type, tied
     or untied head, q/k/v biases, q/k norms: engines/shapes.py) with the real tokenizer where the model directory
     is here (else SmolLM2's, said in the report); every process count, the strategy, the publishing layout,
     checkpoints, evaluations, the restart policy and the placement stay; GPU indices become pretend devices
     (each process still gets its CUDA_VISIBLE_DEVICES, checked in /proc; under Ray a local cluster announces
     pretend GPUs and Ray hands them out); the data is the config's own where its files exist, else a sample in
     the same format shipped with the project (areal_mq/data/samples, said in the report);
  3. `steps` versions through the same code as `areal-mq run` (launch/cli.py `execute`), with one trainer rank
     killed (SIGKILL) once a checkpoint exists and every engine holds a published version (at the last checkpoint
     before the end, regardless): the restart policy restarts it (launcher.on_child_death: restart),
     or the rehearsal resumes the run as a user would (`--resume`, on_child_death: stop); either way the trainer
     must log `trainer.resumed` and finish;
  4. RUN_DIR/rehearsal.json (RUN_DIR = run.run_dir + "-rehearsal"): per role the processes started and alive at
     the end with their devices, the versions that reached every engine, the evaluations, the resume, the engine
     occupancy, the full-scale plan, and `ok`. Any failure names the role and the config field to look at; the
     command exits 1.
Why: every mistake the node layouts shipped with (a missing held-out set, admission that starved the engines, an
evaluation on a trainer's GPU) showed itself only after the queue, the model load and the first step. A rehearsal
finds them in minutes on a laptop, and CI rehearses every file in configs/ (tests/integration/test_rehearsal.py).

    areal-mq run configs/qwen2.5-1.5b-node.yaml --rehearse [--steps 4] [--set data.name=/data/math/train.jsonl]
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal_mq.errors import ConfigError

TOY_ROWS = 8  # rows of a rehearsal engine
TOY_NEW_TOKENS = 16
TOY_EVAL = 4  # held-out problems per rehearsal evaluation
ROLES = ("broker", "controller", "trainer", "rollout", "reward", "agent")


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
    dst = cache / f"{kind}-{'tied' if tied else 'untied'}-{'own' if local else 'smollm2'}-tokenizer"
    if local is not None:
        dst = dst.with_name(f"{dst.name}-{abs(hash(str(local.resolve()))) % 10**8}")
    build_random_model(dst, f"tiny-{kind}", **overrides)
    if local is not None:
        import shutil

        for name in TOKENIZER_COPY:
            if (local / name).is_file():
                shutil.copy2(local / name, dst / name)
    return dst, {"family": kind, "tied": tied, "path": str(dst),
                 "tokenizer": str(local) if local else "SmolLM2's (the model is not on this machine)"}


def _exists(name: str | None) -> bool:
    from areal_mq.data.config import ARITH_SOURCES

    if name is None or name in ARITH_SOURCES:
        return True
    path = Path(name)
    if path.exists():
        return True
    head, _, _ = name.rpartition(":")
    return bool(head) and Path(head).is_dir()


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
    if e["kind"] in ("vllm", "vllm-server") and not _importable("vllm"):
        toy.notes.append(f"rollout.engine.kind {e['kind']}: vLLM is not installed here; rehearsed with the torch engine")
        e["kind"] = "torch"
    e.update(max_concurrent=min(e["max_concurrent"], TOY_ROWS), kv_cache_bytes=None,
             max_kv_tokens=min(e["max_kv_tokens"], 4096), cuda_graphs=False,
             max_model_len=min(e["max_model_len"], 1024) if e.get("max_model_len") else None)
    c = d["controller"]
    c.update(group_size=min(c["group_size"], 4), batch_groups=2, max_concurrent_groups=4, total_steps=steps,
             max_new_tokens=TOY_NEW_TOKENS)
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


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ---------------------------------------------------------------- processes, seen from /proc
def role_processes(config_path: Path) -> list[dict]:
    """Every live process of the run started from `config_path` (`areal_mq.cli ROLE ... --config PATH`): its pid,
    role, rank and CUDA_VISIBLE_DEVICES as the process itself has them. torchrun's agent is not a role process."""
    found = []
    want = str(config_path)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if want not in args or "areal_mq.cli" not in args or "torch.distributed.run" in args:
                continue
            env = dict(kv.split("=", 1) for kv in (entry / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError):
            continue
        if state == "Z":
            continue
        after = args[args.index("areal_mq.cli") + 1:]
        role = after[1] if after[:1] == ["worker"] and len(after) > 1 else after[0] if after else "?"
        if role == "eval":
            continue
        found.append({"pid": int(entry.name), "role": role, "rank": int(env.get("RANK", 0)),
                      "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES")})
    return sorted(found, key=lambda p: (p["role"], p["rank"], p["pid"]))


class Watch:
    """The rehearsal's watcher thread: snapshots the role processes (every 0.5 s) and kills one trainer rank the
    moment the first checkpoint before the last step exists (once per rehearsal). A thread, not the launcher's
    1 s supervision tick: a toy trainer takes a step in a fraction of a second, and the kill must land mid-run."""

    def __init__(self, run_dir: Path, steps: int, ranks: int):
        import threading

        self.run_dir = run_dir
        self.config_path = run_dir / "config.yaml"
        self.steps = steps
        self.ranks = ranks
        self.started: dict[str, set[int]] = {}
        self.last: list[dict] = []  # the newest snapshot with every trainer rank and the controller alive
        self.kill: dict | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread()

    def __enter__(self) -> "Watch":
        import threading

        self._stop.clear()
        self.last = []  # each run (the first, a resumed one) is judged by its own end
        self._thread = threading.Thread(target=self._run, name="rehearsal-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        snap_at = 0.0
        while not self._stop.wait(0.02):
            if time.monotonic() >= snap_at:
                snap_at = time.monotonic() + 0.5
                self._snapshot()
            if self.kill is None and (newest := self._checkpoint_before_last()) and (
                    newest >= self.steps - 1 or self._engines_hold_a_version()):
                self._snapshot()
                self._kill_one_rank()

    def _engines_hold_a_version(self) -> bool:
        """Every rollout worker has loaded a published version (so the kill cannot come before the publishing
        layout was shown to work; at the last checkpoint before the end the rank is killed regardless)."""
        want = [p["pid"] for p in self.last if p["role"] == "rollout"]
        files = list((self.run_dir / "events").glob("rollout*.jsonl"))
        if not want or len(files) < len(want):
            return False
        try:
            return all('"rollout.weights_updated"' in f.read_text(errors="replace") for f in files)
        except OSError:
            return False

    def _snapshot(self) -> None:
        procs = role_processes(self.config_path)
        for p in procs:
            self.started.setdefault(p["role"], set()).add(p["pid"])
        roles = [p["role"] for p in procs]
        if roles.count("trainer") >= self.ranks and "controller" in roles:  # the controller ends by itself at the
            self.last = procs  # last version, a moment before the trainer

    def _checkpoint_before_last(self) -> int:
        """The newest checkpoint's version before the last step (0: none yet)."""
        try:
            names = [e.name for e in os.scandir(self.run_dir / "checkpoints") if e.name.startswith("step")]
        except OSError:
            return 0
        return max((int(n[4:]) for n in names if n[4:].isdigit() and 0 < int(n[4:]) < self.steps), default=0)

    def _kill_one_rank(self) -> None:
        ranks = [p for p in role_processes(self.config_path) if p["role"] == "trainer"]
        if not ranks:
            return
        victim = max(ranks, key=lambda p: p["rank"])  # the last rank: a non-zero one where there are several
        try:
            os.kill(victim["pid"], signal.SIGKILL)
        except ProcessLookupError:
            return
        checkpoints = sorted(p.name for p in (self.run_dir / "checkpoints").glob("step*"))
        self.kill = {"pid": victim["pid"], "rank": victim["rank"], "time": time.time(), "checkpoints": checkpoints}


# ---------------------------------------------------------------- the report
def read_events(run_dir: Path, prefix: str, event: str) -> list[dict]:
    out = []
    for path in sorted((run_dir / "events").glob(f"{prefix}*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == event:
                out.append(rec)
    return out


def expected_processes(cfg: Any) -> dict[str, int]:
    lc = cfg.launcher
    want = {"broker": 1, "controller": 1, "trainer": lc.trainer_ranks, "rollout": lc.rollout_workers,
            "reward": lc.reward_workers}
    if cfg.agent.workflow:
        want["agent"] = lc.agent_workers
    return want


def expected_devices(cfg: Any, role: str, index: int) -> str | None:
    """CUDA_VISIBLE_DEVICES the local launcher gives process `index` of `role` (None: not checked here)."""
    if cfg.launcher.backend != "local" or role == "broker" or role == "controller":
        return None
    return cfg.placement.visible(role, 0 if role == "trainer" else index, cfg.launcher)


def check_processes(cfg: Any, watch: Watch) -> tuple[dict, list[dict]]:
    roles, failures = {}, []
    alive = watch.last
    for role, want in expected_processes(cfg).items():
        mine = [p for p in alive if p["role"] == role]
        devices = [p["cuda_visible_devices"] for p in mine]
        roles[role] = {"expected": want, "started": len(watch.started.get(role, ())), "alive_at_end": len(mine),
                       "cuda_visible_devices": devices}
        if len(mine) != want:
            field_ = "launcher.trainer_ranks" if role == "trainer" else f"launcher.{role}_workers"
            failures.append(_failure(role, field_, f"{len(mine)} of {want} {role} process(es) alive at the end"))
        expect = [expected_devices(cfg, role, i) for i in range(want)]
        if any(x is not None for x in expect) and sorted(map(str, devices)) != sorted(map(str, expect)):
            failures.append(_failure(role, f"placement.{role}.gpus", f"CUDA_VISIBLE_DEVICES {devices}, the placement "
                                     f"says {expect}"))
    seen: dict[str, str] = {}
    for p in alive:  # no GPU in two roles' hands (a trainer's ranks share their unit's list)
        for gpu in filter(None, (p["cuda_visible_devices"] or "").split(",")):
            if seen.setdefault(gpu, p["role"]) != p["role"]:
                failures.append(_failure(p["role"], f"placement.{p['role']}", f"device {gpu} is also {seen[gpu]}'s"))
    return roles, failures


def _failure(role: str, field_: str, reason: str) -> dict:
    return {"role": role, "field": field_, "reason": reason}


def check_resume(run_dir: Path, watch: Watch, cfg: Any) -> tuple[dict, list[dict]]:
    if watch.kill is None:
        return {"killed": None}, [_failure("trainer", "trainer.checkpoint_every", "no checkpoint was written, so no "
                                           "trainer rank was killed and nothing was resumed")]
    resumed = [e for e in read_events(run_dir, "trainer", "trainer.resumed") if e["ts"] >= watch.kill["time"]]
    report = {"killed": watch.kill, "policy": cfg.launcher.on_child_death,
              "resumed": [{"checkpoint": e.get("checkpoint"), "version": e.get("version")} for e in resumed]}
    if not resumed:
        return report, [_failure("trainer", "launcher.on_child_death", "the killed trainer never resumed from its "
                                 "checkpoint (no trainer.resumed event after the kill)")]
    return report, []


def check_engines(run_dir: Path, cfg: Any) -> tuple[dict, list[dict]]:
    """The versions each engine loaded over the rehearsal; every engine must have loaded a published one (a short
    resumed run may train from the store's backlog alone, so 'after the resume' is reported, not required)."""
    versions: dict[str, list[int]] = {}
    for e in read_events(run_dir, "rollout", "rollout.weights_updated"):
        versions.setdefault(e.get("worker_id", "?"), []).append(int(e.get("version", -1)))
    failures = []
    for i in range(cfg.launcher.rollout_workers):
        name = f"rollout-{i}"
        if max(versions.get(name, [-1])) < 1:
            failures.append(_failure("rollout", f"trainer.publish_mode ({cfg.trainer.publish_mode})",
                                     f"{name} never loaded a published version: the trainer's weights did not reach it"))
    return {k: sorted(set(v)) for k, v in sorted(versions.items())}, failures


def check_evals(run_dir: Path, cfg: Any, steps: int) -> tuple[list[dict], list[dict]]:
    evals = []
    for line in (run_dir / "eval.jsonl").read_text().splitlines() if (run_dir / "eval.jsonl").is_file() else []:
        rec = json.loads(line)
        evals.append({k: rec.get(k) for k in ("version", "n", "strict", "lenient", "by_level")})
    want = {0, steps} | ({v for v in range(1, steps) if v % cfg.eval.every == 0} if cfg.eval.every else set())
    got = {e["version"] for e in evals}
    missing = sorted(want - got)
    if missing:
        return evals, [_failure("evaluation", "eval.every / data.eval_name", f"versions {missing} were not evaluated")]
    return evals, []


# ---------------------------------------------------------------- the rehearsal
def full_plan(cfg: Any, device_gib: float | None) -> tuple[dict, list[dict], str]:
    """The config's plan at full scale (a GPU layout on a machine without one: 80 GiB devices, noted)."""
    from areal_mq.launch.plan import make_plan

    if cfg.trainer.sim.enabled and cfg.rollout.engine.kind == "sim":
        return {"skipped": "a simulated engine and trainer"}, [], ""
    plan = make_plan(cfg, device_gib=device_gib)
    failures = [_failure("plan", _field_in(r), r) for r in plan.refusals]
    return plan.to_json(), failures, plan.table()


def rehearse(cfg: Any, console: Any, steps: int = 4, device_gib: float | None = None, quiet: bool = False) -> dict:
    """Rehearse `cfg` (the module docstring); returns the report written to RUN_DIR/rehearsal.json."""
    from areal_mq.engines.models import models_cache_dir
    from areal_mq.launch.cli import _check_memory

    started = time.time()
    plan_json, failures, table = full_plan(cfg, device_gib)
    console.print(f"[bold]rehearsal[/] of {cfg.run.name}: the full-scale plan\n{table}", highlight=False)
    run_dir = rehearsal_dir(cfg)
    toy = toy_config(cfg, steps, run_dir.resolve(), models_cache_dir(cfg.model.cache_dir).parent / "rehearsal")
    for note in [*toy.notes, *toy.data.get("replaced", [])]:
        console.print(f"  rehearsal: {note}", highlight=False)
    report: dict = {"config": cfg.run.name, "run_dir": str(run_dir), "steps": steps, "plan": plan_json,
                    "toy": {"model": toy.model, "data": toy.data, "notes": toy.notes,
                            "occupancy": _occupancy(toy.cfg)}}
    _clean(run_dir)
    watch = Watch(run_dir.resolve(), steps, toy.cfg.launcher.trainer_ranks)
    ray = _pretend_ray(toy.cfg)
    runs: list[dict] = []
    try:
        _check_memory(toy.cfg)
        runs.append(_execute(toy.cfg, console, quiet, False, watch))
        if runs[-1]["outcome"] == "failed" and watch.kill is not None and toy.cfg.launcher.on_child_death == "stop":
            console.print("[yellow]rehearsal: the run stopped at the killed rank (on_child_death: stop); resuming it "
                          "as `areal-mq run --resume` would[/]")
            from areal_mq.config import load_config

            runs.append(_execute(load_config(run_dir / "config.yaml"), console, quiet, True, watch))
    finally:
        if ray is not None:
            ray.shutdown()
    report["runs"] = runs
    if runs[-1]["outcome"] != "done":
        failures.append(_failure(_role_of(runs[-1]["failure"]), runs[-1].get("field", "launcher (the log named in the "
                                 "reason)"), f"the run ended {runs[-1]['outcome']}: {runs[-1]['failure']}"))
    if not watch.started:  # nothing started: the first failure is the whole story
        report.update(roles={}, resume={}, engines={}, evaluations=[], failures=failures, ok=False,
                      seconds=round(time.time() - started, 1))
        (run_dir / "rehearsal.json").write_text(json.dumps(report, indent=2, default=str))
        _say(console, report)
        return report
    report["roles"], more = check_processes(toy.cfg, watch)
    failures += more
    report["resume"], more = check_resume(run_dir, watch, toy.cfg)
    failures += more
    report["engines"], more = check_engines(run_dir, toy.cfg)
    failures += more
    report["evaluations"], more = check_evals(run_dir, toy.cfg, steps)
    failures += more
    report.update(failures=failures, ok=not failures, seconds=round(time.time() - started, 1))
    (run_dir / "rehearsal.json").write_text(json.dumps(report, indent=2, default=str))
    _say(console, report)
    return report


def _execute(cfg: Any, console: Any, quiet: bool, resume: bool, watch: Watch) -> dict:
    """One `areal-mq run` of the toy config; a ConfigError or an early exit becomes the outcome 'failed'."""
    import click

    from areal_mq.launch.cli import execute

    from areal_mq.errors import ArealError

    try:
        with watch:
            outcome, launcher = execute(cfg, console, skip_eval=False, quiet=quiet, resume=resume)
    except ArealError as exc:
        return {"outcome": "failed", "failure": f"launcher: {exc}", "field": _field_in(str(exc))}
    except (click.exceptions.Exit, SystemExit) as exc:
        return {"outcome": "failed", "failure": f"launcher: exit {getattr(exc, 'exit_code', exc)} before the run "
                "started (the message above)"}
    return {"outcome": outcome, "failure": launcher.failure}


def _field_in(text: str) -> str:
    import re

    m = re.search(r"\b(run|model|data|rollout|trainer|controller|eval|launcher|placement|brokers|metrics|reward|"
                  r"security|agent)\.[a-z_.]+", text)
    return m.group(0) if m else "launcher (see the reason)"


def _occupancy(cfg: Any) -> dict:
    from areal_mq.launch.plan import occupancy

    return occupancy(cfg)


def _clean(run_dir: Path) -> None:
    """A rehearsal starts from nothing: an earlier rehearsal's checkpoints would be resumed."""
    import shutil

    for entry in run_dir.iterdir():
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()


def _pretend_ray(cfg: Any) -> Any:
    """Backend ray: a local Ray whose node announces the GPUs and CPUs the layout asks for (pretend devices: Ray
    hands them out as CUDA_VISIBLE_DEVICES as it would real ones). None for the local backend."""
    if cfg.launcher.backend != "ray":
        return None
    from areal_mq.launch.ray_backend import import_ray

    ray = import_ray()
    gpus = sum(count * each for role, (count, each) in cfg.placement.processes(cfg.launcher).items()
               if role != "eval" and getattr(cfg.placement, role).gpus_per_process)
    gpus = max(gpus, cfg.launcher.trainer_ranks)
    ray.init(num_cpus=64, num_gpus=gpus, include_dashboard=False, log_to_driver=False,
             resources={"areal_brokers": 1})
    return ray


def _role_of(failure: str | None) -> str:
    name = (failure or "").split(" ", 1)[0]
    return next((r for r in ROLES if name.startswith(r)), "launcher")


def _say(console: Any, report: dict) -> None:
    from rich.table import Table

    table = Table(title=f"rehearsal of {report['config']}: {'ok' if report['ok'] else 'FAILED'} "
                        f"({report['seconds']:.0f} s)")
    for col in ("role", "expected", "started", "alive at end", "CUDA_VISIBLE_DEVICES"):
        table.add_column(col)
    for role, r in report["roles"].items():
        table.add_row(role, str(r["expected"]), str(r["started"]), str(r["alive_at_end"]),
                      " ".join(sorted({str(d) for d in r["cuda_visible_devices"]})))
    console.print(table)
    occ = report["plan"].get("occupancy") or {}
    if occ:
        console.print(f"full-scale engine occupancy {occ['occupancy']:.0%}; resume: "
                      f"{report['resume'].get('resumed') or 'none'}; evaluations at "
                      f"{[e['version'] for e in report['evaluations']]}; engines reached "
                      f"{ {k: v[-1] for k, v in report['engines'].items()} }", highlight=False)
    for f in report["failures"]:
        console.print(f"[red]FAILED[/] {f['role']} ({f['field']}): {f['reason']}", highlight=False)
    console.print(f"report: {Path(report['run_dir']) / 'rehearsal.json'}")
