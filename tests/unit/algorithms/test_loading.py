"""Meta-device construction and sharded loading (areal_mq/algorithms/loading.py) and the strategy seam
(areal_mq/algorithms/strategy.py): what each strategy decides, and that no caller branches on its name.
The 2-rank parity of every trainer.fsdp.load way is tests/integration/test_trainer_fsdp.py (mode load)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal_mq.algorithms.config import TrainerConfig
from areal_mq.algorithms.loading import INDEX, checkpoint_files, local_box, meta_causal_lm
from areal_mq.algorithms.strategy import STRATEGIES, build_strategy
from areal_mq.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """(single-file, index + shards) copies of one tiny Qwen2 model."""
    from transformers import AutoModelForCausalLM

    from areal_mq.engines.shapes import build_random_model

    root = tmp_path_factory.mktemp("load")
    single = build_random_model(root / "single", "tiny-qwen2", seed=2)
    split = root / "split"
    AutoModelForCausalLM.from_pretrained(str(single)).save_pretrained(str(split), max_shard_size="4MB")
    return single, split


def test_both_checkpoint_layouts_list_every_tensor(tiny):
    single, split = tiny
    one, many = checkpoint_files(single), checkpoint_files(split)
    assert (split / INDEX).is_file() and len(set(many.values())) > 2
    assert set(one.values()) == {single / "model.safetensors"}
    assert one.keys() == many.keys()


def test_a_directory_without_safetensors_is_refused_with_the_knob(tmp_path):
    with pytest.raises(ConfigError, match="trainer.fsdp.load: full"):
        checkpoint_files(tmp_path)


def test_the_meta_model_allocates_nothing_and_keeps_its_real_buffers(tiny):
    lm = meta_causal_lm(tiny[0])
    assert all(p.is_meta for p in lm.parameters())
    assert all(not b.is_meta for b in lm.buffers())  # rotary frequencies come from the config, not the file
    plain = torch.ones(3, 4)
    assert local_box(plain) == ((3, 4), (0, 0))


def test_sharded_loading_at_world_1_gives_the_checkpoint_bit_for_bit(tiny):
    """In a child process (it makes a process group): meta -> fully_shard -> slices / broadcast from either layout
    equals the whole model read by from_pretrained, buffers included."""
    code = f"""
import torch
from pathlib import Path
from areal_mq.algorithms import fsdp, loading
from areal_mq.algorithms.config import FsdpConfig
from areal_mq.algorithms.policy import PolicyLogprobs
ref = loading.load_whole(Path({str(tiny[0])!r}), torch.device("cpu"))
want, bufs = ref.state_dict(), dict(ref.named_buffers())
for src in ({str(tiny[0])!r}, {str(tiny[1])!r}):
    for how in ("slices", "broadcast"):
        lm = loading.meta_causal_lm(Path(src))
        pol = fsdp.shard_policy(PolicyLogprobs(lm), FsdpConfig(), "fp32", torch.device("cpu"))
        loading.materialise(pol, lm, Path(src), torch.device("cpu"), how)
        got = fsdp.full_state_dict(lm, None, True)
        assert got and all(torch.equal(t, want[k]) for k, t in got.items()), (src, how)
        assert all(torch.equal(b, bufs[k]) for k, b in lm.named_buffers()), (src, how)
print("same")
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
                               "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and "same" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("name,precision,accelerate,autocast", [
    ("ddp", "bf16", "bf16", None), ("ddp", "fp16", "no", torch.float16), ("ddp", "fp32", "no", None),
    ("fsdp", "bf16", "no", None), ("fsdp", "fp16", "no", None)])
def test_each_strategy_owns_its_precision_setup(name, precision, accelerate, autocast):
    strategy = build_strategy(TrainerConfig(strategy=name), precision)
    assert strategy.name == name and set(STRATEGIES) == {"ddp", "fsdp"}
    assert strategy.accelerate_precision == accelerate and strategy.autocast == autocast


def test_hsdp_shard_groups_are_laid_out_one_host_each_whatever_order_the_launcher_numbered_the_ranks():
    from areal_mq.algorithms.parallel import host_order

    assert host_order(["a", "a", "b", "b"]) == [0, 1, 2, 3]  # torchrun: already consecutive
    order = host_order(["a", "b", "a", "b", "c", "c"])  # a Ray placement group may interleave them
    assert order == [0, 2, 1, 3, 4, 5] and order[0] == 0
    rows = [order[i:i + 2] for i in range(0, 6, 2)]  # replicate 3 x shard 2: each row on one host
    assert all(len({["a", "b", "a", "b", "c", "c"][r] for r in row}) == 1 for row in rows)


def test_hsdp_mesh_shape_and_who_serves():
    from areal_mq.algorithms.parallel import ParallelDims

    def dims(world, replicate):
        return ParallelDims.of(TrainerConfig(strategy="fsdp", fsdp={"replicate": replicate}), world)

    assert (dims(8, 2).dp_replicate, dims(8, 2).dp_shard) == (2, 4) and dims(4, 1).dp_shard == 4
    with pytest.raises(ConfigError, match="does not divide"):
        dims(6, 4)
    assert ParallelDims.of(TrainerConfig(strategy="ddp"), 1).publish_group(0) is None
    assert ParallelDims.of(TrainerConfig(strategy="fsdp"), 1).publish_group(0) == (0, 1)


SEAM = ("areal_mq/algorithms/trainer.py", "areal_mq/algorithms/checkpoint.py", "workers/trainer.py")
NAME_BRANCH = re.compile(r"""strategy\s*[!=]=|[!=]=\s*["'](fsdp|ddp)["']|\.name\s*[!=]=|strategy\.name\s+(not\s+)?in""")


@pytest.mark.parametrize("path", SEAM)
def test_no_caller_branches_on_the_strategy_name(path):
    text = (REPO / path).read_text()
    hits = [line for line in text.splitlines() if NAME_BRANCH.search(line)]
    assert not hits, f"{path} branches on the strategy's name (move it into the strategy): {hits}"


def test_sharded_publishing_takes_slices_and_never_imports_the_trainer():
    text = (REPO / "areal_mq/weights/sharded.py").read_text()
    assert "areal_mq.algorithms" not in text.replace("areal_mq/algorithms/", "")


def test_a_checkpoint_says_its_format_and_an_older_one_is_read_by_its_layout(tmp_path):
    import json

    from areal_mq.algorithms.checkpoint import SHARDED, STATE_JSON, checkpoint_format

    for name, state, sharded, want in (("new", {"format": "dcp"}, False, "dcp"), ("old-ddp", {}, False, "hf"),
                                       ("old-fsdp", {"strategy": "fsdp"}, True, "dcp")):
        path = tmp_path / name
        (path / SHARDED).mkdir(parents=True) if sharded else path.mkdir()
        (path / STATE_JSON).write_text(json.dumps(state))
        assert checkpoint_format(path) == want, name
    strategies = {n: build_strategy(TrainerConfig(strategy=n), "fp32").checkpoint_format for n in STRATEGIES}
    assert strategies == {"ddp": "hf", "fsdp": "dcp"}
