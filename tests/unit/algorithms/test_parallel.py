"""trainer.parallel (areal_mq/algorithms/parallel.py, issue 61 item 1): the older keys map onto the degrees and
still load unchanged, bad degrees are refused with what to do, `ParallelDims` answers which rank does what, the
trainer refuses tp / cp at start, and no module outside the allowed rooms branches on the strategy's name."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from areal_mq.algorithms.config import TrainerConfig
from areal_mq.algorithms.parallel import ParallelDims, degrees
from areal_mq.config import config_from_dict
from areal_mq.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


def _deg(cfg: TrainerConfig, world: int) -> tuple[int, int, int, int]:
    d = ParallelDims.of(cfg, world)
    return d.dp_replicate, d.dp_shard, d.cp, d.tp


@pytest.mark.parametrize("old, world, want, room", [
    ({}, 4, (4, 1, 1, 1), "ddp"),  # ddp: every rank a whole copy
    ({"strategy": "ddp", "fsdp": {"replicate": 2}}, 4, (4, 1, 1, 1), "ddp"),  # replicate was ignored under ddp
    ({"strategy": "fsdp"}, 4, (1, 4, 1, 1), "fsdp"),
    ({"strategy": "fsdp", "fsdp": {"replicate": 2}}, 8, (2, 4, 1, 1), "fsdp"),  # HSDP 2 x 4
    ({"strategy": "fsdp", "fsdp": {"replicate": 4}}, 4, (4, 1, 1, 1), "fsdp"),  # HSDP of 1-rank groups: still fsdp
])
def test_the_older_keys_map_onto_the_degrees(old, world, want, room):
    cfg = TrainerConfig(**old)
    assert _deg(cfg, world) == want and cfg.strategy == room and ParallelDims.of(cfg, world).room == room


@pytest.mark.parametrize("parallel, world, want, room", [
    ({"dp_shard": 1}, 1, (1, 1, 1, 1), "ddp"),
    ({"dp_replicate": -1, "dp_shard": 1}, 3, (3, 1, 1, 1), "ddp"),
    ({}, 4, (1, 4, 1, 1), "fsdp"),  # dp_shard -1: every rank left
    ({"dp_replicate": 2, "dp_shard": 8}, 16, (2, 8, 1, 1), "fsdp"),
    ({"dp_shard": 8, "tp": 4}, 32, (1, 8, 1, 4), "fsdp"),
    ({"dp_shard": 1, "tp": 2}, 2, (1, 1, 1, 2), "fsdp"),  # tp splits the model: not a whole copy per rank
    ({"dp_replicate": -1, "dp_shard": 2, "cp": 2}, 8, (2, 2, 2, 1), "fsdp"),
])
def test_explicit_degrees_decide_the_strategy(parallel, world, want, room):
    cfg = TrainerConfig(parallel=parallel)
    assert _deg(cfg, world) == want and cfg.strategy == room


@pytest.mark.parametrize("kw", [{}, {"strategy": "fsdp", "fsdp": {"replicate": 2}}, {"parallel": {"tp": 2}},
                                {"strategy": "ddp", "fsdp": {"replicate": 3}}])
def test_a_dumped_config_loads_back_to_the_same_degrees(kw):
    """run_dir/config.yaml holds both keys after loading: they must agree with each other on the way back."""
    cfg = TrainerConfig(**kw)
    back = TrainerConfig(**cfg.model_dump(mode="json"))
    assert back.strategy == cfg.strategy and back.parallel.degrees() == cfg.parallel.degrees()


@pytest.mark.parametrize("parallel, match", [
    ({"dp_shard": 0}, "dp_shard must be a positive number of ranks, or -1"),
    ({"dp_replicate": -3}, "dp_replicate must be a positive number of ranks, or -1"),
    ({"tp": 0}, r"tp must be a positive number of ranks \(1: off\)"),
    ({"cp": -1}, "cp must be a positive number of ranks"),
    ({"dp_replicate": -1, "dp_shard": -1}, "both -1"),
    ({"pp": 2}, "Extra inputs are not permitted"),
])
def test_bad_degrees_are_refused(parallel, match):
    with pytest.raises(ValidationError, match=match):
        TrainerConfig(parallel=parallel)


def test_a_strategy_or_replicate_that_contradicts_the_degrees_is_refused():
    with pytest.raises(ValidationError, match="trainer.strategy 'ddp' contradicts trainer.parallel"):
        TrainerConfig(strategy="ddp", parallel={"dp_shard": 4})
    with pytest.raises(ValidationError, match="trainer.strategy 'fsdp' contradicts trainer.parallel"):
        TrainerConfig(strategy="fsdp", parallel={"dp_shard": 1})
    with pytest.raises(ValidationError, match="trainer.fsdp.replicate 3 contradicts trainer.parallel.dp_replicate 2"):
        TrainerConfig(fsdp={"replicate": 3}, parallel={"dp_replicate": 2})
    agree = TrainerConfig(strategy="fsdp", fsdp={"replicate": 2}, parallel={"dp_replicate": 2, "dp_shard": 4})
    assert agree.strategy == "fsdp"


def test_the_degrees_must_fill_launcher_trainer_ranks():
    def run(parallel, ranks):
        return config_from_dict({"trainer": {"parallel": parallel}, "launcher": {"trainer_ranks": ranks}})

    with pytest.raises(ConfigError, match=r"multiplies to 8 ranks, and the trainer has 4 \(launcher.trainer_ranks\)"):
        run({"dp_shard": 8}, 4)
    with pytest.raises(ConfigError, match="needs a multiple of 3 ranks to fill dp_shard"):
        run({"tp": 3}, 8)
    assert run({"dp_shard": 8, "tp": 4}, 32).trainer.strategy == "fsdp"
    assert run({"tp": 2}, 8).trainer.parallel.dp_shard == -1  # kept as written; resolved per world
    # the older key keeps its older check: it loads, and `plan` refuses it (tests/unit/launch/test_plan_load.py)
    old = config_from_dict({"trainer": {"strategy": "fsdp", "fsdp": {"replicate": 3}},
                            "launcher": {"trainer_ranks": 8}})
    assert "trainer.fsdp.replicate 3 does not divide launcher.trainer_ranks 8" in degrees(old.trainer.parallel, 8)[1]


def test_who_does_what_under_fsdp_x_tp():
    """dp_shard 2 x tp 2: tp innermost, so ranks 0,1 are one tp group; the tp ranks of a group share a batch share;
    every rank of the one replica serves a piece."""
    d = ParallelDims.of(TrainerConfig(parallel={"dp_shard": 2, "tp": 2}), 4)
    assert [d.coords(r) for r in (1, 2)] == [{"dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1},
                                             {"dp_replicate": 0, "dp_shard": 1, "cp": 0, "tp": 0}]
    assert d.dp == 2 and [d.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [d.publish_group(r) for r in range(4)] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert d.shard_ranks == 4 and d.activation_ranks == 2 and d.lockstep and d.gathers_collectively
    assert d.describe() == "fsdp over 2 x tp 2" and d.writes_main(0) and not d.writes_main(1)


def test_who_does_what_under_hsdp_cp_and_ddp():
    hsdp = ParallelDims.of(TrainerConfig(strategy="fsdp", fsdp={"replicate": 2}), 4)
    assert [hsdp.publish_group(r) for r in range(4)] == [(0, 2), (1, 2), None, None]  # replica group 0 serves
    assert [hsdp.dp_rank(r) for r in range(4)] == [0, 1, 2, 3] and hsdp.describe().startswith("HSDP 2 x 2")
    cp = ParallelDims.of(TrainerConfig(parallel={"dp_shard": 2, "cp": 2}), 4)
    assert [cp.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]  # the cp ranks of a pair split one share's tokens
    assert [cp.publish_group(r) for r in range(4)] == [(0, 2), None, (1, 2), None]  # cp 0 holds the pieces
    ddp = ParallelDims.of(TrainerConfig(), 3)
    assert ddp.dp == 3 and ddp.dp_rank(2) == 2 and ddp.publish_group(0) is None
    assert not ddp.lockstep and not ddp.gathers_collectively and ddp.shard_ranks == 1 and ddp.describe() == "ddp"


def test_the_trainer_refuses_what_no_layout_trains_yet_at_start():
    from areal_mq.algorithms.trainer import Trainer

    refused = {"tensor and context parallelism together are not built yet": dict(parallel={"tp": 2, "cp": 2}),
               "cp 2 with trainer.fsdp.offload": dict(parallel={"cp": 2}, fsdp={"offload": True}, packing="dynamic"),
               "packing shared with attention sdpa": dict(parallel={"cp": 2})}  # ulysses.check_objective
    for message, cfg in refused.items():
        with pytest.raises(ConfigError, match=message):
            Trainer(TrainerConfig(**cfg), "/nonexistent-model")  # refused before anything is read


def test_what_tensor_parallelism_cannot_do_is_refused_when_the_config_is_read():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="LoRA under tensor parallelism is not supported"):
        TrainerConfig(parallel={"tp": 2}, lora={"rank": 4})
    with pytest.raises(ValidationError, match="a tp shard of o_proj / down_proj is a column block"):
        TrainerConfig(parallel={"tp": 2}, publish_layout="sharded")
    assert TrainerConfig(parallel={"dp_shard": 2}, lora={"rank": 4}).lora is not None  # tp 1: LoRA as before
    assert TrainerConfig(parallel={"cp": 2}, publish_mode="zmq").sharded_publish  # cp: the cp-0 ranks serve rows
    assert not TrainerConfig(parallel={"tp": 2}, publish_mode="zmq").sharded_publish  # auto gathers under tp


# branches on the strategy's name: `strategy ==`, `strategy in`, `strategy.name ==`, `== "fsdp"` and the like
NAME_BRANCH = re.compile(r"""\bstrategy\b\s*([!=]=|(not\s+)?in\b)|\bstrategy\.name\s*([!=]=|(not\s+)?in\b)"""
                         r"""|[!=]=\s*["'](ddp|fsdp)["']|["'](ddp|fsdp)["']\s*[!=]=""")
# the one place that maps degrees to a room, and the rooms themselves (each family's parallelize function)
ALLOWED = {"areal_mq/algorithms/parallel.py", "areal_mq/algorithms/strategy.py", "areal_mq/algorithms/ddp.py",
           "areal_mq/algorithms/fsdp.py", "areal_mq/algorithms/tensor_parallel.py", "areal_mq/algorithms/ulysses.py"}


def test_no_module_outside_the_rooms_branches_on_the_strategy_name():
    hits = []
    for path in sorted([*(REPO / "areal_mq").rglob("*.py"), *(REPO / "workers").rglob("*.py")]):
        rel = path.relative_to(REPO).as_posix()
        if rel in ALLOWED:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if NAME_BRANCH.search(line.split("#")[0]):
                hits.append(f"{rel}:{n}: {line.strip()}")
    assert not hits, ("these branch on the strategy's name; ask areal_mq/algorithms/parallel.py's ParallelDims (or "
                      "trainer.parallel.shards) instead:\n" + "\n".join(hits))


def test_the_name_branch_pattern_sees_what_it_must():
    for line in ('if cfg.strategy == "fsdp":', "if t.strategy != 'fsdp':", 'if trainer.strategy.name in ("fsdp",):',
                 'x = strategy in ROOMS', 'if "fsdp" == kind:'):
        assert NAME_BRANCH.search(line), line
    for line in ('if lc.ray_trainer_strategy == "STRICT_PACK":', 'opts["scheduling_strategy"] = "SPREAD"',
                 'return STRATEGIES[cfg.strategy]()(cfg, precision)'):
        assert not NAME_BRANCH.search(line), line


def test_publishing_follows_the_degrees_not_the_name():
    """Sharded publishing serves row slices: auto picks it where the degrees shard by rows (tp 1); cuda_ipc needs a
    rank that holds the whole model."""
    assert TrainerConfig(parallel={"dp_shard": 4}, publish_mode="zmq").sharded_publish
    assert not TrainerConfig(parallel={"dp_shard": 4, "tp": 2}, publish_mode="zmq").sharded_publish
    assert not TrainerConfig(parallel={"dp_shard": 1}, publish_mode="zmq").sharded_publish
    with pytest.raises(ValidationError, match="cuda_ipc"):
        TrainerConfig(parallel={"dp_shard": 1, "tp": 2}, publish_mode="cuda_ipc")
