"""The controller's episode path (agent.workflow set): groups of EpisodeJobs instead of GenerateRequests.

Dataflow (a component the controller builds with its job client; admission, retries, the ledger and the one
store path stay the controller's, workers/controller.py):

    admit(problem) ──group_size × EpisodeJob(episode_id, prompt_ids, sampling, min_version)──► job broker
                                                  (service "agent") ──► agent workers run the workflow
    ◄── EpisodeResult(seq = whole episode, loss_mask, reward) ── all n back ──► Controller._store(seqs, meta)

The staleness bound counts groups of episodes exactly as it counts groups of single answers: an episode job is
admitted with the group, and the group leaves the ledger once (stored, dropped_uniform, failed, stale). A failed
episode (the workflow raised or timed out: Error job_failed) is retried like a failed generation; an agent that
dies mid-episode has its job requeued by the broker to another agent. No reward job: the workflow's reward
is the episode's (seq.reward), so a complete group goes straight to the store path.

Run: pytest tests/unit/workers/test_controller_episodes.py -q
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from areal_mq.messages import EpisodeJob, EpisodeResult, SamplingSpec, SeqSample

if TYPE_CHECKING:
    from areal_mq.workers.controller import Group


class EpisodePath:
    """Submits one sample of a group as an EpisodeJob (service "agent") and reads a complete group back."""

    service = "agent"

    def __init__(self, jobs: Any) -> None:
        self.jobs = jobs

    def submit(self, group: Group, index: int, sampling: SamplingSpec, min_version: int) -> str:
        """Episode `index` of `group`, never started on weights older than `min_version`; returns the job id."""
        p = group.problem
        return self.jobs.submit(EpisodeJob(
            episode_id=f"{group.group_id[:120]}-e{index}", group_id=group.group_id, sample_index=index,
            problem_id=str(p.id)[:256], prompt=str(p.prompt), answer=str(p.answer), level=int(p.level or 0),
            prompt_ids=group.prompt_ids, sampling=sampling, min_version=min_version), service=self.service)

    @staticmethod
    def generated_tokens(result: EpisodeResult) -> int:
        """Tokens the policy generated in the episode (mask 1); environment tokens are not generation."""
        mask = result.seq.loss_mask
        return int(mask.sum()) if mask is not None else 0

    @staticmethod
    def scored(results: list[EpisodeResult]) -> tuple[list[SeqSample], dict]:
        """A complete group's episodes, in sample order -> (seqs with their rewards, the Sample's extra meta)."""
        return [r.seq for r in results], {"episodes": True, "turns": [r.turns for r in results]}
