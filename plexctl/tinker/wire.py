"""The Tinker SDK's wire forms (SDK 0.38.0) and their conversions to and from the backend's types.

Requests come as JSON, read into the structs below (unknown fields ignored), except
forward_backward's: a protobuf ``ForwardBackwardRequest`` of the SDK's own schema
(``tinker.proto.tinker_public_pb2``), zstd-compressed when ``Content-Encoding`` says so. The results
of forward_backward and sample go back as protobuf (the SDK accepts nothing else for them), the
others as JSON. Pure functions, two kinds of failure: ``Malformed``, a body that cannot be read at
all (HTTP 400), and ``UserError``, one that can but asks for what this server does not do or is
inconsistent (a failed request, category "user").

A datum becomes a ``calls.TokenDatum``: its text chunks' tokens, and one value per token of each
loss input the SDK sends (dense or sparse CSR, shape ``(N,)`` or ``(N, 1)``). float32 inputs keep
their exact values (as Python floats).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt
import zstandard
from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from plexctl.common import calls as C
from plexctl.common.losses import DATUM_DEFAULTS, DATUM_INPUTS, LOSS_REGISTRY, LossConfigError, loss_of
from plexctl.tinker.backend import STOP_REASONS, ForwardResult, SampleParams, SampleResult, UserError

_NUMPY_DTYPE: dict[int, type[np.generic]] = {
    pb.DTYPE_FLOAT32: np.float32,
    pb.DTYPE_INT64: np.int64,
    pb.DTYPE_INT32: np.int32,
}
_STOP_REASON = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
assert set(_STOP_REASON) == set(STOP_REASONS)


TOPK_EMPTY = -99999.0  # the log-prob of an empty top-k cell (the SDK's ``MASK_LOGPROB``)


class Malformed(Exception):
    """A request body that cannot be read; ``str(error)`` says where."""


# ---------------------------------------------------------------- JSON requests


class Request(msgspec.Struct, kw_only=True):
    pass


class CreateSessionReq(Request):
    tags: list[str] = msgspec.field(default_factory=list)
    sdk_version: str = ""


class SessionReq(Request):
    session_id: str


class LoraConfigWire(Request):
    rank: int
    seed: int | None = None  # train_mlp / train_attn / train_unembed: the cluster's LoRA decides


class OptimizerConfigWire(Request):
    type: str = "adamw"


class CreateModelReq(Request):
    session_id: str
    model_seq_id: int
    base_model: str
    lora_config: LoraConfigWire | None = None  # None: full fine-tuning (every weight of the base)
    optimizer_config: OptimizerConfigWire | None = None


class ModelReq(Request):
    model_id: str


class OptimStepReq(Request):
    model_id: str
    seq_id: int
    adam_params: C.AdamStep | None = None  # the SDK's AdamParams: the engines' one Adam type
    optimizer_params: dict[str, Any] | None = None  # another optimizer than Adam: refused


class SaveWeightsReq(Request):
    model_id: str
    seq_id: int
    path: str | None = None  # the checkpoint's name


class SaveWeightsForSamplerReq(Request):
    model_id: str
    seq_id: int
    path: str | None = None  # named: saved weights; None: a sampler of the current weights
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"


class LoadWeightsReq(Request):
    """Either ``model_id`` + ``seq_id`` (a load into a run) or ``session_id`` + ``model_seq_id``
    (a new run made from the checkpoint)."""

    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    optimizer_config: OptimizerConfigWire | None = None


class CreateSamplingSessionReq(Request):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


class SamplingParamsWire(Request):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str | int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class ModelInputWire(Request):
    chunks: list[dict[str, Any]]


class SampleReq(Request):
    prompt: ModelInputWire
    sampling_params: SamplingParamsWire
    sampling_session_id: str | None = None
    seq_id: int | None = None
    num_samples: int = 1
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: Any = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


class RetrieveFutureReq(Request):
    request_id: str
    allow_metadata_only: bool = False


class WeightsInfoReq(Request):
    tinker_path: str


class CheckpointTtlReq(Request):
    ttl_seconds: int | None = None


T = TypeVar("T")


def decode(body: bytes, kind: type[T]) -> T:
    """The JSON ``body`` as a ``kind``, or ``Malformed`` naming the field at fault."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.DecodeError as e:  # ValidationError included
        raise Malformed(f"malformed {kind.__name__.removesuffix('Req')} request: {e}") from None


def adam_step(req: OptimStepReq) -> C.AdamStep:
    if req.optimizer_params is not None:
        kind = req.optimizer_params.get("type", "?")
        raise UserError(f"optimizer {kind!r} is not supported: only Adam (types.AdamParams)")
    return req.adam_params or C.AdamStep()


def check_optimizer(config: OptimizerConfigWire | None) -> None:
    if config is not None and config.type != "adamw":
        raise UserError(f"optimizer {config.type!r} is not supported: only adamw")


# ---------------------------------------------------------------- forward_backward


MAX_BODY_BYTES = 256 << 20  # a request body, decompressed: larger ones are refused (413)


class TooLarge(Malformed):
    """A body over the limit, as sent or once decompressed."""


def parse_forward_backward(
    body: bytes, content_encoding: str | None, max_bytes: int = MAX_BODY_BYTES
) -> pb.ForwardBackwardRequest:
    """The request's protobuf, decompressed if ``content_encoding`` is zstd (at most
    ``max_bytes`` of it: a small body that would expand past that is refused, not inflated)."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "zstd":
        try:
            parts, size = [], 0
            with zstandard.ZstdDecompressor().stream_reader(body) as reader:
                while size <= max_bytes and (part := reader.read(min(1 << 20, max_bytes + 1 - size))):
                    parts.append(part)
                    size += len(part)
            body = b"".join(parts)
        except zstandard.ZstdError as e:
            raise Malformed(f"forward_backward body is not valid zstd: {e}") from None
        if len(body) > max_bytes:
            raise TooLarge(f"forward_backward body: more than {max_bytes} bytes once decompressed")
    elif encoding != "identity":
        raise Malformed(f"Content-Encoding {content_encoding!r} is not supported (zstd is)")
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as e:
        raise Malformed(f"forward_backward body is not a ForwardBackwardRequest protobuf: {e}") from None
    return msg


def loss_call(msg: pb.ForwardBackwardRequest, max_tokens: int = 0) -> C.LossCall:
    """The loss call a forward_backward request asks for, or ``UserError`` (a datum of more than
    ``max_tokens`` tokens, the model's context, among others; 0: no limit)."""
    loss_fn = msg.loss_fn
    loss = loss_of(loss_fn, "token")
    if loss is None:
        raise UserError(f"loss {loss_fn!r} is not supported (supported: {', '.join(C.TOKEN_LOSSES)})")
    if not msg.data:
        raise UserError("forward_backward needs at least one datum")
    config = loss_config(msg)
    for key in loss.unknown(config):
        takes = f"it takes {', '.join(loss.takes())}" if loss.takes() else "it takes none"
        raise UserError(f"loss_fn_config key {key!r} is not used by {loss_fn} ({takes})")
    try:
        loss.settings(config)
    except LossConfigError as e:
        raise UserError(f"{loss_fn}: loss_fn_config {e}") from None
    return C.LossCall([token_datum(d, i, loss_fn, max_tokens) for i, d in enumerate(msg.data)], loss_fn, config)


def loss_config(msg: pb.ForwardBackwardRequest) -> dict[str, float]:
    """``loss_fn_config_v2`` when the SDK sent it (it writes both maps), else the legacy map."""
    if not msg.loss_fn_config_v2:
        return {k: float(v) for k, v in msg.loss_fn_config.items()}
    config = {}
    for key, value in msg.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise UserError(f"loss_fn_config {key!r} must be a number, not {value.text!r}")
        config[key] = value.number
    return config


def token_datum(d: pb.Datum, i: int, loss_fn: str, max_tokens: int = 0) -> C.TokenDatum:
    tokens = model_input_tokens(d, i)
    if not tokens:
        raise UserError(f"datum {i} has no tokens")
    if max_tokens and len(tokens) > max_tokens:
        raise UserError(f"datum {i} has {len(tokens)} tokens, more than the model's context of {max_tokens}")
    inputs: dict[str, list[Any]] = {}
    for name, tensor in d.loss_fn_inputs.items():
        if name != "target_tokens" and name not in DATUM_INPUTS:
            known = ", ".join(("target_tokens", *DATUM_INPUTS))
            raise UserError(f"datum {i}: loss input {name!r} is not supported (supported: {known})")
        values = tensor_values(tensor, f"datum {i}: loss input {name!r}")
        if len(values) != len(tokens):
            raise UserError(f"datum {i}: loss input {name!r} has {len(values)} values for {len(tokens)} tokens")
        if name == "target_tokens":
            if not np.issubdtype(values.dtype, np.integer):
                raise UserError(f"datum {i}: target_tokens must be integers, not {values.dtype}")
            inputs[name] = values.astype(np.int64).tolist()
        else:
            inputs[name] = values.astype(np.float64).tolist()
    loss = LOSS_REGISTRY[loss_fn]
    missing = [name for name in loss.required() if name not in inputs]
    if missing:
        raise UserError(f"datum {i}: {loss_fn} needs loss input(s) {', '.join(missing)}")
    for name, value in DATUM_DEFAULTS.items():
        if name in loss.reads and name not in inputs:
            inputs[name] = [value] * len(tokens)
    return C.TokenDatum(tokens, inputs["target_tokens"], **{name: inputs.get(name) for name in DATUM_INPUTS})


def model_input_tokens(d: pb.Datum, i: int) -> list[int]:
    """The tokens of the datum's text chunks, in order; other chunks are refused."""
    tokens: list[int] = []
    for chunk in d.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind == "encoded_text":
            tokens += _frombuffer(chunk.encoded_text.tokens, np.int32, f"datum {i}: text chunk").tolist()
        elif kind == "image":
            raise UserError(f"datum {i}: image inputs are not supported: this server trains text models")
        elif kind == "dmel":
            raise UserError(f"datum {i}: audio inputs are not supported: this server trains text models")
    return tokens


def tensor_values(t: pb.Tensor, where: str) -> npt.NDArray[Any]:
    """One value per token of a loss input: dense or sparse CSR (unlisted entries 0), of shape
    ``(N,)`` or ``(N, 1)``."""
    dtype = _NUMPY_DTYPE.get(t.dtype)
    if dtype is None:
        raise UserError(f"{where} has dtype {pb.DType.Name(t.dtype)}; expected float32 or int64")
    shape = [int(s) for s in t.shape]
    if t.WhichOneof("encoding") == "sparse_csr":
        values = _csr_to_dense(t.sparse_csr, dtype, shape, where)
    else:
        values = _frombuffer(t.dense, dtype, where)
        if shape:
            if math.prod(shape) != values.size or min(shape) < 0:
                raise UserError(f"{where} has {values.size} values for shape {shape}")
            values = values.reshape(shape)
    if values.ndim == 2 and values.shape[1] == 1:
        values = values[:, 0]
    if values.ndim != 1:
        raise UserError(f"{where} has shape {list(values.shape)}: one value per token is supported (no top-k targets)")
    return values


def _csr_to_dense(csr: pb.SparseCsr, dtype: type[np.generic], shape: list[int], where: str) -> npt.NDArray[Any]:
    values = _frombuffer(csr.values, dtype, where)
    crow = _frombuffer(csr.crow_indices, np.int64, where)
    col = _frombuffer(csr.col_indices, np.int64, where)
    if len(shape) != 2 or min(shape) < 0:
        raise UserError(f"{where} is sparse CSR of shape {shape}; CSR needs 2 dimensions")
    rows, cols = shape
    ok = (
        len(crow) == rows + 1
        and (rows == 0 or (crow[0] == 0 and bool(np.all(np.diff(crow) >= 0))))
        and crow[-1] == len(values) == len(col)
        and bool(np.all((col >= 0) & (col < cols)))
    )
    if not ok:
        raise UserError(f"{where} is sparse CSR with inconsistent indices for shape {shape}")
    dense = np.zeros((rows, cols), dtype=dtype)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return dense


def _frombuffer(data: bytes, dtype: type[np.generic], where: str) -> npt.NDArray[Any]:
    size = np.dtype(dtype).itemsize
    if len(data) % size:
        raise UserError(f"{where} has {len(data)} bytes, not a whole number of {np.dtype(dtype).name} values")
    return np.frombuffer(data, dtype=dtype)


def forward_backward_output(result: ForwardResult, num_datums: int) -> bytes:
    """The SDK's ``ForwardBackwardOutput``: each datum's log-probs (float32), ``loss:sum``."""
    if len(result.logprobs) != num_datums:
        raise ValueError(f"the backend answered {len(result.logprobs)} log-prob rows for {num_datums} data")
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    out.metrics["loss:sum"] = float(result.loss)
    rows = [np.asarray(row, dtype=np.float32) for row in result.logprobs]
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([row.nbytes for row in rows], out=offsets[1:])
    record = out.loss_fn_outputs.add()
    record.num_datums = num_datums
    record.fields["logprobs"].CopyFrom(
        pb.BatchedTensor(
            data=b"".join(row.tobytes() for row in rows), offsets=offsets.tobytes(), dtype=pb.DTYPE_FLOAT32
        )
    )
    return out.SerializeToString()


# ---------------------------------------------------------------- sample


def check_sample_request(req: SampleReq, prompt_len: int) -> None:
    """Refuse what sample asks beyond tokens, their log-probs, prompt log-probs and their top k
    (of the last N prompt tokens, or all)."""
    unsupported = [
        ("target_prompt_logprobs", req.target_prompt_logprobs is not None),
        ("prompt_alt_tokens_k", req.prompt_alt_tokens_k > 0),
        ("record_stability_info", bool(req.record_stability_info)),
    ]
    asked = [name for name, on in unsupported if on]
    if asked:
        raise UserError(f"sample option(s) not supported: {', '.join(asked)}")
    if req.num_samples < 1:
        raise UserError(f"num_samples must be at least 1, not {req.num_samples}")
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs"):
        if not 0 <= getattr(req, name) <= C.MAX_TOPK:
            raise UserError(f"{name} must be between 0 and {C.MAX_TOPK}, not {getattr(req, name)}")
    last_n = req.prompt_logprobs_last_n
    if last_n is not None and not req.prompt_logprobs:
        raise UserError("prompt_logprobs_last_n applies to prompt log-probs: set include_prompt_logprobs")
    if last_n is not None and not 1 <= last_n <= prompt_len - 1:
        raise UserError(f"prompt_logprobs_last_n must be between 1 and {prompt_len - 1} (the prompt's length - 1)")


def prompt_tokens(prompt: ModelInputWire) -> list[int]:
    tokens: list[int] = []
    for chunk in prompt.chunks:
        kind = chunk.get("type", "encoded_text")
        if kind != "encoded_text":
            raise UserError(f"prompt chunks of type {kind!r} are not supported: this server samples text models")
        got = chunk.get("tokens")
        if not isinstance(got, list) or not all(isinstance(t, int) for t in got):
            raise UserError("a prompt chunk's tokens must be a list of integers")
        tokens += got
    if not tokens:
        raise UserError("the prompt has no tokens")
    return tokens


def sample_params(p: SamplingParamsWire) -> SampleParams:
    """The SDK's ``stop``: None stops at EOS only; ``[]`` not even there; strings or token ids."""
    stop: list[str] = []
    stop_token_ids: list[int] = []
    if isinstance(p.stop, str):
        stop = [p.stop]
    elif p.stop is not None:
        stop = [s for s in p.stop if isinstance(s, str)]
        stop_token_ids = [s for s in p.stop if isinstance(s, int)]
        if stop and stop_token_ids:
            raise UserError("sampling_params.stop mixes strings and token ids: use one kind")
    if p.max_tokens is not None and p.max_tokens < 1:
        raise UserError(f"max_tokens must be at least 1, not {p.max_tokens}")
    ignore_eos = p.stop is not None and not p.stop
    return SampleParams(p.max_tokens, p.temperature, p.top_k, p.top_p, p.seed, stop, stop_token_ids, ignore_eos)


def sample_response(
    result: SampleResult,
    num_samples: int,
    prompt_len: int,
    *,
    logprobs: bool = False,
    topk: int = 0,
    last_n: int | None = None,
    topk_sample: int = 0,
) -> bytes:
    """The SDK's ``SampleResponse``: tokens int32, log-probs float32; with ``logprobs``, the
    prompt's log-probs (NaN for None); with ``topk``, the prompt's top-k matrices (a row of
    ``topk`` per prompt token, empty cells token 0 and ``TOPK_EMPTY``). With ``last_n`` only the
    last N prompt positions are given, the others are None (empty)."""
    if len(result.sequences) != num_samples:
        raise ValueError(f"the backend answered {len(result.sequences)} samples for {num_samples}")
    for asked, rows, what in (
        (logprobs, result.prompt_logprobs, "prompt log-probs"),
        (topk > 0, result.topk_prompt_logprobs, "top-k rows"),
    ):
        got = None if rows is None else len(rows)
        if asked and got != prompt_len:
            raise ValueError(f"the backend answered {got} {what} for {prompt_len} prompt tokens")
    resp = pb.SampleResponse()
    for seq in result.sequences:
        if seq.stop_reason not in _STOP_REASON:
            raise ValueError(f"the backend's stop reason {seq.stop_reason!r} is not one of {STOP_REASONS}")
        if len(seq.logprobs) != len(seq.tokens):
            raise ValueError(f"the backend answered {len(seq.logprobs)} log-probs for {len(seq.tokens)} tokens")
        sampled = pb.SampledSequence(
            stop_reason=_STOP_REASON[seq.stop_reason],
            tokens=np.asarray(seq.tokens, dtype=np.int32).tobytes(),
            logprobs=np.asarray(seq.logprobs, dtype=np.float32).tobytes(),
        )
        if topk_sample:
            if seq.topk_logprobs is None or len(seq.topk_logprobs) != len(seq.tokens):
                raise ValueError(f"the backend answered no top-k row for each of {len(seq.tokens)} sampled tokens")
            sampled.topk_sampled_logprobs.CopyFrom(_topk_matrix(seq.topk_logprobs, topk_sample, 0))
        resp.sequences.append(sampled)
    first = 0 if last_n is None else prompt_len - last_n  # the positions before it are not given
    if logprobs and result.prompt_logprobs is not None:
        lp = [math.nan if x is None or i < first else x for i, x in enumerate(result.prompt_logprobs)]
        resp.prompt_logprobs = np.asarray(lp, dtype=np.float32).tobytes()
    if topk and result.topk_prompt_logprobs is not None:
        resp.topk_prompt_logprobs.CopyFrom(_topk_matrix(result.topk_prompt_logprobs, topk, first))
    return resp.SerializeToString()


def _topk_matrix(rows: Sequence[Sequence[tuple[int, float]] | None], k: int, first: int) -> Any:
    """The SDK's ``TopkLogprobs``: a row of ``k`` per position (from ``first`` on; the others, and
    empty cells, token 0 and ``TOPK_EMPTY``)."""
    ids = np.zeros((len(rows), k), dtype=np.int32)
    values = np.full(ids.shape, TOPK_EMPTY, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate((row or [])[:k] if i >= first else []):
            ids[i, j], values[i, j] = token, logprob
    return pb.TopkLogprobs(token_ids=ids.tobytes(), logprobs=values.tobytes(), k=k, length=len(ids))
