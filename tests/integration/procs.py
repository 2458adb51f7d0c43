"""Helpers for integration tests: free ports, run configs (with the run's CURVE keys), processes stopped by PID."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from areal_mq.launch.ports import quiet_ports
from areal_mq.security import Keyring, generate_keys
from areal_mq.testing import wait_for  # re-exported: integration tests import it from here or conftest


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports for a test's own sockets and processes: below the kernel's ephemeral range (never
    taken by some process's outgoing connection before the test binds it) and, under pytest-xdist, in a slice of
    that range of this worker's own (launch.ports.quiet_ports, quiet_span)."""
    return quiet_ports("127.0.0.1", n)


def run_ranks(script: str | Path, *args: str, nproc: int, timeout: float = 400) -> str:
    """Run `script ARGS...` on `nproc` ranks under torch.distributed.run (127.0.0.1, a port of this xdist worker's,
    CUDA hidden, one thread per rank, this checkout first on the path); its output. A failed rank fails the test with
    the output's tail; a hung one is killed at `timeout`."""
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_ports(1)[0]), str(script), *args]
    proc = subprocess.Popen(cmd, env=env, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, output[-4000:]
    return output


def launch_ranks(script: str | Path, mode: str, nproc: int, out: Path, timeout: float = 400) -> dict:
    """`run_ranks(script, MODE, OUT)`: a rank script's convention (test_trainer_fsdp.py and its kin), its rank 0
    writing OUT/result-MODE.json; that result."""
    import json

    run_ranks(script, mode, str(out), nproc=nproc, timeout=timeout)
    return json.loads((Path(out) / f"result-{mode}.json").read_text())


def end_process_group() -> None:
    """A rank script's last act: its process group's threads joined before exit (a 2-rank test's rank aborted with
    SIGABRT in CI when it exited with gloo's threads running; areal_mq/algorithms/trainer.py Trainer.close)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def write_config(tmp_path: Path, extra: dict | None = None, name: str = "config.yaml") -> Path:
    job, bus_in, bus_out, store = free_ports(4)
    data = {
        "run": {"name": "test", "run_dir": str(tmp_path / "run")},
        "brokers": {"job_port": job, "bus_in_port": bus_in, "bus_out_port": bus_out, "store_port": store,
                    "heartbeat_s": 0.2, "liveness": 5, "reconnect_max_s": 1.0},
        "events": {"console": "json"},
    }
    for section, values in (extra or {}).items():
        data.setdefault(section, {}).update(values)
    if not data.get("security", {}).get("insecure"):
        generate_keys(Path(data["run"]["run_dir"]) / "keys")  # what the launcher does for a run
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def keys(cfg, role: str = "observer") -> Keyring:
    """The run's key of `role` (the identity a test client speaks with)."""
    return Keyring.from_config(cfg, role)


class Procs:
    """Starts CLI processes with logs in tmp_path; stops every one of them by PID."""

    def __init__(self, tmp_path: Path):
        self.tmp_path = tmp_path
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def start(self, args: list[str], name: str, env: dict | None = None) -> subprocess.Popen:
        log = self.tmp_path / f"{name}.log"
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.Popen([sys.executable, "-m", "areal_mq.cli", *args], stdout=open(log, "wb"),
                                stderr=subprocess.STDOUT, env=full_env, stdin=subprocess.DEVNULL)
        self.procs.append((proc, log))
        return proc

    def log(self, proc: subprocess.Popen) -> str:
        for p, path in self.procs:
            if p is proc:
                return path.read_text(errors="replace")
        return ""

    def stop(self, proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        return proc.returncode

    def stop_all(self) -> None:
        for proc, _ in reversed(self.procs):
            self.stop(proc, timeout=5)


class ScriptedTrainers:
    """`python -c SCRIPT tmp_path ARGS...` trainer-like children that announce one version per stdout line
    ({"ready": WeightsReady, "sums": {name: checksum}}) and take "next"/"stop" on stdin; killed by PID at close."""

    def __init__(self, script: str, tmp_path: Path):
        self.script, self.tmp_path, self.started = script, tmp_path, []

    def __call__(self, *args) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", self.script, str(self.tmp_path), *map(str, args)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.started.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            proc.stdout.close()
            proc.stdin.close()


def next_ready(proc: subprocess.Popen):
    """The next (WeightsReady, checksums) a ScriptedTrainers child announced."""
    import json

    from areal_mq.messages import WeightsReady

    line = proc.stdout.readline()
    assert line, "the trainer process exited"
    got = json.loads(line)
    return WeightsReady.model_validate(got["ready"]), got["sums"]
