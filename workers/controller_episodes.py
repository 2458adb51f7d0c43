"""The controller's episode path (agent.workflow set): groups of EpisodeJobs instead of GenerateRequests.

Dataflow (a mixin of workers/controller.Controller; admission, retries, the ledger and the store are its own):

    admit(problem) ──group_size × EpisodeJob(episode_id, prompt_ids, sampling, min_version)──► job broker
                                                  (service "agent") ──► agent workers run the workflow
    ◄── EpisodeResult(seq = whole episode, loss_mask, reward) ── all n back ──► Sample(n episodes) ──► store

The staleness bound counts groups of episodes exactly as it counts groups of single answers: an episode job is
admitted with the group, and the group leaves the ledger once (stored, dropped_uniform, failed, stale). A failed
episode (the workflow raised or timed out: Error job_failed) is retried like a failed generation; an agent that
dies mid-episode has its job requeued by the broker to another agent. No reward job: the workflow's reward
is the episode's.
"""
from __future__ import annotations

from typing import Any

from areal_mq.messages import EpisodeJob, EpisodeResult, Sample


class EpisodeAdmission:
    """Needs: self.ctl_cfg, cfg, jobs, _sampling, by_job, version, gen_tokens, rewards, _retry/_fail/_drop/_put."""

    def _submit_episode(self, group: Any, index: int) -> None:
        p = group.problem
        job = self.jobs.submit(EpisodeJob(
            episode_id=f"{group.group_id[:120]}-e{index}", group_id=group.group_id, sample_index=index,
            problem_id=str(p.id)[:256], prompt=str(p.prompt), answer=str(p.answer), level=int(p.level or 0),
            prompt_ids=group.prompt_ids, sampling=self._sampling(group, index), min_version=self.version),
            service="agent")
        self.by_job[job] = ("episode", group.group_id, index)

    def _on_episode(self, group: Any, index: int, msg: EpisodeResult) -> None:
        group.results[index] = msg
        if msg.seq.loss_mask is not None:
            self.gen_tokens += int(msg.seq.loss_mask.sum())
        if len(group.results) == self.ctl_cfg.group_size:
            self._store_episodes(group)

    def _store_episodes(self, group: Any) -> None:
        seqs = [group.results[i].seq for i in range(self.ctl_cfg.group_size)]
        rewards = [s.reward for s in seqs]
        self.rewards.extend(rewards)
        versions = sorted({int(v) for s in seqs for v in s.versions if v >= 0})
        reward_mean = round(sum(rewards) / len(rewards), 4)
        if self.ctl_cfg.drop_uniform_groups and max(rewards) - min(rewards) <= 1e-9:
            self._drop(group, seqs, reward_mean, versions)
            return
        sample = Sample(sample_id=group.group_id, prompt_id=group.problem.id, seqs=seqs,
                        meta={"level": group.problem.level, "episodes": True,
                              "turns": [group.results[i].turns for i in range(self.ctl_cfg.group_size)]})
        self._put(group, sample, reward_mean, versions)
