"""The test kit: the doubles and guards our own tests use, shipped so a workflow, reward or engine author tests
their code the way we test ours (STYLE 16).

- fakes.py:   RecordingLog, FakeRuntime, InMemoryJobs (+ InMemoryLink), InMemoryStore, ManualClock
- scripted.py: ScriptedModel, a workflow backend answering turns from a script (docs/workflows.md)
- waits.py:   wait_for(predicate, timeout): wait on a condition, never a fixed sleep
- device_guard.py: DeviceGuard (imports torch: import it from its module)
The job broker in one process, on its real dispatch policy, is areal_mq.brokers.stub.StubBroker (beside the
broker it mirrors: the core package imports no broker).
"""
from .fakes import FakeRuntime, InMemoryJobs, InMemoryLink, InMemoryStore, ManualClock, RecordingLog, Signal
from .scripted import ScriptedModel
from .waits import wait_for

__all__ = ["FakeRuntime", "InMemoryJobs", "InMemoryLink", "InMemoryStore", "ManualClock", "RecordingLog",
           "ScriptedModel", "Signal", "wait_for"]
