"""RewardExecutor: failures become default rewards with error records, hung calls are killed, cache,
idempotency, group and combined rewards, config errors.

Run: pytest tests/unit/rewards/test_executor.py -q   (~30 s: pool processes start with spawn)
"""
import threading

import pytest

from areal_mq.errors import RewardError
from areal_mq.messages import RewardJob
from areal_mq.rewards import RewardConfig, RewardExecutor, RewardRegistry, TaskConfig

FNS = "tests.unit.rewards.rewardfns"


def _tasks(tmp):
    t = lambda name, **kw: TaskConfig(fn=f"{FNS}:{name}", **kw)  # noqa: E731
    return {
        "length": t("length"), "counted": t("counted", kwargs={"log_path": str(tmp / "calls.log")}),
        "raises": t("raises", default_reward=-1.0), "hangs": t("hangs"), "exits": t("exits"),
        "killed": t("killed"), "bad_type": t("bad_type"), "narrow": t("narrow"),
        "flaky": t("flaky", kwargs={"marker": str(tmp / "flaky.marker")}),
        "rank": t("rank"), "short_group": t("short_group"),
        "mixed": TaskConfig(combine={"math": 1.0, "format": 0.5}), "arith": TaskConfig(fn="arith"),
    }


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("rewards")


@pytest.fixture(scope="module")
def errors():
    return []


@pytest.fixture(scope="module")
def ex(tmp, errors):
    cfg = RewardConfig(processes=2, timeout_s=3.0, retries=1, tasks=_tasks(tmp))
    with RewardExecutor(cfg, on_error=errors.append, worker_id="w-test") as executor:
        yield executor


def job(task, *completions, **kw):
    return RewardJob(task=task, prompt="p", completions=list(completions), **kw)


def test_per_sample_rewards_and_worker_id(ex):
    r = ex.score(job("length", "a", "abc", "abcdef"), timeout=60)
    assert r.rewards == [1.0, 3.0, 6.0] and r.errors == [None] * 3 and r.worker_id == "w-test"


def test_arith_through_the_pool(ex):
    r = ex.score(job("arith", r"\boxed{4}", r"\boxed{4}\boxed{4}", r"\boxed{4}", reference=4,
                     truncated=[False, False, True]), timeout=60)
    assert r.rewards == [1.0, -0.5, -0.5]
    assert [d["reason"] for d in r.details] == ["correct", "multiple_boxes", "truncated"]


def test_a_raising_function_yields_the_default_and_an_error_record(ex, errors):
    r = ex.score(job("raises", "x", "y"), job_id="job-raise", timeout=60)
    assert r.rewards == [-1.0, -1.0]
    assert all("ZeroDivisionError" in e and "job-raise" in e for e in r.errors)
    recs = [e for e in errors if e["job"] == "job-raise"]
    assert len(recs) == 2 and all(rec["kind"] == "exception" and rec["attempts"] == 2 for rec in recs)
    assert "ZeroDivisionError: boom" in recs[0]["error"] and "raises" in recs[0]["traceback"]
    assert ex.score(job("length", "ok"), timeout=60).rewards == [2.0]


def test_a_hung_function_is_killed_and_its_process_replaced(ex, errors):
    before = ex.stats()["timeouts"]
    r = ex.score(job("hangs", "slow", "fast"), job_id="job-hang", timeout=60)
    assert r.rewards == [0.0, 0.5]
    assert "timeout" in r.errors[0] and "job-hang" in r.errors[0] and r.errors[1] is None
    assert ex.stats()["timeouts"] - before == 2  # both attempts
    assert [e["kind"] for e in errors if e["job"] == "job-hang"] == ["timeout"]
    assert ex.score(job("length", "abc"), timeout=60).rewards == [3.0]
    assert ex.stats()["processes"] == 2


@pytest.mark.parametrize("task", ["exits", "killed"])
def test_a_dying_process_does_not_lose_the_job(ex, errors, task):
    r = ex.score(job(task, "x"), job_id=f"job-{task}", timeout=60)
    assert r.rewards == [0.0] and "crashed" in r.errors[0] and f"job-{task}" in r.errors[0]
    assert ex.score(job("length", "abcd"), timeout=60).rewards == [4.0]


def test_a_transient_failure_is_retried(ex):
    before = ex.stats()["retries"]
    r = ex.score(job("flaky", "x"), timeout=60)
    assert r.rewards == [2.0] and r.errors == [None]
    assert ex.stats()["retries"] == before + 1


def test_bad_return_values_are_reported(ex):
    r = ex.score(job("bad_type", "x"), timeout=60)
    assert r.rewards == [0.0] and "must be a number" in r.errors[0]


def test_a_function_without_meta_gets_only_its_arguments(ex):
    assert ex.score(job("narrow", "x", truncated=[True]), timeout=60).rewards == [3.0]


def test_cache_on_task_prompt_id_and_completion(ex, tmp):
    log = tmp / "calls.log"
    first = ex.score(job("counted", "a", "b", prompt_id="p1", reference="a"), timeout=60)
    again = ex.score(job("counted", "a", "b", prompt_id="p1", reference="a"), timeout=60)
    assert first.rewards == again.rewards == [1.0, 0.0]
    assert not first.cached and again.cached
    assert sorted(log.read_text().splitlines()) == ["a", "b"]  # each once; 2 processes, any order
    ex.score(job("counted", "a", prompt_id="p2", reference="a"), timeout=60)  # other prompt: computed
    ex.score(job("counted", "a", prompt_id="p1", reference="a", truncated=[True]), timeout=60)  # other flag
    assert len(log.read_text().splitlines()) == 4


def test_idempotency_by_job_id(ex, tmp):
    log = tmp / "calls.log"
    n0 = len(log.read_text().splitlines()) if log.exists() else 0
    j = job("counted", "same", prompt_id="idem", reference="same")
    futs = [ex.submit(j, job_id="job-idem") for _ in range(3)]
    results = [f.result(timeout=60) for f in futs]
    later = ex.submit(j, job_id="job-idem").result(timeout=60)
    assert all(r.rewards == [1.0] for r in results + [later])
    assert len(log.read_text().splitlines()) == n0 + 1
    assert ex.stats()["duplicates"] >= 3


def test_group_rewards(ex):
    r = ex.score(job("rank", "aaa", "a", "aa"), timeout=60)
    assert r.rewards == [1.0, 0.0, 0.5] and all(d["group_size"] == 3 for d in r.details)
    bad = ex.score(job("short_group", "a", "b"), timeout=60)
    assert bad.rewards == [0.0, 0.0] and all("one reward per completion" in e for e in bad.errors)


def test_combined_rewards(ex):
    r = ex.score(job("mixed", r"\boxed{\frac{1}{2}}", "0.5", r"\boxed{3}", reference="1/2"), timeout=60)
    assert r.rewards == [1.5, 1.0, 0.5]
    assert r.details[0]["math"]["reward"] == 1.0 and r.details[0]["format"]["reward"] == 1.0


def test_concurrent_submitters(ex):
    out, threads = [], []
    for i in range(8):
        t = threading.Thread(target=lambda i=i: out.append(ex.score(job("length", "x" * i), timeout=60)))
        threads.append(t)
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(r.rewards[0] for r in out) == [float(i) for i in range(8)]


def test_bad_jobs_and_configs_are_refused_clearly(ex, tmp):
    with pytest.raises(RewardError, match="unknown reward task 'nope'"):
        ex.submit(job("nope", "x"))
    with pytest.raises((RewardError, ValueError), match="truncated flags|flags for 2 completions"):
        ex.submit(job("length", "x", "y", truncated=[True]))  # RewardJob itself may refuse it first
    bad_kwargs = RewardConfig(tasks={"t": TaskConfig(fn=f"{FNS}:narrow", kwargs={"extra": 1})})
    with pytest.raises(RewardError, match="takes no argument"):
        RewardExecutor(bad_kwargs).start()
    bad_path = RewardConfig(tasks={"t": TaskConfig(fn="no_such_module_xyz:fn")})
    with pytest.raises(RewardError, match="cannot import module 'no_such_module_xyz'"):
        RewardExecutor(bad_path).start()
    with pytest.raises(ValueError, match="exactly one of fn, combine, http"):
        TaskConfig(fn="math", combine={"format": 1.0})


def test_unpicklable_registration_is_refused_for_spawn():
    reg = RewardRegistry()
    reg.register("lam", lambda p, c, r, **m: 1.0)
    with pytest.raises(Exception, match="define it at module level"):
        RewardExecutor(RewardConfig(tasks={"lam": TaskConfig(fn="lam")}), reg).start()


def test_closing_fails_unfinished_jobs_instead_of_hanging(tmp):
    cfg = RewardConfig(processes=1, timeout_s=30.0, tasks={"hangs": TaskConfig(fn=f"{FNS}:hangs")})
    ex = RewardExecutor(cfg).start()
    fut = ex.submit(job("hangs", "slow"))
    ex.close()
    with pytest.raises(RewardError, match="closed"):
        fut.result(timeout=30)


def test_a_call_queued_behind_a_hung_one_is_not_charged_for_it():
    """One process holds two calls (prefetch); the first hangs, the second never started: it is rerun."""
    cfg = RewardConfig(processes=1, timeout_s=1.5, retries=0, tasks={"hangs": TaskConfig(fn=f"{FNS}:hangs")})
    errors = []
    with RewardExecutor(cfg, on_error=errors.append) as ex:
        r = ex.score(job("hangs", "slow", "fast"), job_id="job-queued", timeout=60)
    assert r.rewards == [0.0, 0.5] and "timeout" in r.errors[0] and r.errors[1] is None
    assert [e["indices"] for e in errors] == [[0]]


def test_job_meta_reaches_only_undeclared_names(ex):
    """A job's meta comes off the wire: it cannot change arith's reward values nor collide with call arguments."""
    meta = {"correct_reward": 100.0, "prompt": "x", "reference": 5, "completion": "y", "truncated": True, "ok": 1}
    r = ex.score(job("arith", r"\boxed{4}", reference=4, meta=meta), timeout=60)
    assert r.rewards == [1.0] and r.errors == [None]
