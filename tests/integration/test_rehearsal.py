"""Every file in configs/ rehearsed end to end (`areal-mq run CONFIG --rehearse`), and what a rehearsal refuses.

The configs are globbed, so a config added later is rehearsed without anyone remembering to (STYLE 21: a config we
ship is a config we ran). Each rehearsal starts every process its layout asks for (the 7B layout: 8 trainer
ranks over gloo, 8 engines, 4 reward workers, under a local Ray with pretend GPUs), kills one trainer rank after
the first checkpoint and checks the resume; a tiny model and 4 steps keep the whole folder to a few minutes on 2
cores. A config that differs from another only in its data (`data_twin`: the gsm8k and math variants of the 1.5B
node layout) starts no process of its own (issue 58: its processes are its twin's, started here already): its
toy config, its data and held-out sets as the rehearsal loads them, and its full-scale plan are checked instead.
Likewise a config that differs from a rehearsed one only in the trainer's objective (`objective_twin`: the recipe
examples quickstart-gspo, -drgrpo, -rloo, -cispo, -reinforcepp beside quickstart.yaml; OBJECTIVE_KEYS) runs its objective
in a real Trainer on the toy model instead: two optimizer steps whose losses differ from the twin's objective on the
same batch, and its full-scale plan. What the objective changes is the trainer's step and nothing a process does.
Run: pytest tests/integration/test_rehearsal.py -m slow
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
# The kill-and-resume runs once per layout kind (issue 58): every process started twice costs minutes, and the
# restart path of, say, the 1.5B node layout is the same code whatever data the gsm8k and math layouts read. These
# are the kinds' chosen configs; a config of a kind none of them has is its kind's first, so a new kind is killed too.
KILL_FOR_KIND = ("quickstart.yaml", "quickstart-lora.yaml", "qwen2.5-1.5b-node.yaml", "qwen2.5-7b-2nodes.yaml")


def data_twin(path: Path) -> str | None:
    """The shipped config whose layout `path` repeats with other data (everything equal but run.name, run.run_dir
    and data): the first such, a kind's chosen config (KILL_FOR_KIND) before the others, then by name; None when
    none or when `path` is itself the first."""
    from areal_mq.config import load_config

    def layout(p: Path) -> dict:
        d = load_config(p).model_dump(mode="json")
        d.pop("data")
        d["run"].pop("name"), d["run"].pop("run_dir")
        return d

    mine = layout(path)
    for other in sorted(CONFIGS, key=lambda p: (p.name not in KILL_FOR_KIND, p.name)):
        if other == path:
            return None
        if layout(other) == mine:
            return other.name
    return None


# The trainer's objective (areal_mq/algorithms/objective.py, advantages.py): what a recipe example changes. A config
# that differs from a whole-rehearsed one in these alone starts the same processes doing the same things; only the
# trainer's arithmetic differs, checked in process (check_objective_variant). Controller keys (dynamic sampling,
# overlong shaping: quickstart-dapo) change what processes do and are rehearsed whole.
OBJECTIVE_KEYS = ("policy_loss", "loss_agg", "loss_agg_constant", "eps_clip_low", "eps_clip_high", "adv_estimator",
                  "adv_baseline", "adv_std_norm", "kl_coef", "kl_in", "kl_estimator", "entropy_coef")


def objective_twin(path: Path) -> str | None:
    """The whole-rehearsed config `path` repeats with another objective (everything equal but run.name, run.run_dir
    and OBJECTIVE_KEYS): a kind's chosen config (KILL_FOR_KIND) first, then by name, never a data or objective
    variant itself; None when none."""
    from areal_mq.config import load_config

    def layout(p: Path) -> dict:
        d = load_config(p).model_dump(mode="json")
        d["run"].pop("name"), d["run"].pop("run_dir")
        for key in OBJECTIVE_KEYS:
            d["trainer"].pop(key)
        return d

    mine = layout(path)
    for other in sorted(CONFIGS, key=lambda p: (p.name not in KILL_FOR_KIND, p.name)):
        if other == path:
            return None
        if data_twin(other) is None and layout(other) == mine:
            return other.name
    return None


def layout_kind(cfg) -> str:
    """What decides how a rank dies and comes back: LoRA's checkpoint, Ray's restart, a sharded node, one process.
    trainer.parallel's tp and cp are not a kind: a rank dies and is restarted by the same launcher path, and a
    checkpoint written at tp or cp resuming (resharded) is tests/integration/test_trainer_tp_cp.py's, so the 72B tp
    layout is a Ray restart and the 7B cp layout a sharded node, each rehearsed once without a kill."""
    if cfg.trainer.lora is not None:
        return "lora"
    if cfg.launcher.backend == "ray":
        return f"ray {cfg.launcher.on_child_death}"
    if cfg.launcher.trainer_ranks > 1:
        return f"{cfg.trainer.strategy} node {cfg.launcher.on_child_death}"
    return f"single process {cfg.launcher.on_child_death}"


def killed_configs() -> set[str]:
    from areal_mq.config import load_config

    kinds: dict[str, str] = {}
    for path in sorted(CONFIGS, key=lambda p: (p.name not in KILL_FOR_KIND, p.name)):
        kinds.setdefault(layout_kind(load_config(path)), path.name)
    return set(kinds.values())


def rehearse(config: Path | str, run_dir: Path, *extra: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run([sys.executable, "-m", "areal_mq.cli", "run", str(config), "--rehearse", "--quiet",
                           "--set", f"run.run_dir={run_dir}", *extra], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=str(run_dir.parent),
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    report_path = run_dir.with_name(run_dir.name + "-rehearsal") / "rehearsal.json"
    return proc, (json.loads(report_path.read_text()) if report_path.is_file() else {})


# over 120 s beside another test (tests/README.md): 8 gloo ranks + 8 engines under Ray; 8 ranks + 4 engines under
# Ray; 4 ranks + 4 engines, twice; 8 ranks at tp 4 + 2 engines under Ray
LONG = {"qwen2.5-7b-2nodes.yaml", "qwen2.5-32b-2nodes.yaml", "qwen2.5-1.5b-node.yaml", "qwen2.5-72b-tp.yaml"}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("config", [pytest.param(p, marks=[pytest.mark.long] if p.name in LONG else [])
                                    for p in CONFIGS], ids=lambda p: p.name)
def test_every_shipped_config_rehearses_green(config, tmp_path):
    from areal_mq.config import load_config
    from areal_mq.launch.rehearsal import expected_processes

    cfg = load_config(config)
    if (twin := data_twin(config)) is not None:
        return check_data_variant(config, twin, tmp_path)
    if (twin := objective_twin(config)) is not None:
        return check_objective_variant(config, twin, tmp_path)
    kill = config.name in killed_configs()
    proc, report = rehearse(config, tmp_path / "run", *(() if kill else ("--no-kill",)))
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0 and report.get("ok"), tail
    # every process the toy layout asks for, alive at the end (the toy's own counts: launch/toy.py caps the trainer
    # ranks of a layout past TOY_TRAINER_RANKS, the 72B's 32, keeping its tp x cp group)
    toy_cfg = load_config(tmp_path / "run-rehearsal" / "config.yaml")
    for role, want in expected_processes(toy_cfg).items():
        assert report["roles"][role]["alive_at_end"] == want, (role, report["roles"])
    killed = report["resume"]["killed"]
    if kill:
        assert killed and killed["checkpoints"] and report["resume"]["resumed"], report["resume"]
        assert killed["rank"] == toy_cfg.launcher.trainer_ranks - 1  # the last rank: non-zero where there are several
    else:  # its kind's restart path is another config's rehearsal; this one's steps ran once, nothing killed
        assert killed is None and report["resume"]["skipped"] and len(report["runs"]) == 1, report["resume"]
    assert sorted(report["engines"]) == [f"rollout-{i}" for i in range(cfg.launcher.rollout_workers)]
    versions = [e["version"] for e in report["evaluations"]]
    assert versions[0] == 0 and versions[-1] == report["steps"]
    assert report["plan"]["occupancy"]["occupancy"] >= 0.9 and not report["plan"]["refusals"]
    if report["plan"].get("admission"):  # the engines' own rule at full scale (engines/admission.py), carried here
        assert report["plan"]["admission"]["running"] >= 0.9, report["plan"]["admission"]
    if any(getattr(cfg.placement, r).gpus for r in ("trainer", "rollout")):  # pretend devices, as placed
        assert report["roles"]["rollout"]["cuda_visible_devices"], report["roles"]


def check_data_variant(config: Path, twin: str, tmp_path: Path) -> None:
    """A data variant of `twin` below the process level: the rehearsal's own toy config (its data mapped to the
    shipped samples), the training and held-out problems loaded as the controller and the evaluation load them, and
    the full-scale plan (no refusal, the engines' rows running in the scheduler twin)."""
    from areal_mq.config import load_config
    from areal_mq.data.dataset import build_dataset, load_eval_problems
    from areal_mq.launch.plan import make_plan
    from areal_mq.launch.toy import toy_config

    cfg = load_config(config)
    toy = toy_config(cfg, 4, tmp_path / "run-rehearsal", tmp_path / "cache")
    assert toy.data["replaced"], toy.data  # its own data names, each mapped to a sample the rehearsal reads
    train, held_out = build_dataset(toy.cfg.data), load_eval_problems(toy.cfg.data)
    assert len(train) > 0 and len(held_out) > 0
    plan = make_plan(cfg, device_gib=80)
    assert not plan.refusals and plan.admission["running"] >= 0.9, (plan.refusals, plan.admission)
    assert data_twin(ROOT / "configs" / twin) is None  # the twin itself is rehearsed whole


def check_objective_variant(config: Path, twin: str, tmp_path: Path) -> None:
    """An objective variant of `twin` below the process level: the rehearsal's toy config (the toy model with the
    real tokenizer), a real Trainer with the config's trainer settings taking two optimizer steps on realistic
    groups (finite losses, a gradient, the parameters moved), the twin's objective on the same batch giving another
    loss (the config's objective is what ran), and the full-scale plan."""
    import math

    import torch

    from areal_mq.algorithms.trainer import Trainer
    from areal_mq.config import load_config
    from areal_mq.launch.plan import make_plan
    from areal_mq.launch.toy import toy_config
    from tests.unit.algorithms.batches import make_samples

    cfg, other = load_config(config), load_config(ROOT / "configs" / twin)
    assert objective_twin(ROOT / "configs" / twin) is None  # the twin itself is rehearsed whole
    toy = toy_config(cfg, 4, tmp_path / "run-rehearsal", tmp_path / "cache")
    model_dir = Path(toy.cfg.model.name)
    losses = {}
    for name, trainer_cfg in ((config.name, toy.cfg.trainer), (twin, toy.cfg.trainer.model_copy(
            update={k: getattr(other.trainer, k) for k in OBJECTIVE_KEYS}))):
        torch.manual_seed(0)
        trainer = Trainer(trainer_cfg.model_copy(update={"device": "cpu"}), model_dir)
        try:
            before = {n: p.detach().clone() for n, p in trainer.unwrapped.named_parameters() if p.requires_grad}
            steps = [trainer.train_step(make_samples(seed, n_groups=2, group_size=cfg.controller.group_size,
                                                     gen_len=(2, 24), version=trainer.version)) for seed in (0, 1)]
            assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in steps), steps
            moved = [n for n, p in trainer.unwrapped.named_parameters() if n in before and not torch.equal(p, before[n])]
            assert moved, "two optimizer steps moved no parameter"
            losses[name] = steps[0]["loss"]
        finally:
            trainer.close()
    assert losses[config.name] != losses[twin], losses  # the objective keys reached the step
    plan = make_plan(cfg, device_gib=80)
    assert not plan.refusals and plan.admission["running"] >= 0.9, (plan.refusals, plan.admission)


def test_the_objective_variants_are_the_recipe_examples_beside_the_quickstart():
    """Which configs are checked as objective variants: the recipe examples whose only difference from the
    quickstart is the trainer's objective. quickstart-dapo changes controller settings too (dynamic sampling by
    outcome, overlong shaping): it is rehearsed as processes, and its clip-higher objective goes through the same
    seam (areal_mq/algorithms/objective.py) in the trainer process there."""
    variants = {p.name: objective_twin(p) for p in CONFIGS if objective_twin(p)}
    recipes = ("cispo", "drgrpo", "entropy", "gspo", "reinforcepp", "reinforcepp-baseline", "rloo")
    assert variants == {f"quickstart-{n}.yaml": "quickstart.yaml" for n in recipes}, variants


def test_the_data_variants_are_the_1_5b_node_layouts_and_nothing_else():
    """Which configs skip starting processes (their twin's rehearsal starts the same ones): exactly the two data
    variants of the 1.5B node layout. A config that differs in anything but its data is rehearsed whole."""
    variants = {p.name: data_twin(p) for p in CONFIGS if data_twin(p)}
    assert variants == {"qwen2.5-1.5b-math.yaml": "qwen2.5-1.5b-node.yaml",
                        "qwen2.5-1.5b-gsm8k.yaml": "qwen2.5-1.5b-node.yaml"}, variants


def test_one_kill_and_resume_per_layout_kind():
    """The kinds the shipped configs have are each killed and resumed once, in the kinds' chosen configs."""
    from areal_mq.config import load_config

    killed = killed_configs()
    assert {layout_kind(load_config(p)) for p in CONFIGS} == {layout_kind(load_config(p)) for p in CONFIGS
                                                              if p.name in killed}
    assert killed == set(KILL_FOR_KIND), killed  # one each: a chosen config that shares a kind is a wasted restart


@pytest.mark.slow
def test_a_layout_without_a_held_out_set_fails_naming_the_field(tmp_path):
    """The node configs' first failure (issue 50): no data.eval_name with a local dataset. One line, the field,
    exit 1, a report; no process is started."""
    from areal_mq.data.samples import SAMPLES

    proc, report = rehearse(ROOT / "configs" / "tiny.yaml", tmp_path / "run", "--set",
                            f"data.name={SAMPLES['gsm8k'][0]}", timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert not report["ok"] and report["failures"][0]["field"] == "data.eval_name", report["failures"]
    assert "Traceback" not in proc.stderr and report["roles"] == {}
