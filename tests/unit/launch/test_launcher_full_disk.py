"""The launcher keeps supervising when it cannot write its own event line (issue 40: under the soak's disk_full
fault a child died, the launcher's `launcher.child_restarted` line met ENOSPC, and the launcher itself exited)."""
from __future__ import annotations

from areal_mq.config import load_config
from areal_mq.launch.launcher import Launcher


def test_an_event_line_the_disk_cannot_take_is_dropped_not_raised(tmp_path):
    launcher = Launcher(load_config(None, [f"run.run_dir={tmp_path}"]))
    blocked = tmp_path / "events" / "launcher.jsonl"
    blocked.mkdir(parents=True)  # opening it for append raises OSError (IsADirectoryError), as ENOSPC would
    launcher.event("launcher.child_restarted", child="controller")  # nothing raised
    blocked.rmdir()
    launcher.event("launcher.child_restarted", child="broker")
    assert '"child": "broker"' in blocked.read_text() and "controller" not in blocked.read_text()
