"""GRPO (group relative policy optimisation) as a job's control loop.

Per step: take ``prompts_per_step`` prompts, ``generate`` ``group_size`` samples each with
the current (or, under ``max_staleness`` >= 1, a slightly older) policy, score them with the
job's reward, normalise rewards within each group into advantages, ``train_step`` one
clipped policy-gradient update, ``publish`` the new adapter to the rollout engine, report
metrics, and ``checkpoint`` every N steps. The reward is computed here, in the driver: that
CPU time is one of the gaps other jobs fill on the engines.

Simplifications, stated up front: one optimizer step per batch (no PPO epochs), the
staleness pipeline overlaps at most one generate with one train step, evaluation is the
mean reward over a fixed prompt set with a fixed sampling seed.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import msgspec

from plexctl.data import PromptCursor, load_records
from plexctl.envs.base import episode_batch, episode_metrics
from plexctl.protocol import Completion, Sampling, TrainBatch, TrainHParams
from plexctl.rewards import make_scorer
from plexctl.rl import JobClient
from plexctl.spec import JobSpec

EVAL_SEED = 12345


class ErrorRateExceeded(Exception):
    """Too many of a step's samples failed in reward or tool code: the job stops."""


def group_advantages(rewards: list[float], group_size: int, eps: float = 1e-6) -> list[float]:
    """(r - mean) / (std + eps) within each consecutive group of ``group_size`` samples."""
    out: list[float] = []
    for g in range(0, len(rewards), group_size):
        group = rewards[g:g + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))
        out.extend((r - mean) / (std + eps) for r in group)
    return out


def build_batch(comps: list[Completion], advantages: list[float]) -> TrainBatch:
    input_ids, mask, old = [], [], []
    for c in comps:
        n_prompt = len(c.prompt_token_ids)
        input_ids.append(list(c.prompt_token_ids) + list(c.token_ids))
        mask.append([0] * n_prompt + [1] * len(c.token_ids))
        old.append([0.0] * n_prompt + list(c.logprobs))
    return TrainBatch(input_ids=input_ids, loss_mask=mask, old_logprobs=old, advantages=advantages)


class GRPO:
    def __init__(self, client: JobClient, spec: JobSpec, job_dir: Path, log: Callable[[str], None] = print) -> None:
        self.client = client
        self.spec = spec
        self.job_dir = job_dir
        self.log = log
        d = spec.data
        self.records = load_records(d.path, d.prompt_field, d.answer_field)
        self.eval_records = load_records(d.eval_path, d.prompt_field, d.answer_field) if d.eval_path else None
        self.reward_pool = None
        if spec.reward.fn:  # a user's reward runs in the sandbox pool, never in this process
            from plexctl.sandbox import SandboxPool

            self.reward_pool = SandboxPool()
        self.reward = make_scorer(spec.reward, spec.reward.failure_reward, self.reward_pool, spec.reward.timeout_s)
        a = spec.algo
        self.hp = TrainHParams(lr=a.lr, clip_low=a.clip_range, clip_high=a.clip_range_high or a.clip_range,
                               kl_coef=a.kl_coef, loss_agg=a.loss_agg)
        self.metrics_path = job_dir / "metrics.jsonl"
        self._errors_seen = 0  # reward errors and tool timeouts so far
        self.env_factory = None
        if spec.env is not None:  # multi-turn episodes with tools, scored by the environment
            from plexctl.envs import load_env
            from plexctl.sandbox import SandboxPool

            e = spec.env
            self.env_factory = load_env({"name": e.name, "cls": e.cls, "path": e.path, "config": e.config})
            self.pool = SandboxPool(max_workers=e.workers)

    def close(self) -> None:
        """Stop the sandbox pools and remove the staged copy of the user's reward directory."""
        if hasattr(self.reward, "close"):
            self.reward.close()
        for pool in (self.reward_pool, getattr(self, "pool", None)):
            if pool is not None:
                pool.close(wait=False)

    # -- pieces

    def sampling(self, step: int, n: int, seed: int | None = None) -> Sampling:
        s = self.spec.sampling
        return Sampling(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens, n=n,
                        seed=seed if seed is not None else self.spec.seed * 1_000_003 + step)

    def score(self, records: list[dict], comps: list[Completion], n: int) -> list[float]:
        d = self.spec.data
        return self.reward.score_many([(c.text, str(records[i // n][d.answer_field]), records[i // n])
                                       for i, c in enumerate(comps)])

    def episodes(self, records: list[dict], n: int, sampling: Sampling) -> list:
        """Run ``n`` multi-turn episodes per record; each turn of all of them is one generate call."""
        from plexctl.envs import run_episodes

        e = self.spec.env
        samples = [r for r in records for _ in range(n)]
        envs = [self.env_factory() for _ in samples]
        return run_episodes(self.client.generate, envs, samples, msgspec.structs.replace(sampling, n=1),
                            e.max_turns, self.pool, failure_reward=self.spec.reward.failure_reward,
                            truncated_reward=e.truncated_reward, step_timeout_s=e.step_timeout_s,
                            max_total_tokens=e.max_total_tokens)

    def evaluate(self, step: int) -> float | None:
        if not self.eval_records:
            return None
        n = self.spec.algo.eval_samples
        sampling = self.sampling(step, n, seed=EVAL_SEED)
        if self.env_factory is not None:
            rewards = [ep.reward for ep in self.episodes(self.eval_records, n, sampling)]
        else:
            prompts = [r[self.spec.data.prompt_field] for r in self.eval_records]
            rewards = self.score(self.eval_records, self.client.generate(prompts, sampling), n)
        value = sum(rewards) / len(rewards)
        self.client.report("eval", step, {"eval_reward": value})
        self.write_metrics({"step": step, "eval_reward": value})
        self.log(f"eval at step {step}: reward {value:.4f} over {len(rewards)} samples")
        return value

    def write_metrics(self, row: dict[str, Any]) -> None:
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({"time": time.time(), **row}) + "\n")

    # -- the loop

    def run(self) -> None:
        a, c = self.spec.algo, self.client
        restored = c.restore()
        if restored:
            start = int(restored["step"])
            cursor = PromptCursor.from_state(self.records, restored["cursor"])
            version = c.publish()
            self.log(f"resumed from checkpoint at step {start} (policy version {version})")
        else:
            start, version = 0, 0
            cursor = PromptCursor(self.records, seed=self.spec.data.shuffle_seed)
            self.evaluate(0)

        def next_generate(step: int) -> tuple[list[dict], int]:
            recs = cursor.next_batch(a.prompts_per_step)
            return recs, c.generate_async([r[self.spec.data.prompt_field] for r in recs],
                                          self.sampling(step, a.group_size))

        multi_turn = self.env_factory is not None
        pending = next_generate(start) if start < a.steps and not multi_turn else None
        for step in range(start, a.steps):
            t0 = time.perf_counter()
            extra: dict[str, float] = {}
            if multi_turn:  # episodes: one generate per turn, tools between turns (no overlap)
                recs = cursor.next_batch(a.prompts_per_step)
                episodes = self.episodes(recs, a.group_size, self.sampling(step, a.group_size))
                staleness, t_gen = 0, time.perf_counter() - t0
                rewards = [ep.reward for ep in episodes]
                adv = group_advantages(rewards, a.group_size)
                batch = episode_batch(episodes, adv)
                lengths = [sum(ep.loss_mask) for ep in episodes]
                extra = episode_metrics(episodes)
            else:
                recs, msg_id = pending
                reply = c.wait(msg_id)
                comps = c.completions(reply)
                staleness = version - int(reply.get("policy_version", version))  # policy versions behind
                t_gen = time.perf_counter() - t0
                rewards = self.score(recs, comps, a.group_size)
                adv = group_advantages(rewards, a.group_size)
                batch = build_batch(comps, adv)
                lengths = [len(x.token_ids) for x in comps]
            errors_before = self._errors_seen
            errors_now = (int(extra.get("reward_errors", 0) + extra.get("tool_timeouts", 0)) + errors_before
                          if multi_turn else int(getattr(self.reward, "errors", 0)))
            self._errors_seen = errors_now
            error_rate = (errors_now - errors_before) / len(rewards)
            if error_rate > self.spec.reward.max_error_rate:
                raise ErrorRateExceeded(
                    f"{error_rate:.0%} of step {step + 1}'s samples hit a reward error or tool timeout "
                    f"(reward.max_error_rate {self.spec.reward.max_error_rate:.0%})")
            last = step + 1 == a.steps
            if a.max_staleness > 0 and not last and not multi_turn:
                pending = next_generate(step + 1)  # overlaps this step's training
            train = c.train_step(batch, self.hp)
            version = c.publish()
            if a.max_staleness == 0 and not last and not multi_turn:
                pending = next_generate(step + 1)
            row = {
                "step": step + 1,
                "reward_mean": sum(rewards) / len(rewards),
                "reward_max": max(rewards),
                "response_len": sum(lengths) / len(lengths),
                "policy_version": version,
                "staleness": staleness,
                "reward_errors": getattr(self.reward, "errors", 0),
                "error_rate": error_rate,
                "generate_s": t_gen,
                "step_s": time.perf_counter() - t0,
                **{f"train/{k}": v for k, v in train.items()},
                **{f"env/{k}": v for k, v in extra.items()},
            }
            self.write_metrics(row)
            c.report("step", step + 1, {k: float(v) for k, v in row.items()})
            self.log(f"step {step + 1}/{a.steps} reward {row['reward_mean']:.3f} "
                     f"loss {train.get('loss', float('nan')):.4f} v{version} {row['step_s']:.2f}s")
            if a.eval_every and (step + 1) % a.eval_every == 0 and not last:
                self.evaluate(step + 1)
            every = self.spec.checkpoint.every
            if every and (step + 1) % every == 0 and not last:
                c.checkpoint(step + 1, {"step": step + 1, "cursor": cursor.state()})
        self.evaluate(a.steps)
        c.checkpoint(a.steps, {"step": a.steps, "cursor": cursor.state()})
        self.log("done")
