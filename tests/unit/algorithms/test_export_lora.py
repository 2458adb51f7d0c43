"""`areal-mq checkpoint export` of a LoRA checkpoint (areal_mq/algorithms/export_lora.py) the real trainer wrote on
the tiny Llama (rank 4, alpha 8, two steps): merged weights streamed from the checked base (fp32: exactly
weights/adapter.py's merge of the base; bf16: those rounded once, with the trainer's greedy tokens), a PEFT adapter
directory that PeftModel loads with the trainer's logits, and the refusals (a missing or different base, --adapter
on a full checkpoint) that exit 2 and write nothing."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("peft")

from typer.testing import CliRunner  # noqa: E402

from areal_mq.algorithms.export import export_model  # noqa: E402
from areal_mq.cli import app  # noqa: E402
from areal_mq.errors import ExportError  # noqa: E402

PROMPT = [1, 306, 4658, 278, 6593, 310, 2834, 338]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir):
    """(LoRA checkpoint, the trainer's PEFT policy, its adapter tensors in fp32, a full checkpoint)."""
    from accelerate.state import AcceleratorState

    from areal_mq.algorithms.checkpoint import save_checkpoint
    from areal_mq.algorithms.config import LoraConfig, TrainerConfig
    from areal_mq.algorithms.trainer import Trainer
    from tests.unit.algorithms.batches import make_samples

    root = tmp_path_factory.mktemp("export_lora")
    trainer = Trainer(TrainerConfig(lr=1e-2, max_tokens_per_mb=64, seed=7, grad_clip=None, precision="fp32",
                                    lora=LoraConfig(rank=4, alpha=8.0)), tiny_model_dir)
    for i in range(2):
        trainer.train_step(make_samples(i, version=i, staleness=0))
    ckpt = save_checkpoint(trainer, root / "lora")
    adapter = trainer.publish_tensors("float32")
    policy = trainer.unwrapped.eval()
    AcceleratorState._reset_state(reset_partial_state=True)
    full = save_checkpoint(Trainer(TrainerConfig(seed=7, precision="fp32"), tiny_model_dir), root / "full")
    AcceleratorState._reset_state(reset_partial_state=True)
    return ckpt, policy, adapter, full


def _greedy(model, n: int = 12) -> list[int]:
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              min_new_tokens=n)[0, len(PROMPT):].tolist()


def _merged_reference(base_dir, adapter, dtype):
    """The base with weights/adapter.py's merge in fp32, then cast to `dtype`."""
    from transformers import AutoModelForCausalLM

    from areal_mq.weights.adapter import merge

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, local_files_only=True)
    state = model.state_dict()
    model.load_state_dict({**state, **merge(state, adapter, 8.0 / 4)})
    return model.to(dtype).eval()


def test_the_merged_fp32_export_is_the_merge_of_the_base_and_bf16_keeps_the_greedy_tokens(trained, tiny_model_dir,
                                                                                          tmp_path):
    from transformers import AutoModelForCausalLM

    ckpt, policy, adapter, _ = trained
    done = export_model(ckpt, tmp_path / "f32", dtype="float32", max_shard_size="1MB")
    assert done.source == "lora" and len(done.files) >= 2
    assert (tmp_path / "f32" / "model.safetensors.index.json").is_file()
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        assert (tmp_path / "f32" / name).is_file(), name
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "f32"), local_files_only=True).eval()
    want = _merged_reference(tiny_model_dir, adapter, torch.float32)
    got, ref = exported.state_dict(), want.state_dict()
    assert got.keys() == ref.keys()
    for name, tensor in ref.items():
        assert torch.equal(got[name], tensor), name
    changed = [n for n in ref if "proj" in n]
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), local_files_only=True).state_dict()
    assert changed and all(not torch.equal(got[n], base[n]) for n in changed)  # every adapted module merged
    assert _greedy(exported) == _greedy(policy)  # the trainer's PEFT policy

    export_model(ckpt, tmp_path / "bf16", max_shard_size="1MB")  # bf16 by default
    bf16 = AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"), local_files_only=True).eval()
    assert bf16.dtype == torch.bfloat16
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for name, tensor in ref.items():  # rounded once, from the fp32 merge
        assert torch.equal(bf16.state_dict()[name], tensor.to(torch.bfloat16)), name
    assert _greedy(bf16) == _greedy(_merged_reference(tiny_model_dir, adapter, torch.bfloat16))


def test_the_adapter_export_loads_in_peft_with_the_trainers_logits(trained, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ckpt, policy, _, _ = trained
    out = tmp_path / "adapter"
    result = CliRunner().invoke(app, ["checkpoint", "export", str(ckpt.parent), str(out), "--adapter"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(tiny_model_dir.resolve())
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), local_files_only=True)
    loaded = PeftModel.from_pretrained(base, str(out)).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, policy(input_ids=ids).logits, rtol=0, atol=0)


def test_a_missing_or_other_base_and_adapter_on_full_weights_are_refused(trained, tiny_model_dir, tmp_path):
    ckpt, _, _, full = trained
    runner = CliRunner()

    def refused(src, *flags, match):
        out = tmp_path / "out"
        result = runner.invoke(app, ["checkpoint", "export", str(src), str(out), *flags])
        assert result.exit_code == 2, result.output
        assert len(result.output.strip().splitlines()) == 1 and match in result.output, result.output
        assert not out.exists() and not list(tmp_path.glob(".out*"))

    refused(full, "--adapter", match="holds no LoRA adapter")
    refused(full, "--base", str(tiny_model_dir), match="holds full weights")
    moved = tmp_path / "moved"
    shutil.copytree(ckpt, moved)
    (moved / "base_model.json").write_text(json.dumps({**json.loads((ckpt / "base_model.json").read_text()),
                                                       "path": str(tmp_path / "gone")}))
    for flags in ((), ("--adapter",)):
        refused(moved, *flags, match="base model of LoRA checkpoint")
    other = tmp_path / "other_base"  # the same config with other weights
    shutil.copytree(tiny_model_dir, other)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(other / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    saved = json.loads((ckpt / "base_model.json").read_text())["sha256"]
    for flags in (("--base", str(other)), ("--base", str(other), "--adapter")):
        refused(moved, *flags, match=saved)
    with pytest.raises(ExportError, match=f"{other}.*has sha256"):
        export_model(moved, tmp_path / "out", base=other)
    # the same base copied elsewhere: --base overrides the moved path, still checked
    same = tmp_path / "same_base"
    shutil.copytree(tiny_model_dir, same)
    assert export_model(moved, tmp_path / "ok", base=same).source == "lora"
