"""Periodic held-out evaluation during a run, each one pinned to a named published policy version.

What: every `eval.every` versions the launcher starts `areal-mq eval` in a background process on
`run_dir/weights/vN` and the result (with `version: N`) is appended to `run_dir/eval.jsonl`, where the live
display and `areal-mq plot` pick it up. The final version is evaluated by `areal-mq run` after training.
Why pinned: the trainer prunes old versions (`trainer.keep_weight_versions`), so before starting the
evaluation the version's files are hard-linked into `run_dir/eval_pins/vN` — the evaluation reads exactly the
weights of version N even if the trainer deletes weights/vN meanwhile, and it costs no copy.
Where: on the GPUs of `placement.eval`, else beside the first rollout engine (its CUDA_VISIBLE_DEVICES), never on
the launcher's first visible GPU, which a node layout gives to trainer rank 0 (`areal-mq plan` counts it there).
Why in the background, niced, with one thread: on a 2-core machine an evaluation competes with training, so
it takes what is idle and never blocks the run. At most one evaluation runs at a time; when several versions
are due it evaluates the newest and records the skipped ones in its log (`eval_pins/skipped.txt`).

    launcher = Launcher(cfg); ... launcher.evaluator = PeriodicEval.from_config(cfg, config_path)

eval.via rollout (default: process, all of the above): no process and no engine of its own. The controller sends the
held-out problems to the rollout workers as requests pinned to the due version (workers/controller_eval.py, the same
`due_versions`; GenerateRequest.pin_version), grades the answers with heldout.py's `score` and appends the line itself,
with "via": "rollout"; greedy answers equal a standalone evaluation of that version. It needs no GPU or memory beyond
the rollout engines', so it is allowed under Ray with GPUs. The cost: while the evaluation's requests run, a worker
fetches newer versions but does not apply them (workers/rollout_pins.py, bounded), so the training samples it
generates meanwhile are at the evaluated version — more staleness for them, up to the η bound, never beyond (the
sample store still drops what is too stale); and the evaluation's requests share the engines' rows with training. A
request that reaches a worker already past the version (the trainer published the next one and that worker applied
it before the request got a row) skips that version's evaluation, logged controller.eval_skipped with the reason,
never a number of other weights. The launcher only says what happened (`RolloutEvalNotes`).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from areal_mq.telemetry.tail import read_new_lines
from areal_mq.weights import disk_versions


def due_versions(published: list[int], every: int, last_step: int, done: set[int]) -> list[int]:
    """Versions that are due for evaluation: multiples of `every` that are published, not yet handled and
    before the final version (the run evaluates that one itself after training)."""
    if every <= 0:
        return []
    return sorted(v for v in published if v > 0 and v % every == 0 and v < last_step and v not in done)


def pin_version(src: Path, pins: Path) -> Path | None:
    """Hard-link (copy where links are impossible) the files of a published version into `pins/vN`;
    None if the version was pruned before it could be pinned."""
    dest = pins / src.name
    tmp = pins / f".{src.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for f in src.iterdir():
            try:
                os.link(f, tmp / f.name)
            except OSError:
                shutil.copy2(f, tmp / f.name)
    except FileNotFoundError:
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


@dataclass
class PeriodicEval:
    config_path: Path
    run_dir: Path
    every: int
    last_step: int
    threads: int = 1
    visible: str | None = None  # CUDA_VISIBLE_DEVICES of the evaluation (None: the launcher's environment)
    done: set[int] = field(default_factory=set)
    proc: subprocess.Popen | None = None
    current: int | None = None

    @classmethod
    def from_config(cls, cfg, config_path: Path) -> "PeriodicEval":
        """Versions already in run_dir/eval.jsonl (a resumed run) are not evaluated again."""
        from areal_mq.telemetry.plots import read_jsonl

        run_dir = Path(cfg.run.run_dir)
        done = {int(e["version"]) for e in read_jsonl(run_dir / "eval.jsonl") if isinstance(e.get("version"), int)}
        return cls(Path(config_path), run_dir, cfg.eval.every, cfg.controller.total_steps, done=done,
                   visible=cfg.placement.visible("eval", 0, cfg.launcher))

    @property
    def pins(self) -> Path:
        return self.run_dir / "eval_pins"

    def poll(self) -> str | None:
        """Reap a finished evaluation and start the next due one; returns a line to show the user, if any."""
        note = self._reap()
        if self.proc is not None:
            return note
        due = due_versions(disk_versions(self.run_dir / "weights"), self.every, self.last_step, self.done)
        if not due:
            return note
        version, skipped = due[-1], due[:-1]
        self.done.update(due)
        if skipped:
            self.pins.mkdir(parents=True, exist_ok=True)
            with open(self.pins / "skipped.txt", "a") as f:
                f.write(f"evaluating v{version}; skipped {skipped} (an evaluation was still running)\n")
        pinned = pin_version(self.run_dir / "weights" / f"v{version}", self.pins)
        if pinned is None:
            return f"periodic eval: v{version} was pruned before it could be pinned; skipped"
        self._start(version, pinned)
        return note or f"periodic eval: evaluating v{version} in the background (log {self._log(version)})"

    def _log(self, version: int) -> Path:
        return self.run_dir / "logs" / f"eval-v{version}.log"

    def _start(self, version: int, pinned: Path) -> None:
        cmd = [sys.executable, "-m", "areal_mq.cli", "eval", "--config", str(self.config_path), "--weights",
               str(pinned), "--version", str(version), "--append-to", str(self.run_dir), "--no-progress"]
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
        if self.visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.visible
        self._log(version).parent.mkdir(parents=True, exist_ok=True)
        with open(self._log(version), "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True, preexec_fn=lambda: os.nice(10))
        self.current = version

    def _reap(self) -> str | None:
        if self.proc is None or (code := self.proc.poll()) is None:
            return None
        version, self.proc, self.current = self.current, None, None
        shutil.rmtree(self.pins / f"v{version}", ignore_errors=True)
        if code != 0:
            return f"periodic eval of v{version} failed (exit {code}); log {self._log(version)}"
        return None

    def wait(self, timeout_s: float) -> None:
        """Let a running evaluation finish (end of the run); stop it if it takes longer than `timeout_s`."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
        self._reap()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reap()


@dataclass
class RolloutEvalNotes:
    """eval.via rollout: the launcher's evaluator. The controller evaluates (workers/controller_eval.py); this only
    turns its controller.eval_done / controller.eval_skipped events into lines for the user. Nothing to wait for or
    stop: the evaluation lives and ends with the controller."""

    run_dir: Path
    offsets: dict = field(default_factory=dict)

    def poll(self) -> str | None:
        notes = []
        for path in sorted((self.run_dir / "events").glob("controller*.jsonl")):
            for rec in read_new_lines(path, self.offsets):
                if rec.get("event") == "controller.eval_done":
                    notes.append(f"periodic eval (through the rollout engines): v{rec.get('version')} strict "
                                 f"{rec.get('strict', 0):.1%} lenient {rec.get('lenient', 0):.1%} (n={rec.get('n')}, "
                                 f"{rec.get('seconds')}s)")
                elif rec.get("event") == "controller.eval_skipped":
                    reason = str(rec.get("reason")).replace("[", "(").replace("]", ")")  # no rich markup
                    notes.append(f"periodic eval of v{rec.get('version')} skipped: {reason}")
        return "\n".join(notes) or None

    def wait(self, timeout_s: float) -> None:
        return None

    def stop(self) -> None:
        return None
