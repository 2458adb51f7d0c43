"""Live progress of a local run: step, version, reward, staleness, throughput, ETA (rich).

Reads the files the processes write (run_dir/metrics.jsonl from the trainer, controller.stats events),
so the display costs the workers nothing and works the same when replaying a finished run.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from areal_mq.telemetry.tail import read_new_lines


class RunView:
    """Incremental reader of a run directory's metrics and controller events."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self._offsets: dict[Path, int] = {}
        self.metrics: list[dict] = []
        self.controller: dict = {}
        self.evals: list[dict] = []

    def _new_lines(self, path: Path) -> list[dict]:
        return read_new_lines(path, self._offsets)

    def refresh(self) -> None:
        self.metrics.extend(self._new_lines(self.run_dir / "metrics.jsonl"))
        self.evals.extend(self._new_lines(self.run_dir / "eval.jsonl"))
        for path in sorted((self.run_dir / "events").glob("controller*.jsonl")):
            for rec in self._new_lines(path):
                if rec.get("event") == "controller.stats":
                    self.controller = rec


def render(view: RunView, total_steps: int, started: float) -> Any:
    from rich.table import Table

    m = view.metrics[-1] if view.metrics else {}
    c = view.controller
    step = int(m.get("version", 0))
    elapsed = time.time() - started
    eta = (elapsed / step) * (total_steps - step) if step else None
    acc = view.evals[-1] if view.evals else None
    table = Table(title="areal-mq", show_header=True, header_style="bold")
    for col in ("step", "reward", "held-out (strict/lenient)", "staleness mean/max", "gen tok/s", "train tok/s",
                "groups stored", "elapsed", "ETA"):
        table.add_column(col)
    table.add_row(
        f"{step}/{total_steps}",
        _fmt(m.get("reward_mean")),
        f"{acc['strict']:.0%} / {acc['lenient']:.0%} @v{acc.get('version', 0)}" if acc else "-",
        f"{_fmt(m.get('staleness_mean'))} / {m.get('staleness_max', '-')}",
        _fmt(c.get("gen_tokens_per_s"), 1),
        _fmt(m.get("tokens_per_s"), 1),
        str(c.get("stored", "-")),
        f"{elapsed / 60:.1f} min",
        f"{eta / 60:.1f} min" if eta is not None else "-",
    )
    return table


def _fmt(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def live_progress(launcher: Any, console: Any, quiet: bool = False, poll_s: float = 1.0) -> str:
    """Supervise the launcher's children while showing progress; returns 'done' or 'failed'. Each tick refreshes the
    view every `poll_s` and ends early when a child exits (Launcher.wait_for_exit)."""
    from rich.live import Live

    view = RunView(Path(launcher.cfg.run.run_dir))
    started = time.time()
    total = launcher.cfg.controller.total_steps
    if quiet or not console.is_terminal:
        last = -1
        while (state := launcher.check_children()) is None:
            view.refresh()
            step = int(view.metrics[-1].get("version", 0)) if view.metrics else 0
            if step != last:
                last = step
                m = view.metrics[-1] if view.metrics else {}
                console.print(f"step {step}/{total} reward {_fmt(m.get('reward_mean'))} "
                              f"staleness {_fmt(m.get('staleness_mean'))} elapsed {(time.time() - started) / 60:.1f} min")
            launcher.wait_for_exit(poll_s)
        return state
    with Live(render(view, total, started), console=console, refresh_per_second=2) as live:
        while (state := launcher.check_children()) is None:
            view.refresh()
            live.update(render(view, total, started))
            launcher.wait_for_exit(poll_s)
        view.refresh()
        live.update(render(view, total, started))
    return state
