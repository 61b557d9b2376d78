"""The library a job's RL loop is written against: the service calls and the job around them.

The runtime owns the plumbing (placement on shared engines, state swaps, adapter publishing); a
loop owns only its control logic, on this module alone:

* ``CallClient``: the service calls (``generate``, ``train_step``, ``publish``,
  ``train_and_publish``, ``checkpoint``, ``restore``; ``*_async`` / ``wait`` to overlap them),
  written once on the typed requests and replies of ``plexctl.common.calls``, over a transport:
  ``JobClient`` (ZeroMQ to the daemon, which schedules each call on a shared engine; it survives
  a daemon restart) or ``daemon.inproc.InprocClient`` (the daemon's core and engines in the
  caller's process, for a one-job script).
* ``Job``: the job as its loop sees it: ``client``, ``spec``, ``prompts`` (a ``PromptCursor``),
  ``rng`` (seeded by ``spec.seed``, saved in checkpoints), ``reward`` (built-ins here, a custom
  ``fn`` in the sandbox pool), ``log``; and helpers that compose the calls: ``rollout`` (generate
  and score, or multi-turn episodes), ``train``, ``publish``, ``evaluate``, ``record``,
  ``end_step`` (periodic checkpoints; when the cluster stops, checkpoint and ``JobDrained``),
  ``checkpoint`` / ``resume``.
* ``Rollout``: a step's samples, prompt-major in groups of ``n``, with their rewards; it becomes
  a ``TrainBatch`` once the loop has computed one advantage per sample.

The built-in algorithms (``plexctl/algos``) use nothing else; a user's ``algo.loop`` gets a
``Job`` in the job's driver process. Pure Python: importable without torch or vLLM. It computes
no advantages (the loop's job) and no losses (named, in the trainer).
"""

from __future__ import annotations

import abc
import dataclasses
import json
import os
import random
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.utils.monitor

from plexctl.common import auth
from plexctl.common import calls as C
from plexctl.common import protocol as P
from plexctl.common.atomic import write_bytes_atomic
from plexctl.common.client import monitor_socket
from plexctl.common.cluster import endpoint_address, orphan_grace
from plexctl.common.frames import recv_message, send_frames
from plexctl.common.jobdir import JobDir
from plexctl.common.protocol import Completion, Sampling, TrainBatch, TrainHParams
from plexctl.common.spec import JobSpec
from plexctl.data import PromptCursor, load_records
from plexctl.metric_sinks import MetricSinks
from plexctl.rewards import make_scorer

if TYPE_CHECKING:
    from plexctl.envs import EnvFactory
    from plexctl.sandbox import SandboxPool

__all__ = [
    "CallClient",
    "CallFailed",
    "Completion",
    "DaemonLost",
    "Job",
    "JobCancelled",
    "JobClient",
    "JobDrained",
    "Rollout",
    "Sampling",
    "TrainBatch",
    "TrainHParams",
    "build_batch",
]

EVAL_SEED = 12345
NO_SPACE = "no space left"  # how a checkpoint fails when its filesystem is full (worker.errors.NoSpaceError)


class JobCancelled(Exception):
    """The job was cancelled: stop at this call boundary."""


class CallFailed(Exception):
    """A service call failed on the engine side."""


class JobDrained(Exception):
    """The cluster is stopping: the job checkpointed at a step boundary and exits; it resumes there."""


class DrainCheckpointFailed(JobDrained):
    """The cluster is stopping but the job's checkpoint found no disk space: the job exits and
    resumes from its last good checkpoint (the message says which)."""


# ---------------------------------------------------------------- the service calls


class DaemonLost(CallFailed):
    """No daemon came back within the orphan grace after this job's daemon went away."""


class CallClient(abc.ABC):
    """The service calls of one job, whatever serves them. A transport fills in ``call_async``
    (send a typed request, return its call id), ``wait`` (that call's typed reply, or
    ``JobCancelled`` / ``CallFailed``), ``report`` and ``close``; the calls a loop makes
    (``generate``, ``train_step``, ``publish`` ...) are written once, here, on the requests and
    replies of ``plexctl.common.calls``. ``JobClient`` reaches the daemon over ZeroMQ;
    ``daemon.inproc.InprocClient`` drives the daemon's core and the engines in this process."""

    def __init__(self) -> None:
        self.drain = ""  # why the daemon asked the job to checkpoint and stop (set by a publish's reply)
        self.train_calls = 0  # train_step calls sent by this process (a loop that sent none trained nothing)

    # -- the transport's part

    @abc.abstractmethod
    def call_async(self, request: C.Request, after: int | None = None) -> int:
        """Send a service call; return its id for ``wait``. ``after``: the id of a call in
        flight this one must follow; it starts the moment that one is done (no trip back here
        in between), and fails if that one fails."""

    @abc.abstractmethod
    def wait(self, call_id: int) -> Any:
        """The reply of call ``call_id`` (its method's ``plexctl.common.calls`` reply struct);
        ``JobCancelled`` or ``CallFailed`` when it failed."""

    @abc.abstractmethod
    def report(self, event: str, step: int, metrics: dict[str, float], message: str = "") -> None:
        """Progress for the daemon: ``step`` (reward_mean), ``eval`` (eval_reward), ``note`` or ``failed``."""

    def close(self) -> None:  # noqa: B027 - a transport with nothing to close need not say so
        """Let go of what the transport holds (nothing by default)."""

    # -- the calls

    def call(self, request: C.Request | str, args: dict[str, Any] | None = None) -> Any:
        """A call by its request, or by its method's name and the request's fields; its reply."""
        if isinstance(request, str):
            request = C.request_of(request, args)
        return self.wait(self.call_async(request))

    def generate_async(self, prompts: list[str], sampling: Sampling, after: int | None = None) -> int:
        """Start generating ``sampling.n`` samples per prompt; ``completions(wait(id))`` later.
        ``after``: a ``train_and_publish_async`` call in flight: generate from the adapter it
        publishes, started the moment it lands."""
        return self.call_async(C.GenerateReq(prompts, sampling), after)

    def completions(self, reply: C.GenerateRep) -> list[Completion]:
        return reply.completions

    def generate(self, prompts: list[str], sampling: Sampling) -> list[Completion]:
        """``sampling.n`` completions per prompt, prompt-major, from the job's current policy."""
        return self.completions(self.wait(self.generate_async(prompts, sampling)))

    def train_step(self, batch: TrainBatch, hp: TrainHParams | None = None, **changes: Any) -> dict[str, float]:
        """One optimizer step on the job's adapter; ``changes`` override fields of ``hp``,
        e.g. ``loss="pg-tis", loss_params={"cap": 2.0}, loss_agg="seq-mean-token-sum"``."""
        hp = hp or TrainHParams()
        if changes:
            hp = msgspec.structs.replace(hp, **changes)
        reply: C.TrainStepRep = self.wait(self.call_async(C.TrainStepReq(batch, hp)))
        return reply.metrics

    def publish(self) -> int:
        """Make the trained adapter the rollout policy; return its policy version. When the
        daemon is stopping, the reply says so and ``drain`` holds why."""
        reply: C.PublishRep = self.wait(self.call_async(C.PublishReq()))
        self.drain = reply.drain or self.drain
        return reply.version

    def train_and_publish(self, batch: TrainBatch, hp: TrainHParams | None = None) -> tuple[dict[str, float], int]:
        """``train_step`` then ``publish`` in one call (one round trip to the trainer, not two):
        the step's metrics and the new policy version."""
        return self.published(self.wait(self.train_and_publish_async(batch, hp)))

    def train_and_publish_async(self, batch: TrainBatch, hp: TrainHParams | None = None) -> int:
        """Start ``train_and_publish``; ``published(wait(id))`` later."""
        return self.call_async(C.TrainStepReq(batch, hp or TrainHParams(), publish=True))

    def published(self, reply: C.TrainStepRep) -> tuple[dict[str, float], int]:
        """The metrics and new policy version of a ``train_and_publish`` reply."""
        self.drain = reply.drain or self.drain
        return dict(reply.metrics), reply.version

    def checkpoint(self, step: int, extra: dict[str, Any]) -> str:
        """Save adapter, optimizer and ``extra`` (JSON) durably, atomically; return the directory."""
        reply: C.CheckpointRep = self.wait(self.call_async(C.CheckpointReq(step, extra)))
        return reply.path

    def restore(self) -> dict[str, Any] | None:
        """Reload the latest checkpoint into the trainer; return its ``extra`` (None: none yet)."""
        reply: C.RestoreRep = self.wait(self.call_async(C.RestoreReq()))
        return reply.extra

    def forward_backward(self, call: C.LossCall) -> C.ForwardBackwardRep:
        """A token-level loss call (the Tinker API's ``forward_backward``): each datum's
        log-probs of its target tokens and the loss's sum; nothing changes until
        ``optim_step``, which is given the calls to take the gradient of."""
        reply: C.ForwardBackwardRep = self.wait(self.call_async(C.ForwardBackwardReq(call)))
        return reply

    def optim_step(
        self, calls: list[C.LossCall], adam: C.AdamStep | None = None, publish: bool = False
    ) -> C.OptimStepRep:
        """One AdamW step on the summed gradient of ``calls`` (the loss calls since the last
        step, in order); ``publish``: then the result becomes the rollout policy."""
        reply: C.OptimStepRep = self.wait(self.call_async(C.OptimStepReq(calls, adam or C.AdamStep(), publish)))
        return reply


class JobClient(CallClient):
    """The service calls of one job, over one ZeroMQ socket to the daemon.

    The job outlives its daemon: when the connection drops (or the daemon that started this
    driver dies) the client keeps its calls in flight and waits, up to ``PLEXRL_ORPHAN_GRACE_S``,
    for a daemon to come back on the same state directory (at the address in
    ``endpoint_file`` if it moved); once connected again it sends those calls again. The new
    daemon adopted this job, and a repeated trainer call is applied once (worker.servers).
    """

    def __init__(
        self,
        endpoint: str,
        job_id: str,
        parent_pid: int | None = None,
        keys: auth.CurveKeys | None = None,
        endpoint_file: Path | None = None,
        log: Callable[[str], None] | None = None,
        identity: str = "",
    ) -> None:
        """``identity``: the socket's name at the daemon (default ``drv:JOB``, the job's driver's;
        another client of the same job, e.g. the Tinker front end, needs its own)."""
        super().__init__()
        self.job_id = job_id
        self.parent_pid = parent_pid
        self.endpoint = endpoint
        self.endpoint_file = endpoint_file
        self.log = log or (lambda _msg: None)
        self._sock: zmq.Socket = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, (identity or f"drv:{job_id}").encode())
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)  # back off while the daemon is away
        keys = keys or auth.internal_keys_from_env()  # the daemon names its keys in the driver's environment
        if keys is not None:
            keys.apply(self._sock)
        self._back_event = zmq.EVENT_HANDSHAKE_SUCCEEDED if keys is not None else zmq.EVENT_CONNECTED
        self._monitor = monitor_socket(self._sock, zmq.EVENT_DISCONNECTED | self._back_event)
        self._sock.connect(endpoint)
        self._replies: dict[int, tuple[bytes, Any]] = {}
        self._in_flight: dict[int, list[bytes]] = {}  # call id -> its frames, until the reply
        self._reply_types: dict[int, type[C.Reply]] = {}  # call id -> its method's reply type
        self._partials: dict[int, Callable[[P.PartialBody], None]] = {}  # call id -> where its tokens go
        self._lost_since: float | None = None  # when the daemon went away
        self._connected_once = False

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close()

    def call_async(
        self, request: C.Request, after: int | None = None, on_partial: Callable[[P.PartialBody], None] | None = None
    ) -> int:
        """``CallClient.call_async``; ``on_partial``: called, in ``wait``, with each batch of tokens a
        streamed generate (``Sampling.stream``) sampled, before its reply."""
        frames, msg_id = P.encode(P.Op.CALL, P.CallReq(self.job_id, request, after or 0))  # type: ignore[arg-type]
        self._in_flight[msg_id] = frames
        self._reply_types[msg_id] = C.METHODS[request.method].reply
        if on_partial is not None:
            self._partials[msg_id] = on_partial
        self.train_calls += request.method == "train_step"
        send_frames(self._sock, frames)
        return msg_id

    def _watch_daemon(self) -> None:
        """Notice the daemon going away and coming back; send the calls in flight again."""
        # its parent first: the daemon died before this socket saw it go, and a new daemon
        # this driver has reconnected to already (the events below) is not lost
        if self.parent_pid is not None and os.getppid() != self.parent_pid:
            self.parent_pid = None
            if self._lost_since is None:
                self._lost("the daemon that started this driver is gone")
        while self._monitor.poll(0):
            event = zmq.utils.monitor.recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED and self._lost_since is None:
                self._lost(f"lost the daemon at {self.endpoint}")
            elif event == self._back_event:
                if self._lost_since is not None or self._connected_once and self._in_flight:
                    self.log(
                        f"reconnected to the daemon at {self.endpoint}: sending "
                        f"{len(self._in_flight)} calls in flight again"
                    )
                    for frames in list(self._in_flight.values()):
                        send_frames(self._sock, frames)
                self._lost_since, self._connected_once = None, True
        if self._lost_since is None:
            return
        if time.monotonic() - self._lost_since > orphan_grace():
            raise DaemonLost(f"no daemon came back within {orphan_grace():.0f} s")
        self._follow_endpoint()

    def _lost(self, why: str) -> None:
        self._lost_since = time.monotonic()
        self.log(f"{why}: waiting up to {orphan_grace():.0f} s for it to come back")

    def _follow_endpoint(self) -> None:
        address = endpoint_address(self.endpoint_file) if self.endpoint_file else None
        if address and address != self.endpoint:
            self.log(f"the daemon moved to {address}")
            self._sock.disconnect(self.endpoint)
            self._sock.connect(address)
            self.endpoint = address

    def wait(self, call_id: int) -> Any:
        while call_id not in self._replies:
            self._watch_daemon()
            if not self._sock.poll(200):
                continue
            try:
                op, header, body = P.decode(recv_message(self._sock))
            except P.ProtocolError:
                continue
            if op == P.Op.PARTIAL:
                told = self._partials.get(header.in_reply_to)
                if told is not None and header.in_reply_to in self._in_flight:
                    told(body)
                continue
            if self._in_flight.pop(header.in_reply_to, None) is not None:  # not a repeated reply
                self._replies[header.in_reply_to] = (op, body)
        op, body = self._replies.pop(call_id)
        reply_type = self._reply_types.pop(call_id)
        self._partials.pop(call_id, None)
        if op == P.Op.ERROR:
            if body.code == "cancelled":
                raise JobCancelled(body.message)
            raise CallFailed(f"{body.code}: {body.message}")
        return msgspec.convert(body, reply_type)

    def report(self, event: str, step: int, metrics: dict[str, float], message: str = "") -> None:
        frames, _ = P.encode(P.Op.REPORT, P.ReportBody(self.job_id, event, step, metrics, message))
        send_frames(self._sock, frames)


# ---------------------------------------------------------------- a step's samples


def build_batch(comps: list[Completion], advantages: list[float]) -> TrainBatch:
    """One row per completion: prompt tokens (mask 0) then generated tokens (mask 1)."""
    input_ids, mask, old = [], [], []
    for c in comps:
        n_prompt = len(c.prompt_token_ids)
        input_ids.append(list(c.prompt_token_ids) + list(c.token_ids))
        mask.append([0] * n_prompt + [1] * len(c.token_ids))
        old.append([0.0] * n_prompt + list(c.logprobs))
    return TrainBatch(input_ids=input_ids, loss_mask=mask, old_logprobs=old, advantages=advantages)


@dataclasses.dataclass
class Rollout:
    """Samples of ``records`` (``n`` per record, prompt-major) with their rewards.

    ``samples`` are ``Completion``s, or ``Episode``s for a multi-turn job. ``errors`` counts
    the reward errors and tool timeouts met while scoring them.
    """

    records: list[dict]
    n: int
    samples: list[Any]
    rewards: list[float]
    policy_version: int
    errors: int = 0
    generate_s: float = 0.0
    multi_turn: bool = False

    @property
    def lengths(self) -> list[int]:
        """Generated (trainable) tokens per sample."""
        if self.multi_turn:
            return [sum(ep.loss_mask) for ep in self.samples]
        return [len(c.token_ids) for c in self.samples]

    def groups(self) -> list[list[float]]:
        """Rewards per record."""
        return [self.rewards[g * self.n : (g + 1) * self.n] for g in range(len(self.records))]

    def keep(self, groups: Iterable[int]) -> Rollout:
        """Only the given groups (records), in that order."""
        groups = list(groups)
        index = [g * self.n + k for g in groups for k in range(self.n)]
        return dataclasses.replace(
            self,
            records=[self.records[g] for g in groups],
            samples=[self.samples[i] for i in index],
            rewards=[self.rewards[i] for i in index],
        )

    def __add__(self, other: Rollout) -> Rollout:
        """Both rollouts' groups (the older policy version is kept: staleness is a maximum)."""
        if other.n != self.n or other.multi_turn != self.multi_turn:
            raise ValueError("cannot join rollouts of different group sizes or kinds")
        return Rollout(
            self.records + other.records,
            self.n,
            self.samples + other.samples,
            self.rewards + other.rewards,
            min(self.policy_version, other.policy_version),
            self.errors + other.errors,
            self.generate_s + other.generate_s,
            self.multi_turn,
        )

    def batch(self, advantages: list[float]) -> TrainBatch:
        """The ``TrainBatch`` of these samples with one advantage each."""
        if len(advantages) != len(self.samples):
            raise ValueError(f"{len(self.samples)} samples but {len(advantages)} advantages")
        if self.multi_turn:
            from plexctl.envs.base import episode_batch

            return episode_batch(self.samples, advantages)
        return build_batch(self.samples, advantages)

    def env_metrics(self) -> dict[str, float]:
        """Episode accounting of a multi-turn rollout (turns, tool calls, failures); else {}."""
        if not self.multi_turn:
            return {}
        from plexctl.envs.base import episode_metrics

        return episode_metrics(self.samples)


@dataclasses.dataclass
class PendingRollout:
    """A rollout on its way: a generate call in flight, or episodes to run when waited on."""

    records: list[dict]
    n: int
    sampling: Sampling
    msg_id: int | None  # None: multi-turn, run by ``Job.wait``


@dataclasses.dataclass
class PendingTrain:
    """A ``train_and_publish`` call in flight (``Job.train_async``); ``msg_id`` None: nothing
    to learn from, no call made."""

    msg_id: int | None


# ---------------------------------------------------------------- the job


@dataclasses.dataclass
class Job:
    """One job as its loop sees it; the driver builds it and passes it to the algorithm."""

    client: CallClient
    spec: JobSpec
    job_dir: Path
    log: Callable[[str], None] = print
    version: int = 0  # the policy version last published
    restored: dict[str, Any] = dataclasses.field(default_factory=dict)  # the checkpoint ``extra`` resumed from
    checkpoint_step: int = 0  # the step of the last checkpoint written or resumed from (0: none)

    def __post_init__(self) -> None:
        spec = self.spec
        d, reward = self.data, self.reward_spec = spec.loop_parts()
        self.records = load_records(d.path, d.prompt_field, d.answer_field)
        self.eval_records = load_records(d.eval_path, d.prompt_field, d.answer_field) if d.eval_path else None
        self.prompts = PromptCursor(self.records, seed=d.shuffle_seed)
        self.rng = random.Random(spec.seed)
        self.reward_pool: SandboxPool | None = None
        if reward.fn:  # a user's reward runs in the sandbox pool, never in this process
            from plexctl.sandbox import SandboxPool

            self.reward_pool = SandboxPool()
        self.reward = make_scorer(reward, reward.failure_reward, self.reward_pool, reward.timeout_s)
        self.metrics_path = JobDir(self.job_dir).metrics
        self.sinks = MetricSinks(self.job_dir, spec.name, self.log)  # TensorBoard / wandb copies, when installed
        self.env_factory: EnvFactory | None = None
        self.env_pool: SandboxPool | None = None
        self._agents: Any = None  # the agent endpoint of ``algo.agent``, open from its first rollout
        self._agent_fn: Any = None
        if spec.env is not None:  # multi-turn episodes with tools, scored by the environment
            from plexctl.envs import load_env
            from plexctl.sandbox import SandboxPool

            e = spec.env
            self.env_factory = load_env({"name": e.name, "cls": e.cls, "path": e.path, "config": e.config})
            self.env_pool = SandboxPool(max_workers=e.workers)

    def close(self) -> None:
        """Stop the sandbox pools and the agent endpoint, and remove the staged copy of the user's
        reward directory."""
        if self._agents is not None:
            self._agents.__exit__(None, None, None)
            self._agents = None
        if hasattr(self.reward, "close"):
            self.reward.close()
        self.sinks.close()
        for pool in (self.reward_pool, self.env_pool):
            if pool is not None:
                pool.close(wait=False)

    @property
    def multi_turn(self) -> bool:
        return self.env_factory is not None or self.spec.algo.agent is not None

    def _agent_rollout(self, records: list[dict], n: int) -> Rollout:
        """``n`` episodes of the spec's ``algo.agent`` per record, through the job's agent endpoint
        (opened at the first, kept until ``close``)."""
        from plexctl.common.user_code import import_object

        a = self.spec.algo
        assert a.agent is not None
        if self._agents is None:
            self._agent_fn = import_object(a.agent, a.path, "algo agent", ValueError)
            self._agents = self.agent_endpoint().__enter__()
        return self._agents.rollout(records, n, self._agent_fn)

    # -- sampling and rollouts

    def sampling(self, step: int, n: int, seed: int | None = None) -> Sampling:
        """The spec's sampling with ``n`` samples per prompt; the seed defaults to one per step."""
        s = self.spec.sampling
        return Sampling(
            temperature=s.temperature,
            top_p=s.top_p,
            max_tokens=s.max_tokens,
            n=n,
            seed=seed if seed is not None else self.spec.seed * 1_000_003 + step,
        )

    def score(self, records: list[dict], comps: list[Completion], n: int) -> list[float]:
        """The job's reward of each completion (``n`` per record); failures give failure_reward."""
        d = self.data
        return self.reward.score_many(
            [(c.text, str(records[i // n][d.answer_field]), records[i // n]) for i, c in enumerate(comps)]
        )

    def episodes(self, records: list[dict], n: int, sampling: Sampling) -> list:
        """Run ``n`` multi-turn episodes per record; each turn of all of them is one generate call."""
        from plexctl.envs import run_episodes

        e = self.spec.env
        assert e is not None and self.env_factory is not None and self.env_pool is not None  # multi-turn jobs only
        samples = [r for r in records for _ in range(n)]
        envs = [self.env_factory() for _ in samples]
        return run_episodes(
            self.client.generate,
            envs,
            samples,
            msgspec.structs.replace(sampling, n=1),
            e.max_turns,
            self.env_pool,
            failure_reward=self.reward_spec.failure_reward,
            truncated_reward=e.truncated_reward,
            step_timeout_s=e.step_timeout_s,
            max_total_tokens=e.max_total_tokens,
        )

    def rollout_async(
        self, records: list[dict], n: int, sampling: Sampling, after: PendingTrain | None = None
    ) -> PendingRollout:
        """Start generating ``n`` samples per record; ``after``: from the adapter that training
        call publishes, started the moment it lands. Multi-turn episodes cannot run ahead (each
        turn waits on the last one's tools): they run when waited on."""
        msg_id = None
        if not self.multi_turn:
            prompts = [r[self.data.prompt_field] for r in records]
            msg_id = self.client.generate_async(
                prompts, msgspec.structs.replace(sampling, n=n), after.msg_id if after is not None else None
            )
        return PendingRollout(records, n, sampling, msg_id)

    def wait(self, pending: PendingRollout) -> Rollout:
        """The scored ``Rollout`` of ``pending``; ``generate_s`` is the time spent generating."""
        t0 = time.perf_counter()
        if pending.msg_id is None and self.spec.algo.agent is not None:
            return self._agent_rollout(pending.records, pending.n)
        if pending.msg_id is None:
            episodes = self.episodes(pending.records, pending.n, pending.sampling)
            rewards = [ep.reward for ep in episodes]
            rollout = Rollout(
                pending.records,
                pending.n,
                episodes,
                rewards,
                self.version,
                multi_turn=True,
                generate_s=time.perf_counter() - t0,
            )
            env = rollout.env_metrics()
            rollout.errors = int(env.get("reward_errors", 0) + env.get("tool_timeouts", 0))
            return rollout
        reply = self.client.wait(pending.msg_id)
        comps = self.client.completions(reply)
        version = reply.policy_version
        generate_s = time.perf_counter() - t0
        errors_before = getattr(self.reward, "errors", 0)
        rewards = self.score(pending.records, comps, pending.n)
        return Rollout(
            pending.records,
            pending.n,
            comps,
            rewards,
            version,
            errors=getattr(self.reward, "errors", 0) - errors_before,
            generate_s=generate_s,
        )

    def rollout(self, records: list[dict], n: int, sampling: Sampling) -> Rollout:
        """Generate ``n`` samples per record and score them (or run episodes), now."""
        return self.wait(self.rollout_async(records, n, sampling))

    def agent_endpoint(self) -> Any:
        """The job's current policy over the OpenAI API, for agent code (``plexctl.agents.AgentEndpoint``):
        ``with job.agent_endpoint() as agents: rollout = agents.rollout(records, n, agent)``."""
        from plexctl.agents import AgentEndpoint

        return AgentEndpoint(self)

    # -- training and publishing

    def hparams(self, **changes: Any) -> TrainHParams:
        """The spec's loss and optimizer settings as ``TrainHParams``; ``changes`` override them."""
        a = self.spec.algo
        hp = TrainHParams(
            lr=a.lr,
            clip_low=a.clip_range,
            clip_high=a.clip_range_high or a.clip_range,
            kl_coef=a.kl_coef,
            loss_agg=a.loss_agg,
            loss=a.loss,
            loss_params=dict(a.loss_params),
        )
        if a.loss_fn:
            hp = msgspec.structs.replace(hp, loss_fn=a.loss_fn, loss_path=a.path or "")
        hp = msgspec.structs.replace(hp, **changes) if changes else hp
        if hp.loss_agg == "seq-mean-token-sum-norm" and hp.loss_agg_len == 0:
            hp = msgspec.structs.replace(hp, loss_agg_len=self.max_response_tokens())
        return hp

    def max_response_tokens(self) -> int:
        """Most trainable tokens a sample can have (a multi-turn episode: every turn's budget)."""
        turns = self.spec.env.max_turns if self.spec.env is not None else 1
        return self.spec.sampling.max_tokens * turns

    def train(
        self, rollout: Rollout, advantages: list[float], hp: TrainHParams, publish: bool = False
    ) -> dict[str, float]:
        """One optimizer step on ``rollout`` with one advantage per sample; ``publish``: then
        make the result the rollout policy, in the same call (``version`` follows)."""
        if publish:
            return self.wait_train(self.train_async(rollout, advantages, hp))
        batch = self._batch(rollout, advantages)
        return self.client.train_step(batch, hp) if batch is not None else {}

    def _batch(self, rollout: Rollout, advantages: list[float]) -> TrainBatch | None:
        """``rollout``'s batch; None (noted in the log) when no sample has a token to learn from."""
        batch = rollout.batch(advantages)
        if not batch.input_ids:  # every episode failed before generating a token
            self.log("no sample with a token to learn from: update skipped")
            return None
        return batch

    def train_async(self, rollout: Rollout, advantages: list[float], hp: TrainHParams) -> PendingTrain:
        """Start one optimizer step on ``rollout`` and the publish of its result, in one call;
        ``wait_train`` for its metrics. A ``rollout_async(..., after=`` it``)`` sent meanwhile
        samples from the new adapter without waiting on this process."""
        batch = self._batch(rollout, advantages)
        return PendingTrain(self.client.train_and_publish_async(batch, hp) if batch is not None else None)

    def wait_train(self, pending: PendingTrain) -> dict[str, float]:
        """The metrics of ``train_async``'s step; the policy version moves to the one it published."""
        if pending.msg_id is None:
            return {}
        metrics, self.version = self.client.published(self.client.wait(pending.msg_id))
        return metrics

    def publish(self) -> int:
        """Make the trained adapter the rollout policy; ``version`` follows."""
        self.version = self.client.publish()
        return self.version

    # -- evaluation, metrics, checkpoints

    def evaluate(self, step: int) -> float | None:
        """Mean reward on the fixed evaluation prompts (fixed sampling seed); None without them."""
        if not self.eval_records:
            return None
        n = self.spec.algo.eval_samples
        sampling = self.sampling(step, n, seed=EVAL_SEED)
        if self.spec.algo.agent is not None:
            rewards = self._agent_rollout(self.eval_records, n).rewards
        elif self.multi_turn:
            rewards = [ep.reward for ep in self.episodes(self.eval_records, n, sampling)]
        else:
            prompts = [r[self.data.prompt_field] for r in self.eval_records]
            rewards = self.score(self.eval_records, self.client.generate(prompts, sampling), n)
        value = sum(rewards) / len(rewards)
        self.client.report("eval", step, {"eval_reward": value})
        self.write_metrics({"step": step, "eval_reward": value})
        self.log(f"eval at step {step}: reward {value:.4f} over {len(rewards)} samples")
        return value

    def write_metrics(self, row: dict[str, Any]) -> None:
        row = {"time": time.time(), **row}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self.sinks.write(row)

    def record(self, step: int, row: dict[str, Any]) -> None:
        """Append a step's metrics to ``metrics.jsonl`` and report them (``reward_mean`` shows in
        ``plexctl status``)."""
        row = {"step": step, **row}
        self.write_metrics(row)
        self.client.report("step", step, {k: float(v) for k, v in row.items()})

    def checkpoint(self, step: int, **extra: Any) -> str:
        """Save the trainer state with the data cursor, the RNG and ``extra`` (JSON values)."""
        version, state, gauss = self.rng.getstate()
        path = self.client.checkpoint(
            step, {"step": step, "cursor": self.prompts.state(), "rng": [version, list(state), gauss], **extra}
        )
        self.checkpoint_step = step
        return path

    def end_step(self, step: int, **extra: Any) -> None:
        """Call after step ``step`` (1-based): checkpoints (with ``extra``) every
        ``checkpoint.every`` steps before the last; when the daemon is stopping, checkpoints now
        and raises ``JobDrained``. A checkpoint that finds no disk space does not end the job:
        one line is logged and noted in the journal, training goes on and the next checkpoint
        tries again; when stopping, ``DrainCheckpointFailed`` (the job resumes from the last good one)."""
        if self.client.drain:
            try:
                self.checkpoint(step, **extra)
            except CallFailed as exc:
                if NO_SPACE not in str(exc):
                    raise
                then = (
                    f"the job resumes from step {self.checkpoint_step}"
                    if self.checkpoint_step
                    else "the job starts again from the beginning"
                )
                line = self._checkpoint_skipped(step, exc, then)
                raise DrainCheckpointFailed(f"{self.client.drain}; {line}") from None
            raise JobDrained(self.client.drain)
        every = self.spec.checkpoint.every
        if every and step % every == 0 and step < self.spec.algo.steps:
            try:
                self.checkpoint(step, **extra)
            except CallFailed as exc:
                if NO_SPACE not in str(exc):
                    raise
                self._checkpoint_skipped(step, exc, "training goes on, the next checkpoint tries again")

    def _checkpoint_skipped(self, step: int, exc: CallFailed, then: str) -> str:
        """Log and note (in the journal) a checkpoint that found no disk space; return that line."""
        text = str(exc)
        last = (
            f"the last good checkpoint (step {self.checkpoint_step}) is kept"
            if self.checkpoint_step
            else "there is no checkpoint yet"
        )
        line = f"{text[text.index(NO_SPACE) :]}; {last}; {then}"
        self.log(line)
        self.client.report("note", step, {}, line)
        return line

    def resume(self) -> int:
        """Reload the latest checkpoint, if any: trainer state, cursor, RNG, then publish it.
        Return the step to continue from (0: a fresh start); ``restored`` holds its ``extra``."""
        restored = self.client.restore()
        if not restored:  # a fresh start (perhaps again, after a crash before any checkpoint)
            self.metrics_path.unlink(missing_ok=True)
            return 0
        self.restored = restored
        start = self.checkpoint_step = int(restored["step"])
        self.prompts = PromptCursor.from_state(self.records, restored["cursor"])
        if "rng" in restored:
            version, state, gauss = restored["rng"]
            self.rng.setstate((version, tuple(state), gauss))
        self.publish()
        self._forget_metrics_after(start)
        self.log(f"resumed from checkpoint at step {start} (policy version {self.version})")
        return start

    def _forget_metrics_after(self, step: int) -> None:
        """Drop metrics of steps past the checkpoint: they run again, and are recorded again."""
        if not self.metrics_path.exists():
            return
        lines = self.metrics_path.read_text().splitlines(keepends=True)
        kept = [ln for ln in lines if ln.strip() and json.loads(ln).get("step", 0) <= step]
        if len(kept) != len(lines):
            write_bytes_atomic(self.metrics_path, "".join(kept).encode())
