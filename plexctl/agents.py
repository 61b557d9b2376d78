"""Agent code written against the OpenAI API as a job's environment.

``AgentEndpoint`` serves the job's current policy on 127.0.0.1 with the OpenAI routes of
``plexctl.tinker.openai_api``: an unmodified agent gets its ``base_url`` and, per episode, an API
key of its own. Every completion it asks for is recorded, per episode, as the prompt's token ids
and the sampled token ids with their log-probs; ``rollout`` runs the agents and turns each
episode's recorded turns into its training sequence (an ``Episode``: the loss only on sampled
tokens, the tokens as the engine saw them, never text tokenized again), scored by the job's reward.

Invariants: the job's client makes one generate call at a time, from one dispatcher thread, which
joins the requests that come together (same sampling) into one call so the engine batches them;
an episode's key reaches only that episode's record; a key of no episode is refused (401).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import queue
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from plexctl.common.calls import Completion, GenerateReq, SampleTokens, Sampling
from plexctl.envs.base import Episode
from plexctl.rl import Job, Rollout
from plexctl.tinker.backend import UserError
from plexctl.tinker.openai_api import Policy, PolicyBackend, context_of

GATHER_S = 0.01  # requests arriving this close together go in one generate call
AGENTS_AT_ONCE = 64  # episodes whose agents run at once (each on a thread of the driver)
Agent = Callable[[dict, str, str], str]  # (record, base_url, api_key) -> the episode's final answer


@dataclasses.dataclass
class Turn:
    """One completion an agent asked for: what the engine was given and what it sampled."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    finish: str


def episode_of(sample: dict, turns: list[Turn]) -> Episode:
    """The episode's training sequence from its turns, in order: a turn whose prompt extends the
    sequence so far adds its new prompt tokens (mask 0) and its sampled tokens (mask 1, with
    their log-probs); one whose prompt does not (the agent rewrote its history) starts the
    sequence again from its prompt, the tokens sampled before masked out and counted."""
    ep = Episode(sample=sample)
    for t in turns:
        if ep.token_ids and t.prompt[: len(ep.token_ids)] != ep.token_ids:
            ep.prefix_mismatches += 1
            ep.dropped_tokens += sum(ep.loss_mask)
            ep.token_ids, ep.loss_mask, ep.logprobs = [], [], []
        new = t.prompt[len(ep.token_ids) :]
        if not ep.token_ids:
            ep.prompt_tokens = len(new)
        ep.token_ids += new + t.tokens
        ep.loss_mask += [0] * len(new) + [1] * len(t.tokens)
        ep.logprobs += [0.0] * len(new) + list(t.logprobs)
        ep.turns += 1
        ep.finish_reasons.append(t.finish)
    ep.truncated = bool(ep.finish_reasons) and ep.finish_reasons[-1] == "length"
    return ep


@dataclasses.dataclass
class _Asked:
    prompt: list[int]
    sampling: Sampling
    done: cf.Future


class _Policies(PolicyBackend):
    """The job's current policy under any model name, for the keys of the episodes running."""

    choices_apart = False  # each request is one turn of an episode: n choices are refused whole

    def __init__(self, endpoint: AgentEndpoint) -> None:
        self.endpoint = endpoint

    def authenticate(self, api_key: str) -> str | None:
        return api_key if api_key in self.endpoint.turns else None

    def policies(self, user: str) -> list[Policy]:
        return [self.policy(user, "policy")]

    def policy(self, user: str, model: str) -> Policy:
        path = self.endpoint.job.spec.model.path
        return Policy(model, path, context_of(path), version=self.endpoint.job.version)

    def generate(
        self,
        user: str,
        policy: Policy,
        prompt_tokens: list[int],
        sampling: Sampling,
        on_tokens: Callable[[SampleTokens], None] | None = None,
    ) -> list[Completion]:
        if sampling.n != 1:
            raise UserError("an episode's request samples one choice (n=1)")
        asked = _Asked(prompt_tokens, sampling, cf.Future())
        self.endpoint.asked.put(asked)
        done: list[Completion] = asked.done.result()
        c = done[0]
        self.endpoint.turns[user].append(
            Turn(list(prompt_tokens), list(c.token_ids), list(c.logprobs), c.finish_reason)
        )
        return done


class AgentEndpoint:
    """The job's policy over the OpenAI API, for agents; a context manager (it listens within)."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.turns: dict[str, list[Turn]] = {}  # episode key -> its turns
        self.asked: queue.Queue[_Asked | None] = queue.Queue()
        self.base_url = ""
        self._server: Any = None
        self._threads: list[threading.Thread] = []
        # the routes' blocking calls: a request waits on its generate in one of these threads, so
        # as many as run agents at once (asyncio's default pool, a few a core, would cap the batch)
        self._calls = cf.ThreadPoolExecutor(AGENTS_AT_ONCE, thread_name_prefix="agents-call")

    def __enter__(self) -> AgentEndpoint:
        import asyncio

        import uvicorn
        from fastapi import FastAPI

        from plexctl.tinker import listen, openai_api

        app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

        async def call(fn: Callable[..., Any], *args: Any) -> Any:
            return await asyncio.get_running_loop().run_in_executor(self._calls, fn, *args)

        openai_api.add_routes(app, _Policies(self), call)
        sock = listen.bind("127.0.0.1", 0)
        self.base_url = listen.url_of(sock, "127.0.0.1") + "/v1"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        serving = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True, name="agents")
        dispatch = threading.Thread(target=self._dispatch, daemon=True, name="agents-generate")
        self._threads = [serving, dispatch]
        for t in self._threads:
            t.start()
        while not self._server.started and serving.is_alive():
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.asked.put(None)
        if self._server is not None:
            self._server.should_exit = True
        for t in self._threads:
            t.join(timeout=10)
        self._calls.shutdown(wait=False, cancel_futures=True)

    def _dispatch(self) -> None:
        """The agents' requests, joined into generate calls by sampling, one call at a time."""
        while (first := self.asked.get()) is not None:
            batch = [first]
            deadline = time.monotonic() + GATHER_S
            while (left := deadline - time.monotonic()) > 0:
                try:
                    more = self.asked.get(timeout=left)
                except queue.Empty:
                    break
                if more is None:
                    self.asked.put(None)
                    break
                batch.append(more)
            groups: dict[bytes, list[_Asked]] = {}
            for a in batch:
                groups.setdefault(msgspec.json.encode(a.sampling), []).append(a)
            for same in groups.values():
                client = self.job.client
                try:
                    reply = client.wait(client.call_async(GenerateReq([], same[0].sampling, [a.prompt for a in same])))
                except Exception as e:  # noqa: BLE001 - each agent's request fails with it
                    for a in same:
                        a.done.set_exception(e)
                    continue
                for a, c in zip(same, client.completions(reply), strict=True):
                    a.done.set_result([c])

    def rollout(self, records: list[dict], n: int, agent: Agent) -> Rollout:
        """Run ``agent`` ``n`` times per record (prompt-major), each an episode with its own key,
        and score each by the job's reward on the agent's answer: a multi-turn ``Rollout`` of the
        episodes. An agent that raises fails its episode (the failure reward)."""
        samples = [r for r in records for _ in range(n)]
        keys = [secrets.token_hex(16) for _ in samples]
        for key in keys:
            self.turns[key] = []
        t0 = time.perf_counter()
        version = self.job.version
        with cf.ThreadPoolExecutor(min(AGENTS_AT_ONCE, len(samples)), thread_name_prefix="agent") as pool:
            futures = [pool.submit(agent, r, self.base_url, key) for r, key in zip(samples, keys, strict=True)]
        answers: list[str | None] = []
        episodes = []
        for record, key, future in zip(samples, keys, futures, strict=True):
            ep = episode_of(record, self.turns.pop(key))
            error = future.exception()
            if error is not None:
                ep.failed = True
                ep.errors.append(f"{type(error).__name__}: {error}")
            answers.append(None if error is not None else str(future.result()))
            episodes.append(ep)
        d, failure = self.job.data, self.job.reward_spec.failure_reward
        scored = [(a, str(r[d.answer_field]), r) for a, r in zip(answers, samples, strict=True) if a is not None]
        rewards = iter(self.job.reward.score_many([(a, ans, r) for a, ans, r in scored]) if scored else [])
        for ep, answer in zip(episodes, answers, strict=True):
            ep.reward = next(rewards) if answer is not None else failure
            ep.done = True
        return Rollout(
            records,
            n,
            episodes,
            [ep.reward for ep in episodes],
            version,
            errors=sum(ep.failed for ep in episodes),
            generate_s=time.perf_counter() - t0,
            multi_turn=True,
        )
