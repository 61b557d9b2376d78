"""An agent written only against the OpenAI API, trained as the job's environment.

``arith_agent`` knows nothing of PlexRL: it is given a ``base_url`` and an API key, asks the model
with the ``openai`` SDK, and returns its answer. ``openai-agent.yaml`` names it as the job's agent::

    algo:
      agent: openai_agent:arith_agent   # module:function(record, base_url, api_key), imported from `path`
      path: .

and the built-in GRPO runs each sample as one episode of it: the job's endpoint serves its current
policy, records each completion's token ids and log-probs, and the recorded turns are trained, each
episode scored by the job's reward on the agent's answer.
"""

import functools

from openai import OpenAI


@functools.cache
def client_of(base_url: str) -> OpenAI:
    """One client (one connection pool) for every episode: a new ``OpenAI`` loads the system's CA
    certificates, tens of milliseconds of CPU, as much as the rest of an episode here."""
    return OpenAI(base_url=base_url, api_key="per-episode", max_retries=2)


def arith_agent(record: dict, base_url: str, api_key: str) -> str:
    """One turn: the problem as the user's message, the model's reply as the answer."""
    client = client_of(base_url).with_options(api_key=api_key)  # the episode's own key, the shared pool
    reply = client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": record["prompt"]}],
        max_tokens=4,
        temperature=1.0,
    )
    return reply.choices[0].message.content or ""
