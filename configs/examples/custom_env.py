"""A custom PlexRL environment: guess a digit, with ``higher`` / ``lower`` hints as the tool.

Use it from a job spec (``path`` is relative to the YAML file)::

    env:
      cls: custom_env:GuessEnv
      path: examples
      config: {max_guesses: 3}

The interface (``plexctl.envs.base``): a class whose instances each run ONE episode.

- ``reset(sample: dict) -> str`` returns the first prompt text (here the sample's ``prompt``,
  e.g. ``guess:``) and keeps what the episode needs (the secret digit, from ``answer``).
- ``step(completion_text: str) -> StepResult`` reads one model turn. A tool call (here ``try:5;``)
  returns ``StepResult(observation, done=False, reward=None, info={"tool_call": True})``: the
  observation (``=higher;``) is appended and the model continues. A final answer returns
  ``done=True`` with a float reward; ``reward=None`` with ``done=True`` fails the episode: it gets
  the job's ``failure_reward`` and is counted (``info["malformed"]``, ``info["tool_timeout"]`` or
  ``info["error"]`` says which kind). The helpers ``observe``, ``final``, ``malformed`` build these.
- A step that raises is counted in ``reward_errors`` and gets the failure reward; the job goes on.
  Steps run concurrently across episodes in the driver's pool threads: keep per-episode state on
  ``self``; run untrusted code with ``plexctl.sandbox.run_python``.

Keyword arguments of ``__init__`` are the spec's ``config``, checked at load (one instance is built).
"""

from __future__ import annotations

from plexctl.envs.base import MalformedCall, StepResult, final, malformed, observe, parse_tool_call


class GuessEnv:
    """Find the secret digit. Reward 1.0 for the right final answer, minus 0.1 per extra guess."""

    def __init__(self, max_guesses: int = 3, prompt_field: str = "prompt", answer_field: str = "answer") -> None:
        if max_guesses < 1:
            raise ValueError(f"max_guesses must be >= 1, got {max_guesses}")
        self.max_guesses = max_guesses
        self.prompt_field = prompt_field
        self.answer_field = answer_field
        self.secret = 0
        self.guesses = 0

    def reset(self, sample: dict) -> str:
        self.secret = int(sample[self.answer_field])
        self.guesses = 0
        return str(sample[self.prompt_field])

    def step(self, completion_text: str) -> StepResult:
        try:
            call = parse_tool_call(completion_text, ["try"])
        except MalformedCall as e:
            return malformed(str(e))
        if call is None:  # the final answer
            right = completion_text.strip() == str(self.secret)
            return final(max(0.0, 1.0 - 0.1 * max(self.guesses - 1, 0)) if right else 0.0)
        if not call.argument.isdigit() or self.guesses >= self.max_guesses:
            return malformed(f"bad guess {call.argument!r} (guess {self.guesses + 1} of {self.max_guesses})")
        self.guesses += 1
        guess = int(call.argument)
        hint = "yes" if guess == self.secret else ("higher" if guess < self.secret else "lower")
        return observe(f"={hint};")
