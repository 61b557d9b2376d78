"""The PlexRL wire protocol: opcodes, message structs and framing shared by every process.

Frames on the wire (ZeroMQ ROUTER/DEALER)::

    [identity (ROUTER side only), b"PLX1", opcode (1 byte), header, body]

``header`` and ``body`` are msgpack-encoded msgspec structs. Nothing is pickled. The body
type is fixed by the opcode (``BODY_TYPES``); a frame whose magic, opcode or body does not
decode is rejected as a ``ProtocolError``.

Decoding is bounded, since any holder of a key may send anything: a header of at most
``MAX_HEADER_BYTES``, a body of at most its opcode's ``MAX_BODY_BYTES``, and the values the schema
leaves open (``Any``: a spec, a result's ``info``, a checkpoint's ``extra``) nested at most
``MAX_OPEN_DEPTH`` deep and holding ``MAX_OPEN_ITEMS`` items at most. Typed fields need no depth
check: msgspec validates them as it descends. Every failure, a RecursionError or MemoryError
inside msgspec included, comes out of ``decode`` as a ``ProtocolError`` of one line.

A service call's own messages (request, engine task, result, reply) and the engine data
types inside them live in ``plexctl.common.calls``, re-exported here. Control messages to a worker
(release a job's state, prefetch one, shut down) have opcodes of their own. It deliberately
imports neither torch nor vLLM.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from typing import Annotated, Any, Callable

import msgspec
import msgspec.inspect as mi

from plexctl.common.calls import (  # noqa: F401 - the engine data types, re-exported: every process names them P.*
    LOSS_AGGREGATIONS,
    LOSSES,
    AdapterRef,
    AnyRequest,
    AnyResult,
    AnyTask,
    Completion,
    GenRequest,
    LoraSpec,
    SampleTokens,
    Sampling,
    TokenLogprob,
    TrainBatch,
    TrainHParams,
)

MAGIC = b"PLX1"


class Op:
    """One-byte opcodes."""

    # client -> daemon
    SUBMIT = b"S"
    STATUS = b"Q"
    CANCEL = b"C"
    LOGS = b"L"
    BLOB = b"B"  # upload (a chunk of) one of a job's input files, content-addressed (``plexctl.inputs``)
    EXPORT = b"F"  # a job's adapter or checkpoint files, listed then read in chunks (``plexctl export``)
    DOWN = b"D"
    PING = b"P"
    PUBLISH = b"J"  # a job's policy version readable by every user of the cluster, or its owner's alone again
    # driver -> daemon: a service call (generate, train_step, publish, checkpoint, ...)
    CALL = b"K"
    # driver -> daemon: progress of a job (step metrics)
    REPORT = b"M"
    # worker -> daemon
    REGISTER = b"R"
    HEARTBEAT = b"H"
    RESULT = b"r"
    PARTIAL = b"p"  # a streaming generate's tokens so far (worker -> daemon -> the call's sender)
    INVENTORY = b"I"  # a trainer's tier inventory, outside a result (after a release)
    LEAVE = b"X"  # the worker is going away (its allocation ends): re-queue its calls
    # Slurm node task -> daemon
    WORKER_EXITED = b"G"  # the process of one of its workers exited: lost now, not after the grace
    # daemon -> worker
    TASK = b"T"
    TASK_PASS = b"V"  # several jobs' train steps to run in one pass on a trainer (``TaskPassBody``)
    RELEASE = b"U"  # drop a job's state on an engine (the job ended)
    PREFETCH = b"W"  # bring a job's trainer state up from NVMe ahead of its next call
    SHUTDOWN = b"Y"  # the daemon is stopping: exit
    # daemon -> anyone: reply to a request (body depends on the request)
    REPLY = b"A"
    ERROR = b"E"


class Header(msgspec.Struct, frozen=True):
    msg_id: int
    in_reply_to: int = 0
    sent_at: float = 0.0
    sender_epoch: int = 0


class ErrorBody(msgspec.Struct):
    code: str
    message: str  # one line (``one_line``): the client prints it as it is


ROLLED_BACK = "rolled_back"  # an ErrorBody code: a job's trainer state was lost under the call; it restarts


def one_line(text: str, limit: int = 500) -> str:
    """``text`` as an error's message: its whitespace runs made single spaces, cut at ``limit``."""
    return " ".join(text.split())[:limit]


# ---------------------------------------------------------------- message bodies


class Empty(msgspec.Struct):
    pass


class InputFile(msgspec.Struct, frozen=True):
    """One file of a job's inputs, uploaded by its client: ``field`` names the spec path it
    stands for (``data.path``, ``reward.path``...); ``relpath`` is the file's name (a file
    field) or its path in the directory (a directory field)."""

    field: str
    kind: str  # file | dir
    relpath: str
    sha256: str
    size: int


class SubmitReq(msgspec.Struct):
    submit_id: str  # client-chosen: a retried submit returns the same job
    spec: dict[str, Any]
    user: str
    replace: bool = False  # cancel the sender's queued or running jobs of this name first (else refused)
    inputs: list[InputFile] = msgspec.field(default_factory=list)  # uploaded contents of the spec's paths


class BlobReq(msgspec.Struct):
    sha256: str  # of the whole file
    size: int  # of the whole file
    offset: Annotated[int, msgspec.Meta(ge=0)] = 0  # where ``data`` goes; a request with no data asks what is held
    data: bytes = b""


class BlobRep(msgspec.Struct):
    have: int  # bytes of it the daemon holds for this user (``size``: complete and checked)


class SubmitRep(msgspec.Struct):
    job_id: str
    created: bool
    replaced: list[str] = msgspec.field(default_factory=list)  # jobs of the same name cancelled for it


JOB_STATES = ("queued", "running", "succeeded", "failed", "cancelled", "interrupted")
TRAINS_ADAPTER, TRAINS_ALL = "adapter", "all weights"  # what a job trains (JobInfo.trains)


class JobInfo(msgspec.Struct):
    job_id: str
    name: str
    user: str
    state: str  # one of JOB_STATES
    step: int
    steps: int
    reward: float | None
    eval_first: float | None
    eval_last: float | None
    policy_version: int
    engine: str
    submitted_at: float
    started_at: float | None
    ended_at: float | None
    error: str
    priority: int
    restarts: int = 0
    reason: str = ""  # why a queued job is not running yet
    state_tier: str = ""  # where a running job's trainer state lives (engine:tier)
    trains: str = ""  # TRAINS_ADAPTER or TRAINS_ALL (full fine-tuning), from the job's spec
    model: str = ""  # the job's base model (its resolved path), from its spec


class EngineInfo(msgspec.Struct):
    engine_id: str
    worker_id: str
    kind: str  # rollout | trainer
    model: str
    ready: bool
    running: list[str]  # job ids being served now
    resident: list[str]  # job ids whose state lives here
    busy_seconds: float
    tasks_done: int
    tiers: dict[str, Any] = msgspec.field(default_factory=dict)  # state tiers: capacity, used, jobs
    swaps: dict[str, Any] = msgspec.field(default_factory=dict)  # per direction: count, bytes, seconds
    swaps_by_kind: dict[str, Any] = msgspec.field(default_factory=dict)  # the same, per state: adapter | model
    devices: list[str] = msgspec.field(default_factory=list)  # its worker's CUDA_VISIBLE_DEVICES ids
    dtype: str = ""
    device: str = ""
    suspect: bool = False  # its worker missed heartbeats: no new calls until it answers again (or is lost)
    silent_s: float = 0.0  # seconds since its worker's last heartbeat, when suspect
    weights: str = ""  # a rollout engine's model: resident, awake or asleep (taking turns with others')
    switches: int = 0  # weight loads and wakes the scheduler started on it
    shared_passes: int = 0  # a trainer's passes that trained several jobs' steps at once
    shared_tasks: int = 0  # the steps in them
    last_pass: int = 0  # steps in its latest pass
    largest_pass: int = 0
    ranks: int = 1  # a trainer engine's ranks (its width), its base sharded over them


class StatusReq(msgspec.Struct):
    job_id: str | None = None
    timeline: bool = False  # also send the engines' busy spans and swaps (``plexctl report --cluster``)


class StatusRep(msgspec.Struct):
    jobs: list[JobInfo]
    engines: list[EngineInfo]
    now: float
    policy: str = ""
    bubble_ratio: float | None = None  # idle share of engine time since the daemon started
    started_at: float = 0.0  # when the daemon started
    timeline: list[BusySpan] = msgspec.field(default_factory=list)  # only when asked (StatusReq.timeline)
    swap_marks: list[SwapMark] = msgspec.field(default_factory=list)  # idem
    moves: list[MoveSpan] = msgspec.field(default_factory=list)  # idem
    # the scheduler's interactive class (API requests a client waits on): its share of recent engine
    # time, and its calls queued now
    interactive_share: float = 0.0
    interactive_queued: int = 0


class BusySpan(msgspec.Struct, array_like=True):
    """One finished or running task on an engine: who occupied it, doing what, when."""

    engine_id: str
    job_id: str
    method: str
    start: float
    end: float


class MoveSpan(msgspec.Struct, array_like=True):
    """A job's trainer state moved off the trainer's thread (a prefetch from NVMe, a demotion
    that made room for one, or an eviction's write to NVMe left to the write-behind thread),
    so no call waited for it unless a swap-in later did."""

    engine_id: str
    job_id: str
    direction: str  # e.g. "nvme->host"
    start: float
    end: float


class SwapMark(msgspec.Struct, array_like=True):
    """A job's trainer state moved in before one of its calls (``bytes`` over ``seconds``)."""

    engine_id: str
    job_id: str
    at: float
    bytes: int
    seconds: float


class JobRef(msgspec.Struct):
    job_id: str


class PublishReq(msgspec.Struct):
    job_id: str
    version: Annotated[int, msgspec.Meta(ge=1)]  # its policy version, or (``checkpoint``) its checkpoint's step
    public: bool = True  # False: its owner's alone again
    checkpoint: bool = False  # a checkpoint (a training state), not a policy version


class PublishRep(msgspec.Struct):
    job_id: str
    version: int
    public: bool
    changed: bool  # False: it already was
    checkpoint: bool = False


class LogsReq(msgspec.Struct):
    job_id: str
    kind: str = "log"  # log | metrics
    offset: int = 0


class LogsRep(msgspec.Struct):
    data: str
    offset: int
    finished: bool  # the job has ended: no more data will come


class ExportReq(msgspec.Struct):
    job_id: str
    what: str = "adapter"  # adapter (the latest published) | checkpoint (the latest durable one)
    path: str = ""  # "": list the files; else read this one (relative) from ``offset``
    offset: int = 0


class ExportFile(msgspec.Struct):
    path: str  # relative to the exported directory
    size: int


class ExportRep(msgspec.Struct):
    source: str = ""  # what is exported: "adapter v000012", "checkpoint step-000040"
    files: list[ExportFile] = msgspec.field(default_factory=list)
    data: bytes = b""  # a chunk of ``path`` from ``offset`` (empty at its end)


class Pong(msgspec.Struct):
    version: str
    pid: int
    started_at: float
    workers: int
    engines_ready: int
    engines_total: int
    problems: list[str] = msgspec.field(default_factory=list)
    upload_inputs: bool = False  # the sender's jobs run jailed: their spec's files must be uploaded


class EngineDecl(msgspec.Struct):
    engine_id: str
    kind: str
    model: str
    capacity: int = 1
    state_capacity_bytes: int = 0  # most job state this engine can hold on any tier (0: unknown)
    state_room_bytes: int = 0  # job state a trainer's tiers hold together: host + NVMe (0: not said)
    adapter_slots: int = 0  # adapters a rollout engine keeps loaded, its jobs at once (0: not said)
    dtype: str = ""  # the weights' dtype it serves (float32 | bfloat16 | float16; "": not said)
    device: str = ""  # cpu | cuda
    max_lora_rank: int = 0  # the highest LoRA rank a rollout engine loads (0: no limit said)
    max_model_len: int = 0  # the longest sequence (prompt and completion) a rollout engine holds (0: not said)
    sleeps: bool = False  # takes turns with its worker's other models' engines of its kind on the GPU
    # a GPU trainer's step as the memory plan decided it (``memplan.worker_step``; 0 / "": not said)
    gradient_checkpointing: str = ""  # on | off
    micro_batch_tokens: int = 0
    step_room_bytes: int = 0  # what a step may reach: its share of the GPU less the CUDA runtime
    ranks: int = 1  # a trainer's processes, one per GPU, its base sharded over them (the trainer width)


class RegisterReq(msgspec.Struct):
    worker_id: str
    node: str
    pid: int
    engines: list[EngineDecl]
    ready: bool
    mem_bytes: int = 0
    devices: list[str] = msgspec.field(default_factory=list)
    error: str = ""
    resident: dict[str, str] = msgspec.field(default_factory=dict)  # job -> trainer engine holding its state


class HeartbeatBody(msgspec.Struct):
    worker_id: str


class WorkerExited(msgspec.Struct):
    worker_id: str
    pid: int  # the process that exited (a worker registered since under that id is not it)
    code: int  # its exit code (negative: killed by that signal)


class CallReq(msgspec.Struct):
    job_id: str
    request: AnyRequest  # tagged by the method's name (``plexctl.common.calls.METHODS``)
    # the id of an earlier call of the job this one must follow: the daemon holds it until that
    # call's result is in, then starts it at once (0: start now)
    after: int = 0

    @property
    def method(self) -> str:
        return self.request.method


class TaskBody(msgspec.Struct):
    task_id: int
    job_id: str
    engine_id: str
    task: AnyTask
    # a task of the same worker this one follows: the worker starts it the moment that one
    # succeeded, and fails it if that one failed (0: start now)
    after: int = 0

    @property
    def method(self) -> str:
        return self.task.method


class TaskPassBody(msgspec.Struct):
    """Train steps of several jobs for one trainer to run in one forward and backward; each
    gets its own result. ``tasks`` all name ``engine_id``, in the daemon's order."""

    engine_id: str
    tasks: list[TaskBody]

    @property
    def job_id(self) -> str:
        return ",".join(t.job_id for t in self.tasks)


class ResultBody(msgspec.Struct):
    task_id: int
    ok: bool
    value: AnyResult | None = None  # None when not ok
    error: str = ""
    seconds: float = 0.0  # the call's own time, on the engine
    switch_seconds: float = 0.0  # before it: the engine's switch to the weights it needed (a load, a wake)
    info: dict[str, Any] = msgspec.field(default_factory=dict)  # e.g. the trainer's tier inventory


class PartialBody(msgspec.Struct):
    """The tokens a streaming generate task (``Sampling.stream``) sampled since its last partial,
    for the sample of each of its prompts that has new ones; its result still carries them all."""

    task_id: int
    samples: list[SampleTokens]


class ReleaseBody(msgspec.Struct):
    """Drop the job's state on the engine (its tasks in flight there fail)."""

    job_id: str
    engine_id: str


class PrefetchBody(msgspec.Struct):
    """Bring the job's trainer state from NVMe to host memory, ahead of its next call."""

    job_id: str
    engine_id: str
    upcoming: list[str]  # the daemon's expected order of jobs on that trainer


class InventoryBody(msgspec.Struct):
    """A trainer's tier inventory (and the moves made off its thread) outside a result."""

    info: dict[str, Any]


class ReportBody(msgspec.Struct):
    job_id: str
    event: str  # step | eval | note
    step: int
    metrics: dict[str, float]
    message: str = ""


BODY_TYPES: dict[bytes, type] = {
    Op.SUBMIT: SubmitReq,
    Op.STATUS: StatusReq,
    Op.CANCEL: JobRef,
    Op.LOGS: LogsReq,
    Op.EXPORT: ExportReq,
    Op.BLOB: BlobReq,
    Op.DOWN: Empty,
    Op.PING: Empty,
    Op.PUBLISH: PublishReq,
    Op.CALL: CallReq,
    Op.REPORT: ReportBody,
    Op.REGISTER: RegisterReq,
    Op.HEARTBEAT: HeartbeatBody,
    Op.LEAVE: HeartbeatBody,
    Op.WORKER_EXITED: WorkerExited,
    Op.RESULT: ResultBody,
    Op.PARTIAL: PartialBody,
    Op.INVENTORY: InventoryBody,
    Op.TASK: TaskBody,
    Op.TASK_PASS: TaskPassBody,
    Op.RELEASE: ReleaseBody,
    Op.PREFETCH: PrefetchBody,
    Op.SHUTDOWN: Empty,
    Op.ERROR: ErrorBody,
}
# REPLY bodies are typed by the request they answer; the receiver decodes them.


class ProtocolError(Exception):
    """A frame that is not a valid PlexRL message (its text is one line)."""


# ---------------------------------------------------------------- bounds on what a peer sends

MAX_MESSAGE_BYTES = 256 << 20  # a whole message; the daemon's socket drops a longer one unread (zmq.MAXMSGSIZE)
MAX_HEADER_BYTES = 1 << 10  # a header is four numbers, about 70 bytes
SMALL_BODY_BYTES = 1 << 20  # a request of ids and options
MEDIUM_BODY_BYTES = 16 << 20  # a spec, a chunk of an upload (8 MiB: ``plexctl.inputs.CHUNK``), a worker's inventory
MAX_BODY_BYTES: dict[bytes, int] = {  # per opcode; the rest (calls, tasks, results, replies) up to MAX_MESSAGE_BYTES
    **{op: SMALL_BODY_BYTES for op in (Op.STATUS, Op.CANCEL, Op.LOGS, Op.EXPORT, Op.DOWN, Op.PING, Op.PUBLISH)},
    **{op: SMALL_BODY_BYTES for op in (Op.HEARTBEAT, Op.LEAVE, Op.WORKER_EXITED, Op.RELEASE, Op.SHUTDOWN)},
    **{op: MEDIUM_BODY_BYTES for op in (Op.SUBMIT, Op.BLOB, Op.REGISTER, Op.REPORT, Op.INVENTORY, Op.PREFETCH)},
    Op.ERROR: MEDIUM_BODY_BYTES,
}
MAX_OPEN_DEPTH = 32  # nesting of a value the schema leaves open (``Any``); a spec's is 3 or 4
MAX_OPEN_ITEMS = 1 << 20  # items of one message's open values together: bounds the time to check them

# what decoding untrusted bytes may raise; RecursionError is msgspec's own guard against deep nesting
_DECODE_FAILURES = (msgspec.MsgspecError, RecursionError, MemoryError, ValueError, TypeError, OverflowError)

_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(Header)
_body_decoders: dict[bytes, msgspec.msgpack.Decoder[Any]] = {
    op: msgspec.msgpack.Decoder(t) for op, t in BODY_TYPES.items()
}
_reply_decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder()
_ids = itertools.count(1)
EPOCH = int(time.time() * 1000) ^ os.getpid()


def encode(op: bytes, body: Any, in_reply_to: int = 0) -> tuple[list[bytes], int]:
    """Frames for one message (without the ROUTER identity) and its msg_id."""
    msg_id = next(_ids)
    header = Header(msg_id=msg_id, in_reply_to=in_reply_to, sent_at=time.time(), sender_epoch=EPOCH)
    return [MAGIC, op, _encoder.encode(header), _encoder.encode(body)], msg_id


def decode_header(frames: list[bytes]) -> Header | None:
    """The header of a message whose body may not decode, or whose frames are one too few or too
    many (to answer it); None if it has none."""
    if len(frames) < 3 or frames[0] != MAGIC:
        return None
    try:
        return _decode_header(frames[2])
    except ProtocolError:
        return None


def decode(frames: list[bytes]) -> tuple[bytes, Header, Any]:
    """(opcode, header, body) of a message; REPLY bodies come back as msgpack builtins.

    Within the bounds of the module docstring, else a ``ProtocolError``. A REPLY's open values
    are not walked: replies come from the daemon, whose key the client checked, and the client
    converts them to the reply's type."""
    if len(frames) != 4 or frames[0] != MAGIC:
        raise ProtocolError(f"bad frame layout ({len(frames)} frames)")
    op = bytes(frames[1])
    decoder = _reply_decoder if op == Op.REPLY else _body_decoders.get(op)
    if decoder is None:
        raise ProtocolError(f"unknown opcode {op[:8]!r}")
    header = _decode_header(frames[2])
    raw = frames[3]
    limit = MAX_BODY_BYTES.get(op, MAX_MESSAGE_BYTES)
    if len(raw) > limit:
        raise ProtocolError(f"a body of {len(raw)} bytes for opcode {op!r}, over its limit of {limit}")
    try:
        body = decoder.decode(raw)
    except _DECODE_FAILURES as exc:
        raise ProtocolError(f"invalid body for opcode {op!r}: {_failure(exc)}") from None
    if op != Op.REPLY:
        collect = _open_values_of(op)
        if collect is not None:
            found: list[Any] = []
            collect(body, found)
            try:
                check_open_values(found)
            except ProtocolError as exc:
                raise ProtocolError(f"invalid body for opcode {op!r}: {exc}") from None
    return op, header, body


def _decode_header(raw: bytes) -> Header:
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"a header of {len(raw)} bytes, over its limit of {MAX_HEADER_BYTES}")
    try:
        return _header_decoder.decode(raw)
    except _DECODE_FAILURES as exc:
        raise ProtocolError(f"invalid header: {_failure(exc)}") from None


def _failure(exc: BaseException) -> str:
    """What went wrong decoding, in one short line."""
    if isinstance(exc, RecursionError):
        return "nested too deep"
    if isinstance(exc, MemoryError):
        return "too large to decode"
    return one_line(str(exc), 200) or type(exc).__name__


def check_open_values(values: list[Any]) -> None:
    """Each of ``values`` (decoded msgpack: lists, tuples as map keys, dicts, scalars) nests at most
    ``MAX_OPEN_DEPTH`` deep and all hold ``MAX_OPEN_ITEMS`` items at most, else a ``ProtocolError``.
    Iterative, and a container's items are counted before they are looked at."""
    budget = MAX_OPEN_ITEMS
    stack = [(value, 1) for value in values if type(value) in _CONTAINERS]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_OPEN_DEPTH:
            raise ProtocolError(f"a value nested deeper than {MAX_OPEN_DEPTH} levels")
        is_dict = type(value) is dict
        budget -= 2 * len(value) if is_dict else len(value)
        if budget < 0:
            raise ProtocolError(f"open values of more than {MAX_OPEN_ITEMS} items")
        for item in itertools.chain(value, value.values()) if is_dict else value:
            if type(item) in _CONTAINERS:
                stack.append((item, depth + 1))


_CONTAINERS = frozenset((list, tuple, dict))

# ``collect(value, found)`` appends to ``found`` the parts of a decoded ``value`` that its type
# leaves open (``Any``); planned once per type from the type itself, so a new ``Any`` field is
# checked without being listed anywhere.
Collect = Callable[[Any, list[Any]], None]


@functools.cache
def _open_values_of(op: bytes) -> Collect | None:
    """How to find the open values in a body of ``op`` (None: its type has none)."""
    return _plan(mi.type_info(BODY_TYPES[op]))


def _whole(value: Any, found: list[Any]) -> None:
    found.append(value)


_SCALARS = (
    mi.NoneType,
    mi.BoolType,
    mi.IntType,
    mi.FloatType,
    mi.StrType,
    mi.BytesType,
    mi.ByteArrayType,
    mi.MemoryViewType,
    mi.DateTimeType,
    mi.TimeType,
    mi.DateType,
    mi.TimeDeltaType,
    mi.UUIDType,
    mi.DecimalType,
    mi.ExtType,
    mi.RawType,
    mi.EnumType,
    mi.LiteralType,
)
_RUNTIME_CLASS: dict[type, type] = {
    mi.ListType: list,
    mi.VarTupleType: tuple,
    mi.TupleType: tuple,
    mi.SetType: set,
    mi.FrozenSetType: frozenset,
    mi.DictType: dict,
}


def _plan(t: mi.Type) -> Collect | None:
    """The ``Collect`` of a type (see above); a kind of type the schema does not use yet is a
    TypeError here, caught by the test that plans every body type."""
    if isinstance(t, mi.AnyType):
        return _whole
    if isinstance(t, _SCALARS):
        return None
    if isinstance(t, mi.Metadata):
        return _plan(t.type)
    if isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
        return _each(_plan(t.item_type))
    if isinstance(t, mi.DictType):
        key, value = _plan(t.key_type), _plan(t.value_type)
        if _whole in (key, value):
            return _whole  # a container of open values is one open value
        return None if key is None and value is None else _dict_of(key, value)
    if isinstance(t, mi.TupleType):
        return _fields([(i, c) for i, it in enumerate(t.item_types) if (c := _plan(it)) is not None], by_index=True)
    if isinstance(t, mi.StructType):
        return _fields([(f.name, c) for f in t.fields if (c := _plan(f.type)) is not None], by_index=False)
    if isinstance(t, mi.UnionType):
        members: dict[type, Collect] = {}
        for member in t.types:
            member = member.type if isinstance(member, mi.Metadata) else member
            collect = _plan(member)
            if collect is _whole:
                return _whole
            if collect is not None:
                members[member.cls if isinstance(member, mi.StructType) else _RUNTIME_CLASS[type(member)]] = collect
        return _union(members) if members else None
    raise TypeError(f"no plan for the open values of {t!r}")


def _each(item: Collect | None) -> Collect | None:
    if item is None or item is _whole:
        return item  # a container of open values is one open value

    def each(value: Any, found: list[Any]) -> None:
        for x in value:
            item(x, found)

    return each


def _dict_of(key: Collect | None, value: Collect | None) -> Collect:
    def dict_of(d: Any, found: list[Any]) -> None:
        for k, v in d.items():
            if key is not None:
                key(k, found)
            if value is not None:
                value(v, found)

    return dict_of


def _fields(parts: list[tuple[Any, Collect]], by_index: bool) -> Collect | None:
    if not parts:
        return None

    def fields(value: Any, found: list[Any]) -> None:
        for where, collect in parts:
            collect(value[where] if by_index else getattr(value, where), found)

    return fields


def _union(members: dict[type, Collect]) -> Collect:
    def union(value: Any, found: list[Any]) -> None:
        collect = members.get(type(value))
        if collect is not None:
            collect(value, found)

    return union


def to_builtins(obj: Any) -> Any:
    return msgspec.to_builtins(obj)


def convert(obj: Any, typ: type) -> Any:
    return msgspec.convert(obj, typ)
