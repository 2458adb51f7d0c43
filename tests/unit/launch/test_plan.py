"""`areal-mq plan`: the memory estimate holds within 25 % of what benchmarks/speed/trainer_fsdp.py measured (one process
and per FSDP rank, Qwen2.5-0.5B shape, benchmarks/results/trainer_fsdp.json); a 7B config is refused on one
80 GB GPU with ddp, naming the knob, and accepted with fsdp over 8. Model configs are the public ones
(areal_mq/engines/shapes.py), saved locally: nothing is downloaded or loaded."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from areal_mq.config import config_from_dict
from areal_mq.launch.plan import GIB, make_plan

ROOT = Path(__file__).resolve().parents[3]


def _config_dir(tmp_path: Path, shape: str, **overrides) -> Path:
    from areal_mq.engines.shapes import hf_config

    out = tmp_path / shape
    hf_config(shape, **overrides).save_pretrained(str(out))
    return out


def test_the_estimate_is_within_25_percent_of_the_measured_trainer_peaks(tmp_path):
    bench = json.loads((ROOT / "benchmarks" / "results" / "trainer_fsdp.json").read_text())
    single, fsdp = bench["results"]
    tokens = bench["sizes"]["groups"] * bench["sizes"]["group_size"] * (bench["sizes"]["prompt"] + bench["sizes"]["gen"])
    model = _config_dir(tmp_path, "qwen2.5-0.5b", num_hidden_layers=bench["model"]["layers"])
    base = {"model": {"name": str(model), "device": "cpu"}, "trainer": {"precision": "fp32"}}
    one = make_plan(config_from_dict({**base, "trainer": {"precision": "fp32", "max_tokens_per_mb": tokens}}))
    # each of the 2 FSDP ranks trained its half of the batch in one micro-batch
    two = make_plan(config_from_dict({**base, "trainer": {"precision": "fp32", "strategy": "fsdp",
                                                          "max_tokens_per_mb": tokens // 2},
                                      "launcher": {"trainer_ranks": 2}}))
    est_single = one.processes[0].nbytes / GIB
    est_rank = two.processes[0].nbytes / GIB
    assert est_single == pytest.approx(single["peak_rss_gib"], rel=0.25), (est_single, single["peak_rss_gib"])
    assert est_rank == pytest.approx(max(fsdp["rank_peak_rss_gib"]), rel=0.25), (est_rank, fsdp["rank_peak_rss_gib"])
    assert one.shape.params == bench["model"]["params"]


def test_a_7b_trainer_is_refused_on_one_80_gb_gpu_with_ddp_and_fits_with_fsdp_over_8(tmp_path):
    model = _config_dir(tmp_path, "qwen2.5-7b")
    base = {"model": {"name": str(model)}, "rollout": {"engine": {"dtype": "bfloat16"}}}
    ddp = make_plan(config_from_dict(base), device_gib=80)
    assert ddp.refusals and "trainer.strategy=fsdp" in ddp.refusals[0] and "80.0 GiB" in ddp.refusals[0]
    fsdp = make_plan(config_from_dict({**base, "trainer": {"strategy": "fsdp"}, "launcher": {"trainer_ranks": 8}}),
                     device_gib=80)
    assert not fsdp.refusals, fsdp.table()
    rank = fsdp.processes[0]
    assert rank.count == 8 and 20 * GIB < rank.nbytes < 40 * GIB
    assert "fits" in fsdp.table() and "REFUSED" in ddp.table()


def _big_layout(model: Path, **fsdp) -> dict:
    """8 trainer ranks on 80 GB GPUs, bf16, gradient checkpointing, 8k tokens a micro-batch, sharded publishing."""
    return {"model": {"name": str(model), "device": "cuda", "dtype": "bfloat16"},
            "trainer": {"strategy": "fsdp", "gradient_checkpointing": True, "max_tokens_per_mb": 8192,
                        "publish_mode": "zmq", "fsdp": fsdp},
            "launcher": {"trainer_ranks": 8, "rollout_workers": 8}}


def test_qwen2_5_32b_fits_fsdp_over_8_and_14b_hsdp_2x4_fits_as_the_units_lay_out_the_vocabulary(tmp_path):
    """Issue 59 item 3: the embeddings and the norm + head are FSDP units of their own (algorithms/fsdp.py
    vocab_units), gathered one at a time, and the sharded publish snapshots are pinned host memory: Qwen2.5-32B
    (its public config: the 14B widths, 27,648 intermediate, 64 layers) plans at most 76 GiB a rank over 8 ranks."""
    q32 = _config_dir(tmp_path / "32b", "qwen2.5-14b", intermediate_size=27648, num_hidden_layers=64)
    q14 = _config_dir(tmp_path, "qwen2.5-14b")
    full = make_plan(config_from_dict(_big_layout(q32)), device_gib=80)
    hsdp = make_plan(config_from_dict(_big_layout(q14, replicate=2)), device_gib=80)
    assert not full.refusals and not hsdp.refusals, (full.table(), hsdp.table())
    assert 31e9 < full.shape.params < 34e9
    rank = full.processes[0]
    assert rank.layout == "fsdp over 8" and rank.nbytes <= 76 * GIB, full.table()
    assert hsdp.processes[0].layout.startswith("HSDP 2 x 4") and hsdp.processes[0].nbytes <= 76 * GIB
    items = {i.name: i.nbytes for i in rank.items}
    assert items["gathered embeddings or head + its gradient"] == (2 + 4) * full.shape.embed_params  # bf16 + fp32
    assert not any("staging" in name or "root" in name for name in items)  # host memory / no vocabulary root


def test_the_cli_prints_the_plan_and_exits_2_when_it_cannot_fit(tmp_path):
    from typer.testing import CliRunner

    from areal_mq.cli import app

    model = _config_dir(tmp_path, "qwen2.5-7b")
    runner = CliRunner()
    ok = runner.invoke(app, ["plan", "--set", f"model.name={model}", "--set", "trainer.strategy=fsdp",
                             "--set", "launcher.trainer_ranks=8", "--device-gib", "80"])
    assert ok.exit_code == 0 and "trainer rank" in ok.output and "fits" in ok.output
    bad = runner.invoke(app, ["plan", "--set", f"model.name={model}", "--device-gib", "80"])
    assert bad.exit_code == 2 and "REFUSED" in bad.output


def test_areal_mq_run_checks_the_plan_first_and_stops_before_anything_starts(tmp_path):
    """On the CPU every process shares the host: a 7B run on this machine is refused at once (exit 2), with no
    run directory written and no process started."""
    import subprocess
    import sys

    model = _config_dir(tmp_path, "qwen2.5-7b")
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "areal_mq.cli", "run", str(ROOT / "configs" / "tiny.yaml"),
                           "--skip-eval", "--set", f"model.name={model}", "--set", "model.device=cpu",
                           "--set", f"run.run_dir={run_dir}", "--set", "rollout.engine.dtype=float32"],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "REFUSED" in proc.stderr and "shares its memory" in proc.stderr
    assert not run_dir.exists()


def test_the_shipped_node_config_fits_its_node(tmp_path):
    """configs/qwen2.5-1.5b-node.yaml (4 trainer ranks + 4 engines on 8 x 80 GB) against the public 1.5B config."""
    from areal_mq.config import load_config

    model = _config_dir(tmp_path, "qwen2.5-1.5b")
    cfg = load_config(ROOT / "configs" / "qwen2.5-1.5b-node.yaml", [f"model.name={model}"])
    result = make_plan(cfg, device_gib=80)
    assert not result.refusals, result.table()
    assert [p.count for p in result.processes] == [4, 4, 1]  # trainer ranks, engines, the periodic evaluation
    assert result.processes[2].role == "evaluation (beside rollout engine 0)"
    assert cfg.placement.visible("rollout", 3, cfg.launcher) == "7"
    assert cfg.placement.visible("eval", 0, cfg.launcher) == "4"  # engine 0's GPU, never trainer rank 0's
    tight = make_plan(cfg, device_gib=40)  # the engines' 40 GiB KV pool does not fit a 40 GB card
    assert tight.refusals and "kv_cache_bytes" in tight.refusals[0]


def test_a_vllm_engine_is_counted_per_gpu_of_its_tensor_parallel_size_and_held_to_its_utilization(tmp_path):
    model = _config_dir(tmp_path, "qwen2.5-7b")
    base = {"model": {"name": str(model)}, "trainer": {"strategy": "fsdp"}, "launcher": {"trainer_ranks": 8},
            "rollout": {"engine": {"kind": "vllm", "dtype": "bfloat16", "kv_cache_bytes": 40 * GIB}}}
    one = make_plan(config_from_dict(base), device_gib=80)
    engine = one.processes[1]
    assert engine.device_share == 0.9 and engine.role == "rollout engine"
    assert not one.refusals, one.table()  # 14.2 GiB of weights + 40 GiB of KV on one GPU: under 0.9 x 80
    tight = make_plan(config_from_dict({**base, "rollout": {"engine": {
        "kind": "vllm", "dtype": "bfloat16", "kv_cache_bytes": 40 * GIB, "vllm": {"gpu_memory_utilization": 0.6}}}}),
        device_gib=80)
    assert tight.refusals and "gpu_memory_utilization" in tight.refusals[0] and "gpus_per_process" in tight.refusals[0]
    split = make_plan(config_from_dict({**base, "placement": {"rollout": {"gpus_per_process": 2}}, "rollout": {
        "engine": {"kind": "vllm", "dtype": "bfloat16", "kv_cache_bytes": 40 * GIB,
                   "vllm": {"gpu_memory_utilization": 0.6}}}}), device_gib=80)
    assert not split.refusals, split.table()  # the same engine over 2 GPUs: half the weights and KV on each
    assert "1 of 2 GPUs" in split.table()
    assert split.processes[1].nbytes < 0.6 * engine.nbytes


def test_a_public_shape_name_or_an_absent_model_dir_plans_against_the_public_config(tmp_path):
    """A plan is worth most before the download: `model.name=qwen2.5-7b`, or the config's /models/... path that is
    not here yet (read as the public shape, with a note); anything else is one clear ConfigError."""
    from areal_mq.config import load_config
    from areal_mq.errors import ConfigError
    from areal_mq.launch.plan import shape_for_name

    assert shape_for_name("/models/Qwen2.5-7B-Instruct") == "qwen2.5-7b"
    assert shape_for_name("/models/Mistral-7B") is None
    cache = f"model.cache_dir={tmp_path / 'models'}"
    named = make_plan(load_config(None, ["model.name=qwen2.5-7b", cache]), device_gib=80)
    assert 7.5e9 < named.shape.params < 7.7e9 and not named.notes
    guessed = make_plan(load_config(ROOT / "configs" / "qwen2.5-7b-2nodes.yaml", [cache]), device_gib=80)
    assert guessed.shape.params == named.shape.params
    assert "not on this machine" in guessed.notes[0] and "qwen2.5-7b" in guessed.table()
    with pytest.raises(ConfigError, match="public shape"):
        make_plan(load_config(None, ["model.name=/nowhere/Mistral-7B", cache]), device_gib=80)


def test_the_plan_reports_engine_occupancy_and_warns_below_half():
    from areal_mq.launch.plan import occupancy

    starved = config_from_dict({"controller": {"group_size": 8, "batch_groups": 32, "max_staleness": 4,
                                               "max_concurrent_groups": 32},
                                "rollout": {"engine": {"max_concurrent": 256}}, "launcher": {"rollout_workers": 4}})
    occ = occupancy(starved)
    assert occ["occupancy"] == 0.25 and "max_concurrent_groups" in occ["limited_by"]
    by_bound = config_from_dict({"controller": {"group_size": 8, "batch_groups": 32, "max_staleness": 4,
                                                "max_concurrent_groups": 500},
                                 "rollout": {"engine": {"max_concurrent": 256}}, "launcher": {"rollout_workers": 8}})
    assert occupancy(by_bound)["occupancy"] == 0.625 and "staleness bound" in occupancy(by_bound)["limited_by"]
    sync = config_from_dict({"run": {"mode": "sync"}, "controller": {"group_size": 4, "batch_groups": 4,
                                                                     "max_concurrent_groups": 16}})
    assert occupancy(sync)["sequences"] == 16  # η = 0: one batch in flight


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_fills_its_engines(path, tmp_path):
    """The issue-50 target: every shipped config's engines >= 90 % occupied by the plan's arithmetic."""
    from areal_mq.config import load_config
    from areal_mq.launch.plan import occupancy

    occ = occupancy(load_config(path))
    assert occ["occupancy"] >= 0.9, occ


def test_the_periodic_evaluation_is_counted_beside_engine_0_or_on_its_own_gpu(tmp_path):
    model = _config_dir(tmp_path, "qwen2.5-7b")
    base = {"model": {"name": str(model), "dtype": "bfloat16", "device": "cuda"}, "eval": {"every": 10},
            "trainer": {"strategy": "fsdp"}, "launcher": {"trainer_ranks": 2, "rollout_workers": 1},
            "placement": {"trainer": {"gpus": [0, 1]}, "rollout": {"gpus": [2]}},
            "rollout": {"engine": {"kv_cache_bytes": 48 * GIB, "max_concurrent": 128}}}
    beside = make_plan(config_from_dict(base), device_gib=80)
    assert any("periodic evaluation" in r and "placement.eval.gpus" in r for r in beside.refusals), beside.table()
    small = make_plan(config_from_dict({**base, "eval": {"every": 10, "kv_cache_bytes": 4 * GIB},
                                        "rollout": {"engine": {"kv_cache_bytes": 40 * GIB, "max_concurrent": 128}}}),
                      device_gib=80)
    assert not small.refusals, small.table()
    own = make_plan(config_from_dict({**base, "placement": {**base["placement"], "eval": {"gpus": [3]}}}),
                    device_gib=80)
    assert not own.refusals and own.processes[-1].role == "evaluation", own.table()
    assert config_from_dict(base).placement.visible("eval", 0, config_from_dict(base).launcher) == "2"


def test_vllm_engines_are_counted_by_their_memory_share_and_the_evaluation_shares_engine_0s_device(tmp_path):
    """vLLM takes gpu_memory_utilization of its device whatever the model needs: the periodic evaluation beside
    rollout engine 0 is a second vLLM engine with the same share, so 0.9 + 0.9 is refused naming the knobs, however
    small the model; 0.45 each fits, and so does an evaluation GPU of its own (issue 59)."""
    model = _config_dir(tmp_path, "qwen2.5-1.5b")
    base = {"model": {"name": str(model), "dtype": "bfloat16", "device": "cuda"}, "eval": {"every": 10},
            "trainer": {"strategy": "fsdp"}, "launcher": {"trainer_ranks": 2, "rollout_workers": 1},
            "placement": {"trainer": {"gpus": [0, 1]}, "rollout": {"gpus": [2]}},
            "rollout": {"engine": {"kind": "vllm", "dtype": "bfloat16", "kv_cache_bytes": 4 * GIB}}}
    both = make_plan(config_from_dict(base), device_gib=80)
    ev = both.processes[-1]
    assert ev.role == "evaluation (beside rollout engine 0)" and ev.device_share == 0.9
    refused = [r for r in both.refusals if "second vLLM engine" in r]
    assert refused and "1.8 of one device" in refused[0], both.refusals
    assert all(k in refused[0] for k in ("gpu_memory_utilization", "placement.eval.gpus", "eval.every: 0"))
    halves = make_plan(config_from_dict({**base, "rollout": {"engine": {**base["rollout"]["engine"],
                                                                         "vllm": {"gpu_memory_utilization": 0.45}}}}),
                       device_gib=80)
    assert not halves.refusals, halves.refusals
    own = make_plan(config_from_dict({**base, "placement": {**base["placement"], "eval": {"gpus": [3]}}}),
                    device_gib=80)
    assert not own.refusals, own.refusals
    no_eval = make_plan(config_from_dict({**base, "eval": {"every": 0}}), device_gib=80)
    assert not no_eval.refusals and len(no_eval.processes) == 2


def test_a_torch_engine_given_several_gpus_is_refused_toward_vllm_tp(tmp_path):
    model = _config_dir(tmp_path, "qwen2.5-1.5b")
    base = {"model": {"name": str(model), "dtype": "bfloat16", "device": "cuda"},
            "placement": {"rollout": {"gpus": [1, 2], "gpus_per_process": 2}, "trainer": {"gpus": [0]}}}
    torch_plan = make_plan(config_from_dict(base), device_gib=80)
    assert any("use vllm with TP" in r and "gpus_per_process 2" in r for r in torch_plan.refusals), torch_plan.refusals
    vllm_plan = make_plan(config_from_dict({**base, "rollout": {"engine": {"kind": "vllm", "dtype": "bfloat16"}}}),
                          device_gib=80)
    assert not any("use vllm with TP" in r for r in vllm_plan.refusals), vllm_plan.refusals
    assert "1 of 2 GPUs" in vllm_plan.table()


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_runs_90_percent_of_its_rows_by_the_engines_rule(path):
    """Issue 59: the rows each engine runs at once at full scale (the scheduler twin, engines/twin.py: the torch
    engine's own scheduler in virtual time), on the devices the config is planned for, are >= 90 % of the rows it
    sizes and >= 80 % of them decode (the rest prefill); the plan says so on a line that says 'running'."""
    from areal_mq.config import load_config

    cfg = load_config(path)
    gpu = bool(cfg.placement.rollout.gpus) or cfg.model.device.startswith("cuda")
    plan = make_plan(cfg, device_gib=80 if gpu else None)
    assert plan.admission["twin"] and plan.admission["running"] >= 0.9, plan.admission
    assert plan.admission["decoding"] >= 0.8 and plan.admission["preempt_per_1k"] < 1, plan.admission
    assert any("running" in line and f"{plan.admission['running']:.0%}" in line for line in plan.table().splitlines())


def test_the_old_reservation_cap_would_throttle_the_node_layout_and_the_plan_says_so(tmp_path):
    """configs/qwen2.5-1.5b-node.yaml with the reservation cap the engine used to apply by default (65,536 tokens of
    prompt + max_new_tokens 8,192): 7 of 256 rows, refused as a warning naming the cap; without it the pool decides."""
    from areal_mq.config import load_config
    from areal_mq.engines.admission import steady_rows

    path = ROOT / "configs" / "qwen2.5-1.5b-node.yaml"
    capped = make_plan(load_config(path, ["rollout.engine.max_reserved_tokens=65536"]), device_gib=80)
    assert capped.admission["rows"] == 65536 // (256 + 8192) == 7  # in the twin as by the rule
    assert capped.admission["limited_by"] == "rollout.engine.max_reserved_tokens"
    assert any("7 of its 256 rows" in w for w in capped.warnings), capped.warnings
    full = make_plan(load_config(path), device_gib=80)
    assert full.admission["rows"] == 256 and not any("rows (" in w for w in full.warnings)
    # the pool decides where nothing else does: a pool of 100 rows' live tokens runs ~100 (the watermark aside)
    small = steady_rows(max_concurrent=256, pool_tokens=100 * 3000, block_size=16, prompt_tokens=256,
                        max_new_tokens=8192)
    assert small["limited_by"] == "the KV pool" and 95 <= small["rows"] <= 100, small


def test_a_packed_row_counts_its_quadratic_attention_mask():
    """Packed micro-batches (shared, dynamic) attend through an L x L mask today (algorithms/packing.py; issue 61):
    a boolean and SDPA's additive bias in the compute dtype, 3 bytes a pair in bf16 on a GPU: 3 GiB at 32k tokens,
    16 x the 8k row's; padded micro-batches count none."""
    def items(*sets):
        from areal_mq.config import load_config

        plan = make_plan(load_config(ROOT / "configs" / "quickstart-gpu.yaml", list(sets)))
        return {i.name: i.nbytes for i in next(p for p in plan.processes if p.role == "trainer rank").items}

    long, short = items("trainer.max_tokens_per_mb=32768"), items("trainer.max_tokens_per_mb=8192")
    assert long["attention mask (L x L)"] == 32768 ** 2 * 3 == 3 * 2 ** 30
    assert long["attention mask (L x L)"] == 16 * short["attention mask (L x L)"]
    assert "attention mask (L x L)" not in items("trainer.packing=padded")
    assert "attention mask (L x L)" not in items("trainer.max_tokens_per_mb=32768", "trainer.attention=varlen")
