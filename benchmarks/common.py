"""Small helpers every benchmark script shares: loopback ports, process CPU time, machine description,
logging, stopping processes, the common flags (--quick, --json), the wall time, the JSON file and the table.

Imported as `import common` by the scripts of every kind (`python benchmarks/KIND/NAME.py`; each puts benchmarks/
on sys.path first). Importing it puts the kinds' folders (speed, quality, faults, baselines) on sys.path too, so a
script imports a module of another kind by its name (quality.py uses speed/e2e.py, speed/engine.py the frozen
baselines/contiguous_engine).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

KINDS = ("speed", "quality", "faults", "baselines")
for _kind in KINDS:
    if str(Path(__file__).resolve().parent / _kind) not in sys.path:
        sys.path.append(str(Path(__file__).resolve().parent / _kind))


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1, below the kernel's ephemeral range (areal_mq/launch/ports.py
    quiet_ports: a port from bind(0) can be taken by any outgoing connection before the benchmark binds it)."""
    from areal_mq.launch.ports import quiet_ports

    return quiet_ports("127.0.0.1", n)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (fields 14 and 15 of /proc/PID/stat); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        return ""


def machine(**extra) -> dict:
    """What the numbers were measured on: CPUs, CPU model, platform, Python, load average at start, plus
    whatever the benchmark adds (library versions, model, dtype)."""
    return {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform(),
            "python": platform.python_version(), **extra, "loadavg_at_start": list(os.getloadavg())}


def torch_machine(**extra) -> dict:
    """machine() with the torch version first among the extras (torch imported here, not at start-up)."""
    import torch

    return machine(torch=torch.__version__, **extra)


# ---------------------------------------------------------------- logging and processes
def logger(area: str) -> Callable[[str], None]:
    """A log(text) that prints `[AREA bench HH:MM:SS] text` to stderr (stdout is the table's)."""
    def log(text: str) -> None:
        print(f"[{area} bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    return log


def exited(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for `proc` to exit: True as soon as it has (a poll loop's sleep, ended by the event)."""
    try:
        proc.wait(timeout_s)
        return True
    except subprocess.TimeoutExpired:
        return False


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, wait_s: float = 30.0,
                 kill_wait_s: float = 5.0) -> None:
    """Send `sig` to a still-running process, wait up to `wait_s` for it to exit, then kill it."""
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(kill_wait_s)


# ---------------------------------------------------------------- command line and report
QUICK_HELP = "Reduced sizes, under a minute on 2 cores."


def arg_parser(doc: str, quick_help: str = QUICK_HELP) -> argparse.ArgumentParser:
    """A parser with the flags every benchmark accepts (--quick, --json PATH); the script adds its own."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--json", type=Path, help="Write the results here.")
    return parser


def add_device_arg(parser: argparse.ArgumentParser) -> None:
    """--device (default cpu): where a benchmark puts the model; cpu, cuda, cuda:N or auto (areal_mq/devices.py)."""
    from areal_mq.devices import check_device_spec

    def spec(text: str) -> str:
        try:
            return check_device_spec(text)
        except Exception as exc:  # ConfigError -> an argparse usage error naming the choices
            raise argparse.ArgumentTypeError(str(exc)) from exc

    parser.add_argument("--device", type=spec, default="cpu",
                        help="Where the model runs: cpu (default), cuda, cuda:N or auto (docs/gpu.md).")


def device_name(spec: str) -> str:
    """The resolved device and, on CUDA, the GPU's name, for the machine record: 'cuda:0 (NVIDIA H100 ...)'."""
    import torch

    from areal_mq.devices import resolve_device

    device = resolve_device(spec)
    return f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else str(device)


def command(script: str) -> str:
    """How this run was started, for the table's last line: `python benchmarks/KIND/SCRIPT ARGS...` (a bare script
    name is found in its kind's folder)."""
    hits = [] if "/" in script else sorted(Path(__file__).resolve().parent.glob(f"*/{script}"))
    rel = f"{hits[0].parent.name}/{script}" if len(hits) == 1 else script
    return "python " + " ".join([f"benchmarks/{rel}", *sys.argv[1:]])


def timed(run: Callable[..., dict], *args, tmp_prefix: str | None = None) -> dict:
    """The report of run(*args), with its wall time in seconds as report["wall_s"]. With tmp_prefix, run also
    gets a temporary work directory (a Path, after args), deleted afterwards."""
    started = time.monotonic()
    if tmp_prefix is None:
        report = run(*args)
    else:
        with tempfile.TemporaryDirectory(prefix=tmp_prefix) as tmp:
            report = run(*args, Path(tmp))
    report["wall_s"] = round(time.monotonic() - started, 1)
    return report


def save(report: dict, path: Path | None) -> None:
    """Write the report as JSON to path (creating its folder); nothing when path is None."""
    if path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))


def finish(report: dict, path: Path | None, table: str) -> None:
    """Save the report, print the table and then the wall time: the end of every benchmark's main()."""
    save(report, path)
    print(table)
    print(f"wall time {report['wall_s']:.1f} s")


def met(value: float, target: float, larger_is_better: bool = True) -> str:
    """"yes" when value reaches target (>= it, or < it when smaller is better), else "NO"."""
    return "yes" if (value >= target if larger_is_better else value < target) else "NO"


def align(rows: list[tuple], rule: bool = True) -> list[str]:
    """Rows of cells as left-aligned columns two spaces apart; with rule, a dashed line under the header."""
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    if rule:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def ratio_rows(report: dict) -> list[tuple[str, str, str]]:
    """A ("ratio", "value", "target") header and a row per ratio: value, `>= target  met` (or `-`)."""
    rows = [("ratio", "value", "target")]
    for name, value in report["ratios"].items():
        target = report["targets"].get(name)
        if value is None:  # not measurable in this run (said where the ratio is computed)
            rows.append((name, "n/a", "-" if target is None else f">= {target}  not measured"))
            continue
        verdict = "-" if target is None else f">= {target}  {'met' if value >= target else 'NOT met'}"
        rows.append((name, f"{value:.3f}", verdict))
    return rows
