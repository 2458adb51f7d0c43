"""`areal-mq checkpoint export` (areal_mq/algorithms/export.py) on checkpoints the real trainer wrote: tiny Llama
(tied embeddings) and tiny Qwen2 (q/k/v biases, untied lm_head), one training step each, exported as bf16 shards
with an index that transformers and the torch engine load and whose greedy tokens are the trainer's weights' in
bf16; fp32 exports are the trainer's weights exactly; an fsdp-layout (torch.distributed.checkpoint) checkpoint
exports the same tensors; bad input is refused before anything is written and a cut export leaves nothing.
The 2-rank fsdp checkpoint is tests/integration/test_export_fsdp.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from areal_mq.algorithms.export import export_model
from areal_mq.errors import ExportError

FAMILIES = ("tiny-llama", "tiny-qwen2")
SHARD = "1MB"  # the tiny models' embeddings (49152 x 64) are 6.3 MB in bf16: >= 2 files each
PROMPT = [1, 306, 4658, 278, 6593, 310, 2834, 338]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """family -> (checkpoint dir, the trainer's fp32 state dict after one step, model dir)."""
    from accelerate.state import AcceleratorState

    from areal_mq.algorithms.checkpoint import save_checkpoint
    from areal_mq.algorithms.config import TrainerConfig
    from areal_mq.algorithms.trainer import Trainer
    from areal_mq.engines.shapes import build_random_model
    from tests.unit.algorithms.batches import make_samples

    root = tmp_path_factory.mktemp("export")
    out = {}
    for fam in FAMILIES:
        model_dir = build_random_model(root / "models" / fam, fam, seed=5)
        trainer = Trainer(TrainerConfig(lr=1e-2, max_tokens_per_mb=64, seed=3), model_dir, device="cpu")
        trainer.train_step(make_samples(4, version=0, staleness=0))
        ckpt = save_checkpoint(trainer, root / "ckpt" / fam)
        state = {k: v.detach().clone() for k, v in trainer.unwrapped.state_dict().items()}
        out[fam] = (ckpt, state, model_dir)
        del trainer
        AcceleratorState._reset_state(reset_partial_state=True)
    return out


def _greedy(model, n: int = 12) -> list[int]:
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              min_new_tokens=n)[0, len(PROMPT):].tolist()


def _reference(model_dir: Path, state: dict, dtype: torch.dtype):
    """The trainer's weights in `dtype` in a fresh model of the same config."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    return model.eval()


@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_export_loads_in_transformers_with_the_trainers_weights_and_greedy_tokens(trained, tmp_path, fam, dtype):
    from transformers import AutoModelForCausalLM

    ckpt, state, model_dir = trained[fam]
    done = export_model(ckpt, tmp_path / "out", dtype=dtype, max_shard_size=SHARD)
    out = tmp_path / "out"
    assert done.source == "safetensors" and len(done.files) >= 2
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == done.files
    assert all(f.startswith("model-") and f.endswith(f"-of-{len(done.files):05d}.safetensors") for f in done.files)
    assert index["metadata"]["total_size"] == done.total_size
    assert index["metadata"]["total_size"] == sum((out / f).stat().st_size for f in done.files) - sum(
        8 + int.from_bytes((out / f).read_bytes()[:8], "little") for f in done.files)
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == dtype
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).is_file(), name
    assert not list(tmp_path.glob(".out.export-*"))  # the temp folder was renamed into place

    exported = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True).eval()
    want = getattr(torch, dtype)
    assert exported.dtype == want  # from config.json's dtype
    got = exported.state_dict()
    for name, tensor in state.items():  # exact: a cast is deterministic (a tied lm_head comes from the embedding)
        assert torch.equal(got[name], tensor.to(want)), name
    tied = fam == "tiny-llama"
    assert ("lm_head.weight" in index["weight_map"]) != tied
    assert _greedy(exported) == _greedy(_reference(model_dir, state, want))


def test_the_torch_engine_loads_the_bf16_export(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    from areal_mq.engines.base import EngineRequest
    from areal_mq.engines.config import EngineConfig
    from areal_mq.engines.torch.engine import TorchEngine
    from areal_mq.messages import SamplingSpec

    ckpt, state, _ = trained["tiny-qwen2"]
    export_model(ckpt, tmp_path / "out", max_shard_size=SHARD)
    engine = TorchEngine(tmp_path / "out", EngineConfig(seed=0, threads=1), dtype="float32")
    try:
        engine.submit(EngineRequest("g", PROMPT, SamplingSpec(temperature=0, max_new_tokens=10, ignore_eos=True)))
        outs = []
        while engine.has_work():
            outs += engine.step()
    finally:
        engine.close()
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32, local_files_only=True)
    assert outs[-1].output_ids.tolist() == _greedy(hf.eval(), 10)


def test_an_fsdp_layout_checkpoint_exports_the_same_tensors(trained, tmp_path):
    """The `sharded/` torch.distributed.checkpoint layout of an fsdp trainer (model.lm.<name>, beside AdamW state
    that is not read), written here by one process; 2 ranks' chunks: tests/integration/test_export_fsdp.py."""
    import torch.distributed.checkpoint as dcp

    ckpt, state, _ = trained["tiny-llama"]
    fsdp = tmp_path / "step00000001"
    fsdp.mkdir()
    for f in ckpt.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy2(f, fsdp / f.name)
    meta = json.loads((fsdp / "trainer_state.json").read_text())
    (fsdp / "trainer_state.json").write_text(json.dumps({**meta, "strategy": "fsdp", "format": "dcp"}))
    model = {f"lm.{k}": v for k, v in state.items()}  # lm_head.weight too: the tied alias is held twice here
    optim = {"state": {f"lm.{k}": {"exp_avg": torch.zeros_like(v)} for k, v in state.items()}}
    dcp.save({"model": model, "optim": optim}, checkpoint_id=str(fsdp / "sharded"), no_dist=True)

    done = export_model(fsdp, tmp_path / "out", dtype="float32", max_shard_size=SHARD)
    assert done.source == "dcp" and len(done.files) >= 2
    from safetensors import safe_open

    got = {}
    for f in done.files:
        with safe_open(str(tmp_path / "out" / f), "pt") as h:
            got.update({k: h.get_tensor(k) for k in h.keys()})
    assert sorted(got) == sorted(k for k in state if k != "lm_head.weight")
    for name, tensor in got.items():
        assert torch.equal(tensor, state[name]), name


def test_bad_input_is_refused_before_anything_is_written(trained, tmp_path):
    ckpt, _, _ = trained["tiny-llama"]
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="does not exist"):
        export_model(tmp_path / "nowhere", out)
    with pytest.raises(ExportError, match="unknown export dtype 'fp8'"):
        export_model(ckpt, out, dtype="fp8")
    with pytest.raises(ExportError, match="not a size"):
        export_model(ckpt, out, max_shard_size="lots")
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty.*--force"):
        export_model(ckpt, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(ExportError, match="--force would delete it"):
        export_model(ckpt, ckpt.parent, force=True)
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ExportError, match="does not fit its config.json: missing \\['model.layers.2"):
        export_model(other, tmp_path / "out2")
    assert not (tmp_path / "out2").exists() and not list(tmp_path.glob(".out*"))
    # a checkpoints folder means its newest checkpoint; --force replaces OUT once the export is complete
    done = export_model(ckpt.parent, out, force=True, max_shard_size=SHARD)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file() and len(done.files) >= 2


def test_a_cut_export_leaves_nothing_and_keeps_the_old_output(trained, tmp_path, monkeypatch):
    from areal_mq.algorithms.export_sources import SafetensorsSource

    ckpt, _, _ = trained["tiny-qwen2"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    real, calls = SafetensorsSource.read, []

    def dies(self, name):
        calls.append(name)
        if len(calls) == 5:
            raise KeyboardInterrupt("cut")
        return real(self, name)

    monkeypatch.setattr(SafetensorsSource, "read", dies)
    with pytest.raises(KeyboardInterrupt):
        export_model(ckpt, out, force=True, max_shard_size=SHARD)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no partial folder left


def test_a_cut_checkpoint_file_is_refused(trained, tmp_path):
    ckpt, _, _ = trained["tiny-llama"]
    cut = tmp_path / "cut"
    shutil.copytree(ckpt, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ExportError, match="cut short"):
        export_model(cut, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_cli_says_one_line_and_exits_2(trained, tmp_path):
    from typer.testing import CliRunner

    from areal_mq.cli import app

    ckpt, _, _ = trained["tiny-llama"]
    bad = CliRunner().invoke(app, ["checkpoint", "export", str(ckpt), str(tmp_path / "o"), "--dtype", "int4"])
    assert bad.exit_code == 2 and bad.output.strip().splitlines() == [
        "error: unknown export dtype 'int4'; choose one of bfloat16, float32"]
    good = CliRunner().invoke(app, ["checkpoint", "export", str(ckpt), str(tmp_path / "o"), "--no-progress",
                                    "--max-shard-size", "2MB"])
    assert good.exit_code == 0 and "bfloat16" in good.output and (tmp_path / "o" / "config.json").is_file()
    helptext = CliRunner().invoke(app, ["checkpoint", "export", "--help"]).output
    assert "bfloat16" in helptext and "--max-shard-size" in helptext
