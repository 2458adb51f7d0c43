"""The one role loop (areal_mq/actor/roles.py): hooks called in order, pause/resume as middleware (READY(0) and
back), stats as middleware, drain on stop, and a loop without a runtime (a trainer rank > 0)."""
from __future__ import annotations

from areal_mq.messages import Control, RewardJob, WeightsReady
from areal_mq.actor.link import Job
from areal_mq.actor.roles import PauseControl, Role, RoleLoop, StatsReport
from areal_mq.testing import FakeRuntime


class Counting(Role):
    name = "echo"
    drain_timeout_s = 5.0

    def __init__(self, rt, ticks_to_stop=3, in_flight=0):
        super().__init__(rt)
        self.calls: list[str] = []
        self.ticks_to_stop, self.in_flight = ticks_to_stop, in_flight

    def on_signal(self, msg):
        self.calls.append(f"signal:{type(msg).__name__}:{'paused' if self.paused else 'running'}")

    def on_job(self, job):
        self.calls.append(f"job:{job.id}")

    def on_tick(self):
        self.calls.append("tick")
        if self.calls.count("tick") >= self.ticks_to_stop and self.rt is not None:
            self.rt.stopping = True
        if not self.rt and self.calls.count("tick") >= self.ticks_to_stop:
            self.done = True
        self.in_flight = max(0, self.in_flight - 1) if self.rt is not None and self.rt.stopping else self.in_flight
        return True

    def should_stop(self, stopping):
        return stopping or getattr(self, "done", False)

    def busy(self):
        return self.in_flight > 0

    def on_stop(self):
        self.calls.append("stop")


def test_signals_then_tick_then_jobs_and_a_drain_that_waits_for_in_flight_work():
    rt = FakeRuntime(signals=[WeightsReady(version=1, mode="base")],
                     jobs=[Job("a", RewardJob(task="t", completions=["x"]))])
    role = Counting(rt, ticks_to_stop=2, in_flight=2)
    RoleLoop(rt, role).run()
    assert role.calls[:3] == ["signal:WeightsReady:running", "tick", "job:a"]
    assert role.calls[-1] == "stop" and role.in_flight == 0
    assert rt.readies == [0]  # the drain announced READY(0) before finishing in-flight work


def test_pause_and_resume_are_the_loops_and_tell_the_broker():
    rt = FakeRuntime(signals=[Control(action="pause", reason="t"), Control(action="pause", target_role="other"),
                              Control(action="resume", target_role="echo")])
    role = Counting(rt, ticks_to_stop=1)
    loop = RoleLoop(rt, role, [PauseControl()])
    loop.round(accept=True)
    # the role sees each signal after the middleware: paused by the first, untouched by the other role's
    assert role.calls[:3] == ["signal:Control:paused", "signal:Control:paused", "signal:Control:running"]
    assert rt.readies == [0, 4] and not role.paused
    assert [kw["action"] for kw in rt.log.named("echo.control")] == ["pause", "resume"]


def test_stats_middleware_logs_role_stats_on_schedule():
    rt = FakeRuntime()
    role = Counting(rt, ticks_to_stop=10)
    role.stats = lambda: {"answered": 3}
    stats = StatsReport(every_s=0.0)
    RoleLoop(rt, role, [stats]).round(accept=True)
    assert ("echo.stats", {"answered": 3}) in rt.log.events


def test_a_loop_without_a_runtime_only_ticks():
    role = Counting(None, ticks_to_stop=3)
    RoleLoop(None, role).run()
    assert role.calls == ["tick", "tick", "tick", "stop"]


def test_stats_also_go_to_the_metrics_sinks_and_are_closed_with_the_loop():
    class Sinks:
        def __init__(self):
            self.rows, self.closed = [], False

        def write(self, step, metrics):
            self.rows.append((step, metrics))

        def close(self):
            self.closed = True

    rt, sinks = FakeRuntime(), Sinks()
    role = Counting(rt, ticks_to_stop=2)
    role.stats = lambda: {"answered": 3}
    RoleLoop(rt, role, [StatsReport(every_s=0.0, sinks=sinks)]).run()
    assert sinks.rows[:2] == [(0, {"answered": 3}), (1, {"answered": 3})] and sinks.closed
