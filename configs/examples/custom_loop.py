"""Your own RL algorithm on the plexctl.rl library: REINFORCE with a moving-average baseline.

No groups and no critic: the baseline is an exponential moving average of past steps' mean
reward, so each sample's advantage is ``reward - baseline``. The update uses the trainer's
truncated importance-sampling loss (``pg-tis``). The runtime does the rest: placement on the
shared engines, state swaps, adapter publishing. Run it with ``custom-loop.yaml``::

    algo:
      loop: custom_loop:reinforce     # module:function(job), imported from `path`
      path: .
"""

from plexctl.rl import Job


def reinforce(job: Job, decay: float = 0.8) -> None:
    a = job.spec.algo
    hp = job.hparams(loss="pg-tis", loss_params={"cap": 2.0})  # a named loss of the trainer
    start = job.resume()  # 0, or the step of the checkpoint it continues from
    baseline = job.restored.get("baseline")
    if start == 0:
        job.evaluate(0)
    for step in range(start, a.steps):
        records = job.prompts.next_batch(a.prompts_per_step)  # the job's data iterator
        rollout = job.rollout(records, a.group_size, job.sampling(step, a.group_size))
        mean = sum(rollout.rewards) / len(rollout.rewards)
        baseline = mean if baseline is None else baseline
        advantages = [r - baseline for r in rollout.rewards]
        train = job.train(rollout, advantages, hp)  # one optimizer step on the job's adapter
        job.publish()  # the next rollout samples from the updated adapter
        job.record(step + 1, {"reward_mean": mean, "baseline": baseline,
                              **{f"train/{k}": v for k, v in train.items()}})
        job.log(f"step {step + 1}/{a.steps} reward {mean:.3f} baseline {baseline:.3f}")
        baseline = decay * baseline + (1 - decay) * mean
        job.end_step(step + 1, baseline=baseline)  # periodic checkpoint, with the loop's own state
    job.evaluate(a.steps)
    job.checkpoint(a.steps, baseline=baseline)
    job.log("done")
