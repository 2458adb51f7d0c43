"""The rehearsal's toy config (areal_mq/launch/toy.py: same family, same layout, toy sizes, data samples) and its
view of the processes (areal_mq/launch/rehearsal.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from areal_mq.config import load_config
from areal_mq.errors import ConfigError
from areal_mq.launch.rehearsal import role_processes
from areal_mq.launch.toy import toy_config

ROOT = Path(__file__).resolve().parents[3]


def toy(tmp_path, name, *overrides, steps=4):
    cfg = load_config(ROOT / "configs" / name, list(overrides))
    return cfg, toy_config(cfg, steps, tmp_path / "run-rehearsal", tmp_path / "cache")


def model_config(toy_result) -> dict:
    return json.loads((Path(toy_result.cfg.model.name) / "config.json").read_text())


def test_the_7b_layout_keeps_its_processes_placement_and_family_at_toy_size(tmp_path):
    cfg, t = toy(tmp_path, "qwen2.5-7b-2nodes.yaml")
    c = t.cfg
    conf = model_config(t)
    assert conf["model_type"] == "qwen2" and conf["tie_word_embeddings"] is False  # Qwen2.5-7B: untied head
    assert conf["num_hidden_layers"] == 2 and conf["hidden_size"] == 64
    assert (c.launcher.trainer_ranks, c.launcher.rollout_workers, c.launcher.reward_workers) == (8, 8, 4)
    assert c.launcher.backend == "ray" and c.launcher.on_child_death == "restart"
    assert c.placement.rollout.gpus_per_process == 1 and c.trainer.strategy == "fsdp"
    assert c.trainer.publish_mode == "zmq" and c.trainer.gradient_checkpointing
    assert c.model.device == "cpu" and c.model.dtype == cfg.model.dtype
    assert c.controller.total_steps == 4 and c.controller.max_new_tokens <= 16 and c.trainer.checkpoint_every == 1
    assert c.rollout.engine.kv_cache_bytes is None and c.rollout.engine.max_concurrent <= 8
    assert c.run.run_dir == str(tmp_path / "run-rehearsal")
    assert "math sample" in " ".join(t.data["replaced"])  # /data/math/... is not on this machine
    assert Path(c.data.name).is_file() and Path(c.data.eval_name).is_file()


def test_a_tied_family_stays_tied_and_gpu_indices_stay_pretend_devices(tmp_path):
    _, t = toy(tmp_path, "qwen2.5-1.5b-node.yaml")
    assert model_config(t)["tie_word_embeddings"] is True  # Qwen2.5-1.5B ties its head
    c = t.cfg
    assert c.placement.trainer.gpus == [0, 1, 2, 3] and c.placement.visible("rollout", 2, c.launcher) == "6"
    assert c.eval.every == 2 and c.eval.size <= 4  # a periodic evaluation inside 4 steps
    assert c.launcher.threads["trainer"] == 1


def test_the_configs_own_data_is_kept_where_it_exists(tmp_path):
    from areal_mq.data.samples import SAMPLES

    train, test = SAMPLES["gsm8k"]
    _, t = toy(tmp_path, "qwen2.5-1.5b-node.yaml", f"data.name={train}", f"data.eval_name={test}")
    assert t.cfg.data.name == train and t.data == {"source": "the config's own files"}


def test_a_model_of_unknown_family_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="model.name.*public shape"):
        toy(tmp_path, "tiny.yaml", "model.name=/nowhere/Mistral-7B")


def test_role_processes_reads_role_rank_and_devices_from_proc(tmp_path):
    """What the rehearsal checks each process against: its own /proc entry (role, RANK, CUDA_VISIBLE_DEVICES).
    A stand-in process with the cmdline shape of a role process (it imports nothing of ours)."""
    config = tmp_path / "config.yaml"
    config.write_text("{}")
    script = "import time; time.sleep(30)"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "5", "RANK": "3"}
    proc = subprocess.Popen([sys.executable, "-c", script, "areal_mq.cli", "worker", "rollout", "--config", str(config)],
                            env=env)
    try:
        deadline = time.monotonic() + 10
        while not (found := role_processes(config)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert found == [{"pid": proc.pid, "role": "rollout", "rank": 3, "cuda_visible_devices": "5"}]
    finally:
        proc.kill()
        proc.wait()


def test_the_toy_says_which_admission_knobs_it_changed_and_their_full_scale_values(tmp_path):
    """STYLE 23 / issue 59: the node layout's 256 rows and 40 GiB pool become a toy's 8 rows and a 4,096-token CPU
    pool; the rehearsal report says so, and its rule stays the engine's (no reservation cap appears)."""
    cfg, t = toy(tmp_path, "qwen2.5-1.5b-node.yaml")
    note = next(n for n in t.notes if n.startswith("rollout.engine admission at toy scale"))
    assert "max_concurrent 256 -> 8" in note and "kv_cache_bytes 42949672960 -> None" in note, note
    assert "engines/admission.py" in note
    assert t.cfg.rollout.engine.max_reserved_tokens is None


def test_the_32b_layout_keeps_eight_ranks_and_two_gpus_per_engine_and_says_how_it_runs_vllm(tmp_path):
    """Issue 59 item 5: vLLM engines of tensor parallel 2 on pretend GPUs run as torch engines on this CPU (vLLM's
    CPU backend cannot span them), with their placement and a note saying so; or, without vLLM, the torch engine."""
    cfg, t = toy(tmp_path, "qwen2.5-32b-2nodes.yaml")
    c = t.cfg
    assert cfg.rollout.engine.kind == "vllm" and cfg.rollout.engine.vllm.tensor_parallel_size == 2
    assert (c.launcher.trainer_ranks, c.launcher.rollout_workers) == (8, 4) and c.launcher.backend == "ray"
    assert c.placement.rollout.gpus_per_process == 2 and c.rollout.engine.kind == "torch"
    assert any("vLLM" in n and "torch engine" in n for n in t.notes), t.notes


def test_the_72b_tp_layout_keeps_its_tp_group_on_eight_ranks_and_a_kv_head_per_tp_rank(tmp_path):
    """32 toy ranks would not fit a CI machine: the toy keeps tp 4 and fewer dp_shard ranks, says so, and builds a
    toy model whose KV heads tp divides (the tiny family has 2)."""
    cfg, t = toy(tmp_path, "qwen2.5-72b-tp.yaml")
    p = t.cfg.trainer.parallel
    assert (cfg.launcher.trainer_ranks, cfg.trainer.parallel.tp) == (32, 4)
    assert (t.cfg.launcher.trainer_ranks, p.dp_shard, p.tp, p.cp) == (8, 2, 4, 1)
    assert any(n.startswith("launcher.trainer_ranks 32 -> 8") for n in t.notes), t.notes
    fields = model_config(t)
    assert fields["num_key_value_heads"] % 4 == 0 and fields["num_attention_heads"] % 4 == 0 and t.model["kv_heads"] == 4


def test_the_7b_cp_layout_keeps_its_four_ranks_and_cp_2(tmp_path):
    cfg, t = toy(tmp_path, "qwen2.5-7b-32k-cp.yaml")
    p = t.cfg.trainer.parallel
    assert (t.cfg.launcher.trainer_ranks, p.dp_shard, p.cp) == (4, 2, 2) and t.cfg.trainer.attention == "varlen"
    assert not any(n.startswith("launcher.trainer_ranks") for n in t.notes), t.notes


def test_the_14b_lora_layout_keeps_its_adapter_and_four_plus_four_gpus(tmp_path):
    cfg, t = toy(tmp_path, "qwen2.5-14b-lora-node.yaml")
    c = t.cfg
    assert c.trainer.lora is not None and c.trainer.lora.rank == 64 and c.trainer.strategy == "fsdp"
    assert (c.launcher.trainer_ranks, c.launcher.rollout_workers) == (4, 4)
    assert c.placement.trainer.gpus == [0, 1, 2, 3] and c.placement.rollout.gpus == [4, 5, 6, 7]


def test_no_kill_is_an_option_of_the_rehearsal_only():
    proc = subprocess.run([sys.executable, "-m", "areal_mq.cli", "run", str(ROOT / "configs" / "tiny.yaml"), "--no-kill"],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 2 and "--no-kill is an option of --rehearse" in proc.stderr, proc.stderr[-2000:]


def test_the_dapo_overlong_buffer_keeps_its_share_of_the_toy_answers_and_says_so(tmp_path):
    """configs/quickstart-dapo.yaml punishes the last 16 of 64 tokens; the toy answers are 16 tokens, so the buffer
    becomes 4 (a buffer as long as the answers is refused), with a note naming the full-scale value; the overlong
    filter is turned off, said."""
    cfg, t = toy(tmp_path, "quickstart-dapo.yaml")
    assert cfg.controller.overlong_buffer == 16 and cfg.controller.max_new_tokens == 64
    assert t.cfg.controller.overlong_buffer == 4 and t.cfg.controller.max_new_tokens == 16
    assert any("overlong_buffer 16 -> 4" in note for note in t.notes)
    # a random model's answers all hit the cap: filtered, no step would ever train (said, like drop_uniform_groups)
    assert cfg.controller.overlong_filter and not t.cfg.controller.overlong_filter
    assert any("overlong_filter off" in note for note in t.notes)


def test_check_evals_takes_a_named_skip_of_an_evaluation_through_the_rollout_engines(tmp_path):
    """eval.via rollout may skip a due version with its reason (controller.eval_skipped: the pin was passed, or
    another evaluation was running); the rehearsal reports it as skipped instead of failing, while a version that
    is neither evaluated nor skipped still fails, and via process keeps today's rule."""
    import json

    from areal_mq.config import load_config
    from areal_mq.launch.rehearsal import check_evals

    cfg = load_config(None, ["eval.every=1", "eval.via=rollout"])
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"version": v, "n": 4, "strict": 0.5}) + "\n"
                                                 for v in (0, 1, 3)))
    (tmp_path / "events").mkdir()
    (tmp_path / "events" / "controller.jsonl").write_text(json.dumps(
        {"ts": 1.0, "event": "controller.eval_skipped", "version": 2, "reason": "the evaluation of v1 was still running"})
        + "\n")
    evals, failures = check_evals(tmp_path, cfg, 3)
    assert not failures and [e["version"] for e in evals] == [0, 1, 2, 3] and evals[2]["skipped"].startswith("the eval")
    _, failures = check_evals(tmp_path, cfg, 4)  # v4 (the final one) neither evaluated nor skipped
    assert failures and "[4]" in failures[0]["reason"]
    _, failures = check_evals(tmp_path, cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"via": "process"})}), 3)
    assert failures  # via process: a skip is not an evaluation
