"""benchmarks/gpu/fit_sim.py on small synthetic stage JSON: the fitted slot reproduces the figures it was fitted
on, loads through areal_mq/sim/timing.py, and bad input says which file and field are wrong."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from areal_mq.errors import ConfigError
from areal_mq.sim.timing import load_measured

ROOT = Path(__file__).resolve().parents[3]
H100 = "cuda:0 (NVIDIA H100 80GB HBM3)"


def fit_sim():
    spec = importlib.util.spec_from_file_location("fit_sim", ROOT / "benchmarks" / "gpu" / "fit_sim.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stages(device: str = H100) -> tuple[dict, dict, dict]:
    """Figures on exact lines: step = 4 ms + 2e-8 s x batch x context; train = 0.5 s + 10 us x tokens."""
    machine = {"device": device, "torch": "2.11"}
    sweep = [{"batch": b, "context": c, "step_s": 0.004 + 2e-8 * b * c, "prefill_tokens": b * c, "prefill_s": 1.0}
             for b in (1, 8, 64, 256) for c in (256, 1024)]
    b = {"stage": "b", "machine": machine, "decode_sweep": sweep, "prefill_tokens_per_s": 50_000.0,
         "model": {"name": "smollm2-135m", "weights": "random", "kv_bytes_per_token": 23040.0, "weight_bytes": 2.7e8}}
    c = {"stage": "c", "machine": machine, "precision": "bf16",
         "train_scaling": [{"tokens": t, "step_s": 0.5 + 1e-5 * t} for t in (4096, 8192, 16384)]}
    d = {"stage": "d", "machine": machine, "updates": [
        {"mode": "disk", "engine_pause_s": 0.31}, {"mode": "zmq", "engine_pause_s": 0.12},
        {"mode": "cuda_ipc", "todo": "cuda_ipc: not built"}]}
    return b, c, d


def write(tmp_path: Path, reports) -> list[str]:
    paths = []
    for name, report in zip("bcd", reports):
        path = tmp_path / f"stage_{name}.json"
        path.write_text(json.dumps(report))
        paths.append(str(path))
    return paths


def test_fit_reproduces_the_measured_lines_and_loads_into_the_slot(tmp_path):
    out = tmp_path / "sim_timing.json"
    assert fit_sim().main([*write(tmp_path, stages()), "--out", str(out)]) == 0
    model = load_measured(out)
    assert model.name == "smollm2-135m-h100-measured"
    assert "smollm2-135m" in model.source and "H100" in model.source and "zmq" in model.source
    for batch, context in ((1, 256), (64, 1024), (256, 1024), (32, 512)):
        assert model.decode_step_s(batch, context) == pytest.approx(0.004 + 2e-8 * batch * context, rel=1e-6)
    assert model.prefill_s(1000) == pytest.approx(0.02)
    assert model.update_pause_s == pytest.approx(0.12)  # the fastest measured mode; the TODO row is skipped
    assert model.train_step_s(10_000, devices=1) == pytest.approx(0.6, rel=1e-6)


def test_missing_stage_field_names_the_file_and_the_stage(tmp_path, capsys):
    b, c, d = stages()
    del c["train_scaling"]
    paths = write(tmp_path, (b, c, d))
    assert fit_sim().main([*paths, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "stage_c.json" in err and "train_scaling" in err and "run.sh c" in err
    assert not (tmp_path / "x.json").exists()


def test_no_measured_update_and_too_few_sweep_points_are_refused(tmp_path, capsys):
    b, c, d = stages()
    d["updates"] = [{"mode": "cuda_ipc", "todo": "not built"}]
    assert fit_sim().main(write(tmp_path, (b, c, d))) == 2
    assert "engine_pause_s" in capsys.readouterr().err
    b["decode_sweep"] = b["decode_sweep"][:1]
    assert fit_sim().main(write(tmp_path, (b, c, stages()[2]))) == 2
    assert "decode_sweep" in capsys.readouterr().err


def test_install_refuses_a_fit_not_measured_on_an_h100(tmp_path, capsys):
    assert fit_sim().main([*write(tmp_path, stages(device="cpu")), "--install"]) == 2
    assert "not an H100" in capsys.readouterr().err


def test_load_measured_absent_is_none_and_bad_is_a_config_error(tmp_path):
    assert load_measured(tmp_path / "absent.json") is None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ConfigError, match="fit_sim.py"):
        load_measured(bad)
