"""build_random_model (engines/shapes.py) shared between processes: parallel rehearsals and tests draw the same toy
model into one cache directory. Two builds at once must give one whole model (built in a temporary directory and
renamed into place under a lock), never a half-written one; a directory that is not a random model is not
overwritten."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from areal_mq.engines.shapes import MARK, build_random_model

DRAW = "import sys; from areal_mq.engines.shapes import build_random_model; build_random_model(sys.argv[1], 'tiny-llama', seed=3)"


def test_two_processes_drawing_one_directory_leave_one_whole_model(tmp_path):
    dst = tmp_path / "cache" / "llama"
    procs = [subprocess.Popen([sys.executable, "-c", DRAW, str(dst)]) for _ in range(2)]
    assert [p.wait(timeout=240) for p in procs] == [0, 0]
    assert json.loads((dst / MARK).read_text())["seed"] == 3
    from safetensors.torch import load_file

    tensors = load_file(str(dst / "model.safetensors"))
    assert tensors and all(t.isfinite().all() for t in tensors.values())
    assert sorted(p.name for p in dst.parent.iterdir() if not p.name.startswith(".llama.lock")) == ["llama"]


def test_a_new_draw_replaces_an_earlier_one_but_never_a_foreign_directory(tmp_path):
    dst = build_random_model(tmp_path / "m", "tiny-llama", seed=1)
    assert json.loads((build_random_model(dst, "tiny-llama", seed=2) / MARK).read_text())["seed"] == 2
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not overwritten"):
        build_random_model(foreign, "tiny-llama")
    assert (foreign / "notes.txt").read_text() == "keep" and len(list(tmp_path.glob(".mine.tmp-*"))) == 0
