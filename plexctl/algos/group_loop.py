"""The step loop the built-in algorithms share: sample a group per prompt, score, update, publish.

Per step: take ``prompts_per_step`` prompts from the job's data iterator, sample
``group_size`` completions each with the current (or, under ``max_staleness`` >= 1, one
version older) policy, score them, let the algorithm turn rewards into one advantage per
sample, run one ``train_step`` with the algorithm's loss and ``publish`` the new adapter (one
call; the next step's generate is sent behind it, and the daemon starts it the moment the
publish lands), record the metrics, evaluate and checkpoint every N steps. Everything goes
through ``plexctl.rl``.

An algorithm (``GRPO``, ``DrGRPO``, ``DAPO``, ``RLOO``) is a subclass that fills in:
``advantages(rollout)``, and optionally ``hparams()`` (its loss), ``collect(step, rollout)``
(e.g. DAPO's dynamic sampling: drop groups, refill) and ``step_metrics``.

Simplifications, stated up front: one optimizer step per batch (no PPO epochs), the staleness
pipeline overlaps at most one generate with one train step, evaluation is the mean reward
over a fixed prompt set with a fixed sampling seed.
"""

from __future__ import annotations

import abc
import time
from typing import Any

from plexctl.rl import Job, PendingRollout, PendingTrain, Rollout, TrainHParams


class ErrorRateExceeded(Exception):
    """Too many of a step's samples failed in reward or tool code: the job stops."""


class GroupLoop(abc.ABC):
    """Group sampling + one policy-gradient update per step; subclasses say how to learn."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.spec = job.spec
        self.group_size = job.spec.algo.group_size
        self.hp = self.hparams()

    # -- what an algorithm fills in

    def hparams(self) -> TrainHParams:
        """The loss of each update (default: the spec's ``algo`` section)."""
        return self.job.hparams()

    @abc.abstractmethod
    def advantages(self, rollout: Rollout) -> list[float]:
        """One advantage per sample of ``rollout``."""

    def collect(self, step: int, rollout: Rollout) -> tuple[Rollout, Rollout]:
        """(what to train on, everything sampled this step) from the step's first rollout."""
        return rollout, rollout

    def step_metrics(self, trained: Rollout, seen: Rollout) -> dict[str, float]:
        """Extra metrics of the algorithm for the step's row."""
        return {}

    # -- the loop

    def next_rollout(self, step: int, after: PendingTrain | None = None) -> PendingRollout:
        a = self.spec.algo
        return self.job.rollout_async(
            self.job.prompts.next_batch(a.prompts_per_step), a.group_size, self.job.sampling(step, a.group_size), after
        )

    def check_error_rate(self, step: int, seen: Rollout) -> float:
        rate = seen.errors / len(seen.rewards)
        if rate > self.job.reward_spec.max_error_rate:
            raise ErrorRateExceeded(
                f"{rate:.0%} of step {step + 1}'s samples hit a reward error or tool timeout "
                f"(reward.max_error_rate {self.job.reward_spec.max_error_rate:.0%})"
            )
        return rate

    def run(self) -> None:
        job, a = self.job, self.spec.algo
        start = job.resume()
        if start == 0:
            job.evaluate(0)
        pending = self.next_rollout(start) if start < a.steps else None
        for step in range(start, a.steps):
            t0 = time.perf_counter()
            assert pending is not None  # None only when no step is left
            first = job.wait(pending)
            staleness = job.version - first.policy_version  # policy versions behind
            trained, seen = self.collect(step, first)
            error_rate = self.check_error_rate(step, seen)
            last = step + 1 == a.steps
            boundary = job.prompts.state()  # where step + 1 starts: what a checkpoint after this step resumes
            if a.max_staleness > 0 and not last:
                pending = self.next_rollout(step + 1)  # overlaps this step's training
            training = PendingTrain(None)
            if trained.samples:
                training = job.train_async(trained, self.advantages(trained), self.hp)  # and publish
            else:
                job.log(f"step {step + 1}: no group to learn from, update skipped")
            if a.max_staleness == 0 and not last:  # from the adapter this step publishes, sent now
                pending = self.next_rollout(step + 1, after=training)  # started when the publish lands
            train: dict[str, Any] = job.wait_train(training)
            lengths = seen.lengths
            row = {
                "reward_mean": sum(seen.rewards) / len(seen.rewards),
                "reward_max": max(seen.rewards),
                "response_len": sum(lengths) / len(lengths),
                "policy_version": job.version,
                "staleness": staleness,
                "reward_errors": getattr(job.reward, "errors", 0),
                "error_rate": error_rate,
                "generate_s": seen.generate_s,
                "step_s": time.perf_counter() - t0,
                **{f"train/{k}": v for k, v in train.items()},
                **{f"env/{k}": v for k, v in seen.env_metrics().items()},
                **self.step_metrics(trained, seen),
            }
            job.record(step + 1, row)
            job.log(
                f"step {step + 1}/{a.steps} reward {row['reward_mean']:.3f} "
                f"loss {train.get('loss', float('nan')):.4f} v{job.version} {row['step_s']:.2f}s"
            )
            if a.eval_every and (step + 1) % a.eval_every == 0 and not last:
                job.evaluate(step + 1)
            if not last:
                job.end_step(step + 1, cursor=boundary)
        job.evaluate(a.steps)
        job.checkpoint(a.steps)
        job.log("done")
