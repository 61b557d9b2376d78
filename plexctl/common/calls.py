"""The service calls: one typed struct per step of each call, and one table of them all.

A call goes four ways: the job's loop sends a *request* (``CallReq.request``); the daemon makes
it an engine *task* (``TaskBody.task``), adding what only it knows (the adapter to sample from,
the job's trainer context, where to write); the engine answers with a *result*
(``ResultBody.value``); the daemon answers the loop with the *reply*, adding what it decided
(the policy version, a drain). Each call is one ``Method``: its four types, the kind of engine
that serves it, and how the daemon makes the task and the reply through a ``CallSite`` (the
daemon's view of the job). ``METHODS`` holds them all; the job client (``plexctl.rl``), the
daemon and the worker all read it.

Requests, tasks and results are tagged structs whose tag is the method's name: the wire names the
call, and a body of the wrong shape is refused when it is decoded. The engine data types that
travel inside calls (``GenRequest``, ``Completion``, ``TrainBatch`` ...) live here too, so that
the processes agree on them without importing each other; a trainer task's LoRA settings are the
job spec's own ``LoraSpec`` (one struct, its wire fields the spec's). Pure msgspec: no torch, no vLLM.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Protocol

import msgspec

from plexctl.common.losses import DEFAULT_RL_LOSS, loss_names
from plexctl.common.spec import LoraSpec

# ---------------------------------------------------------------- engine data types


class Sampling(msgspec.Struct):
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    n: int = 1
    seed: int | None = None
    top_k: int = -1  # -1: no limit
    stop: list[str] = msgspec.field(default_factory=list)  # strings that end a sample (besides EOS)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)  # tokens that end a sample
    ignore_eos: bool = False  # EOS does not end a sample
    prompt_logprobs: bool = False  # also each prompt token's log-prob (``Completion.prompt_logprobs``)
    topk_prompt_logprobs: int = 0  # also the k likeliest tokens at each prompt position (0: none; at most MAX_TOPK)
    topk_logprobs: int = 0  # also the k likeliest tokens at each sampled position (0: none; at most MAX_TOPK)
    json_schema: str | None = None  # a JSON schema (as JSON text) every sample is held to, token by token
    stream: bool = False  # its tokens sent to the caller as they are sampled (one sample, no prompt log-probs)


MAX_TOPK = 20  # the most top-k log-probs per position a rollout engine gives (vLLM's max_logprobs)


class TokenLogprob(msgspec.Struct, array_like=True):
    """A token and its log-prob at one position."""

    token: int
    logprob: float


class SampleTokens(msgspec.Struct, array_like=True):
    """A sample's next tokens, each with its log-prob (and, as ``Sampling.topk_logprobs`` asks,
    its position's likeliest tokens): what its ``Completion`` will hold at these positions."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float] = msgspec.field(default_factory=list)
    topk_logprobs: list[list[TokenLogprob]] = msgspec.field(default_factory=list)


class AdapterRef(msgspec.Struct):
    """A published policy version of a job, loadable by the rollout engine: a PEFT adapter, or
    (``full``) every weight of the model in ``model.safetensors``, loaded in place."""

    job_id: str
    version: int
    path: str
    full: bool = False


class GenRequest(msgspec.Struct):
    job_id: str
    prompts: list[str]
    sampling: Sampling
    adapter: AdapterRef | None = None  # None: the base model (policy version 0)
    prompt_tokens: list[list[int]] = msgspec.field(default_factory=list)  # prompts as token ids, after ``prompts``


class Completion(msgspec.Struct):
    prompt_index: int
    text: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # log-prob of each sampled token under the behaviour policy
    finish_reason: str
    # asked for (``Sampling.prompt_logprobs``): each prompt token's log-prob, None for the first
    prompt_logprobs: list[float | None] = msgspec.field(default_factory=list)
    # asked for (``Sampling.topk_prompt_logprobs``): each prompt position's likeliest tokens, most
    # likely first, None for the first position
    topk_prompt_logprobs: list[list[TokenLogprob] | None] = msgspec.field(default_factory=list)
    # asked for (``Sampling.topk_logprobs``): each sampled position's likeliest tokens, most likely first
    topk_logprobs: list[list[TokenLogprob]] = msgspec.field(default_factory=list)


class TrainBatch(msgspec.Struct):
    """One GRPO batch. Row i is prompt + completion tokens of one sample.

    ``loss_mask[i][t]`` is 1 where token t is a generated (trainable) token;
    ``old_logprobs[i][t]`` is the behaviour log-prob of token t (0 where masked);
    ``advantages[i]`` is the sequence-level advantage of sample i.
    """

    input_ids: list[list[int]]
    loss_mask: list[list[int]]
    old_logprobs: list[list[float]]
    advantages: list[float]


LOSSES = loss_names("rl")  # TrainHParams.loss: plexctl.common.losses declares each
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


class TrainHParams(msgspec.Struct):
    """How one ``train_step`` turns a batch into an update: the loss by name, its parameters.

    Losses (per token t of sample i, ``r = pi_theta / pi_behaviour``, ``A`` the sample's
    advantage; ``kl_coef`` > 0 adds the k3 KL to the base model):

    * ``pg-clip``: PPO's clipped surrogate ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``.
    * ``pg-tis``: truncated importance sampling for stale samples: the trainer's own log-probs
      at the step are the proximal policy, each token is weighted by ``min(pi_theta /
      pi_behaviour, loss_params["cap"])`` (default 2), detached: ``-A w log pi_theta``.
    * ``loss_fn`` (``module:function``): a trusted user's per-token loss, loaded in the trainer.

    Aggregations (``loss_agg``), the weight of a token loss: ``token-mean`` 1 / all tokens;
    ``seq-mean-token-mean`` 1 / (its row's tokens x rows); ``seq-mean-token-sum`` 1 / rows;
    ``seq-mean-token-sum-norm`` 1 / (``loss_agg_len`` x rows), Dr. GRPO's constant normaliser.
    """

    lr: float = 1e-4
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    loss_agg: str = "token-mean"  # one of LOSS_AGGREGATIONS
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    loss: str = DEFAULT_RL_LOSS  # one of LOSSES
    loss_params: dict[str, float] = msgspec.field(default_factory=dict)
    loss_agg_len: int = 0  # seq-mean-token-sum-norm's constant (0: the batch's longest trainable row)
    loss_fn: str = ""  # "module:function": a trusted user's own token loss, replaces ``loss``
    loss_path: str = ""  # directory holding loss_fn's module
    user_code_trusted: bool = False  # set by the daemon from the job's submitter, never by the driver


class TrainerContext(msgspec.Struct):
    """What every trainer task carries about its job: the state to make resident if it is not,
    the key that makes a repeated call a no-op, and the daemon's expected order of jobs."""

    lora: LoraSpec | None  # the spec's section; None: full fine-tuning
    seed: int
    call_key: str = ""  # "<driver pid>:<call id>": a repeat is answered with the last result, unapplied
    upcoming: list[str] = msgspec.field(default_factory=list)  # jobs expected on this trainer next


# ---------------------------------------------------------------- the four kinds of message


class Request(msgspec.Struct, tag_field="method"):
    """What a job's loop asks (``CallReq.request``)."""

    @property
    def method(self) -> str:
        return str(self.__struct_config__.tag)


class EngineTask(msgspec.Struct, tag_field="method"):
    """What an engine is given to do (``TaskBody.task``)."""

    @property
    def method(self) -> str:
        return str(self.__struct_config__.tag)


class Result(msgspec.Struct, tag_field="method"):
    """What an engine answers (``ResultBody.value``)."""


class Reply(msgspec.Struct):
    """What the daemon answers the loop (a ``REPLY`` body)."""


# generate: the rollout engine samples ``sampling.n`` completions per prompt


class GenerateReq(Request, tag="generate"):
    prompts: list[str]
    sampling: Sampling
    prompt_tokens: list[list[int]] = msgspec.field(default_factory=list)  # prompts given as token ids
    version: int | None = None  # the job's policy version to sample from (None: its current; 0: the base)
    of_job: str = ""  # another job of the same user and base model whose published policy to sample
    # a request a client waits on (an API's sample): the scheduler's interactive class, for the jobs
    # the API front end makes (kind external); other jobs' calls are batch work whatever they say
    interactive: bool = False


class GenerateTask(EngineTask, tag="generate"):
    request: GenRequest  # with the adapter of the policy it samples from


class GenerateResult(Result, tag="generate"):
    completions: list[Completion]


class GenerateRep(Reply):
    completions: list[Completion]
    policy_version: int  # the policy the samples come from


# train_step: one optimizer step; with ``publish``, then the adapter becomes the rollout policy


class TrainStepReq(Request, tag="train_step"):
    batch: TrainBatch
    hp: TrainHParams = msgspec.field(default_factory=TrainHParams)
    publish: bool = False


class TrainStepTask(EngineTask, tag="train_step"):
    trainer: TrainerContext
    batch: TrainBatch
    hp: TrainHParams
    publish_dir: str = ""  # where to save the adapter after the step ("": no publish)


class TrainStepResult(Result, tag="train_step"):
    metrics: dict[str, float]  # the step's, with the swap-in it waited for (swap_bytes, swap_seconds ...)


class TrainStepRep(Reply):
    metrics: dict[str, float]
    version: int = 0  # the policy version it published (0: it did not)
    drain: str = ""  # why the cluster is stopping: checkpoint at this step's end and exit


# publish: the trained adapter becomes the rollout policy


class PublishReq(Request, tag="publish"):
    pass


class PublishTask(EngineTask, tag="publish"):
    trainer: TrainerContext
    out_dir: str


class PublishResult(Result, tag="publish"):
    pass


class PublishRep(Reply):
    version: int
    drain: str = ""


# checkpoint: adapter, optimizer and the loop's ``extra`` (JSON), durably


class CheckpointReq(Request, tag="checkpoint"):
    step: int
    extra: dict[str, Any] = msgspec.field(default_factory=dict)


class CheckpointTask(EngineTask, tag="checkpoint"):
    trainer: TrainerContext
    out_dir: str
    extra: dict[str, Any]


class CheckpointResult(Result, tag="checkpoint"):
    manifest: dict[str, Any]


class CheckpointRep(Reply):
    path: str


# restore: the latest checkpoint (or a named one of the user's jobs) back into the trainer


class RestoreReq(Request, tag="restore"):
    ckpt_dir: str = ""  # "": the job's latest; else a checkpoint of one of its user's jobs
    weights_only: bool = False  # the optimizer starts afresh (AdamW moments and step zeroed)


class RestoreTask(EngineTask, tag="restore"):
    trainer: TrainerContext
    ckpt_dir: str
    weights_only: bool = False


class RestoreResult(Result, tag="restore"):
    extra: dict[str, Any]


class RestoreRep(Reply):
    extra: dict[str, Any] | None = None  # None: no checkpoint yet


# forward_backward and optim_step: token-level losses as the Tinker API defines them. A
# forward_backward call computes a loss call's per-token log-probs and loss and changes nothing;
# optim_step takes the loss calls made since the last step (kept by the client), computes their
# summed gradient and makes one AdamW step. So no gradient outlives a call: a job's state moves
# between tiers between any two calls as it does between train steps.


TOKEN_LOSSES = loss_names("token")  # a LossCall's loss_fn: plexctl.common.losses declares each


class TokenDatum(msgspec.Struct):
    """One sequence: the model input's tokens and, at each of its positions ``i``, the loss inputs
    for predicting ``target_tokens[i]`` (the next token). Each list present has ``len(tokens)``."""

    tokens: list[int]
    target_tokens: list[int]
    weights: list[float] | None = None  # cross_entropy
    logprobs: list[float] | None = None  # the sampler's, for the importance-weighted losses
    advantages: list[float] | None = None
    sequence_ratio_mask: list[float] | None = None  # gspo: the tokens its sequence ratio averages over


class LossCall(msgspec.Struct):
    """The data and loss of one forward_backward call; ``loss_fn`` one of ``TOKEN_LOSSES``."""

    data: list[TokenDatum]
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict[str, float] = msgspec.field(default_factory=dict)


class AdamStep(msgspec.Struct):
    """One AdamW step's settings (torch.optim.AdamW; ``grad_clip_norm`` 0: no clipping)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class ForwardBackwardReq(Request, tag="forward_backward"):
    call: LossCall


class ForwardBackwardTask(EngineTask, tag="forward_backward"):
    trainer: TrainerContext
    call: LossCall


class ForwardBackwardResult(Result, tag="forward_backward"):
    logprobs: list[list[float]]  # per datum, at each position: log p(target_tokens[i])
    loss: float  # the loss's sum over tokens and data


class ForwardBackwardRep(Reply):
    logprobs: list[list[float]]
    loss: float


class OptimStepReq(Request, tag="optim_step"):
    calls: list[LossCall]  # the forward_backward calls since the last step, in order
    adam: AdamStep = msgspec.field(default_factory=AdamStep)
    publish: bool = False


class OptimStepTask(EngineTask, tag="optim_step"):
    trainer: TrainerContext
    calls: list[LossCall]
    adam: AdamStep
    publish_dir: str = ""


class OptimStepResult(Result, tag="optim_step"):
    metrics: dict[str, float]


class OptimStepRep(Reply):
    metrics: dict[str, float]
    version: int = 0  # the policy version it published (0: it did not)


AnyRequest = GenerateReq | TrainStepReq | PublishReq | CheckpointReq | RestoreReq | ForwardBackwardReq | OptimStepReq
AnyTask = (
    GenerateTask | TrainStepTask | PublishTask | CheckpointTask | RestoreTask | ForwardBackwardTask | OptimStepTask
)
AnyResult = (
    GenerateResult
    | TrainStepResult
    | PublishResult
    | CheckpointResult
    | RestoreResult
    | ForwardBackwardResult
    | OptimStepResult
)


class CallRefused(Exception):
    """A call the daemon answers with an error instead of a task: ``code`` (a protocol error
    code, e.g. ``bad_request``) and one line ``why``."""

    def __init__(self, code: str, why: str) -> None:
        super().__init__(why)
        self.code, self.why = code, why


class CallSite(Protocol):
    """The daemon's side of one call of one job, as a method makes its task: what it knows of
    the job, and the decisions only it takes (which policy to sample, the next version's
    directory, where checkpoints live). The ``reserve``/``checkpoint_to`` decisions are recorded
    in the call (``Made``) for its reply."""

    job_id: str
    trainer: TrainerContext  # the job's, with this call's key
    trusted: bool  # the job's user may run code in the trainer

    def sample_from(self, version: int | None, of_job: str = "") -> AdapterRef | None:
        """The adapter of the job's policy ``version`` (None: the current; 0 or None back: the
        base), or of job ``of_job``'s, a job of the same user and base model, running or ended;
        ``CallRefused`` if that version is not kept, or that job is not such a job."""
        ...

    def reserve(self) -> str:
        """Make the call publish the job's next policy version: its directory."""
        ...

    def checkpoint_to(self, step: int) -> str:
        """The directory of the job's checkpoint at ``step``."""
        ...

    def restore_from(self, ckpt_dir: str) -> str | None:
        """The checkpoint to restore: ``ckpt_dir`` if it is one of the user's jobs'
        (``CallRefused`` if not), or with ``""`` the job's latest (None: none yet)."""
        ...


class Made(Protocol):
    """What the daemon recorded when it made a call's task, that its reply tells."""

    version: int  # generate: the policy sampled; a publishing call: the version it made
    publishes: bool
    out_dir: str  # where a publish or a checkpoint wrote


class Method(abc.ABC):
    """One service call: its name, the engine kind that serves it, its four message types, and
    how the daemon makes its engine task from the request (``task_of``) and the loop's reply from
    the engine's result (``reply_of``). Adding a call is a subclass here (its messages above, a
    row in the unions and ``METHODS``) and, for a trainer call, one handler in the worker's
    ``TrainerServer``."""

    name: ClassVar[str]
    kind: ClassVar[str]  # rollout | trainer
    request: ClassVar[type[Request]]
    task: ClassVar[type[EngineTask]]
    result: ClassVar[type[Result]]
    reply: ClassVar[type[Reply]]

    @abc.abstractmethod
    def task_of(self, req: Any, site: CallSite) -> EngineTask | Reply:
        """The engine task of ``req``, or a reply the daemon gives at once."""

    @abc.abstractmethod
    def reply_of(self, result: Any, made: Made, drain: str) -> Reply:
        """The loop's reply to ``result``; ``drain``: why the cluster stops ("" if it does not)."""


class Generate(Method):
    name, kind = "generate", "rollout"
    request, task, result, reply = GenerateReq, GenerateTask, GenerateResult, GenerateRep

    def task_of(self, req: GenerateReq, site: CallSite) -> GenerateTask:
        adapter = site.sample_from(req.version, req.of_job)
        return GenerateTask(GenRequest(site.job_id, req.prompts, req.sampling, adapter, req.prompt_tokens))

    def reply_of(self, result: GenerateResult, made: Made, drain: str) -> GenerateRep:
        return GenerateRep(result.completions, made.version)


class TrainStep(Method):
    name, kind = "train_step", "trainer"
    request, task, result, reply = TrainStepReq, TrainStepTask, TrainStepResult, TrainStepRep

    def task_of(self, req: TrainStepReq, site: CallSite) -> TrainStepTask:
        hp = msgspec.structs.replace(req.hp, user_code_trusted=site.trusted)  # checked again in the trainer
        return TrainStepTask(site.trainer, req.batch, hp, publish_dir=site.reserve() if req.publish else "")

    def reply_of(self, result: TrainStepResult, made: Made, drain: str) -> TrainStepRep:
        return TrainStepRep(result.metrics, made.version, drain) if made.publishes else TrainStepRep(result.metrics)


class Publish(Method):
    name, kind = "publish", "trainer"
    request, task, result, reply = PublishReq, PublishTask, PublishResult, PublishRep

    def task_of(self, req: PublishReq, site: CallSite) -> PublishTask:
        return PublishTask(site.trainer, site.reserve())

    def reply_of(self, result: PublishResult, made: Made, drain: str) -> PublishRep:
        return PublishRep(made.version, drain)


class Checkpoint(Method):
    name, kind = "checkpoint", "trainer"
    request, task, result, reply = CheckpointReq, CheckpointTask, CheckpointResult, CheckpointRep

    def task_of(self, req: CheckpointReq, site: CallSite) -> CheckpointTask:
        return CheckpointTask(site.trainer, site.checkpoint_to(req.step), req.extra)

    def reply_of(self, result: CheckpointResult, made: Made, drain: str) -> CheckpointRep:
        return CheckpointRep(made.out_dir)


class Restore(Method):
    name, kind = "restore", "trainer"
    request, task, result, reply = RestoreReq, RestoreTask, RestoreResult, RestoreRep

    def task_of(self, req: RestoreReq, site: CallSite) -> RestoreTask | RestoreRep:
        ckpt = site.restore_from(req.ckpt_dir)
        return RestoreRep(None) if ckpt is None else RestoreTask(site.trainer, ckpt, req.weights_only)

    def reply_of(self, result: RestoreResult, made: Made, drain: str) -> RestoreRep:
        return RestoreRep(result.extra)


class ForwardBackward(Method):
    name, kind = "forward_backward", "trainer"
    request, task, result, reply = ForwardBackwardReq, ForwardBackwardTask, ForwardBackwardResult, ForwardBackwardRep

    def task_of(self, req: ForwardBackwardReq, site: CallSite) -> ForwardBackwardTask:
        return ForwardBackwardTask(site.trainer, req.call)

    def reply_of(self, result: ForwardBackwardResult, made: Made, drain: str) -> ForwardBackwardRep:
        return ForwardBackwardRep(result.logprobs, result.loss)


class OptimStep(Method):
    name, kind = "optim_step", "trainer"
    request, task, result, reply = OptimStepReq, OptimStepTask, OptimStepResult, OptimStepRep

    def task_of(self, req: OptimStepReq, site: CallSite) -> OptimStepTask:
        return OptimStepTask(site.trainer, req.calls, req.adam, publish_dir=site.reserve() if req.publish else "")

    def reply_of(self, result: OptimStepResult, made: Made, drain: str) -> OptimStepRep:
        return OptimStepRep(result.metrics, made.version if made.publishes else 0)


METHODS: dict[str, Method] = {
    m.name: m for m in (Generate(), TrainStep(), Publish(), Checkpoint(), Restore(), ForwardBackward(), OptimStep())
}


def request_of(method: str, args: dict[str, Any] | None = None) -> Request:
    """The request of a call named ``method`` with ``args`` as its fields (``ValueError``: no such call)."""
    spec = METHODS.get(method)
    if spec is None:
        raise ValueError(f"unknown service call {method!r} (known: {', '.join(METHODS)})")
    return msgspec.convert(args or {}, spec.request)
