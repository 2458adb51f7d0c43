"""Parameters counted from config.json alone (engines/shapes.py count_parameters, what `plan` and the launcher's
memory check read) equal the meta-device model's, total and per decoder layer, for every shape we ship and the
variants a config may set (biases, a missing head_dim, untied embeddings); an unknown family is left to the meta
device."""
from __future__ import annotations

import json

import pytest

from areal_mq.engines.shapes import SHAPES, TINY, count_parameters, hf_config, shape

VARIANTS = [(name, {}) for name in {**SHAPES, **TINY}] + [
    ("tiny-llama", {"attention_bias": True}), ("tiny-llama", {"mlp_bias": True, "tie_word_embeddings": False}),
    ("tiny-qwen3", {"attention_bias": True}), ("tiny-qwen2", {"head_dim": None}),
    ("tiny-llama", {"model_type": "mistral", "head_dim": None}),
]


def meta_count(fields: dict) -> tuple[int, int]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in fields.items() if v is not None}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.model.layers[0].parameters())


@pytest.mark.parametrize("name,overrides", VARIANTS, ids=[f"{n}{'-' + '-'.join(o) if o else ''}" for n, o in VARIANTS])
def test_counted_equals_the_meta_model(name, overrides):
    fields = shape(name, **overrides)
    raw = json.loads(json.dumps({k: v for k, v in fields.items() if v is not None}))  # as config.json has them
    assert count_parameters(raw) == meta_count(fields)


def test_a_family_it_does_not_know_or_a_missing_field_is_left_to_the_meta_device():
    assert count_parameters({**shape("tiny-llama"), "model_type": "gemma2"}) is None
    for missing in ("intermediate_size", "num_key_value_heads"):  # Qwen2's default kv heads is 32, not the heads
        fields = shape("tiny-qwen2")
        del fields[missing]
        assert count_parameters(fields) is None, missing
    assert count_parameters(shape("tiny-qwen2")) is not None and hf_config("tiny-qwen2") is not None


def test_plan_reads_the_shape_without_importing_torch(tmp_path):
    """The launcher's memory check (launch/job.py check_memory -> plan.read_shape) must not import torch: in a
    fresh interpreter, reading a Qwen2.5-7B-shaped config.json leaves torch and transformers unimported."""
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps(shape("qwen2.5-7b")))
    code = ("import sys; from areal_mq.launch.plan import read_shape; s = read_shape(sys.argv[1]); "
            "print(s.params, 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    params, torch_in, hf_in = out.stdout.split()
    assert int(params) == count_parameters(shape("qwen2.5-7b"))[0] and torch_in == hf_in == "False"
