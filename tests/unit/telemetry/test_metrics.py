"""Metrics sinks (areal_mq/telemetry/metrics.py) with the real writers: the JSONL line format, TensorBoard event files read
back, an offline W&B run read back, a missing package refused at startup, a failing sink dropped with one warning.
The TensorBoard and W&B tests skip where those extras are not installed (CI installs only `.[test]`)."""
from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path

import pytest

from areal_mq.config import load_config
from areal_mq.errors import ConfigError
from areal_mq.telemetry.metrics import JsonlSink, MetricsSinks
from areal_mq.testing import RecordingLog

STEPS = [
    {"loss": 0.5, "reward": 0.25, "version": 1, "note": "text", "grad": float("nan"), "ids": [1, 2]},
    {"loss": 0.25, "reward": 0.5, "version": 2, "note": "text", "grad": float("inf"), "ids": [3]},
    {"loss": 0.125, "reward": 0.75, "version": 3, "note": "text", "grad": 1.5, "ids": []},
]


def config(tmp_path: Path, *overrides: str):
    return load_config(None, [f"run.run_dir={tmp_path / 'run'}", "run.name=mtest", *overrides])


def write_all(sinks: MetricsSinks) -> None:
    for step, metrics in enumerate(STEPS, start=1):
        sinks.write(step, metrics)
    sinks.close()


class Broken:
    name = "broken"

    def __init__(self):
        self.calls = 0

    def write(self, step, metrics):
        self.calls += 1
        raise OSError("disk full")

    def close(self):
        raise OSError("still full")


def test_jsonl_lines_are_json_dumps_of_the_metrics_appended(tmp_path):
    cfg = config(tmp_path)
    path = tmp_path / "run" / "metrics.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text('{"earlier": 1}\n')
    sinks = MetricsSinks.from_config(cfg, "trainer")
    assert [s.name for s in sinks.sinks] == ["jsonl"]
    write_all(sinks)
    assert path.read_text() == '{"earlier": 1}\n' + "".join(json.dumps(m) + "\n" for m in STEPS)
    write_all(MetricsSinks.from_config(cfg, "controller"))
    assert len((tmp_path / "run" / "metrics-controller.jsonl").read_text().splitlines()) == 3


def test_metrics_section_is_validated(tmp_path):
    assert config(tmp_path, "metrics.tensorboard=true").metrics.tensorboard
    with pytest.raises(ConfigError, match="did you mean 'metrics.tensorboard'"):
        config(tmp_path, "metrics.tensorbord=true")


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    write_all(MetricsSinks.from_config(config(tmp_path, "metrics.tensorboard=true"), "trainer"))
    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["trainer/grad", "trainer/loss", "trainer/reward", "trainer/version"]
    assert [(e.step, e.value) for e in acc.Scalars("trainer/loss")] == [(1, 0.5), (2, 0.25), (3, 0.125)]
    assert [(e.step, e.value) for e in acc.Scalars("trainer/version")] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert [(e.step, e.value) for e in acc.Scalars("trainer/grad")] == [(3, 1.5)]  # NaN and inf left out


def wandb_records(path: Path) -> list:
    """The records of a .wandb file: a ':W&B' header, then a LevelDB log (32 KiB blocks, 7-byte record headers)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, part = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # block trailer too short for a header: padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_ERROR_REPORTING": "false",
                        "WANDB_DISABLE_GIT": "true", "WANDB_API_KEY": ""}.items():
        monkeypatch.setenv(name, value)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    yield wandb
    wandb.teardown()  # stop the wandb-core process this test started


def test_wandb_offline_run_read_back(tmp_path, offline_wandb):
    write_all(MetricsSinks.from_config(config(tmp_path, "metrics.wandb=true", "metrics.wandb_project=p1"), "trainer"))
    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 30
    while True:  # wandb-core may still be writing the file after finish() returns, on a loaded machine
        records = wandb_records(run_file)
        runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        if runs and any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    (run,) = runs
    assert (run.project, run.display_name, run.run_group, run.job_type) == ("p1", "mtest-trainer", "mtest", "trainer")
    assert json.loads({u.key: u.value_json for u in run.config.update}["metrics"])["wandb_project"] == "p1"
    history = [(r.history.step.num, {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
               for r in records if r.WhichOneof("record_type") == "history"]
    assert [step for step, _ in history] == [1, 2, 3]
    assert [items["trainer/loss"] for _, items in history] == [0.5, 0.25, 0.125]
    assert "trainer/grad" not in history[0][1] and history[2][1]["trainer/grad"] == 1.5
    assert not any("trainer/note" in items for _, items in history)


@pytest.mark.parametrize("key", ["tensorboard", "wandb"])
def test_missing_package_is_a_config_error_naming_the_extra(tmp_path, monkeypatch, key):
    monkeypatch.setitem(sys.modules, key, None)  # `import key` now raises ImportError, as when not installed
    with pytest.raises(ConfigError, match=rf"metrics\.{key} is true .*pip install 'areal-mq\[{key}\]'"):
        MetricsSinks.from_config(config(tmp_path, f"metrics.{key}=true"), "trainer")


def test_a_failing_sink_is_dropped_with_one_warning_and_the_others_go_on(tmp_path):
    log, broken = RecordingLog(), Broken()
    sinks = MetricsSinks([broken, JsonlSink(tmp_path / "m.jsonl")], "trainer", log)
    for step, metrics in enumerate(STEPS, start=1):
        sinks.write(step, metrics)
    assert broken.calls == 1 and [s.name for s in sinks.sinks] == ["jsonl"]
    sinks.close()
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 3
    assert log.at("warning") == [("metrics.sink_disabled",
                             {"sink": "broken", "during": "write", "error": "OSError: disk full"})]
    broken_at_close = MetricsSinks([Broken()], "trainer", log)
    broken_at_close.sinks[0].write = lambda step, metrics: None
    broken_at_close.close()
    broken_at_close.close()
    assert log.at("warning")[1:] == [("metrics.sink_disabled",
                                 {"sink": "broken", "during": "close", "error": "OSError: still full"})]


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_wandb_mode_comes_from_the_config(tmp_path, mode):
    """metrics.wandb_mode reaches wandb.init (a GPU user watches live); the W&B module is passed in, as the sink
    takes it, so this runs where wandb is not installed."""
    from types import SimpleNamespace

    from areal_mq.telemetry.metrics import WandbSink

    calls = []
    fake = SimpleNamespace(init=lambda **kw: calls.append(kw) or SimpleNamespace(), Settings=lambda **kw: kw)
    WandbSink(fake, config(tmp_path, "metrics.wandb=true", f"metrics.wandb_mode={mode}"), "trainer")
    assert calls[0]["mode"] == mode and calls[0]["project"] == "areal-mq"
    with pytest.raises(ConfigError, match="wandb_mode"):
        config(tmp_path, "metrics.wandb_mode=live")
