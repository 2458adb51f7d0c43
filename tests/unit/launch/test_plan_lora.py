"""`areal-mq plan` under trainer.lora: the adapter counted as PEFT builds it, a 7B LoRA layout fits one 80 GB GPU of
trainer and one of engine where full fine-tuning is refused."""
from __future__ import annotations

import pytest

from areal_mq.config import load_config
from areal_mq.launch.plan import make_plan

ROOT = __import__("pathlib").Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]])
def test_adapter_parameters_are_what_peft_builds(targets):
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from areal_mq.algorithms import lora
    from areal_mq.algorithms.config import LoraConfig
    from areal_mq.engines.shapes import hf_config
    from areal_mq.launch.plan import read_shape

    cfg = LoraConfig(rank=8, target_modules=targets)
    from transformers import AutoModelForCausalLM

    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        hf_config("qwen2.5-0.5b", num_hidden_layers=2).save_pretrained(tmp)
        shape = read_shape(tmp)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config("qwen2.5-0.5b", num_hidden_layers=2))
    wrapped = lora.attach(model, cfg, torch.bfloat16)
    assert shape.adapter_params(cfg) == sum(p.numel() for p in wrapped.parameters() if p.requires_grad)


def test_a_7b_lora_layout_fits_one_trainer_gpu_and_one_engine_gpu():
    sets = ["model.name=qwen2.5-7b", "trainer.kl_coef=0.05"]
    full = make_plan(load_config(ROOT / "configs" / "quickstart-gpu.yaml", sets))
    assert full.refusals and "trainer rank" in full.refusals[0]
    plan = make_plan(load_config(ROOT / "configs" / "quickstart-gpu.yaml", sets + ["trainer.lora.rank=16"]))
    assert not plan.refusals, plan.refusals
    trainer = next(p for p in plan.processes if p.role == "trainer rank")
    items = {i.name: i.nbytes for i in trainer.items}
    assert "reference model" not in items and "weights+grads+AdamW" not in items
    assert items["frozen base"] == pytest.approx(2 * plan.shape.params)  # bf16 on a GPU
    assert items["adapter weights+grads+AdamW"] < 0.05 * items["frozen base"]


def test_under_fsdp_the_frozen_base_and_the_adapter_are_sharded():
    sets = ["model.name=qwen2.5-7b", "trainer.kl_coef=0.05", "trainer.lora.rank=16"]
    one = make_plan(load_config(ROOT / "configs" / "quickstart-gpu.yaml", sets))
    two = make_plan(load_config(ROOT / "configs" / "quickstart-gpu.yaml", sets + [
        "trainer.strategy=fsdp", "launcher.trainer_ranks=2", "trainer.publish_mode=zmq"]))
    items = [{i.name: i.nbytes for i in next(p for p in plan.processes if p.role == "trainer rank").items}
             for plan in (one, two)]
    assert items[1]["frozen base"] == pytest.approx(items[0]["frozen base"] / 2) == pytest.approx(two.shape.params)
    assert items[1]["adapter weights+grads+AdamW"] == pytest.approx(items[0]["adapter weights+grads+AdamW"] / 2)
    assert "reference model" not in items[1] and "publish staging (2 shard copies)" not in items[1]
