"""`areal-mq plan` of a layout written with trainer.parallel's degrees (issue 61 item 6): Qwen2.5-72B as dp_shard 8 x
tp 4 on 32 x 80 GB fits, each rank counted with the tp / cp division (areal_mq/launch/plan.py trainer_rank, by
areal_mq/algorithms/parallel.py ParallelDims), where the same model sharded over 8 ranks alone is refused.
The layout is written here, not shipped in configs/: every shipped config is run in CI (STYLE 21), and the trainer
does not run tp yet. The model config is Qwen2.5-72B's public shape, saved locally: nothing is downloaded or loaded."""
from __future__ import annotations

from pathlib import Path

import pytest

from areal_mq.config import config_from_dict
from areal_mq.launch.plan import GIB, make_plan


def _qwen72b(tmp_path: Path) -> Path:
    from areal_mq.engines.shapes import hf_config

    out = tmp_path / "qwen2.5-72b"  # Qwen2.5-72B's config.json: the 32B's family, these widths
    hf_config("qwen2.5-32b", hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
              num_key_value_heads=8).save_pretrained(str(out))
    return out


def _layout(model: Path, parallel: dict, ranks: int, **trainer) -> dict:
    """32 trainer GPUs of 80 GB in bf16, gradient checkpointing, 8k tokens a micro-batch; no engine planned here
    (rollout.engine.kind sim: the trainer's ranks are the question)."""
    return {"model": {"name": str(model), "device": "cuda", "dtype": "bfloat16"},
            "rollout": {"engine": {"kind": "sim"}},
            "trainer": {"parallel": parallel, "gradient_checkpointing": True, "max_tokens_per_mb": 8192,
                        "publish_mode": "zmq", **trainer},
            "launcher": {"trainer_ranks": ranks}}


def _items(plan) -> dict[str, float]:
    return {i.name: i.nbytes for i in plan.processes[0].items}


def test_qwen2_5_72b_as_dp_shard_8_x_tp_4_fits_32_gpus_of_80_gb(tmp_path):
    model = _qwen72b(tmp_path)
    plan = make_plan(config_from_dict(_layout(model, {"dp_shard": 8, "tp": 4}, 32)), device_gib=80)
    rank, s = plan.processes[0], plan.shape
    assert 72e9 < s.params < 73.5e9 and s.layers == 80
    assert not plan.refusals, plan.table()
    assert rank.count == 32 and rank.layout == "fsdp over 8 x tp 4" and "fsdp over 8 x tp 4" in plan.table()
    items, layers = _items(plan), s.layers * s.layer_params
    # the decoder layers' 16 bytes a parameter over dp_shard x tp; the embeddings, head and norm over dp_shard only
    assert items["weights+grads+AdamW"] == pytest.approx(16 * (layers / 32 + (s.params - layers) / 8))
    assert items["gathered layer"] == pytest.approx(2 * 2 * s.layer_params / 4)  # bf16, two layers, a tp shard
    assert items["activations"] == pytest.approx(8192 * 80 * 8192 * 2 / 4)  # checkpointed: H a token, / tp
    assert rank.nbytes < 60 * GIB and rank.load["device"] < 4 * s.params / 16  # its fp32 shard while it loads


def test_the_same_72b_over_8_ranks_alone_is_refused_and_cp_divides_the_activations(tmp_path):
    model = _qwen72b(tmp_path)
    flat = make_plan(config_from_dict(_layout(model, {"dp_shard": 8}, 8)), device_gib=80)
    assert flat.refusals and "a trainer rank needs" in flat.refusals[0], flat.table()
    cfg = _layout(model, {"dp_shard": 8, "tp": 2, "cp": 2}, 32, gradient_checkpointing=False)
    cp = make_plan(config_from_dict(cfg), device_gib=80)
    tp4 = make_plan(config_from_dict({**cfg, "trainer": {**cfg["trainer"], "parallel": {"dp_shard": 8, "tp": 4}}}),
                    device_gib=80)
    assert cp.processes[0].layout == "fsdp over 8 x tp 2 x cp 2"
    assert _items(cp)["activations"] == pytest.approx(_items(tp4)["activations"])  # tp x cp = 4 either way
    assert _items(cp)["weights+grads+AdamW"] > _items(tp4)["weights+grads+AdamW"]  # cp does not split parameters


def test_the_degrees_that_do_not_fill_the_ranks_are_refused_where_the_config_is_read(tmp_path):
    from areal_mq.errors import ConfigError

    with pytest.raises(ConfigError, match="multiplies to 32 ranks, and the trainer has 16"):
        config_from_dict(_layout(_qwen72b(tmp_path), {"dp_shard": 8, "tp": 4}, 16))
