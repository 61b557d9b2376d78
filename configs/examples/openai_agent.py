"""An agent written only against the OpenAI API, trained as the job's environment with GRPO.

``arith_agent`` knows nothing of PlexRL: it is given a ``base_url`` and an API key, asks the model
with the ``openai`` SDK, and returns its answer. ``agent_grpo`` runs it through
``job.agent_endpoint()``: the endpoint serves the job's current policy, records each completion's
token ids and log-probs per episode, and the loop trains on the recorded turns, each episode scored
by the job's reward on the agent's answer. Run it with ``openai-agent.yaml``::

    algo:
      loop: openai_agent:agent_grpo     # module:function(job), imported from `path`
      path: .
"""

from openai import OpenAI

from plexctl.rl import Job


def arith_agent(record: dict, base_url: str, api_key: str) -> str:
    """One turn: the problem as the user's message, the model's reply as the answer."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=2)
    reply = client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": record["prompt"]}],
        max_tokens=4,
        temperature=1.0,
    )
    return reply.choices[0].message.content or ""


def agent_grpo(job: Job) -> None:
    a = job.spec.algo
    hp = job.hparams()
    start = job.resume()
    if start == 0:
        job.evaluate(0)
    with job.agent_endpoint() as agents:
        for step in range(start, a.steps):
            records = job.prompts.next_batch(a.prompts_per_step)
            rollout = agents.rollout(records, a.group_size, arith_agent)
            advantages = []
            for group in rollout.groups():  # GRPO: each reward against its group's mean and spread
                mean = sum(group) / len(group)
                std = (sum((r - mean) ** 2 for r in group) / len(group)) ** 0.5
                advantages += [(r - mean) / (std + 1e-6) for r in group]
            train = job.train(rollout, advantages, hp, publish=True)  # the agents' next turns see it
            reward = sum(rollout.rewards) / len(rollout.rewards)
            job.record(
                step + 1,
                {"reward_mean": reward, **rollout.env_metrics(), **{f"train/{k}": v for k, v in train.items()}},
            )
            job.log(f"step {step + 1}/{a.steps} reward {reward:.3f}")
            job.end_step(step + 1)
    job.evaluate(a.steps)
    job.checkpoint(a.steps)
    job.log("done")
