"""`areal-mq run CONFIG --rehearse`: a config's whole layout, at toy scale, on the machine at hand.

What: before anyone pays for a GPU node, run the same layout end to end on a CPU:
  1. the full-scale plan of the config as written (`areal-mq plan`, against the public shape when the model is not
     here yet): its refusals fail the rehearsal, its engine occupancy is reported;
  2. the toy config (launch/toy.py `toy_config`): the model becomes a small random model of the same family (model_type, tied
     or untied head, q/k/v biases, q/k norms: engines/shapes.py) with the real tokenizer where the model directory
     is here (else SmolLM2's, said in the report); every process count, the strategy, the publishing layout,
     checkpoints, evaluations, the restart policy and the placement stay; GPU indices become pretend devices
     (each process still gets its CUDA_VISIBLE_DEVICES, checked in /proc; under Ray a local cluster announces
     pretend GPUs and Ray hands them out); the data is the config's own where its files exist, else a sample in
     the same format shipped with the project (areal_mq/data/samples, said in the report);
  3. `steps` versions through the same code as `areal-mq run` (launch/job.py `execute`), with one trainer rank
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
from pathlib import Path
from typing import Any

from areal_mq.launch.toy import rehearsal_dir, toy_config
from areal_mq.telemetry.tail import read_events

ROLES = ("broker", "controller", "trainer", "rollout", "reward", "agent")


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
    moment a checkpoint before the last step exists and (under on_child_death: stop, where the run ends with the
    rank) every engine has loaded a published version (once per rehearsal). A thread, not the launcher's
    1 s supervision tick: a toy trainer takes a step in a fraction of a second, and the kill must land mid-run."""

    def __init__(self, run_dir: Path, steps: int, ranks: int, restarts: bool = False, kill: bool = True):
        import threading

        self.kill_enabled = kill  # False (--no-kill): the steps run once, nothing is killed or resumed
        self.run_dir = run_dir
        self.config_path = run_dir / "config.yaml"
        self.steps = steps
        self.ranks = ranks
        # on_child_death restart: the engines live through the kill and load the resumed trainer's versions, so
        # the kill need not wait for them (waiting serialises the unit's restart behind the engines' start)
        self.restarts = restarts
        self.started: dict[str, set[int]] = {}
        self.last: list[dict] = []  # the newest snapshot with every trainer rank and the controller alive
        self.kill: dict | None = None
        self._loaded: set[str] = set()  # rollout events files that show a weight load
        self._engines_at = 0.0
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
            if self.kill_enabled and self.kill is None and (newest := self._checkpoint_before_last()) and (
                    self.restarts or newest >= self.steps - 1 or self._engines_hold_a_version()):
                self._snapshot()
                self._kill_one_rank()

    def _engines_hold_a_version(self) -> bool:
        """Every rollout worker has loaded a published version (so the kill cannot come before the publishing
        layout was shown to work; at the last checkpoint before the end the rank is killed regardless). Read at most
        every 0.2 s, each events file until it shows a load: a cheap look beside a run on 2 cores."""
        now = time.monotonic()
        if now < self._engines_at:
            return False
        self._engines_at = now + 0.2
        want = sum(p["role"] == "rollout" for p in self.last)
        for f in (self.run_dir / "events").glob("rollout*.jsonl"):
            if f.name not in self._loaded:
                try:
                    if '"rollout.weights_updated"' in f.read_text(errors="replace"):
                        self._loaded.add(f.name)
                except OSError:
                    pass
        return want > 0 and len(self._loaded) >= want

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
    if not watch.kill_enabled:
        return {"killed": None, "skipped": "--no-kill: the steps ran once; no rank was killed or resumed"}, []
    if watch.kill is None:
        return {"killed": None}, [_failure("trainer", "trainer.checkpoint_every", "no checkpoint was written, so no "
                                           "trainer rank was killed and nothing was resumed")]
    resumed = [e for e in read_events(run_dir, "trainer.resumed") if e["ts"] >= watch.kill["time"]]
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
    for e in read_events(run_dir, "rollout.weights_updated"):
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
    if cfg.eval.via == "rollout":  # a periodic evaluation skipped with its reason is no failure
        skipped = {e["version"]: e.get("reason") for e in read_events(run_dir, "controller.eval_skipped")}
        evals += [{"version": v, "skipped": skipped[v]} for v in sorted(set(skipped) & (want - got))]
        got |= set(skipped)
        evals.sort(key=lambda e: e["version"])
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


def rehearse(cfg: Any, console: Any, steps: int = 4, device_gib: float | None = None, quiet: bool = False,
             kill: bool = True) -> dict:
    """Rehearse `cfg` (the module docstring); returns the report written to RUN_DIR/rehearsal.json. kill=False
    (`--no-kill`) leaves out step 3's kill and resume: for a layout whose restart path another rehearsal of the same
    kind has shown (CI kills one rank per layout kind, tests/integration/test_rehearsal.py)."""
    from areal_mq.engines.models import models_cache_dir
    from areal_mq.launch.job import check_memory

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
    watch = Watch(run_dir.resolve(), steps, toy.cfg.launcher.trainer_ranks,
                  restarts=toy.cfg.launcher.on_child_death == "restart", kill=kill)
    ray = _pretend_ray(toy.cfg)
    runs: list[dict] = []
    try:
        check_memory(toy.cfg)
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
        report.update(roles={}, resume={}, engines={}, evaluations=[])
        return _finish(report, failures, started, console)
    report["roles"], more = check_processes(toy.cfg, watch)
    failures += more
    report["resume"], more = check_resume(run_dir, watch, toy.cfg)
    failures += more
    report["engines"], more = check_engines(run_dir, toy.cfg)
    failures += more
    report["evaluations"], more = check_evals(run_dir, toy.cfg, steps)
    failures += more
    return _finish(report, failures, started, console)


def _finish(report: dict, failures: list[dict], started: float, console: Any) -> dict:
    """The verdict into the report, RUN_DIR/rehearsal.json written, the summary shown."""
    report.update(failures=failures, ok=not failures, seconds=round(time.time() - started, 1))
    (Path(report["run_dir"]) / "rehearsal.json").write_text(json.dumps(report, indent=2, default=str))
    _say(console, report)
    return report


def _execute(cfg: Any, console: Any, quiet: bool, resume: bool, watch: Watch) -> dict:
    """One `areal-mq run` of the toy config; a ConfigError or an early exit becomes the outcome 'failed'."""
    import click

    from areal_mq.launch.job import execute

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
    adm = report["plan"].get("admission") or {}
    if adm:
        twin = (f"; scheduler twin: {adm['decoding']:.0%} decoding, {adm['preempt_per_1k']:.2f} preemptions per 1k "
                f"tokens, KV {adm['kv_use']:.0%} used (engines/twin.py)" if adm.get("twin") else "")
        console.print(f"full-scale engine rows running {adm['running']:.0%} ({adm['rows']:g} of {adm['max_concurrent']} "
                      f"per engine, limited by {adm['limited_by']}{twin})", highlight=False)
    if occ:
        console.print(f"full-scale engine occupancy {occ['occupancy']:.0%}; resume: "
                      f"{report['resume'].get('resumed') or 'none'}; evaluations at "
                      f"{[e['version'] for e in report['evaluations']]}; engines reached "
                      f"{ {k: v[-1] for k, v in report['engines'].items()} }", highlight=False)
    for f in report["failures"]:
        console.print(f"[red]FAILED[/] {f['role']} ({f['field']}): {f['reason']}", highlight=False)
    console.print(f"report: {Path(report['run_dir']) / 'rehearsal.json'}")
